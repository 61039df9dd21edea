"""The disk a node's results take, given back once every job has read them.

A node (`pipeline.runtime.node`: the batch service's broker and consumers) serves batch after
batch for as long as its server runs, and its consumers append every job's answers to their
results files; each job's collector reads them from where it stopped (`collect.py`). What
every job that may still read a file has read is of no use to anyone: its blocks are freed
with a hole (fallocate's PUNCH_HOLE, KEEP_SIZE), so the offsets every reader saved stay
valid, no file is renamed under its writer, and the disk the node takes follows the answers
not yet read, not the service's life.

    freed = reclaim_results(node_dir, job_data_dirs)   # the scheduler, every RECLAIM_INTERVAL_S

The readers are the jobs of the batches not ended that were made (a data directory with a
manifest): each reads a file from the position its collector last saved (`read_positions`),
from the start where the positions do not name it, and holds everything while it saved no
positions yet (a job that just started, or one killed before its first save). A job not yet
made holds nothing: it starts at the end of every file (`Collector.skip_results_so_far`,
after its manifest is written).

`reclaimable` is the rule, pure; `reclaim_results` reads the sizes and positions and punches.
NOTE: rolling each consumer's file by size and removing read ones was the alternative; it
renames files under their writer and every reader of results, where a hole changes none.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
from collections.abc import Iterable, Mapping

from pipeline.batchjob.collect import read_positions, results_files
from pipeline.batchjob.manifest import manifest_path

log = logging.getLogger("pipeline.service")

# Holes are punched in whole units of this many bytes (a file system frees whole blocks; a
# partial block would be zeroed and kept, a write for nothing).
HOLE_ALIGN_BYTES = 1 << 20
# Linux's fallocate(2) modes.
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def reclaimable(sizes: Mapping[str, int], readers: Iterable[Mapping[str, int] | None]) -> dict[str, int]:
    """For each file of `sizes` (bytes), the length of its start every reader has read past,
    down to HOLE_ALIGN_BYTES (files with none left out). A reader is the positions it saved
    (a file it does not name: read from 0), or None: it saved none, and holds every file."""
    hold = dict(sizes)
    for positions in readers:
        if positions is None:
            return {}
        for name in hold:
            hold[name] = min(hold[name], positions.get(name, 0))
    freed = {name: read - read % HOLE_ALIGN_BYTES for name, read in hold.items()}
    return {name: length for name, length in freed.items() if length > 0}


def reclaim_results(results_root: str, job_dirs: Iterable[str]) -> int:
    """Free what every job of `job_dirs` has read of the results under `results_root`; the
    bytes newly freed. The sizes are taken before the readers are looked at: a data directory
    without a manifest is a job that has not started reading, and when it starts it reads
    from the ends of the files as they are then, past every size taken here. One file that
    cannot be read or freed stops no other."""
    sizes = {}
    for relative in results_files(results_root):
        try:
            found = os.stat(os.path.join(results_root, relative), follow_symlinks=False)
        except OSError:
            continue  # gone meanwhile, or not ours to read: nothing of it is freed
        if stat.S_ISREG(found.st_mode):
            sizes[relative] = found.st_size
    readers = (read_positions(d) for d in job_dirs if os.path.exists(manifest_path(d)))
    freed = 0
    for relative, length in reclaimable(sizes, readers).items():
        freed += _punch(os.path.join(results_root, relative), length)
    return freed


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
