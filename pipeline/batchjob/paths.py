"""Every path a batch job writes, replaces or deletes, checked before the job starts.

The rule: a job never writes, replaces or deletes a path it did not create, and never a
device, a FIFO, a socket, a directory or a symlink's target.

- Its outputs (the output file, the error file, the run report, the summary beside the
  output) are told apart from each other and from the input (by path, by their directory's
  identity with their name, and by file identity where they exist: two spellings of one file
  through a bind mount or a link are one), are never inside the data directory, and
  each is either absent, or a regular file the job itself wrote (its manifest names it; the
  output of `--output-order completion` is appended across resumes), or a regular file the
  user allows to be replaced (`--overwrite`). Their directories must be writable: a probe
  file is made and removed there before anything runs, so an unwritable directory is not
  found after every request ran.
- Its data directory: what it may hold when the job takes it, and what the job removes of it
  at the end, are `jobfiles.py`'s.
- A file is replaced by writing a new one and renaming it over (`replace_file`): an unnamed
  temporary file (O_TMPFILE) linked in at the end, so a kill in the middle leaves nothing;
  where the file system has no O_TMPFILE, a named one that the next run removes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from pipeline.wire import fileops
from pipeline.wire.errors import JobPathError
from pipeline.wire.fileops import errno_text

# The name of a temporary file beside a file being replaced: `.NAME.partial` here (fixed, so
# that the next run finds and removes one a kill left), with a random part before the suffix
# for the user's outputs (`outfiles.py`, where O_TMPFILE is not supported).
PARTIAL_PREFIX = "."
PARTIAL_SUFFIX = ".partial"
FILE_MODE = 0o600
# Bytes gathered into one write when a file is written from lines.
WRITE_CHUNK_BYTES = 1 << 20


@dataclass(slots=True, frozen=True)
class OutputPath:
    """One file the job writes: its role (for messages), its absolute path, and whether it
    may already exist (the job's own, or --overwrite)."""

    role: str
    path: str


def check_input(path: str) -> str:
    """The input's absolute path: an existing regular file."""
    info = stat_or_none(path, follow=True)
    if info is None:
        raise JobPathError(f"input file {path}: does not exist")
    if not stat.S_ISREG(info.st_mode):
        raise JobPathError(f"input file {path}: not a regular file ({path_kind(info)}): a batch file is read twice, "
                           f"checked then run")
    return os.path.abspath(path)


def check_outputs(outputs: list[OutputPath], input_path: str, data_dir: str, own: Callable[[str], list[int] | None],
                  overwrite: bool) -> list[str]:
    """The checks of the module's doc for every output, and what the job expects at each
    (`outfiles`: "absent", "own", "replace"); `own(path)`: the (device, inode) of the file
    the job made there before, or None."""
    seen = dict.fromkeys(_spellings(input_path), "the input file")
    data_real = os.path.realpath(data_dir)
    data_info = _quiet_stat(data_dir)
    expects: list[str] = []
    for out in outputs:  # apart first: two names of one file are said as such, whatever is there
        keys = _spellings(out.path)
        also = next((seen[key] for key in keys if key in seen), None)
        if also is not None:
            raise JobPathError(f"{out.role} {out.path} is also {also}: give each its own path")
        if _inside(out.path, data_real, data_info):
            raise JobPathError(f"{out.role} {out.path} is inside the data directory {data_dir}, where the job keeps "
                               f"its own files (a default data directory is removed once the output is written): "
                               f"put it elsewhere")
        seen.update(dict.fromkeys(keys, f"the {out.role}"))
    for out in outputs:
        info = stat_or_none(out.path, follow=False)
        expects.append("absent" if info is None else _check_existing(out, info, own, overwrite))
        probe_directory(os.path.dirname(out.path) or ".", out)
    return expects


def _spellings(path: str) -> list[object]:
    """Keys under which two spellings of one file meet: its real path; its directory's
    (device, inode) with its name (a bind mount, or another way to the same directory); the
    file's own (device, inode) where it exists (a hard link)."""
    keys: list[object] = [os.path.realpath(path)]
    parent = _quiet_stat(os.path.dirname(path) or ".")
    if parent is not None:
        keys.append((parent.st_dev, parent.st_ino, os.path.basename(path)))
    info = _quiet_stat(path)
    if info is not None:
        keys.append((info.st_dev, info.st_ino))
    return keys


def _inside(path: str, data_real: str, data_info: os.stat_result | None) -> bool:
    """`path` is the data directory or inside it: by real path, or by the directory's
    (device, inode) met on the way up from `path` (a bind mount of it)."""
    real = os.path.realpath(path)
    if real == data_real or real.startswith(data_real + os.sep):
        return True
    while data_info is not None:
        info = _quiet_stat(path)
        if info is not None and (info.st_dev, info.st_ino) == (data_info.st_dev, data_info.st_ino):
            return True
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return False


def _check_existing(out: OutputPath, info: os.stat_result, own: Callable[[str], list[int] | None],
                    overwrite: bool) -> str:
    if stat.S_ISLNK(info.st_mode):
        raise JobPathError(f"{out.role} {out.path} is a symbolic link: give the path it points to, if that is "
                           f"what you mean (the job never writes through a link)")
    if not stat.S_ISREG(info.st_mode):
        raise JobPathError(f"{out.role} {out.path} is {path_kind(info)}, not a regular file: the job writes only "
                           f"regular files (for no output at all, use a scratch file)")
    mine = own(out.path)
    if mine is not None and mine == [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns][:len(mine)]:
        return "own"
    if info.st_nlink > 1:
        raise JobPathError(f"{out.role} {out.path} is a hard link ({info.st_nlink} names): replacing or appending "
                           f"to it would change the other names' file too; give another path")
    if not overwrite:
        raise JobPathError(f"{out.role} {out.path} exists: pass --overwrite to replace it, or give another path")
    return "replace"


def probe_directory(directory: str, out: OutputPath) -> None:
    """Make and remove a file in `directory`, so a directory the job cannot write to is
    refused now, not when the answers are ready."""
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, FILE_MODE)
        os.close(fd)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise JobPathError(f"{out.role} {out.path}: cannot write in {directory}: {errno_text(exc)}") from exc
    probe = os.path.join(directory, f".{os.path.basename(out.path)}.probe-{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE))
        os.unlink(probe)
    except OSError as exc:
        raise JobPathError(f"{out.role} {out.path}: cannot write in {directory}: {errno_text(exc)}") from exc


class ChunkBuffer:
    """Small writes gathered into writes of WRITE_CHUNK_BYTES."""

    __slots__ = ("_chunk", "_held")

    def __init__(self) -> None:
        self._chunk: list[bytes] = []
        self._held = 0

    def add(self, fd: int, data: bytes) -> None:
        self._chunk.append(data)
        self._held += len(data)
        if self._held >= WRITE_CHUNK_BYTES:
            self.flush(fd)

    def flush(self, fd: int) -> None:
        if self._chunk:
            fileops.write_all(fd, b"".join(self._chunk))
            self._chunk, self._held = [], 0


class ReplacingFile:
    """A file written anew and put in place of `path` at `commit()`, whole or not at all
    (the module's doc); `abandon()` (idempotent, and a no-op after commit) drops it. Writes
    are gathered into WRITE_CHUNK_BYTES. OSError from the file system is raised as it is."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._directory = os.path.dirname(os.path.abspath(path))
        self._fd, self._temp = _temporary(self._directory, path)
        self._buffer = ChunkBuffer()
        try:
            os.fchmod(self._fd, FILE_MODE)
        except BaseException:
            self.abandon()
            raise

    def write(self, data: bytes) -> None:
        self._buffer.add(self._fd, data)

    def commit(self) -> None:
        self._buffer.flush(self._fd)
        fileops.fsync(self._fd)
        if self._temp is None:
            self._temp = _link_unnamed(self._fd, self._directory, self.path)
        os.close(self._fd)
        self._fd = -1
        fileops.rename(self._temp, self.path)
        self._temp = None
        fileops.fsync_directory(self._directory)

    def abandon(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._temp is not None:
            _unlink_quietly(self._temp)
            self._temp = None


def replace_file(path: str, chunks: Iterable[bytes]) -> None:
    """Write `chunks` as the file `path`, whole or not at all (the module's doc), fsynced
    with its directory."""
    out = ReplacingFile(path)
    try:
        for chunk in chunks:
            out.write(chunk)
        out.commit()
    finally:
        out.abandon()


def partial_path(path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(path)), f"{PARTIAL_PREFIX}{os.path.basename(path)}{PARTIAL_SUFFIX}")


def remove_partial(path: str) -> None:
    """Remove the named temporary file a kill left beside `path` (a regular file only)."""
    partial = partial_path(path)
    info = stat_or_none(partial, follow=False)
    if info is not None and stat.S_ISREG(info.st_mode):
        _unlink_quietly(partial)


def _temporary(directory: str, path: str) -> tuple[int, str | None]:
    """An unnamed file in `directory` (name None), or, without O_TMPFILE, the fixed partial
    name beside `path` (created fresh)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, FILE_MODE), None
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    remove_partial(path)
    partial = partial_path(path)
    return os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE), partial


def _link_unnamed(fd: int, directory: str, path: str) -> str:
    """Give the unnamed file a name beside `path` (then renamed over it): the fixed partial
    name, replacing one a kill left between this link and the rename."""
    partial = partial_path(path)
    remove_partial(path)
    # A directory fd makes os.link call linkat(AT_SYMLINK_FOLLOW), which links the file the
    # /proc link names; plain link(2) would try to link the /proc symlink itself.
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(partial), dst_dir_fd=dir_fd, follow_symlinks=True)
    finally:
        os.close(dir_fd)
    return partial


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def stat_or_none(path: str, follow: bool) -> os.stat_result | None:
    try:
        return os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JobPathError(f"{path}: cannot be checked ({exc.strerror})") from exc


def _quiet_stat(path: str) -> os.stat_result | None:
    """The file at `path` (links followed), or None where there is none or it cannot be read:
    for comparing paths, where a path that cannot be read is told apart by its spelling."""
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


def path_kind(info: os.stat_result) -> str:
    mode = info.st_mode
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


@contextlib.contextmanager
def unless_disk_full() -> Iterator[None]:
    """The block's write skipped where the disk is full (ENOSPC): for the job's own files
    that are rebuilt from its answers (read positions, the status file)."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
