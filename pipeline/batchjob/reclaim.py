"""The disk a node's results take, given back once every job has read them.

A node (`pipeline.runtime.node`: the batch service's broker and consumers) serves batch after
batch for as long as its server runs, and its consumers append every job's answers to their
results files; each job's collector reads them from where it stopped (`collect.py`). What
every job that may still read a file has read is of no use to anyone: its blocks are freed
with a hole (fallocate's PUNCH_HOLE, KEEP_SIZE), so the offsets every reader saved stay
valid, no file is renamed under its writer, and the disk the node takes follows the answers
not yet read, not the service's life.

    freed = reclaim_results(node_dir, job_data_dirs, live_results_dir)   # the scheduler, every
                                                                         # RECLAIM_INTERVAL_S

The readers are the jobs of the batches not ended that were made (a data directory with a
manifest): each reads a file from the position its collector last saved (`read_positions`),
from the start where the positions do not name it, and holds everything while it saved no
positions yet (a job that just started, or one killed before its first save). A job not yet
made holds nothing: it starts at the end of every file (`Collector.skip_results_so_far`,
after its manifest is written).

A node that stopped (the server restarted, or the node was started again) leaves its results
folder behind: once every job has read one of its files to the end, and nothing has written
it for RESULTS_QUIET_S, the file goes, and the folder with its last file.

`read_by_all`, `reclaimable` and `removable` are the rule, pure; `reclaim_results` reads the
sizes and positions, punches and removes.
NOTE: rolling each consumer's file by size and removing read ones was the alternative; it
renames files under their writer and every reader of results, where a hole changes none.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
import time
from collections.abc import Iterable, Mapping

from pipeline.batchjob.collect import read_positions, results_files, whole_lines_end
from pipeline.batchjob.manifest import manifest_path

log = logging.getLogger("pipeline.service")

# Holes are punched in whole units of this many bytes (a file system frees whole blocks; a
# partial block would be zeroed and kept, a write for nothing).
HOLE_ALIGN_BYTES = 1 << 20
# A file of a node run that stopped is removed only once it has not been written for this
# long: a consumer of a node killed with kill -9 may outlive its node by a moment.
RESULTS_QUIET_S = 60.0
# Linux's fallocate(2) modes.
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def read_by_all(sizes: Mapping[str, int], readers: Iterable[Mapping[str, int] | None]) -> dict[str, int]:
    """For each file of `sizes` (bytes), how much of its start every reader has read past
    (at most its size). A reader is the positions it saved (a file it does not name: read
    from 0), or None: it saved none, and holds every file (then {})."""
    read = dict(sizes)
    for positions in readers:
        if positions is None:
            return {}
        for name in read:
            read[name] = min(read[name], positions.get(name, 0))
    return read


def reclaimable(sizes: Mapping[str, int], readers: Iterable[Mapping[str, int] | None]) -> dict[str, int]:
    """What of each file may be freed: its start every reader has read past, down to
    HOLE_ALIGN_BYTES (files with none left out)."""
    return _aligned(read_by_all(sizes, readers))


def _aligned(read: Mapping[str, int]) -> dict[str, int]:
    freed = {name: length - length % HOLE_ALIGN_BYTES for name, length in read.items()}
    return {name: length for name, length in freed.items() if length > 0}


def removable(sizes: Mapping[str, int], read: Mapping[str, int], quiet: Iterable[str]) -> list[str]:
    """Files of `quiet` (of a node run that stopped, unwritten for RESULTS_QUIET_S) that every
    reader has read to their end (`read`, from `read_by_all`)."""
    return sorted(name for name in quiet if name in read and read[name] >= sizes[name])


def reclaim_results(results_root: str, job_dirs: Iterable[str], live_dir: str | None = None) -> int:
    """Free what every job of `job_dirs` has read of the results under `results_root`, and
    remove the files of earlier node runs (not `live_dir`, the live node's results folder)
    that every job read whole; the bytes newly freed. The sizes are taken before the readers
    are looked at: a data directory without a manifest is a job that has not started
    reading, and when it starts it reads from the ends of the files as they are then, past
    every size taken here. One file that cannot be read or freed stops no other."""
    sizes, quiet, found = {}, [], {}
    live = None if live_dir is None else os.path.relpath(os.path.abspath(live_dir), os.path.abspath(results_root))
    for relative in results_files(results_root):
        try:
            found[relative] = os.stat(os.path.join(results_root, relative), follow_symlinks=False)
        except OSError:
            continue  # gone meanwhile, or not ours to read: nothing of it is freed
        if stat.S_ISREG(found[relative].st_mode):
            sizes[relative] = found[relative].st_size
            if live is not None and os.path.dirname(relative) != live \
                    and time.time() - found[relative].st_mtime >= RESULTS_QUIET_S:
                quiet.append(relative)
    read = read_by_all(sizes, [read_positions(d) for d in job_dirs if os.path.exists(manifest_path(d))])
    freed = 0
    for relative, length in _aligned(read).items():
        freed += _punch(os.path.join(results_root, relative), length)
    for relative in removable(_whole_lines_ends(results_root, quiet, sizes), read, quiet):
        freed += _remove(results_root, relative)
    return freed


def _whole_lines_ends(results_root: str, quiet: list[str], sizes: Mapping[str, int]) -> dict[str, int]:
    """Where the last whole line of each quiet file ends: what its readers read up to (a
    line a killed consumer cut short is never read, and stays the tail)."""
    ends = dict(sizes)
    for relative in quiet:
        try:
            ends[relative] = min(sizes[relative], whole_lines_end(os.path.join(results_root, relative)))
        except OSError:
            continue  # gone meanwhile: `removable` judges it by its size, and its unlink finds nothing
    return ends


def _remove(results_root: str, relative: str) -> int:
    """Unlink one file of a stopped node run, and its folder once empty; the bytes freed."""
    path = os.path.join(results_root, relative)
    try:
        allocated_bytes = os.stat(path, follow_symlinks=False).st_blocks * 512
        os.unlink(path)
    except OSError:
        return 0
    with contextlib.suppress(OSError):  # not empty yet, or gone: tried again at the next pass
        os.rmdir(os.path.join(results_root, os.path.dirname(relative)))
    return allocated_bytes


def _punch(path: str, length: int) -> int:
    """A hole over the first `length` bytes of `path`; the bytes newly freed (0 where they
    were, or the file system keeps them: said once for each reason)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return 0  # gone, or not ours: nothing to free
    try:
        try:
            data = os.lseek(fd, 0, os.SEEK_DATA)
        except OSError as exc:  # ENXIO: no data left at all
            data = length if exc.errno == errno.ENXIO else 0
        if data >= length:
            return 0
        if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, length) != 0:
            code = ctypes.get_errno()
            if code not in _SAID:
                _SAID.add(code)
                log.warning("%s: freeing what every job read of the node's results failed (%s): they keep their "
                            "disk until the server's data directory is cleared", path, os.strerror(code))
            return 0
        return length - data
    finally:
        os.close(fd)


# The process's own symbols, libc's among them (ctypes.util.find_library would run ldconfig
# at import).
_fallocate = ctypes.CDLL(None, use_errno=True).fallocate
_fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_fallocate.restype = ctypes.c_int
_SAID: set[int] = set()  # the errno values a failed punch was logged with (once each, not every pass)
