"""One segment file of the disk tier: create, append groups of entries, tombstone, seal, scan.

A segment holds the entries of one (model, signature, lane) (layout in `pipeline.layouts`).
The broker is its only writer; consumers and tools map it read-only.

Durability (SPEC §5): an append is written with one `pwrite` of the whole group; the
readable boundary (`readable_end`) moves only after that write returned (`process`: the
bytes are in the page cache and survive kill -9 of any process) or after `sync()` has also
fdatasync'ed them (`power`). Readers never see bytes past the boundary.

Tombstones are written through a shared writable mapping of the file, not with a syscall
each: a 4-byte pwrite at a random offset of a large file costs ~40 us here, a store into a
mapped page a few nanoseconds (issue 4's measurements).

Files grow in preallocated steps (posix_fallocate, doubling up to the segment limit):
writing into allocated, zeroed space keeps appends sequential, and a zero state word marks
the end of the data for a scan.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import xxhash

from pipeline.broker.storage import crashpoints
from pipeline.broker.storage.paths import CREATING_SUFFIX
from pipeline.errors import DiskFullError, DurabilityError, SegmentCorruptError, SegmentFormatError
from pipeline.layouts import (
    ENTRY_ALIGN_BYTES,
    ENTRY_CHECKSUM_FROM,
    ENTRY_HEADER_DTYPE,
    ENTRY_HEADER_SIZE_BYTES,
    ENTRY_HEADER_STRUCT,
    ENTRY_LIVE,
    ENTRY_NONE,
    ENTRY_TOMBSTONE,
    SEGMENT_HEADER_DTYPE,
    SEGMENT_HEADER_SIZE_BYTES,
    SEGMENT_IDENTITY_BYTES,
    SEGMENT_MAGIC,
    SEGMENT_VERSION,
    TOKEN_SIZE_BYTES,
    entry_checksum,
    entry_size_bytes,
)
from shm.layout import field_offset

# First preallocation of a new segment: most lanes of a many-shape workload hold a few
# batches, so 100,000 lanes take 6.4 GB of allocation at 64 KiB each (at 1 MiB: 100 GB);
# a busy lane doubles its file up to the segment limit in ten steps.
FIRST_ALLOCATION_BYTES = 64 << 10
# Segments seal at this size: big enough that per-file costs (open, fsync of the directory,
# the header page) vanish, small enough that a fully completed segment is freed soon.
DEFAULT_SEGMENT_MAX_BYTES = 64 << 20

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in lazily
_STATE = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_OFF_SEALED = field_offset(SEGMENT_HEADER_DTYPE, "sealed")
_OFF_ENTRY_COUNT = field_offset(SEGMENT_HEADER_DTYPE, "entry_count")
_OFF_DATA_END = field_offset(SEGMENT_HEADER_DTYPE, "data_end")
_OFF_DELETED = field_offset(SEGMENT_HEADER_DTYPE, "deleted_count")
_IDENTITY = struct.Struct("<8sIIIIQQQQ")  # the header's bytes 0..56: keys then their checksum
assert _IDENTITY.size == SEGMENT_IDENTITY_BYTES + 8
# errno values that mean "no space": a full disk, or the user's quota on it.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# An entry header as 8-byte words (entries start 16-aligned): gathered for many entries at once.
_HEADER_WORDS = np.arange(ENTRY_HEADER_SIZE_BYTES // 8, dtype=np.int64)


def _no_space(exc: OSError, path: str, offset: int, nbytes: int, what: str) -> DiskFullError:
    return DiskFullError(
        f"{path}: disk full ({exc.strerror}) {what} {nbytes} bytes at offset {offset}; "
        f"appends stop until space comes back, nothing accepted is lost"
    )


def _durability_failed(exc: OSError, path: str, what: str) -> DurabilityError:
    return DurabilityError(
        f"{path}: {what} failed ({exc.strerror}, errno {exc.errno}): the kernel may have "
        f"dropped the dirty pages, so the broker must stop"
    )


class Durability(Enum):
    """How far an append must get before its entries become readable (SPEC §5)."""

    PROCESS = "process"  # written to the page cache: survives kill -9 of any process
    POWER = "power"  # also fdatasync'ed, with group commit: survives power loss


@dataclass(frozen=True, slots=True)
class SegmentKeys:
    """The routing keys a segment holds once in its header."""

    model: int
    signature: int
    lane: int
    segment_seq: int


def _identity_bytes(keys: SegmentKeys, created_ns: int) -> bytes:
    head = struct.pack(
        "<8sIIIIQQQ", SEGMENT_MAGIC, SEGMENT_VERSION, SEGMENT_HEADER_SIZE_BYTES,
        keys.model, keys.lane, keys.signature, keys.segment_seq, created_ns,
    )
    assert len(head) == SEGMENT_IDENTITY_BYTES
    return head + _U64.pack(xxhash.xxh3_64_intdigest(head))


def read_identity(header: bytes | memoryview, path: str) -> tuple[SegmentKeys, int]:
    """Check a segment header's identity block; return (keys, created_ns) or raise."""
    if len(header) < SEGMENT_HEADER_SIZE_BYTES:
        raise SegmentFormatError(f"{path}: {len(header)} bytes, shorter than a segment header")
    magic, version, header_size, model, lane, signature, seq, created_ns, checksum = (
        _IDENTITY.unpack_from(header, 0)
    )
    if magic != SEGMENT_MAGIC or version != SEGMENT_VERSION or header_size != SEGMENT_HEADER_SIZE_BYTES:
        raise SegmentFormatError(
            f"{path}: offset 0: magic {magic!r}, version {version}, header size {header_size}; "
            f"expected {SEGMENT_MAGIC!r}, {SEGMENT_VERSION}, {SEGMENT_HEADER_SIZE_BYTES}"
        )
    if xxhash.xxh3_64_intdigest(bytes(header[:SEGMENT_IDENTITY_BYTES])) != checksum:
        raise SegmentFormatError(f"{path}: offset 48: identity checksum does not match the routing keys")
    return SegmentKeys(model, signature, lane, seq), created_ns


@dataclass(slots=True)
class ScanReport:
    """What a scan of one segment found.

    `offsets[i]` and `headers[i]` (ENTRY_HEADER_DTYPE) describe the whole, checksummed
    entries in file order; `torn_at` is where a torn tail starts (None if the data ends
    cleanly) and `torn_bytes` how much it holds; `corrupt_at` is where an entry fails its
    checks although a valid entry follows it (the segment must be quarantined).
    """

    path: str
    keys: SegmentKeys
    created_ns: int
    sealed: bool
    header_entry_count: int
    header_deleted_count: int
    header_data_end: int
    file_size: int
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    headers: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=ENTRY_HEADER_DTYPE))
    data_end: int = SEGMENT_HEADER_SIZE_BYTES
    torn_at: int | None = None
    torn_bytes: int = 0
    corrupt_at: int | None = None
    corrupt_reason: str = ""

    @property
    def entry_count(self) -> int:
        return int(self.offsets.shape[0])

    @property
    def live_item_ids(self) -> np.ndarray:
        """Item ids of the live entries, in file order."""
        return self.headers["item_id"][self.headers["state"] == ENTRY_LIVE]

    @property
    def live_count(self) -> int:
        return int(np.count_nonzero(self.headers["state"] == ENTRY_LIVE))

    @property
    def tombstone_count(self) -> int:
        return int(np.count_nonzero(self.headers["state"] == ENTRY_TOMBSTONE))

    @property
    def counts_agree(self) -> bool:
        """The header's counts match the entries (a crash between a tombstone and its count,
        or a torn tail, leaves them apart until recovery repairs them)."""
        return (
            self.header_deleted_count == self.tombstone_count
            and self.header_entry_count == self.entry_count
        )


# The fields a walk needs: state, length, checksum, then (past item_id, seq, producer_id)
# prefix_len and payload_len.
_WALK = struct.Struct("<IIQ20xII")
assert _WALK.size == field_offset(ENTRY_HEADER_DTYPE, "payload_len") + 4


def _check_entry(buf, offset: int, limit: int) -> tuple[int, str]:
    """(size, "") if the entry at `offset` is whole and checks out, else (0, why)."""
    if offset + ENTRY_HEADER_SIZE_BYTES > limit:
        return 0, f"entry header at {offset} runs past the end of the file ({limit})"
    state, length, checksum, prefix_len, payload_len = _WALK.unpack_from(buf, offset)
    if state not in (ENTRY_LIVE, ENTRY_TOMBSTONE):
        return 0, f"state word {state:#010x} at {offset} is neither live nor tombstone"
    size = entry_size_bytes(length, payload_len)
    if length == 0 or prefix_len > length or offset + size > limit:
        return 0, f"entry at {offset}: length {length}, prefix {prefix_len}, size {size} do not fit"
    if entry_checksum(buf, offset, offset + size, length) != checksum:
        return 0, f"entry at {offset}: checksum mismatch"
    return size, ""


def _valid_entry_after(buf: memoryview, start: int, limit: int) -> int | None:
    """Offset of the first whole, checksummed entry at a 16-aligned offset after `start`.

    A torn write is sequential, so nothing valid can follow a torn entry: a valid entry
    after a bad one means the damage is in the middle of the segment.
    """
    first = start + ENTRY_ALIGN_BYTES
    count = (limit - first) // 4
    if count <= 0:
        return None
    words = np.frombuffer(buf, dtype="<u4", count=count, offset=first)[::4]
    candidates = np.flatnonzero((words == ENTRY_LIVE) | (words == ENTRY_TOMBSTONE))
    del words
    for index in candidates.tolist():
        offset = first + index * ENTRY_ALIGN_BYTES
        if _check_entry(buf, offset, limit)[0]:
            return offset
    return None


def _last_nonzero_end(buf: memoryview, start: int, limit: int) -> int:
    """One past the last non-zero byte in [start, limit), or `start` if all are zero."""
    if limit <= start:
        return start
    view = np.frombuffer(buf, dtype=np.uint8, count=limit - start, offset=start)
    nonzero = np.flatnonzero(view)
    end = start + int(nonzero[-1]) + 1 if nonzero.size else start
    del view, nonzero
    return end


def _walk_entries(buf: memoryview, size: int) -> tuple[list[int], int]:
    """Offsets of every whole, checksummed entry from the first on, and where the walk
    stopped (a zero state word, or the first entry that fails a check).

    NOTE: this is `_check_entry` inlined into one loop with no calls but the hash: the scan
    must run at page-cache speed (>= 1 GB/s), and per-entry calls cost a third of that.
    The other header fields are gathered afterwards for all entries at once with numpy.
    """
    offsets: list[int] = []
    offset = SEGMENT_HEADER_SIZE_BYTES
    unpack = _WALK.unpack_from
    digest = xxhash.xxh3_64_intdigest
    live, tomb = ENTRY_LIVE, ENTRY_TOMBSTONE
    header, align_mask, skip = ENTRY_HEADER_SIZE_BYTES, ENTRY_ALIGN_BYTES - 1, ENTRY_CHECKSUM_FROM
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


def scan_segment(path: str) -> ScanReport:
    """Read a segment's header and walk every entry, checking state words and checksums.

    Stops at the first zero state word (preallocated space). A bad entry with nothing
    valid after it is a torn tail (`torn_at`, `torn_bytes`: what a crash mid-write left);
    a bad entry followed by a valid one is corruption (`corrupt_at`): never truncated.
    Raises SegmentFormatError when the header itself is not a segment header.
    """
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size < SEGMENT_HEADER_SIZE_BYTES:
            raise SegmentFormatError(f"{path}: {size} bytes, shorter than a segment header")
        # MAP_POPULATE maps every page up front in one call instead of one fault per page:
        # a cold scan of a 40 MB segment ran at ~0.55 GB/s without it.
        mapping = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ)
    view = memoryview(mapping)  # slices of a memoryview are free; slices of an mmap are copies
    try:
        return _scan_mapped(path, view, size)
    finally:
        view.release()
        mapping.close()


def _scan_mapped(path: str, buf: memoryview, size: int) -> ScanReport:
    keys, created_ns = read_identity(buf, path)
    (sealed,) = _STATE.unpack_from(buf, _OFF_SEALED)
    report = ScanReport(
        path, keys, created_ns, bool(sealed),
        header_entry_count=_U64.unpack_from(buf, _OFF_ENTRY_COUNT)[0],
        header_deleted_count=_U64.unpack_from(buf, _OFF_DELETED)[0],
        header_data_end=_U64.unpack_from(buf, _OFF_DATA_END)[0],
        file_size=size,
    )
    offsets, stop = _walk_entries(buf, size)
    report.data_end = stop
    if stop + 4 <= size and _STATE.unpack_from(buf, stop)[0] != ENTRY_NONE:
        _, why = _check_entry(buf, stop, size)
        if _valid_entry_after(buf, stop, size) is not None:
            report.corrupt_at, report.corrupt_reason = stop, why
        else:
            report.torn_at = stop
            report.torn_bytes = _last_nonzero_end(buf, stop, size) - stop
    elif stop + 4 <= size and _valid_entry_after(buf, stop, size) is not None:
        # A zero state word with valid entries after it: damage, not the end of the data.
        report.corrupt_at = stop
        report.corrupt_reason = f"zero state word at {stop} before more entries"
    report.offsets = np.asarray(offsets, dtype=np.int64)
    if offsets:
        raw = np.frombuffer(buf, dtype=np.uint8)
        gathered = raw[report.offsets[:, None] + np.arange(ENTRY_HEADER_SIZE_BYTES)]
        report.headers = gathered.view(ENTRY_HEADER_DTYPE).reshape(-1)
        del raw
    return report


@dataclass(slots=True)
class EncodedGroup:
    """Entries encoded back to back, ready for one write: `offsets[i]` is entry i's offset
    within `data`, `sizes[i]` its size."""

    data: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray

    @property
    def count(self) -> int:
        return int(self.offsets.shape[0])


# The entry header's checksum, as an index in 8-byte words from the entry's start.
_CHECKSUM_WORD = ENTRY_HEADER_DTYPE.fields["checksum"][1] // 8
assert _CHECKSUM_WORD * 8 == ENTRY_HEADER_DTYPE.fields["checksum"][1]


def encode_entries(
    items: np.ndarray,
    tokens: np.ndarray,
    token_starts: np.ndarray,
    payloads: np.ndarray,
    payload_starts: np.ndarray,
    indices: np.ndarray,
    producer_id: int,
) -> EncodedGroup:
    """Encode the items `indices` of a parsed frame as live segment entries.

    `items` is a frame's ITEM_HEADER_DTYPE array, `tokens`/`payloads` its back-to-back data
    (see `pipeline.layouts.Frame`). The buffer is built whole so one pwrite writes the group,
    and each entry is checksummed once it is built (validated before writing, SPEC §5).
    """
    chosen = items[indices]
    lengths = chosen["length"].astype(np.int64)
    payload_lens = chosen["payload_len"].astype(np.int64)
    raw = ENTRY_HEADER_SIZE_BYTES + lengths * TOKEN_SIZE_BYTES + payload_lens
    sizes = (raw + ENTRY_ALIGN_BYTES - 1) & ~(ENTRY_ALIGN_BYTES - 1)
    offsets = np.zeros(sizes.shape[0], dtype=np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    data = np.zeros(int(sizes.sum()), dtype=np.uint8)
    # Headers for the whole group at once, then scattered to their offsets with one numpy
    # assignment of 8-byte words (entries are 16-aligned); only the token copy and the
    # checksum run per entry.
    headers = np.zeros(sizes.shape[0], dtype=ENTRY_HEADER_DTYPE)
    headers["state"] = ENTRY_LIVE
    for name in ("length", "item_id", "seq", "prefix_len", "payload_len", "submit_ns"):
        headers[name] = chosen[name]
    headers["producer_id"] = producer_id
    words = ENTRY_HEADER_SIZE_BYTES // 8
    data.view(np.uint64)[(offsets >> 3)[:, None] + np.arange(words)] = headers.view(np.uint64).reshape(-1, words)
    out = memoryview(data)
    out_tokens = out.cast("i")
    in_tokens = memoryview(np.ascontiguousarray(tokens))
    in_payloads = memoryview(np.ascontiguousarray(payloads))
    _copy_entry_bodies(out, out_tokens, in_tokens, in_payloads, offsets, lengths, token_starts[indices],
                       payload_lens, payload_starts[indices])
    # Checksums once every entry is whole, written as one column (the checksum word is not
    # part of what it covers).
    digest = xxhash.xxh3_64_intdigest
    sums = [digest(out[at:end], seed=length) for at, end, length in
            zip((offsets + ENTRY_CHECKSUM_FROM).tolist(), (offsets + sizes).tolist(), lengths.tolist())]
    data.view(np.uint64)[(offsets >> 3) + _CHECKSUM_WORD] = sums
    for view in (out_tokens, in_tokens, in_payloads, out):
        view.release()
    return EncodedGroup(data, offsets, sizes)


def _copy_entry_bodies(out: memoryview, out_tokens: memoryview, in_tokens: memoryview, in_payloads: memoryview,
                       offsets: np.ndarray, lengths: np.ndarray, starts: np.ndarray, payload_lens: np.ndarray,
                       payload_starts: np.ndarray) -> None:
    """Each entry's tokens and payload, copied one entry at a time.
    NOTE: a 2-D copy for groups of equal lengths (tokens as rows of one stride) measured no
    faster in the broker: 0.35 to 1.1 us per item against 0.5, by row length."""
    rows = zip(offsets.tolist(), lengths.tolist(), starts.tolist(), payload_lens.tolist(), payload_starts.tolist())
    for at, length, token_at, plen, payload_at in rows:
        first = (at + ENTRY_HEADER_SIZE_BYTES) >> 2
        out_tokens[first:first + length] = in_tokens[token_at:token_at + length]
        if plen:
            end = at + ENTRY_HEADER_SIZE_BYTES + length * TOKEN_SIZE_BYTES
            out[end:end + plen] = in_payloads[payload_at:payload_at + plen]


# madvise(MADV_POPULATE_WRITE) (Linux 5.14): map a range's pages writable in one call. The
# `mmap` module has no name for it before Python 3.13.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_PAGE_BYTES = mmap.PAGESIZE


def _populate_for_writes(mapping: mmap.mmap, start: int, end: int) -> None:
    """Map the pages an append just wrote into the broker's mapping, writable, in one call.

    Why: their tombstones (and the peek's header reads) go through the mapping, and without
    this every 4 KiB page of entries costs a page fault on its first tombstone, about 0.3
    faults per 256-token item. Best effort: a kernel without the advice (EINVAL) is
    remembered and not asked again.
    NOTE: only with durability `process`. In `power`, the group commit's fdatasync makes the
    pages read-only again for dirty tracking, so they would fault anyway. Pages written
    back long before their tombstones (a deep backlog) fault again too: the call then only
    costs a system call per append.
    """
    global _populate_supported
    if not _populate_supported:
        return
    first = start - start % _PAGE_BYTES
    try:
        mapping.madvise(_MADV_POPULATE_WRITE, first, end - first)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            _populate_supported = False


_populate_supported = True


class SegmentFile:
    """One segment open for appends (until sealed) and tombstones.

    Owner: the disk tier of the broker process, which is the only writer of segment files.
    Not thread-safe. `close()` releases the descriptor and mapping; `unlink()` removes the
    file (a sealed segment whose every entry is tombstoned).
    """

    def __init__(self, path: str, fd: int, keys: SegmentKeys, durability: Durability, max_bytes: int) -> None:
        self.path = path
        self.keys = keys
        self.durability = durability
        self.max_bytes = max_bytes
        self._fd = fd
        self.allocated = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, self.allocated)
        self.data_end = SEGMENT_HEADER_SIZE_BYTES
        self.readable_end = SEGMENT_HEADER_SIZE_BYTES
        self.entry_count = 0
        self.deleted_count = 0
        self.sealed = False
        self._unsynced = False
        self._closed = False

    @classmethod
    def create(cls, path: str, keys: SegmentKeys, durability: Durability,
               max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES) -> SegmentFile:
        """A new, empty, owner-only segment with its header written (and synced in `power`).
        Built under `path + CREATING_SUFFIX` and renamed into place once its header is
        written, so a crash mid-create never leaves a headerless file under a segment name
        (recovery removes the leftover; kill -9 tests found the bare version quarantined)."""
        creating = path + CREATING_SUFFIX
        fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            first = min(FIRST_ALLOCATION_BYTES, max(max_bytes, SEGMENT_HEADER_SIZE_BYTES))
            try:
                os.posix_fallocate(fd, 0, first)
            except OSError as exc:
                if exc.errno in _NO_SPACE:
                    raise _no_space(exc, path, 0, first, "allocating") from exc
                raise
            os.pwrite(fd, _identity_bytes(keys, time.time_ns()), 0)
            if durability is Durability.POWER:
                _fdatasync(fd, path)
            assert not os.path.exists(path), path
            os.rename(creating, path)
            if durability is Durability.POWER:
                fsync_directory(os.path.dirname(path))
            return cls(path, fd, keys, durability, max_bytes)
        except BaseException:
            os.close(fd)
            for leftover in (creating, path):
                if os.path.exists(leftover):
                    os.unlink(leftover)
            raise

    @classmethod
    def reopen(cls, report: ScanReport, durability: Durability,
               max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES) -> SegmentFile:
        """Reopen a scanned segment for tombstones (and appends, if not sealed), repairing
        its header words and dropping a torn tail (recovery, SPEC §5)."""
        assert report.corrupt_at is None, "a corrupt segment is quarantined, not reopened"
        fd = os.open(report.path, os.O_RDWR)
        segment = cls(report.path, fd, report.keys, durability, max_bytes)
        segment.data_end = segment.readable_end = report.data_end
        segment.entry_count = report.entry_count
        segment.deleted_count = report.tombstone_count
        segment.sealed = report.sealed
        if report.torn_at is not None and report.torn_bytes:
            segment._map[report.torn_at:report.torn_at + report.torn_bytes] = bytes(report.torn_bytes)
        segment._write_header_words()
        return segment

    @classmethod
    def open(cls, path: str, durability: Durability, max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES) -> SegmentFile:
        """Reopen a segment this process wrote and closed (the open-file cache evicted it):
        its header words are current, so no scan is needed. Not for recovery: after a
        crash they are only hints (use `scan_segment` and `reopen`)."""
        fd = os.open(path, os.O_RDWR)
        try:
            header = os.pread(fd, SEGMENT_HEADER_SIZE_BYTES, 0)
            keys, _created_ns = read_identity(header, path)
        except BaseException:
            os.close(fd)
            raise
        segment = cls(path, fd, keys, durability, max_bytes)
        segment.sealed = bool(_STATE.unpack_from(header, _OFF_SEALED)[0])
        segment.entry_count = _U64.unpack_from(header, _OFF_ENTRY_COUNT)[0]
        segment.data_end = segment.readable_end = _U64.unpack_from(header, _OFF_DATA_END)[0]
        segment.deleted_count = _U64.unpack_from(header, _OFF_DELETED)[0]
        return segment

    def _write_header_words(self) -> None:
        _STATE.pack_into(self._map, _OFF_SEALED, int(self.sealed))
        _U64.pack_into(self._map, _OFF_ENTRY_COUNT, self.entry_count)
        _U64.pack_into(self._map, _OFF_DATA_END, self.data_end)
        _U64.pack_into(self._map, _OFF_DELETED, self.deleted_count)

    def room_for(self, nbytes: int) -> bool:
        """Whether a group of `nbytes` may go in (an empty segment takes any group)."""
        if self.sealed:
            return False
        return self.entry_count == 0 or self.data_end + nbytes <= self.max_bytes

    def _grow(self, needed_end: int) -> None:
        new_size = self.allocated
        while new_size < needed_end:
            new_size *= 2
        try:
            os.posix_fallocate(self._fd, 0, new_size)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise _no_space(exc, self.path, self.allocated, new_size - self.allocated, "growing the file by") from exc
            raise
        self._map.resize(new_size)
        self.allocated = new_size

    def _write_all(self, data: np.ndarray, at: int) -> None:
        """pwrite until every byte is written (a full disk can cut a write short first)."""
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], at + done)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise _no_space(exc, self.path, at + done, len(view) - done, "writing") from exc
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
        at = self.data_end
        end = at + group.data.nbytes
        if end > self.allocated:
            self._grow(end)
        self._write_all(group.data, at)
        if self.durability is Durability.PROCESS:
            _populate_for_writes(self._map, at, end)
        if crashpoints.ARMED:
            crashpoints.hit("segment.after_write")
        self.data_end = end
        self.entry_count += group.count
        _U64.pack_into(self._map, _OFF_ENTRY_COUNT, self.entry_count)
        _U64.pack_into(self._map, _OFF_DATA_END, end)
        if self.durability is Durability.PROCESS:
            self.readable_end = end
        else:
            self._unsynced = True
        return at

    @property
    def needs_sync(self) -> bool:
        return self._unsynced

    def sync(self) -> None:
        """`power`: fdatasync what was appended, then make it readable (group commit: the disk
        tier calls this once per loop turn for every segment that took appends)."""
        if self._unsynced:
            _fdatasync(self._fd, self.path)  # DurabilityError: fatal, the broker stops
            self._unsynced = False
        self.readable_end = self.data_end

    def tombstone(self, offset: int) -> bool:
        """Mark the entry at `offset` completed: state word first, then the deleted count.
        Returns False if it already was (a duplicate completion)."""
        return self.tombstone_many((offset,)) == 1

    def tombstone_many(self, offsets) -> int:
        """Mark entries completed: every state word (4-byte stores into the shared mapping),
        then the deleted count once; a crash between the two is repaired by a scan, as for
        one entry. Entries already tombstoned are skipped (duplicate completions). Returns
        how many were live. SegmentCorruptError for an offset where no entry starts.
        Example: live entries at 4096 and 5184; tombstone_many([4096, 5184, 4096]) -> 2 and
        the header's deleted count goes up by 2."""
        fresh = self._tombstone_columns(offsets)
        if fresh is None:  # something to refuse: one by one, naming the offset
            fresh = self._tombstone_one_by_one(offsets)
        if fresh:
            if crashpoints.ARMED:
                crashpoints.hit("tombstone.before_count")
            self.deleted_count += fresh
            _U64.pack_into(self._map, _OFF_DELETED, self.deleted_count)
        return fresh

    def _tombstone_columns(self, offsets) -> int | None:
        """Every state word read and written as one numpy column; how many were live, or
        None, with nothing written, when an offset is no live or tombstoned entry."""
        at = np.unique(np.asarray(offsets, dtype=np.int64))  # a duplicate completes once
        if not at.size:
            return 0
        if at[0] < SEGMENT_HEADER_SIZE_BYTES or at[-1] >= self.readable_end or (at & (ENTRY_ALIGN_BYTES - 1)).any():
            return None
        words = np.frombuffer(self._map, dtype=np.uint32, count=self.readable_end // 4)
        try:  # the view is dropped at once: a mapping with views cannot be resized or closed
            states = words[at >> 2]
            live = states == ENTRY_LIVE
            if not (live | (states == ENTRY_TOMBSTONE)).all():
                return None
            words[at[live] >> 2] = ENTRY_TOMBSTONE
        finally:
            del words
        return int(live.sum())

    def _tombstone_one_by_one(self, offsets) -> int:
        mapped, readable = self._map, self.readable_end
        unpack, pack = _STATE.unpack_from, _STATE.pack_into
        live, tomb, mask = ENTRY_LIVE, ENTRY_TOMBSTONE, ENTRY_ALIGN_BYTES - 1
        fresh = 0
        for offset in offsets:
            if not SEGMENT_HEADER_SIZE_BYTES <= offset < readable or offset & mask:
                raise SegmentCorruptError(f"{self.path}: no entry can start at offset {offset}")
            (state,) = unpack(mapped, offset)
            if state == live:
                pack(mapped, offset, tomb)
                fresh += 1
            elif state != tomb:
                raise SegmentCorruptError(f"{self.path}: offset {offset}: state word {state:#010x} is not an entry")
        return fresh

    def entry_headers(self, offsets: list[int]) -> list[tuple]:
        """The live entries at `offsets`, each as ENTRY_HEADER_STRUCT's fields (state, length,
        checksum, item_id, seq, producer_id, prefix_len, payload_len, submit_ns), read from
        the mapping and checked (validated after reading): each must start below the
        readable boundary, be live, and end before it. SegmentCorruptError otherwise."""
        unpack = ENTRY_HEADER_STRUCT.unpack_from
        mapped, readable = self._map, self.readable_end
        out = []
        for offset in offsets:
            fields = unpack(mapped, offset) if SEGMENT_HEADER_SIZE_BYTES <= offset < readable else None
            if (fields is None or fields[0] != ENTRY_LIVE or not fields[1] or offset % ENTRY_ALIGN_BYTES
                    or offset + entry_size_bytes(fields[1], fields[7]) > readable):
                raise SegmentCorruptError(
                    f"{self.path}: offset {offset}: no live entry there (readable up to {readable}, "
                    f"state {'-' if fields is None else hex(fields[0])})"
                )
            out.append(fields)
        return out

    def entry_header_columns(self, offsets: np.ndarray) -> np.ndarray:
        """`entry_headers` for many entries at once, as an ENTRY_HEADER_DTYPE array: gathered
        from the mapping and checked as columns; SegmentCorruptError, naming the first bad
        offset, as `entry_headers` raises it."""
        readable = self.readable_end
        if (not offsets.size or offsets.min() < SEGMENT_HEADER_SIZE_BYTES or offsets.max() >= readable
                or offsets.max() + ENTRY_HEADER_SIZE_BYTES > readable or (offsets & (ENTRY_ALIGN_BYTES - 1)).any()):
            self.entry_headers(offsets.tolist())  # raises, naming the offset (or there is none)
        words = np.frombuffer(self._map, dtype=np.uint64, count=readable // 8)
        try:  # the view is dropped at once: a mapping with views cannot be resized or closed
            headers = words[(offsets >> 3)[:, None] + _HEADER_WORDS].view(ENTRY_HEADER_DTYPE).reshape(-1)
        finally:
            del words
        raw = ENTRY_HEADER_SIZE_BYTES + headers["length"].astype(np.int64) * TOKEN_SIZE_BYTES + headers["payload_len"]
        ends = offsets + ((raw + ENTRY_ALIGN_BYTES - 1) & ~(ENTRY_ALIGN_BYTES - 1))
        bad = (headers["state"] != ENTRY_LIVE) | (headers["length"] == 0) | (ends > readable)
        if bad.any():
            self.entry_headers(offsets[bad].tolist())  # raises, naming the first
        return headers

    def state_at(self, offset: int) -> int:
        """The state word at `offset` (ENTRY_NONE past the readable boundary or off the grid)."""
        if not SEGMENT_HEADER_SIZE_BYTES <= offset < self.readable_end or offset % ENTRY_ALIGN_BYTES:
            return ENTRY_NONE
        return _STATE.unpack_from(self._map, offset)[0]

    def seal(self) -> None:
        """No more appends; the segment is deleted whole once every entry is tombstoned."""
        self.sealed = True
        _STATE.pack_into(self._map, _OFF_SEALED, 1)
        if self.durability is Durability.POWER:
            self.flush_tombstones()

    @property
    def fully_deleted(self) -> bool:
        return self.sealed and self.deleted_count == self.entry_count

    def flush_tombstones(self) -> None:
        """Write mapped tombstones and header words to disk (msync); `power` does this at
        the group-commit points. A tombstone lost to a power cut means redelivery, which
        at-least-once delivery allows and the result files detect."""
        try:
            self._map.flush()
        except OSError as exc:
            raise _durability_failed(exc, self.path, "msync") from exc

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._map.close()
            os.close(self._fd)

    def unlink(self) -> None:
        """Remove the file (after close); the directory is synced in `power`."""
        assert self._closed
        os.unlink(self.path)
        if self.durability is Durability.POWER:
            fsync_directory(os.path.dirname(self.path))


def fsync_directory(path: str) -> None:
    """Make a file's creation or removal durable (SPEC §5, `power`). DurabilityError if the
    fsync fails."""
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise _durability_failed(exc, path, "fsync of the directory") from exc
    finally:
        os.close(fd)


def _fdatasync(fd: int, path: str) -> None:
    try:
        os.fdatasync(fd)
    except OSError as exc:
        raise _durability_failed(exc, path, "fdatasync") from exc
