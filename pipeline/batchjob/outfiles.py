"""The files a job writes for the user (its output, error file, summary and report), written
so that nothing the user made in the meantime is replaced.

    target = Target.open("output file", "/runs/out.jsonl", expect=ABSENT)   # at the check
    out = Publish(target); out.write(b"..."); out.commit()                 # at the end
    fd = open_log(target, fresh, mark)                                      # completion order

A `Target` is fixed when the job's paths are checked: its directory is opened then (every
later write is relative to that descriptor, so swapping a directory in the path for a
symlink mid-run changes nothing), and what the job expects to find at the name is recorded:
- ABSENT: nothing was there. The file is linked in with linkat(2), which fails if a file
  appeared meanwhile (another job, the user): refused, never replaced.
- OWN: the file this job wrote before, by (device, inode) (`OwnFiles`). Replaced only if it
  is still that file.
- REPLACE: the user allowed it (--overwrite): replaced if it is still a regular file with one
  link (a hard link would carry the change to another name).
A file is written as an unnamed temporary file (O_TMPFILE), linked in only when whole, so a
kill leaves the older file and no temporary one.
NOTE: re-checking the path just before a plain rename was rejected: between the check and
the rename another process can still put a file there; linkat fails atomically instead.

`OwnFiles` (DATA_DIR/job/outputs.json) records each file the job created, right after it did:
a rerun recognizes its own output (and the completion-order log it appends to) and nothing
else.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import stat
from dataclasses import dataclass

from pipeline.batchjob.manifest import JOB_DIR
from pipeline.batchjob.paths import FILE_MODE, PARTIAL_PREFIX, PARTIAL_SUFFIX, ChunkBuffer, replace_file
from pipeline.wire import fileops
from pipeline.wire.errors import JobPathError
from pipeline.wire.fileops import errno_text

ABSENT = "absent"
OWN = "own"
REPLACE = "replace"
OWN_FILES_NAME = "outputs.json"
# A file is written under a random name `PARTIAL_PREFIX NAME .<hex> PARTIAL_SUFFIX` beside its
# target before it is linked or renamed into place (without O_TMPFILE a kill may leave one;
# nothing else is ever removed).
# The longest file name where the file system does not say (Linux's NAME_MAX).
DEFAULT_NAME_MAX_BYTES = 255
# Random names tried for a temporary file before giving up (a clash is 1 in 2**48 a try).
PARTIAL_ATTEMPTS = 8
# The extended attribute a completion-order log carries: the job's id. A file the user made
# at the name later, even on the inode number a deleted log had, lacks it.
LOG_MARK_XATTR = "user.shape_broker.job"
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def identity(info: os.stat_result) -> list[int]:
    """A file the job appends to (a completion-order log): its device and inode."""
    return [info.st_dev, info.st_ino]


def sealed_identity(info: os.stat_result) -> list[int]:
    """A file the job wrote whole: its device, inode, size and modification time (edited in
    place since, it is no longer the job's to replace)."""
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns]


@dataclass(slots=True)
class Target:
    """One file the job writes for the user (the module's doc). `close()` releases its
    directory descriptor."""

    role: str
    path: str
    dir_fd: int
    name: str
    expect: str
    own: list[int] | None = None  # OWN: the (device, inode) the job wrote
    seen: list[int] | None = None  # REPLACE: the file --overwrite allowed (`sealed_identity`)

    @classmethod
    def open(cls, role: str, path: str, expect: str, own: list[int] | None = None) -> Target:
        directory = os.path.dirname(os.path.abspath(path)) or "/"
        try:
            dir_fd = os.open(directory, _OPEN_DIR)
        except OSError as exc:
            raise JobPathError(f"{role} {path}: cannot open its directory {directory}: {errno_text(exc)}") from exc
        target = cls(role, path, dir_fd, os.path.basename(path), expect, own)
        found = target.current() if expect == REPLACE else None
        target.seen = sealed_identity(found) if found is not None else None
        return target

    def current(self) -> os.stat_result | None:
        try:
            return os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def check_replaceable(self) -> None:
        """What is at the name now may be replaced (OWN: still the job's file; REPLACE: still the
        file `--overwrite` allowed, unchanged, one link); JobPathError otherwise. Nothing there
        passes."""
        info = self.current()
        if info is None:
            return
        if self.expect == OWN and self.own is not None and sealed_identity(info)[:len(self.own)] == self.own:
            return
        if self.expect == REPLACE and info.st_nlink == 1 and sealed_identity(info) == self.seen:
            return
        why = ("is a hard link to another name (the change would reach it too)"
               if stat.S_ISREG(info.st_mode) and info.st_nlink > 1 else "is not the file this job wrote or was "
               "allowed to replace: it appeared or changed while the job ran")
        raise JobPathError(f"{self.role} {self.path} {why}; its answers are kept: move it away (or pass --overwrite) "
                           f"and run the same command, which writes it without running anything")

    def close(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1


class Publish:
    """A file written anew and put at its target's name at `commit()`, whole or not at all;
    `abandon()` (idempotent, a no-op after commit) drops it. Writes are gathered into
    WRITE_CHUNK_BYTES."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._named: str | None = None  # without O_TMPFILE: the partial name it is written under
        try:
            self._fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, FILE_MODE, dir_fd=target.dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            self._named, self._fd = _create_partial(target)
        self._buffer = ChunkBuffer()
        os.fchmod(self._fd, FILE_MODE)

    def write(self, data: bytes) -> None:
        self._buffer.add(self._fd, data)

    def commit(self) -> list[int]:
        """Put the file in place (the module's doc); its identity."""
        target = self.target
        self._buffer.flush(self._fd)
        fileops.fsync(self._fd)
        source, source_dir = (self._named, target.dir_fd) if self._named else (f"/proc/self/fd/{self._fd}", None)
        if target.expect == ABSENT:
            try:  # fails if anything appeared at the name: never replaces it
                os.link(source, target.name, src_dir_fd=source_dir, dst_dir_fd=target.dir_fd, follow_symlinks=True)
            except FileExistsError:
                raise JobPathError(f"{target.role} {target.path} appeared while the job ran (another job, or you): "
                                   f"it is left as it is; move it away (or pass --overwrite) and run the same "
                                   f"command, which writes it without running anything") from None
        else:
            target.check_replaceable()
            if not self._named:
                self._named = _link_partial(source, target)
            os.rename(self._named, target.name, src_dir_fd=target.dir_fd, dst_dir_fd=target.dir_fd)
            self._named = None
        made = sealed_identity(os.fstat(self._fd))
        os.fsync(target.dir_fd)
        self.abandon()
        return made

    def abandon(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._named is not None:
            _unlink_quietly(self._named, self.target.dir_fd)
            self._named = None


def open_log(target: Target, fresh: bool, mark: bytes) -> int:
    """The completion-order log at `target`, open for appending: the job's own file as it is
    (fresh False: the same inode, carrying the job's `mark`), or a new empty one (fresh True:
    made under a name of its own and linked in where nothing is, or renamed over what may be
    replaced: a file another job appends to is never cut). JobPathError for anything else."""
    if not fresh:
        try:
            fd = os.open(target.name, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                         dir_fd=target.dir_fd)  # read too: recovery finds the end; NONBLOCK: a FIFO never waits
        except OSError as exc:
            raise JobPathError(f"{target.role} {target.path}: cannot open it to append answers: "
                               f"{errno_text(exc)}") from exc
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and identity(info) == target.own and marked(fd, mark):
            os.set_blocking(fd, True)
            try:
                _hold(fd, target)
            except BaseException:
                os.close(fd)
                raise
            return fd
        os.close(fd)
        target.check_replaceable()  # raises, naming what is wrong
        raise JobPathError(f"{target.role} {target.path} is not the file this job wrote: move it away (or pass "
                           f"--overwrite) and run the same command")
    name, fd = _create_partial(target)
    try:
        _hold(fd, target)
        _mark(fd, mark)
        if target.expect == ABSENT or target.current() is None:
            try:  # fails if anything appeared at the name: never replaces it
                os.link(name, target.name, src_dir_fd=target.dir_fd, dst_dir_fd=target.dir_fd)
            except FileExistsError:
                raise JobPathError(f"{target.role} {target.path} appeared before the job could create it: move it "
                                   f"away (or pass --overwrite)") from None
        else:
            target.check_replaceable()
            os.rename(name, target.name, src_dir_fd=target.dir_fd, dst_dir_fd=target.dir_fd)
    except BaseException:
        os.close(fd)
        raise
    finally:
        _unlink_quietly(name, target.dir_fd)  # (renamed: gone already)
    os.fsync(target.dir_fd)
    return fd


def _hold(fd: int, target: Target) -> None:
    """An exclusive lock on `fd`'s file, held while it is open: two runs of one job (from
    copies of its data directory: the same job, the same mark) never append to one log."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise JobPathError(f"{target.role} {target.path}: another run of this job appends to it (from a copy of its "
                           f"data directory?): let it finish, or stop it, and run this again") from None


def marked(fd: int, mark: bytes) -> bool:
    """The file carries the job's mark (LOG_MARK_XATTR), or its file system keeps no extended
    attributes (then its device and inode alone say it is the job's)."""
    try:
        return os.getxattr(fd, LOG_MARK_XATTR) == mark
    except OSError as exc:
        return exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP)


def _mark(fd: int, mark: bytes) -> None:
    try:
        os.setxattr(fd, LOG_MARK_XATTR, mark)
    except OSError as exc:
        if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise


def _partial_name(target: Target) -> str:
    """A random temporary name beside the target: `.NAME.<12 hex>.partial`, NAME cut so the
    whole fits the file system's longest name (a target's own name may be that long)."""
    try:
        name_max = os.fpathconf(target.dir_fd, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = DEFAULT_NAME_MAX_BYTES
    tail = f".{secrets.token_hex(6)}{PARTIAL_SUFFIX}"
    room = name_max - len(PARTIAL_PREFIX) - len(tail)
    return PARTIAL_PREFIX + os.fsdecode(os.fsencode(target.name)[:room]) + tail


def _create_partial(target: Target) -> tuple[str, int]:
    """A new empty file (0600) beside the target under a name of its own, open for reading
    and appending: (its name, its descriptor). Never a name someone else made."""
    for _attempt in range(PARTIAL_ATTEMPTS):
        name = _partial_name(target)
        try:
            fd = os.open(name, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                         FILE_MODE, dir_fd=target.dir_fd)
        except FileExistsError:
            continue
        os.fchmod(fd, FILE_MODE)
        return name, fd
    raise JobPathError(f"{target.role} {target.path}: no free temporary name beside it after {PARTIAL_ATTEMPTS} tries")


def _link_partial(source: str, target: Target) -> str:
    """The unnamed file `source` (/proc/self/fd/N) linked beside the target under a name of
    its own; that name."""
    for _attempt in range(PARTIAL_ATTEMPTS):
        name = _partial_name(target)
        try:
            os.link(source, name, dst_dir_fd=target.dir_fd, follow_symlinks=True)
            return name
        except FileExistsError:
            continue
    raise JobPathError(f"{target.role} {target.path}: no free temporary name beside it after {PARTIAL_ATTEMPTS} tries")


class OwnFiles:
    """The files the job made for the user, by path: their (device, inode) (DATA_DIR/job/
    outputs.json). Written whole after each file is made."""

    def __init__(self, data_dir: str, mark: bytes | None = None) -> None:
        self.path = os.path.join(data_dir, JOB_DIR, OWN_FILES_NAME)
        self.mark = mark  # the job's completion-order logs carry it (`open_log`)
        self.files: dict[str, list[int]] = {}
        try:
            with open(self.path, "rb") as f:
                found = json.loads(f.read(1 << 20))
            if isinstance(found, dict):
                self.files = {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, list)}
        except (OSError, ValueError):
            pass

    def own(self, path: str) -> list[int] | None:
        """What the job recorded of the file it made at `path`; None for none, or for a log
        (recorded by device and inode) that lacks the job's mark: another file on the inode
        number of one deleted."""
        found = self.files.get(os.path.abspath(path))
        if found is None or len(found) != 2 or self.mark is None:
            return found
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return found  # nothing there (or not a file): the path checks say what
        try:
            return found if marked(fd, self.mark) else None
        finally:
            os.close(fd)

    def made(self, path: str, made: list[int]) -> None:
        self.files[os.path.abspath(path)] = made
        replace_file(self.path, [json.dumps(self.files).encode()])


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
