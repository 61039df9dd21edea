"""Seeded fault layers for `pipeline.wire.fileops`: the k-th file operation fails, or the
power goes out.

    layer = FaultyIO(FaultPlan(at_op=k, kind="EIO"))      # operation k raises EIO
    layer = FaultyIO(FaultPlan(at_op=k, kind="ENOSPC", persistent=True))   # k and every later one
    layer = FaultyIO(FaultPlan(at_op=k, kind="short"))    # write k writes half and returns
    fileops.install(layer)

    cut = PowerCut(root, seed, at_op=k, mode="garble", sector_bytes=4096)
    fileops.install(cut)        # at operation k: every file under root becomes what a power
                                # cut leaves, then the process exits at once (os._exit)

Operations are counted in the order the process makes them (`fileops.OPERATIONS`, less
"open"); a dry run with `at_op=None` counts them, so a campaign loops k over every one.

The power cut. Each file's *durable image* is its content at its last fsync, fdatasync or
msync (the whole file: fdatasync and a whole-mapping msync write back every dirty page, the
mapping's stores included), or when the layer first saw it; a file created since has an
empty one. At the cut, every sector (512 or 4096 bytes) where the file differs from its
durable image becomes, by the seeded draw of `mode`: `drop` the durable bytes, `keep` the new
bytes, `garble` random bytes, `mixed` one of the three per sector. Names: a creation, rename,
link or unlink is durable once its directory is fsynced; at the cut a seeded prefix of the
operations not yet durable survives (a journal keeps them in order) and the rest are undone.
This is the model of an ext4 data=ordered disk that SQLite and PostgreSQL reason with: a
synced byte survives, an unsynced one may or may not, and a sector being written may be
garbage.

Owner: the process that installs the layer. Not thread-safe.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from pipeline.wire.fileops import FileIO

FAULT_KINDS = ("EIO", "ENOSPC", "short")
POWER_MODES = ("drop", "keep", "garble", "mixed")
SECTOR_SIZES_BYTES = (512, 4096)
# The status a process exits with at a simulated power cut, so its parent tells it apart.
POWER_CUT_EXIT = 75
# The operations a write fault applies to (a short write needs a byte count to cut).
_WRITES = frozenset({"pwrite", "write"})


@dataclass(slots=True)
class FaultPlan:
    """Which operation fails and how. `at_op` None: nothing fails (a counting run)."""

    at_op: int | None
    kind: str = "EIO"
    persistent: bool = False  # every operation from at_op on fails (a disk that stays bad)

    def __post_init__(self) -> None:
        assert self.kind in FAULT_KINDS, self.kind
        assert self.at_op is None or self.at_op >= 0, self.at_op


class _Counting(FileIO):
    """Counts operations (`ops`, and their names in `log`) and calls `_at(name)` first."""

    def __init__(self) -> None:
        self.ops = 0
        self.log: list[str] = []

    def _at(self, name: str) -> int | None:
        """Called before operation `name`; returns a byte count to cut a write to, or None."""
        self.log.append(name)
        self.ops += 1
        return None

    def pwrite(self, fd: int, data, offset: int) -> int:
        cut = self._at("pwrite")
        return super().pwrite(fd, memoryview(data)[:cut] if cut is not None else data, offset)

    def write(self, fd: int, data) -> int:
        cut = self._at("write")
        return super().write(fd, memoryview(data)[:cut] if cut is not None else data)

    def msync(self, mapping: mmap.mmap, fd: int) -> None:
        self._at("msync")
        super().msync(mapping, fd)

    def fsync(self, fd: int) -> None:
        self._at("fsync")
        super().fsync(fd)

    def fdatasync(self, fd: int) -> None:
        self._at("fdatasync")
        super().fdatasync(fd)

    def fsync_directory(self, directory: str) -> None:
        self._at("fsync_directory")
        super().fsync_directory(directory)

    def rename(self, source: str, target: str) -> None:
        self._at("rename")
        super().rename(source, target)

    def link(self, source: str, target: str) -> None:
        self._at("link")
        super().link(source, target)

    def ftruncate(self, fd: int, size: int) -> None:
        self._at("ftruncate")
        super().ftruncate(fd, size)

    def fallocate(self, fd: int, offset: int, size: int) -> None:
        self._at("fallocate")
        super().fallocate(fd, offset, size)

    def unlink(self, path: str) -> None:
        self._at("unlink")
        super().unlink(path)


class FaultyIO(_Counting):
    """Fails operation `plan.at_op` (and every later one if persistent) as the plan says."""

    def __init__(self, plan: FaultPlan) -> None:
        super().__init__()
        self.plan = plan
        self.injected: list[tuple[int, str]] = []  # (operation index, name) of each fault

    def _at(self, name: str) -> int | None:
        index = self.ops
        super()._at(name)
        at = self.plan.at_op
        if at is None or index < at or (index > at and not self.plan.persistent):
            return None
        self.injected.append((index, name))
        if self.plan.kind == "short" and name in _WRITES:
            return 1  # one byte lands, the caller is told so: it must go on or fail whole
        code = errno.ENOSPC if self.plan.kind == "ENOSPC" else errno.EIO
        raise OSError(code, f"{os.strerror(code)} (injected at operation {index}, {name})")


@dataclass(slots=True)
class _Durable:
    image: bytes  # the file's content as of its last sync


@dataclass(slots=True)
class _NameOp:
    kind: str  # "create", "rename", "unlink"
    directory: str
    args: tuple[str, ...]
    saved: bytes | None = None  # an unlinked or replaced file's durable content, to undo it


@dataclass(slots=True)
class CutReport:
    files: int = 0
    sectors_changed: int = 0
    sectors_dropped: int = 0
    sectors_kept: int = 0
    sectors_garbled: int = 0
    name_ops_kept: int = 0
    name_ops_undone: int = 0
    garbled_at: list[tuple[str, int]] = field(default_factory=list)  # (path, byte offset) of each garbled sector


class PowerCut(_Counting):
    """Tracks durable images of the files under `root` and cuts the power at `at_op`."""

    def __init__(self, root: str, seed: int, at_op: int | None, mode: str = "mixed", sector_bytes: int = 4096,
                 exit_process: bool = True, report_path: str | None = None) -> None:
        super().__init__()
        assert mode in POWER_MODES and sector_bytes in SECTOR_SIZES_BYTES, (mode, sector_bytes)
        self.root = os.path.realpath(root)
        self.rng = np.random.default_rng(seed)
        self.at_op, self.mode, self.sector_bytes = at_op, mode, sector_bytes
        self.exit_process = exit_process
        self.report_path = report_path  # where the cut writes its CutReport (JSON), for the campaign's figures
        self._paths: dict[int, str] = {}  # fd -> path, for files under root
        self._durable: dict[str, _Durable] = {}
        self._pending: list[_NameOp] = []
        self.report: CutReport | None = None
        for directory, _, names in os.walk(self.root):
            for name in names:
                path = os.path.join(directory, name)
                self._durable[path] = _Durable(_read(path))

    def _under(self, path: str) -> bool:
        return os.path.realpath(path).startswith(self.root + os.sep)

    def _at(self, name: str) -> int | None:
        index = self.ops
        super()._at(name)
        if self.at_op is not None and index == self.at_op:
            self.cut()
        return None

    def open(self, path: str, flags: int, mode: int) -> int:
        existed = os.path.lexists(path)
        fd = super().open(path, flags, mode)
        if self._under(path):
            real = os.path.realpath(path)
            self._paths[fd] = real
            if not existed:
                self._durable[real] = _Durable(b"")
                self._pending.append(_NameOp("create", os.path.dirname(real), (real,)))
            elif real not in self._durable:
                self._durable[real] = _Durable(_read(real))
        return fd

    def close(self, fd: int) -> None:
        self._paths.pop(fd, None)
        super().close(fd)

    def _synced(self, fd: int) -> None:
        path = self._paths.get(fd)
        if path is not None:
            self._durable[path] = _Durable(_read(path))

    def msync(self, mapping: mmap.mmap, fd: int) -> None:
        super().msync(mapping, fd)
        self._synced(fd)

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        self._synced(fd)

    def fdatasync(self, fd: int) -> None:
        super().fdatasync(fd)
        self._synced(fd)

    def fsync_directory(self, directory: str) -> None:
        super().fsync_directory(directory)
        real = os.path.realpath(directory)
        self._pending = [op for op in self._pending if op.directory != real]

    def rename(self, source: str, target: str) -> None:
        if self._under(target):
            src, dst = os.path.realpath(source), os.path.realpath(target)
            replaced = self._durable[dst].image if dst in self._durable and os.path.exists(dst) else None
            self._pending.append(_NameOp("rename", os.path.dirname(dst), (src, dst), replaced))
            super().rename(source, target)
            if src in self._durable:
                self._durable[dst] = self._durable.pop(src)
            for fd, path in self._paths.items():
                if path == src:
                    self._paths[fd] = dst
            return
        super().rename(source, target)

    def link(self, source: str, target: str) -> None:
        super().link(source, target)
        if self._under(target):  # a new name, durable once its directory is fsynced
            dst = os.path.realpath(target)
            self._durable[dst] = _Durable(self._durable.get(os.path.realpath(source), _Durable(b"")).image)
            self._pending.append(_NameOp("create", os.path.dirname(dst), (dst,)))

    def unlink(self, path: str) -> None:
        if self._under(path):
            real = os.path.realpath(path)
            saved = self._durable.pop(real, _Durable(b"")).image
            self._pending.append(_NameOp("unlink", os.path.dirname(real), (real,), saved))
        super().unlink(path)

    def cut(self) -> CutReport:
        """Make every file under root what the power cut leaves; exit unless told not to."""
        report = CutReport()
        keep = int(self.rng.integers(0, len(self._pending) + 1))
        for op in reversed(self._pending[keep:]):
            self._undo(op)
        report.name_ops_kept, report.name_ops_undone = keep, len(self._pending) - keep
        for path, durable in sorted(self._durable.items()):
            if os.path.exists(path):
                report.files += 1
                self._tear(path, durable.image, report)
        self.report = report
        if self.report_path is not None:
            with open(self.report_path, "w") as file:
                json.dump(dataclasses.asdict(report), file)
        if self.exit_process:
            os._exit(POWER_CUT_EXIT)
        return report

    def _undo(self, op: _NameOp) -> None:
        if op.kind == "create":
            if os.path.exists(op.args[0]):
                os.unlink(op.args[0])
            self._durable.pop(op.args[0], None)
        elif op.kind == "unlink":
            _write(op.args[0], op.saved or b"")
            self._durable[op.args[0]] = _Durable(op.saved or b"")
        else:  # rename: the source name back with the durable content, the target as it was
            src, dst = op.args
            moved = self._durable.pop(dst, _Durable(b""))
            if os.path.exists(dst):
                os.replace(dst, src)
            self._durable[src] = moved
            if op.saved is not None:
                _write(dst, op.saved)
                self._durable[dst] = _Durable(op.saved)

    def _tear(self, path: str, durable: bytes, report: CutReport) -> None:
        current = _read(path)
        size = len(current)
        old = durable[:size].ljust(size, b"\0")
        out = bytearray(current)
        step = self.sector_bytes
        for start in range(0, size, step):
            end = min(start + step, size)
            if current[start:end] == old[start:end]:
                continue
            report.sectors_changed += 1
            choice = self.mode if self.mode != "mixed" else POWER_MODES[int(self.rng.integers(0, 3))]
            if choice == "drop":
                out[start:end] = old[start:end]
                report.sectors_dropped += 1
            elif choice == "keep":
                report.sectors_kept += 1
            else:
                out[start:end] = self.rng.integers(0, 256, end - start, dtype=np.uint8).tobytes()
                report.sectors_garbled += 1
                report.garbled_at.append((path, start))
        if out != current:
            _write(path, bytes(out), keep_size=True)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except (FileNotFoundError, IsADirectoryError):
        return b""


def _write(path: str, data: bytes, keep_size: bool = False) -> None:
    """Put `data` in the file at `path` (created if missing) with plain OS calls: the cut
    itself is not an operation of the run."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if keep_size else os.O_TRUNC), 0o600)
    try:
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)
