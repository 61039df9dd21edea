"""Replacing a store file whole: the store log's compaction (temp file, preallocate, fsync,
rename, directory fsync). Owner: the caller's file; nothing here keeps state."""

from __future__ import annotations

import errno
import os

from pipeline.wire import fileops
from pipeline.wire.errors import DiskFullError, DurabilityError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def write_replacement(path: str, temp: str, data: bytes, size_bytes: int, what: str) -> int:
    """Replace the file at `path` whole: `data` into `temp` (preallocated to `size_bytes`),
    fsync, rename over `path`, directory fsync; returns the new file's descriptor, open for
    appending records. DiskFullError when there is no room (the old file then stays as it
    was and in use); on any failure `temp` is removed."""
    fd = -1
    try:
        fd = _prepared(temp, data, size_bytes, what)
        fileops.rename(temp, path)
        _fsync_directory(os.path.dirname(path))
    except BaseException:
        if fd >= 0:
            fileops.close_fd(fd)
        if os.path.exists(temp):
            fileops.unlink(temp)
        raise
    return fd


def _prepared(temp: str, data: bytes, size_bytes: int, what: str) -> int:
    """`temp` created, preallocated to `size_bytes`, holding `data`, fsynced; its descriptor."""
    try:
        fd = fileops.open_fd(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as exc:
        if exc.errno in _NO_SPACE:  # no inode for the new file: the old one stays in use
            raise DiskFullError(f"{temp}: disk full ({exc.strerror}) creating the compacted {what}") from exc
        raise
    try:
        try:
            fileops.fallocate(fd, 0, size_bytes)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise DiskFullError(f"{temp}: disk full ({exc.strerror}) allocating {size_bytes} bytes for the "
                                    f"compacted {what}; the old one stays in use") from exc
            raise
        fileops.pwrite_all(fd, data, 0)
        fileops.fsync(fd)
    except BaseException:
        fileops.close_fd(fd)
        raise
    return fd


def _fsync_directory(path: str) -> None:
    try:
        fileops.fsync_directory(path or ".")
    except OSError as exc:
        raise DurabilityError(f"{path}: fsync of the directory failed ({exc.strerror}, errno {exc.errno})") from exc
