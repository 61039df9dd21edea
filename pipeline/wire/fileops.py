"""File operations of the store and the results, through one replaceable layer.

Every write, pwrite, msync, fsync, fdatasync, rename, link, truncate, allocate, unlink and
directory fsync of the segment files, the store log, the broker's state file, the data
directory's shared-memory namespace file, the consumers' results files and a batch job's
output goes through the functions below, which call the
installed `FileIO`. The default passes straight to the OS; a fault campaign installs one that
fails the k-th operation (EIO, ENOSPC, a short write) or simulates a power cut
(`lab.reliability.faults`). Stores into a shared mapping (since segment layout
version 2 only recovery's rewrite of a damaged state word) are not calls and cannot fail one
by one; they are covered where they become durable (the msync that writes them back, which
the layer sees) and by the power-cut simulation, which compares the file's bytes with what
was last synced, sector by sector, however they were written.

Also: an OSError's errno in words for a message.

`install` is for one process's campaign: not thread-safe, and the layer is per process (a
forked child inherits it).
"""

from __future__ import annotations

import errno
import mmap
import os

from pipeline.wire.errors import FileOpError

# The operations a layer sees, by the name a fault plan uses.
OPERATIONS = ("open", "pwrite", "write", "msync", "fsync", "fdatasync", "fsync_directory", "rename", "link",
              "ftruncate", "fallocate", "unlink")


class FileIO:
    """The operations, straight to the OS. Subclasses override what they inject into."""

    def open(self, path: str, flags: int, mode: int) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwrite(self, fd: int, data, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def write(self, fd: int, data) -> int:
        return os.write(fd, data)

    def msync(self, mapping: mmap.mmap, fd: int) -> None:
        mapping.flush()

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync_directory(self, directory: str) -> None:
        fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, source: str, target: str) -> None:
        os.replace(source, target)

    def link(self, source: str, target: str) -> None:
        os.link(source, target)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fallocate(self, fd: int, offset: int, size: int) -> None:
        os.posix_fallocate(fd, offset, size)

    def unlink(self, path: str) -> None:
        os.unlink(path)


_layer = FileIO()


def install(layer: FileIO) -> FileIO:
    """Make `layer` this process's file layer; returns the one it replaces."""
    global _layer
    previous, _layer = _layer, layer
    return previous


def installed() -> FileIO:
    return _layer


def _failed(exc: OSError, op: str, *, path: str | None = None, fd: int | None = None,
            offset: int | None = None) -> FileOpError:
    """The typed error for a failed operation, naming it, the path (found from the descriptor
    where only that is known) and the byte offset; an error already typed passes as it is."""
    if isinstance(exc, FileOpError):
        return exc
    if path is None and fd is not None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = f"descriptor {fd}"
    at = f" at byte {offset}" if offset is not None else ""
    return FileOpError(exc.errno, f"{path}: {op}{at} failed: {errno_text(exc)}", path)


def _guarded(op: str, call, *, path: str | None = None, fd: int | None = None, offset: int | None = None):
    """`call()`, its OSError raised as the FileOpError `_failed` makes."""
    try:
        return call()
    except OSError as exc:
        raise _failed(exc, op, path=path, fd=fd, offset=offset) from exc


def _size(data) -> int:
    return memoryview(data).nbytes


def open_fd(path: str, flags: int, mode: int = 0o600) -> int:
    return _guarded("open", lambda: _layer.open(path, flags, mode), path=path)


def close_fd(fd: int) -> None:
    _guarded("close", lambda: _layer.close(fd), fd=fd)


def pwrite(fd: int, data, offset: int) -> int:
    return _guarded(f"pwrite of {_size(data)} bytes", lambda: _layer.pwrite(fd, data, offset), fd=fd, offset=offset)


def pwrite_all(fd: int, data, offset: int) -> None:
    """pwrite until every byte is written: a write may be cut short (a full disk, a signal)
    and return fewer bytes than asked; an error raises FileOpError naming the byte it stopped at."""
    with memoryview(data).cast("B") as view:
        done = 0
        while done < len(view):
            done += pwrite(fd, view[done:], offset + done)


def write(fd: int, data) -> int:
    return _guarded(f"write of {_size(data)} bytes", lambda: _layer.write(fd, data), fd=fd)


def write_all(fd: int, data) -> None:
    """write until every byte is written (see `pwrite_all`)."""
    with memoryview(data).cast("B") as view:
        done = 0
        while done < len(view):
            done += write(fd, view[done:])


def msync(mapping: mmap.mmap, fd: int) -> None:
    """Write a shared mapping's dirty pages back (`fd`: the file it maps, for the layer)."""
    _guarded("msync", lambda: _layer.msync(mapping, fd), fd=fd)


def fsync(fd: int) -> None:
    _guarded("fsync", lambda: _layer.fsync(fd), fd=fd)


def fdatasync(fd: int) -> None:
    _guarded("fdatasync", lambda: _layer.fdatasync(fd), fd=fd)


def fsync_directory(directory: str) -> None:
    """fsync a directory, so the names created, renamed or removed in it survive a power cut."""
    _guarded("fsync of the directory", lambda: _layer.fsync_directory(directory), path=directory)


def rename(source: str, target: str) -> None:
    """Rename over `target` if it exists (os.replace: atomic within a file system)."""
    _guarded(f"rename to {target}", lambda: _layer.rename(source, target), path=source)


def link(source: str, target: str) -> None:
    """A second name for `source`, refused where `target` exists (FileOpError, errno EEXIST):
    a file made whole under a temporary name and put in place only if nobody was first."""
    _guarded(f"link to {target}", lambda: _layer.link(source, target), path=source)


def ftruncate(fd: int, size: int) -> None:
    _guarded(f"ftruncate to {size} bytes", lambda: _layer.ftruncate(fd, size), fd=fd)


def fallocate(fd: int, offset: int, size: int) -> None:
    _guarded(f"fallocate of {size} bytes", lambda: _layer.fallocate(fd, offset, size), fd=fd, offset=offset)


def unlink(path: str) -> None:
    _guarded("unlink", lambda: _layer.unlink(path), path=path)


def errno_text(exc: OSError) -> str:
    """"ENOSPC (No space left on device)" for an OSError with an errno, else its text."""
    if exc.errno is None:
        return str(exc)
    name = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
    return f"{name} ({exc.strerror or os.strerror(exc.errno)})"
