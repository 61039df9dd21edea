"""Reading a segment file back: a salvage scan of its entries (its identity: `identity.py`).

The one reader of segment files for recovery and the tools (`scan_segment`); nothing parses
a segment a second way. Layout in `pipeline.wire.layouts`.

The scan walks whole, checksummed entries at page-cache speed (`_walk_entries`). Where it
stops before the end of the data, it does not give up on the file: an entry whose checksum
holds but whose state word is neither live nor tombstone (a flipped bit in the one word the
checksum does not cover) is kept as live (a duplicate delivery is allowed, a loss is not);
anything else is a bad range, and the scan resynchronises at the next 16-aligned offset that
holds a whole, checksummed entry and walks on. So one damaged entry costs that entry, never
the entries around it.

Each bad range is judged against the commit boundary, the segment's last BOUNDARY record in
the store log (`storelog.py`; the header's creation words when it holds none): the broker
records it only once the bytes below it are written (`process`) or fdatasync'ed (`power`).
Completions are the log's COMPLETED records: the report's headers read ENTRY_TOMBSTONE
for them (the state word in the file stays live, layout version 2). Zeros from the end of a
group to the next SYNC_ALIGN_BYTES boundary followed by a whole entry there are the padding
of `power` (see `pipeline.storage.segment`), not damage.

    bad bytes below data_end     -> DamagedRange: acknowledged entries damaged on disk
    bad bytes at or past it      -> TornRange: a write that was never acknowledged
    the file ends before it      -> LostEntries: truncation (entries counted, range named)

Nothing is zeroed or truncated: the bytes stay as evidence. Entry counts of a damaged range
come from walking the (unverified) entry headers in it when they chain from its start to its
end; otherwise at least one, topped up from the header's entry count when it says more.

A restart's scan (`skip_done`) starts its walk at the highest commit boundary below which
the log completes every entry (`_done_below`): what was answered is not read again, so a
restart reads what it may still deliver. Damage there costs nothing (every entry in it was
answered); the tools that audit a store walk every entry.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import xxhash

from pipeline.storage.identity import (  # re-exported: the scan's callers use them
    SegmentKeys,
    boundary_checksum,
    establish_identity,
    header_key_fields,
    identity_bytes,
    name_keys_of,
    read_identity,
)
from pipeline.storage.scan_report import DamagedRange, LostEntries, RepairedState, ScanReport, TornRange
from pipeline.storage.storelog import LogReading, SegmentRecords, read_store_log
from pipeline.wire.errors import SegmentFormatError
from pipeline.wire.layouts import segments
from pipeline.wire.layouts.names import SEGMENTS_DIR
from pipeline.wire.layouts.segments import (
    ENTRY_ALIGN_BYTES,
    ENTRY_HEADER_DTYPE,
    ENTRY_HEADER_SIZE_BYTES,
    ENTRY_LIVE,
    ENTRY_STATE,
    ENTRY_TOMBSTONE,
    SEGMENT_ENTRY_COUNT,
    SEGMENT_HEADER_SIZE_BYTES,
    SYNC_ALIGN_BYTES,
    entry_checksum,
    entry_size_bytes,
)
from shm.layout import Field, struct_for

__all__ = [
    "EntryCensus", "SegmentKeys", "boundary_checksum", "census_segment", "establish_identity", "identity_bytes",
    "mapped_file", "name_keys_of", "read_identity", "scan_segment",
]

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in lazily
# The fields a walk needs: state, length, checksum, then (past item_id, seq, producer_id)
# prefix_len and payload_len; and the two a count of unverified headers reads alone.
_WALK = struct_for(ENTRY_HEADER_DTYPE, ["state", "length", "checksum", "prefix_len", "payload_len"])
_LENGTH = Field(ENTRY_HEADER_DTYPE, "length")
_ITEM_ID = Field(ENTRY_HEADER_DTYPE, "item_id")
# The smallest entry (one token, no payload): how many entries a byte range can hold at most,
# so that a damaged count word in a header never claims more lost entries than fit.
MIN_ENTRY_BYTES = entry_size_bytes(1, 0)
# Item ids named per damaged range (the count is always whole): a log line, not a dump.
ITEM_IDS_NAMED_MAX = 1000
# First window of a search past damage (resync, the next non-zero byte); it doubles. Small
# enough that many damaged ranges in a large segment do not each read the rest of the file.
SEARCH_FIRST_WINDOW_BYTES = 64 << 10



# ------------------------------------------------------------------------------ the walk


def _check_entry(buf, offset: int, limit: int, check_state: bool = True) -> tuple[int, str]:
    """(size, "") if the entry at `offset` is whole and checks out, else (0, why)."""
    if offset + ENTRY_HEADER_SIZE_BYTES > limit:
        return 0, f"entry header at {offset} runs past the end of the data ({limit})"
    state, length, checksum, prefix_len, payload_len = _WALK.unpack_from(buf, offset)
    if check_state and state not in (ENTRY_LIVE, ENTRY_TOMBSTONE):
        return 0, f"state word {state:#010x} at {offset} is neither live nor tombstone"
    size = entry_size_bytes(length, payload_len)
    if length == 0 or prefix_len > length or offset + size > limit:
        return 0, f"entry at {offset}: length {length}, prefix {prefix_len}, size {size} do not fit"
    if entry_checksum(buf, offset, offset + size, length) != checksum:
        return 0, f"entry at {offset}: checksum mismatch"
    return size, ""


def _windows(start: int, limit: int) -> Iterator[tuple[int, int]]:
    """[start, limit) in windows that double from SEARCH_FIRST_WINDOW_BYTES: a search that
    ends near its start (the common case) reads little, one that runs to the end reads the
    range about twice at most."""
    size = SEARCH_FIRST_WINDOW_BYTES
    while start < limit:
        end = min(limit, start + size)
        yield start, end
        start, size = end, size * 2


def _valid_entry_after(buf: memoryview, start: int, limit: int) -> int | None:
    """Offset of the first whole, checksummed entry at a 16-aligned offset after `start`.
    Candidates are the offsets holding a live or tombstone state word (a numpy pass)."""
    for first, end in _windows(start + ENTRY_ALIGN_BYTES, limit):
        count = (end - first + ENTRY_ALIGN_BYTES - 1) // ENTRY_ALIGN_BYTES
        words = np.frombuffer(buf, dtype="<u4", count=min(count * 4, (limit - first) // 4), offset=first)[::4]
        candidates = np.flatnonzero((words == ENTRY_LIVE) | (words == ENTRY_TOMBSTONE))
        del words
        for index in candidates.tolist():
            offset = first + index * ENTRY_ALIGN_BYTES
            if _check_entry(buf, offset, limit)[0]:
                return offset
    return None


def _first_nonzero(buf: memoryview, start: int, limit: int) -> int | None:
    """Offset of the first non-zero byte in [start, limit), or None. `start` is 8-aligned.
    Numpy passes over the preallocated zeros past the data: the common end of a scan."""
    for first, end in _windows(start, limit - (limit - start) % 8):
        view = np.frombuffer(buf, dtype="<u8", count=(end - first) // 8, offset=first)
        try:
            if view.any():
                at = first + 8 * int(np.argmax(view != 0))
                return at + next(k for k in range(8) if buf[at + k])
        finally:
            del view
    for at in range(limit - (limit - start) % 8, limit):
        if buf[at]:
            return at
    return None


def _zeros_to_end(buf: memoryview, start: int, size: int, fd: int) -> bool:
    """Whether [start, size) holds only zeros: the preallocated rest of a segment, the common
    end of a walk. Past the block `start` is in, the bytes are read from where the file
    system says data starts (SEEK_DATA on `fd`: an extent preallocated and never written is
    a hole to it unless the page cache holds it; without `fd` or SEEK_DATA, every byte is
    read). `start` is 8-aligned.
    NOTE: reading every byte faulted in each page of the preallocation: 0.1 s of a restart
    over 286 segments (700 MB preallocated past their data)."""
    block_end = min(size, -(-start // SYNC_ALIGN_BYTES) * SYNC_ALIGN_BYTES)
    if _first_nonzero(buf, start, block_end) is not None:
        return False
    start = _data_from(fd, block_end, size)
    return start >= size or _first_nonzero(buf, start - start % 8, size) is None


def _data_from(fd: int, offset: int, size: int) -> int:
    """Where the file open as `fd` holds data at or past `offset` by SEEK_DATA (`size` when
    nowhere), or `offset` itself when that cannot be told (no `fd`, no SEEK_DATA)."""
    if fd < 0 or offset >= size:
        return offset
    try:
        return max(offset, os.lseek(fd, offset, os.SEEK_DATA))
    except OSError as exc:  # ENXIO: no data at or past `offset`
        return size if exc.errno == errno.ENXIO else offset


def _last_nonzero_end(buf: memoryview, start: int, limit: int) -> int:
    """One past the last non-zero byte in [start, limit), or `start` if all are zero."""
    if limit <= start:
        return start
    view = np.frombuffer(buf, dtype=np.uint8, count=limit - start, offset=start)
    nonzero = np.flatnonzero(view)
    end = start + int(nonzero[-1]) + 1 if nonzero.size else start
    del view, nonzero
    return end


def _walk_entries(buf: memoryview, size: int, start: int = SEGMENT_HEADER_SIZE_BYTES) -> tuple[list[int], int]:
    """Offsets of every whole, checksummed entry from `start` on, and where the walk stopped
    (a zero state word, or the first entry that fails a check).

    NOTE: this is `_check_entry` inlined into one loop with no calls but the hash: the scan
    must run at page-cache speed (>= 1 GB/s), and per-entry calls cost a third of that.
    The other header fields are gathered afterwards for all entries at once with numpy.
    """
    offsets: list[int] = []
    offset = start
    unpack = _WALK.unpack_from
    digest = xxhash.xxh3_64_intdigest
    live, tomb = ENTRY_LIVE, ENTRY_TOMBSTONE
    header, align_mask, skip = ENTRY_HEADER_SIZE_BYTES, ENTRY_ALIGN_BYTES - 1, segments.ENTRY_CHECKSUM_FROM
    while offset + header <= size:
        state, length, checksum, prefix_len, payload_len = unpack(buf, offset)
        if state != live and state != tomb:
            break
        end = offset + ((header + length * 4 + payload_len + align_mask) & ~align_mask)
        if length == 0 or prefix_len > length or end > size:
            break
        if digest(buf[offset + skip:end], seed=length) != checksum:
            break
        offsets.append(offset)
        offset = end
    return offsets, offset


@dataclass(slots=True)
class _Walk:
    """The raw result of walking a file: whole entries, bad ranges, repaired state words."""

    offsets: list[int] = field(default_factory=list)
    repaired: list[tuple[int, int]] = field(default_factory=list)  # (index in offsets, word)
    bad: list[tuple[int, int]] = field(default_factory=list)
    good_end: int = SEGMENT_HEADER_SIZE_BYTES


def _salvage_walk(buf: memoryview, size: int, start: int = SEGMENT_HEADER_SIZE_BYTES, fd: int = -1,
                  committed: int = 0) -> _Walk:
    """Every whole entry of the file from `start` on, past any damage (module docstring).
    The fast walk is the whole cost of a clean segment; the rest runs only where it stops
    early. `fd`: the file, open, for SEEK_DATA where a stop is at or past `committed` (the
    commit boundary: the end of the data, likely, where the preallocation starts)."""
    walk = _Walk(good_end=start)
    pos = start
    while True:
        found, stop = _walk_entries(buf, size, pos)
        if found:
            walk.offsets += found
            walk.good_end = stop
        seek_fd = fd if stop >= committed else -1  # before it, a stop is a group's padding: no syscall
        padded = _after_padding(buf, stop, size, seek_fd)
        if padded is not None:
            pos = padded
            continue
        whole = _check_entry(buf, stop, size, check_state=False)[0]
        if whole:  # the checksum holds: only the state word is bad
            walk.repaired.append((len(walk.offsets), ENTRY_STATE.read(buf, stop)))
            walk.offsets.append(stop)
            pos = walk.good_end = stop + whole
            continue
        if _zeros_to_end(buf, stop, size, seek_fd):
            return walk  # zeros (or nothing) to the end of the file: the end of the data
        resume = _valid_entry_after(buf, stop, size)
        if resume is None:
            walk.bad.append((stop, max(_last_nonzero_end(buf, stop, size), stop + 1)))
            return walk
        walk.bad.append((stop, resume))
        pos = resume


def _after_padding(buf: memoryview, stop: int, size: int, fd: int = -1) -> int | None:
    """The next SYNC_ALIGN_BYTES boundary when [stop, it) is zeros and a whole entry starts
    there (the padding before a synced group of `power`), else None."""
    if not stop % SYNC_ALIGN_BYTES or stop + ENTRY_STATE.end > size or ENTRY_STATE.read(buf, stop):
        return None
    aligned = -(-stop // SYNC_ALIGN_BYTES) * SYNC_ALIGN_BYTES
    if aligned >= size or _first_nonzero(buf, stop, aligned) is not None:
        return None
    if _data_from(fd, aligned, size) > aligned:  # a hole there (the end of the data): nothing to
        return None  # read, and reading it would fault in the preallocation
    return aligned if _check_entry(buf, aligned, size)[0] else None


def _done_below(records: SegmentRecords, limit: int) -> tuple[np.ndarray, int]:
    """The completed entries the segment starts with, known from the log alone: those
    below the highest commit boundary (ending at `limit` at most) with as many completions
    below it as it counts entries. Completions name entries that were written, each once
    (the reading's are unique), so every entry below such a boundary was answered, and a
    boundary is where an entry ends. Their offsets, and where the walk takes over (the first
    entry's offset when no boundary qualifies).

    Example: boundaries (3, 4400), (5, 4600); completions at 4096, 4208, 4304, 4500 ->
    3 below 4400 (qualifies), 4 below 4600 (does not): [4096, 4208, 4304], 4400."""
    counts, ends = records.boundaries[:, 0], records.boundaries[:, 1]
    qualifies = (counts > 0) & (ends <= limit) & (np.searchsorted(records.completed, ends) == counts)
    if not qualifies.any():
        return records.completed[:0], SEGMENT_HEADER_SIZE_BYTES
    best = int(np.argmax(np.where(qualifies, ends, -1)))
    return records.completed[:int(counts[best])], int(ends[best])


def _walk_headers(buf: memoryview, start: int, end: int, size: int) -> tuple[int, bool, tuple[int, ...]]:
    """Entry headers chained from `start` (unverified): (how many, whether they chain to
    exactly `end`, their item ids). A header the file ends inside counts if its length and
    item id are still there (a truncation cut it)."""
    pos, count, ids = start, 0, []
    while pos < min(end, size):
        if pos + ENTRY_HEADER_SIZE_BYTES > size:
            if pos + _ITEM_ID.end <= size and _LENGTH.read(buf, pos):  # its length and item id are there
                count += 1
                ids.append(_ITEM_ID.read(buf, pos))
            break
        _state, length, _sum, prefix_len, payload_len = _WALK.unpack_from(buf, pos)
        nbytes = entry_size_bytes(length, payload_len)
        if length == 0 or prefix_len > length or pos + nbytes > end:
            break
        count += 1
        if len(ids) < ITEM_IDS_NAMED_MAX:
            ids.append(_ITEM_ID.read(buf, pos))
        pos += nbytes
    return count, pos == end, tuple(ids)


def _damaged(path: str, buf: memoryview, size: int, start: int, end: int) -> DamagedRange:
    """A damaged range, counted by its headers when they chain from start to end; else one
    entry (the one whose header is at `start`, if any is readable there), which the
    header's entry count may top up: headers that do not chain may have been misread."""
    count, walked, ids = _walk_headers(buf, start, end, size)
    if start + ENTRY_STATE.end <= size and ENTRY_STATE.read(buf, start) == segments.ENTRY_NONE:
        why = f"zero state word at {start}"
    else:
        why = _check_entry(buf, start, size)[1] or "bad bytes"
    if walked:
        return DamagedRange(path, start, end, count, True, ids, why)
    return DamagedRange(path, start, end, 1, False, ids[:1], why)


def _classify(report: ScanReport, buf: memoryview, walk: _Walk) -> None:
    """Judge every bad range against the commit boundary (module docstring)."""
    path, size = report.path, report.file_size
    commit = max(report.header_data_end, SEGMENT_HEADER_SIZE_BYTES)
    bad = list(walk.bad)
    if report.boundary_damage:  # no boundary to trust: every bad byte may have been acknowledged
        commit = max(walk.good_end, bad[-1][1] if bad else SEGMENT_HEADER_SIZE_BYTES)
    covered = max(walk.good_end, bad[-1][1] if bad else SEGMENT_HEADER_SIZE_BYTES)
    tail_start = None
    if covered < commit:  # the committed data ends early: damaged or cut at the tail
        tail_start = bad.pop()[0] if bad and covered > walk.good_end else covered
    for start, end in bad:
        if start < commit:
            report.damaged.append(_damaged(path, buf, size, start, min(end, commit)))
        if end > commit:
            torn_from = max(start, commit)
            count, _, ids = _walk_headers(buf, torn_from, end, size)
            report.torn.append(TornRange(path, torn_from, end, count, ids))
    if tail_start is not None:
        _classify_tail(report, buf, tail_start, commit)
    if not report.boundary_damage:  # an entry count that fails its checksum tops up nothing
        _top_up([r for r in report.damaged if not r.walked], report.header_entry_count - report.accounted_entries)


def _classify_tail(report: ScanReport, buf: memoryview, start: int, commit: int) -> None:
    """[start, commit): bytes the header counts as written that are not whole entries. The
    file ends inside it: lost to truncation. Otherwise: damaged. Either way counted from the
    entry headers still readable, topped up from the header's entry count. With no header
    readable and no entry missing by that count, only the header's data_end word is wrong:
    nothing is reported lost (the counts disagree, and recovery rewrites them)."""
    path, size = report.path, report.file_size
    count, walked, ids = _walk_headers(buf, start, commit, size)
    deficit = report.header_entry_count - report.accounted_entries
    garbage = size > start and _first_nonzero(buf, start, min(size, commit)) is not None
    if not count and deficit <= 0 and (size < commit or not garbage):
        return
    if size < commit:
        report.lost = LostEntries(path, start, commit, size, count, ids)
        _top_up([report.lost], deficit - count)
    else:
        tail = _damaged(path, buf, size, start, commit)
        report.damaged.append(tail)
        _top_up([tail], deficit - tail.entries)


def _top_up(targets: list, deficit: int) -> None:
    """The header counts the entries written below its boundary: those neither whole nor
    counted yet were in these ranges. Never more than a range's bytes can hold, so a damaged
    count word cannot claim absurd losses; what is left shows as counts that disagree."""
    for target in targets:
        if deficit <= 0:
            return
        room = max(0, (target.end - target.offset) // MIN_ENTRY_BYTES - target.entries)
        added = min(deficit, room)
        target.entries += added
        deficit -= added


# ------------------------------------------------------------------------------ entry points


@contextmanager
def mapped_file(path: str, populate: bool = True) -> Iterator[tuple[memoryview, int]]:
    """A read-only view of a whole file and its size (OSError as the system raises it).
    `populate`: MAP_POPULATE maps every page up front in one call instead of one fault per
    page (a cold scan of a 40 MB segment ran at ~0.55 GB/s without it); a reader of a part
    of the file leaves it off."""
    with open(path, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):  # a device (/dev/zero) would be read without end
            raise SegmentFormatError(f"{path}: not a regular file, so not a segment")
        size = info.st_size
        if size < SEGMENT_HEADER_SIZE_BYTES:
            yield memoryview(file.read(size)), size
            return
        flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
        mapping = mmap.mmap(file.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
    view = memoryview(mapping)  # slices of a memoryview are free; slices of an mmap are copies
    try:
        yield view, size
    finally:
        view.release()
        mapping.close()


def scan_segment(path: str, name_keys: SegmentKeys | None = None, name_confirmed: bool = False,
                 skip_done: bool = False, records: SegmentRecords | None = None,
                 log: LogReading | None = None) -> ScanReport:
    """Read a segment's header and walk every entry, past damage (module docstring).

    `name_keys`: the keys the file's name carries (default: parsed from `path` when it ends
    in segment name components); `name_confirmed`: another witness (the store log) vouches for
    them. `records`: what the store log says of the segment (default: what `log`, the store
    log read back once for many segments, says of it; else read from the log of the data
    directory the path is in). `skip_done`: take the completed entries the file
    starts with from them,
    unread (`_done_below`; the report's `done_offsets`), and map only what is read: a restart
    reads what it may still deliver, not what was answered. The tools that audit a store
    walk every entry. Raises SegmentFormatError when the identity cannot be
    established (`establish_identity`), OSError when the file cannot be read.
    """
    if name_keys is None:
        name_keys = name_keys_of(path)
    with mapped_file(path, populate=not skip_done) as (buf, size):
        if size < SEGMENT_HEADER_SIZE_BYTES:
            raise SegmentFormatError(f"{path}: {size} bytes, shorter than a segment header")
        keys, created_ns, identity_damage = establish_identity(buf, path, name_keys, name_confirmed)
        if records is None:
            records = log.of(keys) if log is not None else records_beside(path, keys)
        return _scan_mapped(path, buf, size, keys, created_ns, identity_damage, records, skip_done)


def records_beside(path: str, keys: SegmentKeys) -> SegmentRecords:
    """What the store log of the data directory holding the segment at `path` says of it
    (DATA_DIR/segments/m.../s.../the file; none for a file elsewhere). One read of the whole
    log: for a tool's look at one segment; recovery reads the log once for all."""
    data_dir = data_dir_of(path)
    return SegmentRecords() if data_dir is None else read_store_log(data_dir).of(keys)


def data_dir_of(path: str) -> str | None:
    """The data directory of the segment at `path` (DATA_DIR/segments/m.../s.../the file),
    None for a file elsewhere."""
    shape_dir = os.path.dirname(os.path.abspath(path))
    segments_dir = os.path.dirname(os.path.dirname(shape_dir))
    return os.path.dirname(segments_dir) if os.path.basename(segments_dir) == SEGMENTS_DIR else None


def _scan_mapped(path: str, buf: memoryview, size: int, keys: SegmentKeys, created_ns: int,
                 identity_damage: str, records: SegmentRecords, skip_done: bool = False) -> ScanReport:
    report = ScanReport(
        path, keys, created_ns, records.sealed,
        header_entry_count=SEGMENT_ENTRY_COUNT.read(buf) if records.entry_count is None else records.entry_count,
        header_deleted_count=int(records.completed.shape[0]),
        header_data_end=segments.SEGMENT_DATA_END.read(buf) if records.data_end is None else records.data_end,
        file_size=size, identity_damage=identity_damage, records=records,
    )
    stored = segments.SEGMENT_BOUNDARY_CHECKSUM.read(buf)
    header_count, header_end = SEGMENT_ENTRY_COUNT.read(buf), segments.SEGMENT_DATA_END.read(buf)
    if records.untrusted:
        report.boundary_damage = records.untrusted
    elif records.data_end is None and stored and stored != boundary_checksum(header_count, header_end):
        report.boundary_damage = (f"offset {SEGMENT_ENTRY_COUNT.offset}: entry_count {header_count} and "
                                  f"data_end {header_end} fail their checksum: every bad byte is "
                                  f"judged acknowledged")
    start, end = SEGMENT_HEADER_SIZE_BYTES, size
    if skip_done and not report.boundary_damage:
        report.done_offsets, start = _done_below(records, min(size, report.header_data_end))
        report.walk_start = start
        if records.sealed:  # nothing is written past a sealed segment's boundary: the rest of
            end = min(size, report.header_data_end)  # the file is its preallocation, not read
    walk = _seek_walk(path, buf, end, start, report.header_data_end)
    report.data_end = walk.good_end
    _gather(report, buf, walk)
    if walk.bad or walk.good_end < report.header_data_end:
        _classify(report, buf, walk)
    return report


def _seek_walk(path: str, buf: memoryview, size: int, start: int, committed: int) -> _Walk:
    """`_salvage_walk` with the file open for its SEEK_DATA (read anyway if it cannot be)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        fd = -1
    try:
        return _salvage_walk(buf, size, start, fd, committed)
    finally:
        if fd >= 0:
            os.close(fd)


def _gather(report: ScanReport, buf: memoryview, walk: _Walk) -> None:
    """The whole entries' headers, gathered at once; repaired state words read live."""
    report.offsets = np.asarray(walk.offsets, dtype=np.int64)
    if walk.offsets:
        raw = np.frombuffer(buf, dtype=np.uint8)
        gathered = raw[report.offsets[:, None] + np.arange(ENTRY_HEADER_SIZE_BYTES)]
        report.headers = gathered.view(ENTRY_HEADER_DTYPE).reshape(-1)
        del raw
    for index, word in walk.repaired:
        report.headers["state"][index] = ENTRY_LIVE
        report.repaired_states.append(
            RepairedState(report.path, int(report.offsets[index]), word, int(report.headers["item_id"][index])))
    completed = report.records.completed if report.records is not None else report.offsets[:0]
    if completed.size and walk.offsets:  # both sorted: a search, not np.isin (a hash of all)
        at = np.minimum(np.searchsorted(completed, report.offsets), completed.size - 1)
        report.headers["state"][completed[at] == report.offsets] = ENTRY_TOMBSTONE


@dataclass(frozen=True, slots=True)
class EntryCensus:
    """The entries of a file whose identity cannot be established, walked without it: what
    a quarantined segment held (undeliverable: no model id to deliver them under).
    `entries` counts the whole ones and those the scan counts damaged or lost (by the
    unverified header words); `item_ids` name the whole live ones."""

    path: str
    entries: int
    live: int
    item_ids: tuple[int, ...]
    file_size: int


def census_segment(path: str) -> EntryCensus:
    """Walk a segment file's entries whatever its identity block says (OSError if it cannot
    be read; a file shorter than a header holds none that can be found)."""
    with mapped_file(path) as (buf, size):
        if size < SEGMENT_HEADER_SIZE_BYTES:
            return EntryCensus(path, 0, 0, (), size)
        # Completions are not looked up: the keys its header holds cannot be trusted.
        report = _scan_mapped(path, buf, size, header_key_fields(buf), 0, "", SegmentRecords())
    live = report.headers["state"] == ENTRY_LIVE
    ids = tuple(report.headers["item_id"][live][:ITEM_IDS_NAMED_MAX].tolist())
    return EntryCensus(path, report.accounted_entries, int(live.sum()), ids, size)
