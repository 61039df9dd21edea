"""One segment file of the disk tier: create, append groups of entries, complete, seal.
Reading one back (recovery, tools) is `pipeline.storage.scan`.

A segment holds the entries of one (model, signature, lane) (layout in `pipeline.wire.layouts`).
The broker is its only writer; consumers and tools map it read-only.

Durability (SPEC §5): an append is written with one `pwrite` of the whole group; the
readable boundary (`readable_end`) moves only after that write returned (`process`: the
bytes are in the page cache and survive kill -9 of any process) or after `sync()` has also
fdatasync'ed them (`power`). Readers never see bytes past the boundary.

Written once (layout version 2): no byte of a segment is rewritten after its append, so a
sector being written when the power goes (garbage, under the model of
`lab.reliability.faults.PowerCut`) never holds acknowledged bytes. What changes lives
in the store log (`storelog.py`): completions, the commit boundary, the seal. In
`power` each synced group starts on a SYNC_ALIGN_BYTES boundary when the sector at the end
of the data holds synced bytes (zeros before it: padding the scan skips), so no append
writes into a sector holding synced bytes either. NOTE: the cost is up to 4 KiB of padding
per segment per group commit in `power` (none in `process`, where nothing is synced);
rewriting the partial sector was what lost acknowledged entries.

The log's BOUNDARY record (entry_count, data_end) is the commit boundary a recovery scan
judges damage by (bad bytes below it are corruption, at or past it a torn tail), so it never
runs ahead of what is durable: `process` writes it right after the pwrite (the page cache is
what survives), `power` only after the fdatasync that made the bytes durable; it becomes
durable with the group commit's one sync of the log (`SegmentStore.sync`).

Completions are kept in memory as a bitmap over the 16-byte entry slots (one bit each,
1/128 of the data), made at a segment's first completion, and appended to the log, one
pwrite per `tombstone_many`. A file the store closes (its open-file cache) hands what it
knows to the store (`progress`), which opens it again from that (`open`).
NOTE: a bitmap made with the segment was rejected: a backlog nothing has completed yet then
grows the broker by 1/128 of the store (`pipeline bench memory` at 10,000,000 queued items:
anonymous + file-backed RSS 49.1 MiB against 35.7 MiB at 10,000, 19 MiB of it bitmaps).
NOTE: a 4-byte tombstone stored into the shared mapping was rejected: it puts acknowledged
neighbours at risk under power loss, and a log pwrite per call of 64 completions
costs 576-616 ns per completion against 545-607 for the mapped stores
(SegmentFile.tombstone_many alone, best of 5, 3 alternating pairs).

Files grow in preallocated steps (posix_fallocate, doubling, never past the segment limit but
for one oversize group): writing into allocated, zeroed space keeps appends sequential, and a
zero state word marks the end of the data for a scan.
"""

from __future__ import annotations

import mmap
import os
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

import pipeline.storage.crashpoints as crashpoints
from pipeline.storage.diskio import (
    NO_SPACE_ERRNOS,
    Durability,
    disk_reserve_bytes,
    durability_error,
    fdatasync,
    fsync_directory,
    no_space_error,
)
from pipeline.storage.encode import EncodedGroup, encode_entries  # re-exported: they lived here first
from pipeline.storage.storelog import StoreLog, log_key
from pipeline.storage.paths import CREATING_SUFFIX
from pipeline.storage.scan import (  # re-exported: the scan lived here first
    SegmentKeys,
    boundary_checksum,
    establish_identity,
    identity_bytes,
    read_identity,
    scan_segment,
)
from pipeline.storage.scan_report import ScanReport
from pipeline.storage.walk import done_at, no_entry, walk_entries
from pipeline.wire import fileops
from pipeline.wire.errors import DiskFullError, SegmentCorruptError
from pipeline.wire.layouts.segments import (
    ENTRY_ALIGN_BYTES,
    ENTRY_HEADER_SIZE_BYTES,
    ENTRY_LIVE,
    ENTRY_NONE,
    ENTRY_STATE,
    ENTRY_TOMBSTONE,
    SEGMENT_BOUNDARY_CHECKSUM,
    SEGMENT_DATA_END,
    SEGMENT_ENTRY_COUNT,
    SEGMENT_HEADER_SIZE_BYTES,
    SYNC_ALIGN_BYTES,
    gather_entry_headers,
)

__all__ = [
    "DEFAULT_SEGMENT_MAX_BYTES", "Durability", "EncodedGroup", "ScanReport", "SegmentFile", "SegmentKeys",
    "encode_entries", "fsync_directory", "read_identity", "scan_segment", "unlink_segment",
]

# First preallocation of a new segment whose first group's size is not known (appends pass
# it: their segment starts with what that group needs, page-rounded). Most lanes of a
# many-shape workload hold a few batches: 100,000 lanes took 6.4 GB at 64 KiB each, and on
# an 8 MiB disk 154 lanes' first allocations held 7 MiB for 500 KB of items, so nothing was
# dispatched and the run stood still (tests/runtime/test_disk_full.py); a busy lane doubles from
# its first group's size to the segment limit, one fallocate a step.
FIRST_ALLOCATION_BYTES = 64 << 10
# Segments seal at this size: big enough that per-file costs (open, the header page, in `power`
# the fsyncs) stay a small share (a file per ~40,000 short chat items), small enough that a
# fully completed segment is freed soon. The broker's and each consumer's completion bitmap of
# a segment is a bit per 16 bytes of its file (64 KiB here), and each of a job's lanes keeps
# one open segment, so those bitmaps follow the segment size, not the job's length.
# NOTE: 64 MiB was rejected: a 3,000,000-request job (286 lanes) peaked at 484.8 against 471.7
# MiB PSS, its lanes' bitmaps growing with the job towards 512 KiB each. The price: at
# durability `power` a file's create, seal and delete cost fsyncs, and a one-shape flood of
# 1,000,000 items (4 MiB frames, about one a file) ran 134k against 143k items/s (medians of 6).
DEFAULT_SEGMENT_MAX_BYTES = 8 << 20


def _check_room(fd: int, path: str, offset: int, nbytes: int, what: str, least: int | None = None) -> int:
    """How much to allocate at `offset`: `nbytes`, or, when that would leave less than the
    reserve free, `least` (what the append needs, page-rounded) if that still leaves it;
    DiskFullError otherwise. The store only takes space when it allocates (creating a
    segment, growing one), so this is checked there, once per allocation, never per append.
    NOTE: without the `least` step a nearly full disk refused new segments their 64 KiB
    first allocation while a few KiB would do: on an 8 MiB disk, 110 lanes' first
    allocations held 7 MiB for 500 KB of items, nothing was dispatched (the frame was held
    back whole) and the run stood still (tests/runtime/test_disk_full.py)."""
    info = os.fstatvfs(fd)
    free, reserve = info.f_bavail * info.f_frsize, disk_reserve_bytes(info.f_blocks * info.f_frsize)
    if free - nbytes >= reserve:
        return nbytes
    if least is not None and least < nbytes and free - least >= reserve:
        return least
    raise DiskFullError(
        f"{path}: disk full: {free:,} bytes free, and {what} {least or nbytes:,} bytes at offset {offset} would "
        f"leave less than the {reserve:,} kept free for results; appends stop until space comes back, nothing "
        f"accepted is lost")


def _page_align(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


# NOTE: mapping a peeked batch's pages writable ahead (madvise MADV_POPULATE_WRITE) was
# rejected: a write-populate of a shared file mapping dirties its pages, and the kernel would
# write synced sectors back again, the in-place rewrite the layout forbids. Reads fault in
# 64 KiB at a time (fault-around), and the pages mapped are only those dispatch reaches.


# Pages dropped from a segment's mapping at a time, at least: reads fault in 64 KiB at a time
# (fault-around), and a call per 64 KiB dispatched is about one a batch. A larger step left up
# to that much mapped in each of a job's hundreds of lanes (1 MiB: 94 MB at 300,000 requests).
RELEASE_STEP_BYTES = 64 << 10
# What a read fault maps around the page it needs (the kernel's fault_around_bytes default).
FAULT_AROUND_BYTES = 64 << 10


@dataclass(slots=True)
class SegmentProgress:
    """A closed segment file's state in this process, kept by the store until it opens the
    file again: where its data ends, its entries and completions, whether it is sealed, and
    its completion bitmap, zlib-compressed (None before its first completion).
    NOTE: the bitmap kept as it is was rejected: it is 1/128 of the file (64 KiB a segment)
    for as long as the file stays partly completed, and a job of many shapes leaves a partly
    completed segment in each lane it left. Compressed, it is about a byte a completed entry
    of random lengths (21 KB for 12,000 of 20,000 against 135 KB; tests/storage/test_segment.py)
    and next to nothing for the part not completed."""

    data_end: int
    entry_count: int
    deleted_count: int
    sealed: bool
    done: bytes | None


class SegmentFile:
    """One segment open for appends (until sealed) and completions.

    Owner: the disk tier of the broker process, which is the only writer of segment files
    and of the store log (`log`, shared by every segment of the store). Not thread-safe.
    `close()` releases the descriptor and mapping; `unlink()` removes the file (a sealed
    segment whose every entry is done).
    """

    def __init__(self, path: str, fd: int, keys: SegmentKeys, durability: Durability, max_bytes: int,
                 log: StoreLog) -> None:
        self.path = path
        self.keys = keys
        self.durability = durability
        self.max_bytes = max_bytes
        self._fd = fd
        self._log = log
        self._log_key = log_key(keys)
        self.allocated = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, self.allocated)
        self.data_end = SEGMENT_HEADER_SIZE_BYTES
        self.readable_end = SEGMENT_HEADER_SIZE_BYTES
        self.entry_count = 0
        self.deleted_count = 0
        self.sealed = False
        self._unsynced = False
        self._closed = False
        # One bit per 16-byte slot once something in the segment completed (module docstring).
        self._done: np.ndarray | None = None
        # Pages below this were dropped from the mapping (`release_below`).
        self._released_to = 0

    @classmethod
    def create(cls, path: str, keys: SegmentKeys, durability: Durability, log: StoreLog,
               max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES, need_bytes: int = 0) -> SegmentFile:
        """A new, empty, owner-only segment with its header written (and synced in `power`).
        Built under `path + CREATING_SUFFIX` and renamed into place once its header is
        written, so a crash mid-create never leaves a headerless file under a segment name
        (recovery removes the leftover; kill -9 tests found the bare version quarantined)."""
        creating = path + CREATING_SUFFIX
        try:
            fd = fileops.open_fd(creating, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            if exc.errno in NO_SPACE_ERRNOS:  # no inode left (a tmpfs with nr_inodes, a full ext4)
                raise no_space_error(exc, path, 0, 0, "creating the file,") from exc
            raise
        try:
            need = _page_align(SEGMENT_HEADER_SIZE_BYTES + need_bytes)
            first = need if need_bytes else min(FIRST_ALLOCATION_BYTES, max(max_bytes, SEGMENT_HEADER_SIZE_BYTES))
            first = _check_room(fd, path, 0, first, "allocating", least=need)
            try:
                fileops.fallocate(fd, 0, first)
            except OSError as exc:
                if exc.errno in NO_SPACE_ERRNOS:
                    raise no_space_error(exc, path, 0, first, "allocating") from exc
                raise
            fileops.pwrite_all(fd, identity_bytes(keys, time.time_ns()), 0)
            boundary = bytearray(SEGMENT_BOUNDARY_CHECKSUM.end - SEGMENT_ENTRY_COUNT.offset)
            _write_boundary(boundary, 0, SEGMENT_HEADER_SIZE_BYTES, base=-SEGMENT_ENTRY_COUNT.offset)
            fileops.pwrite_all(fd, boundary, SEGMENT_ENTRY_COUNT.offset)
            if durability is Durability.POWER:
                fdatasync(fd, path)
            assert not os.path.exists(path), path
            fileops.rename(creating, path)
            if durability is Durability.POWER:
                fsync_directory(os.path.dirname(path))
            return cls(path, fd, keys, durability, max_bytes, log)
        except BaseException:
            fileops.close_fd(fd)
            for leftover in (creating, path):
                if os.path.exists(leftover):
                    fileops.unlink(leftover)
            raise

    @classmethod
    def reopen(cls, report: ScanReport, durability: Durability, log: StoreLog,
               max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES) -> SegmentFile:
        """Reopen a scanned segment for completions (and appends, if not sealed): recovery,
        SPEC §5. Nothing is zeroed or truncated: damaged and torn bytes stay as evidence
        (a recovered segment is sealed, so nothing is appended over them). Repairs: a state
        word the scan read as live (`repaired_states`) is rewritten live, so consumers accept
        the entry (the one write into written bytes left: it follows damage, and is synced at
        once in `power`); the log gets the scan's boundary when its own differs (never
        lowered below damage, see ScanReport.boundary)."""
        fd = fileops.open_fd(report.path, os.O_RDWR)
        segment = cls(report.path, fd, report.keys, durability, max_bytes, log)
        segment.data_end = segment.readable_end = report.data_end
        segment.entry_count = report.entry_count
        segment.sealed = report.sealed
        segment._mark_done(report.tombstone_offsets)
        segment.deleted_count = report.tombstone_count
        for repaired in report.repaired_states:
            ENTRY_STATE.write(segment._map, ENTRY_LIVE, base=repaired.offset)
        if report.repaired_states and durability is Durability.POWER:
            segment._msync()
        if (report.header_entry_count, report.header_data_end) != (report.accounted_entries, report.boundary):
            log.boundary(segment._log_key, report.accounted_entries, report.boundary)
        return segment

    @classmethod
    def open(cls, path: str, durability: Durability, log: StoreLog, progress: SegmentProgress,
             max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES, keys: SegmentKeys | None = None) -> SegmentFile:
        """Reopen a segment this process wrote and closed (the open-file cache evicted it),
        from what it knew when closed (`progress`): no scan is needed. Not for recovery:
        after a crash use `scan_segment` and `reopen`. `keys`: the store's keys for it, which
        also admit a segment recovery salvaged with a damaged identity block (see
        scan.establish_identity)."""
        fd = fileops.open_fd(path, os.O_RDWR)
        try:
            header = os.pread(fd, SEGMENT_HEADER_SIZE_BYTES, 0)
            # `keys` are the store's: it established them (at recovery, or by creating it).
            found, _created_ns, _damage = establish_identity(header, path, keys, name_confirmed=keys is not None)
            segment = cls(path, fd, found, durability, max_bytes, log)
        except BaseException:
            fileops.close_fd(fd)
            raise
        segment.sealed = progress.sealed
        segment.entry_count = progress.entry_count
        segment.deleted_count = progress.deleted_count
        segment.data_end = segment.readable_end = progress.data_end
        if progress.done is not None:
            done = np.frombuffer(zlib.decompress(progress.done), dtype=np.uint8)
            segment._done = np.zeros(_done_bytes(segment.allocated), dtype=np.uint8)
            segment._done[:done.shape[0]] = done[:segment._done.shape[0]]
        return segment

    def progress(self) -> SegmentProgress:
        """What `open` needs to go on after this file is closed (everything appended is
        synced first in `power`: the store syncs a file before it closes it)."""
        assert not self._unsynced, self.path
        done = None if self._done is None else zlib.compress(self._done.tobytes(), 1)
        return SegmentProgress(self.data_end, self.entry_count, self.deleted_count, self.sealed, done)

    def _next_at(self) -> int:
        """Where the next group goes: the end of the data, or in `power`, when the sector
        there holds synced bytes, the next SYNC_ALIGN_BYTES boundary (module docstring)."""
        at = self.data_end
        if self.durability is Durability.POWER and not self._unsynced:
            at = -(-at // SYNC_ALIGN_BYTES) * SYNC_ALIGN_BYTES
        return at

    def room_for(self, nbytes: int) -> bool:
        """Whether a group of `nbytes` may go in (an empty segment takes any group)."""
        if self.sealed:
            return False
        return self.entry_count == 0 or self._next_at() + nbytes <= self.max_bytes

    def _grow(self, needed_end: int) -> None:
        # Doubling stops at the segment limit (or at what an oversize first group needs): a
        # file, and the completion bitmaps that follow its size, never pass the limit.
        needed = _page_align(needed_end)
        limit = max(_page_align(self.max_bytes), needed)
        new_size = self.allocated
        while new_size < needed_end:
            new_size = min(new_size * 2, limit)
        grow = _check_room(self._fd, self.path, self.allocated, new_size - self.allocated, "growing the file by",
                           least=needed - self.allocated)
        new_size = self.allocated + grow
        try:
            fileops.fallocate(self._fd, 0, new_size)
        except OSError as exc:
            if exc.errno in NO_SPACE_ERRNOS:
                raise no_space_error(exc, self.path, self.allocated, new_size - self.allocated, "growing the file by") from exc
            raise
        self._map.resize(new_size)
        self.allocated = new_size
        if self._done is not None:
            done = np.zeros(_done_bytes(new_size), dtype=np.uint8)
            done[:self._done.shape[0]] = self._done
            self._done = done

    def _write_all(self, data: np.ndarray, at: int) -> None:
        """pwrite until every byte is written (a full disk can cut a write short first)."""
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += fileops.pwrite(self._fd, view[done:], at + done)
        except OSError as exc:
            if exc.errno in NO_SPACE_ERRNOS:
                raise no_space_error(exc, self.path, at + done, len(view) - done, "writing") from exc
            raise
        finally:
            view.release()

    def append(self, group: EncodedGroup) -> int:
        """Write a group of entries at the end; return its offset. The entries become readable
        now (`process`) or at the next `sync()` (`power`). DiskFullError (ENOSPC from the
        preallocation or the write) or another OSError leave nothing changed in memory: a
        partial write leaves bytes past `data_end` that the next append overwrites and a
        recovery scan drops as a torn tail."""
        assert not self.sealed and not self._closed
        at = self._next_at()
        end = at + group.data.nbytes
        if end > self.allocated:
            self._grow(end)
        self._write_all(group.data, at)
        if crashpoints.ARMED:
            crashpoints.hit("segment.after_write")
        self.data_end = end
        self.entry_count += group.count
        if self.durability is Durability.PROCESS:
            self._log.boundary(self._log_key, self.entry_count, self.data_end)
            self.readable_end = end
        else:
            self._unsynced = True  # the boundary is recorded in sync(), after the fdatasync
        return at

    @property
    def needs_sync(self) -> bool:
        return self._unsynced

    def sync(self) -> None:
        """`power`: fdatasync what was appended, then make it readable (group commit: the disk
        tier calls this once per loop turn for every segment that took appends)."""
        if self._unsynced:
            if crashpoints.ARMED:
                crashpoints.hit("sync.before_fdatasync")
            fdatasync(self._fd, self.path)  # DurabilityError: fatal, the broker stops
            if crashpoints.ARMED:
                crashpoints.hit("sync.after_fdatasync")
            self._log.boundary(self._log_key, self.entry_count, self.data_end)  # only now: never claims unsynced bytes
            self._unsynced = False
        self.readable_end = self.data_end

    def tombstone_many(self, offsets: Sequence[int] | np.ndarray) -> int:
        """Mark entries completed: their bits, then their log records (one pwrite).
        Entries already completed are skipped (duplicate completions). Returns how many
        were live. SegmentCorruptError for an offset where no entry starts.
        Example: live entries at 4096 and 5184; tombstone_many([4096, 5184, 4096]) -> 2 and
        the deleted count goes up by 2."""
        fresh = self._fresh_columns(offsets)
        if fresh is None:  # something to refuse: one by one, naming the offset
            fresh = self._fresh_one_by_one(offsets)
        if fresh.size:
            self._mark_done(fresh)  # NOTE: ufunc.at, as two entries may share a bitmap byte
            if crashpoints.ARMED:
                crashpoints.hit("tombstone.before_record")
            self._log.completed(self._log_key, fresh)
            self.deleted_count += int(fresh.size)
        return int(fresh.size)

    def _is_done(self, offsets: np.ndarray) -> np.ndarray:
        return done_at(self._done, offsets)

    def _mark_done(self, offsets: np.ndarray) -> None:
        if self._done is None:
            self._done = np.zeros(_done_bytes(self.allocated), dtype=np.uint8)
        slots = np.asarray(offsets, dtype=np.int64) >> 4
        np.bitwise_or.at(self._done, slots >> 3, (1 << (slots & 7)).astype(np.uint8))

    def _fresh_columns(self, offsets: Sequence[int] | np.ndarray) -> np.ndarray | None:
        """The offsets not yet completed (sorted, unique), read as numpy columns; None when
        an offset is no entry (nothing is marked)."""
        at = np.asarray(offsets, dtype=np.int64)
        # A batch completes its entries in file order: strictly increasing needs no sort.
        # NOTE: np.unique on every call cost 20 us of a 256-entry batch's 37 (/tmp micro-bench).
        if at.size > 1 and not (at[1:] > at[:-1]).all():
            at = np.unique(at)  # a duplicate completes once
        if not at.size:
            return at
        if at[0] < SEGMENT_HEADER_SIZE_BYTES or at[-1] >= self.readable_end or (at & (ENTRY_ALIGN_BYTES - 1)).any():
            return None
        words = np.frombuffer(self._map, dtype=np.uint32, count=self.readable_end // 4)
        try:  # the view is dropped at once: a mapping with views cannot be resized or closed
            if not (words[at >> 2] == ENTRY_LIVE).all():
                return None
        finally:
            del words
        self._drop_read(int(at[0]), int(at[-1]))
        return at[~self._is_done(at)]

    def _drop_read(self, first: int, last: int) -> None:
        """A completion read the state words of entries `first`..`last`, all dispatched: drop
        the pages that read mapped again (with the kernel's fault-around on either side),
        below what dispatch released (`release_below`)."""
        low = max(0, (first - FAULT_AROUND_BYTES) // mmap.PAGESIZE * mmap.PAGESIZE)
        high = min(self._released_to, -(-(last + FAULT_AROUND_BYTES) // mmap.PAGESIZE) * mmap.PAGESIZE)
        if high > low:
            self._map.madvise(mmap.MADV_DONTNEED, low, high - low)

    def _fresh_one_by_one(self, offsets: Sequence[int] | np.ndarray) -> np.ndarray:
        """The refusal path of `tombstone_many`: entry by entry, so that the error names the
        first offset that is no entry."""
        mapped, readable = self._map, self.readable_end
        for offset in offsets:
            if not SEGMENT_HEADER_SIZE_BYTES <= offset < readable or offset % ENTRY_ALIGN_BYTES:
                raise SegmentCorruptError(f"{self.path}: no entry can start at offset {offset}")
            state = ENTRY_STATE.read(mapped, offset)
            if state != ENTRY_LIVE:
                raise SegmentCorruptError(f"{self.path}: offset {offset}: state word {state:#010x} is not an entry")
        raise AssertionError("unreachable: the column check refused an offset the walk accepts")

    def entry_header_columns(self, offsets: np.ndarray) -> np.ndarray:
        """The live entries at `offsets` (int64), as an ENTRY_HEADER_DTYPE array gathered
        from the mapping and checked as columns (validated after reading): each must start
        16-aligned within the readable data, be live (not completed), hold a token and end
        before the readable boundary. SegmentCorruptError naming the first offset that fails."""
        readable = self.readable_end
        inside = (offsets >= SEGMENT_HEADER_SIZE_BYTES) & (offsets + ENTRY_HEADER_SIZE_BYTES <= readable)
        if not inside.all():
            self._no_entry(int(offsets[np.argmin(inside)]), None)
        words = np.frombuffer(self._map, dtype=np.uint64, count=readable // 8)
        try:  # the view is dropped at once: a mapping with views cannot be resized or closed
            headers, _ends, good = gather_entry_headers(words, offsets, readable)
        finally:
            del words
        good &= ~self._is_done(offsets)
        if not good.all():
            bad = int(np.argmin(good))
            state = int(headers["state"][bad])
            self._no_entry(int(offsets[bad]), ENTRY_TOMBSTONE if state == ENTRY_LIVE else state)
        return headers

    def entry_offsets(self, start: int, end: int, count: int) -> tuple[np.ndarray, int]:
        """The offsets of the next `count` live entries from byte `start` (completed ones and
        `power` padding skipped, none ending past `end` or the readable boundary), and the
        byte after the last: a walk of the headers through the mapping (a queue's cold run
        read back: pipeline/storage/walk.py). SegmentCorruptError where the walk finds
        no entry.
        Example: live entries of 112 and 176 bytes at 4096 -> entry_offsets(4096, 4384, 2)
        is ([4096, 4208], 4384); with the first completed, entry_offsets(4096, 4384, 1)
        is ([4208], 4384)."""
        return walk_entries(self._map, self._done, start, min(end, self.readable_end), count, self.path,
                            self.readable_end)

    def release_below(self, offset: int) -> None:
        """Drop the mapping's pages wholly below `offset` (entries dispatched: read again
        only if a consumer is lost, when they fault back in): the broker's memory then holds
        the pages around each lane's front, not its whole backlog. MADV_DONTNEED on a shared
        file mapping unmaps pages and keeps their data (the page cache, the file).
        NOTE: kept mapped, a 300,000-request job's dispatched pages were 120 MB of the
        broker's 446 MB peak PSS, growing with the job's size."""
        aligned = offset // mmap.PAGESIZE * mmap.PAGESIZE
        if aligned - self._released_to >= RELEASE_STEP_BYTES and not self._closed:
            self._map.madvise(mmap.MADV_DONTNEED, self._released_to, aligned - self._released_to)
            self._released_to = aligned

    def _no_entry(self, offset: int, state: int | None) -> NoReturn:
        no_entry(self.path, offset, self.readable_end, state)

    def state_at(self, offset: int) -> int:
        """The entry's state at `offset`: ENTRY_LIVE, ENTRY_TOMBSTONE once completed, or
        ENTRY_NONE past the readable boundary or off the grid."""
        if not SEGMENT_HEADER_SIZE_BYTES <= offset < self.readable_end or offset % ENTRY_ALIGN_BYTES:
            return ENTRY_NONE
        state = ENTRY_STATE.read(self._map, offset)
        if state == ENTRY_LIVE and self._is_done(np.array([offset], dtype=np.int64))[0]:
            return ENTRY_TOMBSTONE
        return state

    def seal(self) -> None:
        """No more appends (a log record, synced at once in `power`); the segment is deleted
        whole once every entry is completed."""
        self.sealed = True
        self._log.sealed(self._log_key, self.entry_count)
        if self.durability is Durability.POWER:
            self._log.sync()

    def _msync(self) -> None:
        try:
            fileops.msync(self._map, self._fd)
        except OSError as exc:
            raise durability_error(exc, self.path, "msync") from exc

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._map.close()
            fileops.close_fd(self._fd)

    def unlink(self) -> None:
        """Remove the file (after close); the directory is synced in `power`."""
        assert self._closed
        unlink_segment(self.path, self.durability)


def unlink_segment(path: str, durability: Durability) -> None:
    """Remove a segment; the directory is synced in `power`."""
    fileops.unlink(path)
    if durability is Durability.POWER:
        fsync_directory(os.path.dirname(path))


def _done_bytes(allocated: int) -> int:
    """Bytes of a completion bitmap for a file of `allocated` bytes: a bit per 16-byte slot."""
    return -(-allocated // (ENTRY_ALIGN_BYTES * 8))


def _write_boundary(buf, entry_count: int, data_end: int, base: int = 0) -> None:
    """entry_count, data_end and their checksum into a header (at `base` + their offsets)."""
    SEGMENT_ENTRY_COUNT.write(buf, entry_count, base)
    SEGMENT_DATA_END.write(buf, data_end, base)
    SEGMENT_BOUNDARY_CHECKSUM.write(buf, boundary_checksum(entry_count, data_end), base)
