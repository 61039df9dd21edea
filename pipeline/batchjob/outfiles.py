"""The files a job writes for the user (its output, error file, summary and report), written
so that nothing the user made in the meantime is replaced.

    target = Target.open("output file", "/runs/out.jsonl", expect=ABSENT)   # at the check
    out = Publish(target); out.write(b"..."); out.commit()                 # at the end
    fd = open_log(target)                                                   # completion order

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
import json
import os
import stat
from dataclasses import dataclass

from pipeline.batchjob.manifest import JOB_DIR
from pipeline.batchjob.paths import FILE_MODE, ChunkBuffer, replace_file
from pipeline.wire import fileops
from pipeline.wire.errors import JobPathError
from pipeline.wire.fileops import errno_text

ABSENT = "absent"
OWN = "own"
REPLACE = "replace"
OWN_FILES_NAME = "outputs.json"
# The fixed name of a replacement while it is renamed into place (a kill between its link and
# the rename leaves it; the next write of the same file removes it).
PARTIAL_PREFIX = "."
PARTIAL_SUFFIX = ".partial"
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

    @classmethod
    def open(cls, role: str, path: str, expect: str, own: list[int] | None = None) -> Target:
        directory = os.path.dirname(os.path.abspath(path)) or "/"
        try:
            dir_fd = os.open(directory, _OPEN_DIR)
        except OSError as exc:
            raise JobPathError(f"{role} {path}: cannot open its directory {directory}: {errno_text(exc)}") from exc
        return cls(role, path, dir_fd, os.path.basename(path), expect, own)

    def current(self) -> os.stat_result | None:
        try:
            return os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def check_replaceable(self) -> None:
        """What is at the name now may be replaced (OWN: still the job's file; REPLACE: still a
        regular file with one link); JobPathError otherwise. Nothing there passes."""
        info = self.current()
        if info is None:
            return
        if self.expect == OWN and self.own is not None and sealed_identity(info)[:len(self.own)] == self.own:
            return
        if self.expect == REPLACE and stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
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
            self._named = _partial(target.name)
            _unlink_quietly(self._named, target.dir_fd)
            self._fd = os.open(self._named, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                               FILE_MODE, dir_fd=target.dir_fd)
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
            partial = self._named or _partial(target.name)
            if not self._named:
                _unlink_quietly(partial, target.dir_fd)
                os.link(source, partial, dst_dir_fd=target.dir_fd, follow_symlinks=True)
            os.rename(partial, target.name, src_dir_fd=target.dir_fd, dst_dir_fd=target.dir_fd)
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


def open_log(target: Target, fresh: bool) -> int:
    """The completion-order log at `target`, open for appending: the job's own file as it is
    (fresh False), or a new empty one (fresh True: absent, or allowed to be replaced, then
    truncated). JobPathError for anything else at the name."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # read: recovery finds the end
    if fresh and target.expect == ABSENT:
        flags |= os.O_CREAT | os.O_EXCL
    elif fresh and target.current() is None:
        flags |= os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(target.name, flags, FILE_MODE, dir_fd=target.dir_fd)
    except FileExistsError:
        raise JobPathError(f"{target.role} {target.path} appeared before the job could create it: move it away "
                           f"(or pass --overwrite)") from None
    except OSError as exc:
        raise JobPathError(f"{target.role} {target.path}: cannot open it to append answers: {errno_text(exc)}") from exc
    info = os.fstat(fd)
    good = stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and (fresh or identity(info) == target.own)
    if not good:
        os.close(fd)
        target.check_replaceable()  # raises, naming what is wrong
        raise JobPathError(f"{target.role} {target.path} is not the file this job wrote")
    os.set_blocking(fd, True)
    if fresh:
        os.ftruncate(fd, 0)
        os.fchmod(fd, FILE_MODE)
    return fd


class OwnFiles:
    """The files the job made for the user, by path: their (device, inode) (DATA_DIR/job/
    outputs.json). Written whole after each file is made."""

    def __init__(self, data_dir: str) -> None:
        self.path = os.path.join(data_dir, JOB_DIR, OWN_FILES_NAME)
        self.files: dict[str, list[int]] = {}
        try:
            with open(self.path, "rb") as f:
                found = json.loads(f.read(1 << 20))
            if isinstance(found, dict):
                self.files = {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, list)}
        except (OSError, ValueError):
            pass

    def own(self, path: str) -> list[int] | None:
        return self.files.get(os.path.abspath(path))

    def made(self, path: str, made: list[int]) -> None:
        self.files[os.path.abspath(path)] = made
        replace_file(self.path, [json.dumps(self.files).encode()])


def _partial(name: str) -> str:
    return f"{PARTIAL_PREFIX}{name}{PARTIAL_SUFFIX}"


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
