"""What the product makes in a data directory, by name, and the removal of exactly that.

A data directory holds what the product made and, possibly, files a user put there, inside
its folders too (a note in `job/`, a folder in `results/`, a disk mounted on `segments/`).
The rule for "what the product made": a file is the product's when its folder is one the
product makes (a chain of folder names from the top, each of the product's grammar) and its
name is one the product gives files there; each grammar (`Made`) is built from the names
their owners define (the store's segment names, the run directory's locks and pid files, a
batch job's files), so a file named otherwise is not the product's, whatever its folder.

`remove_made(path, made)` removes exactly that:

- it walks only folders the grammar names, each opened with O_NOFOLLOW through its parent's
  descriptor (`dir_fd`), so a folder renamed or swapped for a link meanwhile cannot send it
  elsewhere; it never follows a symbolic link;
- it removes a file only when its name is the grammar's for that folder and it is a regular
  file or a socket (the product makes no link, device or FIFO);
- it never enters a folder on another file system: another st_dev, or a mount point of
  /proc/self/mountinfo (a bind mount of the same disk has the same st_dev);
- it removes a folder only once it is empty, the top one last;
- it returns what it left, relative to the top (a mount point marked so), for a message.

`anything` marks a folder handed whole to a program that names its own files (vLLM's cache
and temporary directory under `engine-cache/`): all of it is that program's, links and
sockets too (removing a link never touches what it points to), still never entered past a
link or a mount point.

    kept = remove_made("/data/out.jsonl.run", made)   # ["job/notes.txt", "results (a mount point: ...)"]
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, replace

from pipeline.broker.config import RUN_DIR, SOCKET_NAME
from pipeline.broker.peers import NAMESPACE_FILE
from pipeline.broker.state import DAMAGED_SUFFIX
from pipeline.broker.state import LOCK_NAME as BROKER_LOCK_NAME
from pipeline.broker.state import TEMPORARY_SUFFIX as STATE_TEMPORARY_SUFFIX
from pipeline.storage.paths import CREATING_SUFFIX, MISSING_SUFFIX, QUARANTINE_DIR
from pipeline.storage.storelog import LOG_TMP_SUFFIX
from pipeline.consumer.engines.vllm import CACHE_SUBDIR, TMP_SUBDIR
from pipeline.runtime.datadir import LAUNCH_LOCK_NAME, NODE_LOCK_NAME
from pipeline.runtime.settings import ENGINE_CACHE_DIR
from pipeline.wire.errors import DataDirMovedError
from pipeline.wire.layouts.storelog import STORE_LOG_FILE
from pipeline.wire.layouts.names import (
    BROKER_STATE_NAME,
    SEGMENT_JOURNAL_SUFFIX,
    SEGMENTS_DIR,
    parse_model_dir,
    parse_segment_file,
    parse_shape_dir,
)
from pipeline.wire.owners import ENDED_OWNERS_NAME

RESULTS_DIR = "results"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
MOUNTINFO_PATH = "/proc/self/mountinfo"

Names = Callable[[str], bool]


def named(*names: str) -> Names:
    """These names exactly."""
    fixed = frozenset(names)
    return fixed.__contains__


def matching(pattern: str) -> Names:
    """Names the regular expression matches whole."""
    compiled = re.compile(pattern)
    return lambda name: compiled.fullmatch(name) is not None


def nothing(_name: str) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class Made:
    """What the product makes in one folder: files whose name `files` takes, and folders
    whose name a key of `folders` takes, with what it makes in each (the module's doc)."""

    files: Names = nothing
    folders: tuple[tuple[Names, Made], ...] = ()
    anything: bool = False

    def file(self, name: str) -> bool:
        return self.anything or self.files(name)

    def folder(self, name: str) -> Made | None:
        if self.anything:
            return self
        return next((made for names, made in self.folders if names(name)), None)

    def knows(self, name: str) -> bool:
        """A file or folder of this name is the product's here."""
        return self.file(name) or self.folder(name) is not None

    def with_folders(self, *more: tuple[Names, Made]) -> Made:
        return replace(self, folders=self.folders + more)


def _segment_name(name: str, suffixes: tuple[str, ...]) -> bool:
    """A segment file's name (`pipeline.wire.layouts`), followed by any of `suffixes` (each
    at most once, in that order)."""
    for suffix in suffixes:
        name = name.removesuffix(suffix)
    return parse_segment_file(name) is not None


def _quarantined_name(name: str) -> bool:
    """A name in quarantine/ (`pipeline.storage.paths.quarantine_target`): a segment,
    a segment journal of an earlier release or a note of a missing one, each possibly a copy's (`.N`)."""
    stem, dot, copy = name.rpartition(".")
    if dot and copy.isdigit():
        name = stem
    for suffix in (SEGMENT_JOURNAL_SUFFIX, MISSING_SUFFIX):
        name = name.removesuffix(suffix)
    stem, dot, copy = name.rpartition(".")
    return _segment_name(stem if dot and copy.isdigit() else name, ())


def _store_tree(files: Names) -> Made:
    """m{model}/s{signature}/ folders holding `files` (segments/ and quarantine/)."""
    shape = Made(files=files)
    model = Made(folders=((lambda name: parse_shape_dir(name) is not None, shape),))
    return Made(folders=((lambda name: parse_model_dir(name) is not None, model),))


def _with_temporaries(name: str, *suffixes: str) -> str:
    return re.escape(name) + "(" + "|".join(re.escape(s) for s in suffixes) + ")?"


# Stage names of a pid or log file (`daemon.StageFiles`), as consumer names may be
# (`pipeline.wire.protocol`), and the temporary a pid file is written under.
_STAGE = r"(broker|consumer-[A-Za-z0-9_\-][A-Za-z0-9._\-]*)"
RUN_DIR_MADE = Made(files=lambda name: named(SOCKET_NAME, BROKER_LOCK_NAME, LAUNCH_LOCK_NAME)(name)
                    or matching(_STAGE + r"\.(pid|log)|" + _STAGE + r"\.pid\.\d+\.tmp")(name))
# A run's results folder (the launcher's run-TIME-PID, a Ray driver's ray-TIME-PID), one
# JSON-lines file per consumer (or node), named as consumers may be; a staged consumer's
# (`pipeline consumer`) directly in results/.
_RESULTS_FILES = Made(files=matching(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]*\.jsonl"))
RESULTS_MADE = _RESULTS_FILES.with_folders((matching(r"(run|ray)-\d{8}T\d{6}Z-\d+"), _RESULTS_FILES))
# The top of a data directory, as the broker, the launcher and the consumers make it.
RUN_MADE = Made(
    files=matching("|".join((
        _with_temporaries(STORE_LOG_FILE, LOG_TMP_SUFFIX),
        _with_temporaries(BROKER_STATE_NAME, STATE_TEMPORARY_SUFFIX),
        re.escape(BROKER_STATE_NAME + DAMAGED_SUFFIX) + r"-\d+",
        re.escape(NAMESPACE_FILE) + r"(\.\d+\.tmp)?",  # `peers.ensure_namespace`'s temporary
        re.escape(NODE_LOCK_NAME),  # a node's (`runtime/node.py`)
        re.escape(ENDED_OWNERS_NAME),  # a node's owner's (`wire/owners.py`)
    ))),
    folders=(
        (named(SEGMENTS_DIR), _store_tree(lambda name: _segment_name(name, (SEGMENT_JOURNAL_SUFFIX, CREATING_SUFFIX)))),
        (named(QUARANTINE_DIR), _store_tree(_quarantined_name)),
        (named(RUN_DIR), RUN_DIR_MADE),
        (named(RESULTS_DIR), RESULTS_MADE),
        (named(ENGINE_CACHE_DIR), Made(folders=((named(CACHE_SUBDIR, TMP_SUBDIR), Made(anything=True)),))),
    ),
)


def remove_made(path: str, made: Made, identity: tuple[int, int] | None = None) -> list[str]:
    """Remove what `made` says the product made in the folder `path`, then the folder once
    empty (the module's doc); what is left, relative to it. A folder `path` that is gone
    leaves nothing to say; one that is not a folder (a link) is left whole, named ".".
    `identity`: the (st_dev, st_ino) the folder must be (DataDirMovedError otherwise, with
    nothing removed)."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        parent_fd = os.open(parent, _DIR_FLAGS)
    except FileNotFoundError:
        return []
    try:
        try:
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
        except FileNotFoundError:
            return []
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return ["."]
            raise
        try:
            top = os.fstat(fd)
            if identity is not None and (top.st_dev, top.st_ino) != identity:
                raise DataDirMovedError(f"{path} is not the data directory the job made (another folder is there "
                                        f"now): nothing of it was removed")
            real = os.readlink(f"/proc/self/fd/{fd}")  # where the folder opened is, whatever its path did
            walk = _Walk(top.st_dev, _mount_points(real))
            walk.clear(fd, made, real, "")
        finally:
            os.close(fd)
        if not walk.kept and _same(parent_fd, name, top):
            try:
                os.rmdir(name, dir_fd=parent_fd)
            except OSError as exc:
                if exc.errno == errno.ENOTEMPTY:  # something appeared meanwhile: not ours
                    return sorted(os.listdir(path))
        return walk.kept
    finally:
        os.close(parent_fd)


class _Walk:
    """One removal's walk: the top's device, the mount points below it, what was kept."""

    def __init__(self, device: int, mounts: frozenset[str]) -> None:
        self.device = device
        self.mounts = mounts
        self.kept: list[str] = []

    def clear(self, fd: int, made: Made, real: str, prefix: str) -> None:
        """Remove what `made` names in the open folder `fd` (at `real`, `prefix` below the top)."""
        for name in sorted(os.listdir(fd)):
            where = prefix + name
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            inner = made.folder(name) if stat.S_ISDIR(info.st_mode) else None
            if inner is not None:
                self._folder(fd, name, info, inner, os.path.join(real, name), where)
            elif made.file(name) and (made.anything or stat.S_ISREG(info.st_mode) or stat.S_ISSOCK(info.st_mode)):
                try:
                    os.unlink(name, dir_fd=fd)
                except FileNotFoundError:
                    pass
            else:
                self.kept.append(where)

    def _folder(self, fd: int, name: str, info: os.stat_result, made: Made, real: str, where: str) -> None:
        """Clear the product's folder `name` in `fd`, then remove it if nothing is left."""
        if info.st_dev != self.device or real in self.mounts:
            self.kept.append(f"{where} (a mount point: not entered)")
            return
        try:
            child = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            self.kept.append(where)  # a link or file put at its name meanwhile
            return
        try:
            opened = os.fstat(child)
            if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
                self.kept.append(where)  # swapped between the look and the open
                return
            before = len(self.kept)
            self.clear(child, made, real, where + "/")
        finally:
            os.close(child)
        if len(self.kept) == before and _same(fd, name, opened):
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    self.kept.append(where)


def _same(fd: int, name: str, info: os.stat_result) -> bool:
    """`name` in `fd` is still the folder `info` describes (not swapped meanwhile)."""
    try:
        now = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino)


def _mount_points(top: str) -> frozenset[str]:
    """The mount points below the folder `top` (its real path), from /proc/self/mountinfo;
    none where it cannot be read."""
    try:
        with open(MOUNTINFO_PATH, "rb") as f:
            lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    except OSError:
        return frozenset()
    below = top.rstrip("/") + "/"
    found = set()
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040 is a space
            if point.startswith(below):
                found.add(point)
    return frozenset(found)
