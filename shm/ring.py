"""A single-producer single-consumer ring of variable-length records in POSIX shared memory.

One writer process appends records; one reader process peeks them through numpy views
(no copy) and releases them later, in order, once it has done with them (the broker releases
a record only after it is stored). A writer that finds the ring full blocks, with a timeout:
that is the backpressure producers feel.

Positions (`write_pos`, `read_pos`, the reader's cursor) are monotonic 64-bit byte counts;
the offset in the data region is `pos & (capacity - 1)`. At 10 GB/s a u64 lasts 58 years.

Publication order: the writer writes the record, then stores `write_pos`, then wakes the
reader. On x86-64 (TSO: stores are seen in program order) a reader that loads the new
`write_pos` therefore sees the whole record; a writer killed at any point before the store
leaves a record the reader never sees, so there are no torn records.

Wake-ups. Each ring has a data semaphore (reader sleeps on it) and a space semaphore
(writer sleeps on it when full); the writer also rings an optional shared `Doorbell` so one
reader can sleep on many rings. A side posts a semaphore only when its value is 0: the
count then stays bounded (a semaphore overflows at 2**31 posts, which a busy reader that
never sleeps would otherwise reach in about half an hour at a million records per second).

NOTE: checking the value before posting is not fenced (Python has no memory fence), so on
x86 a wake-up can in theory be lost in a window of a few nanoseconds (the waker's store of
its position still in its store buffer while it reads a stale token count). Every sleep is
therefore cut into `WAIT_SLICE_S` slices and re-checks the positions between them: a lost
wake-up costs at most one slice, never a hang. Posting unconditionally and draining the
count was rejected: it needs one more semaphore call per record on both sides.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from dataclasses import dataclass
from typing import Self

import numpy as np
import posix_ipc

from shm.errors import (
    ObjectExistsError,
    RecordTooLargeError,
    RingClosedError,
    RingTimeoutError,
    ShmError,
    StaleObjectError,
)
from shm.layout import checked_dtype, field_offset, struct_for
from shm.objects import (
    SEMAPHORE_FOOTPRINT_BYTES,
    Doorbell,
    attach_shared_memory,
    create_shared_memory,
    object_footprint_bytes,
    object_path,
    open_semaphore,
    unlink_quietly,
)

RING_MAGIC = b"SHMRING1"
# Bump when any field below moves or changes meaning; a ring of another version is reported.
RING_LAYOUT_VERSION = 1
# The control block takes one page so the data region starts page-aligned.
HEADER_SIZE_BYTES = 4096
# Records start on 16-byte boundaries. The record header is 16 bytes, so the gap left at
# the end of the data region is always 0 or >= 16 and a wrap marker always fits in it.
RECORD_ALIGN_BYTES = 16
# One page: below this the header page would outweigh the data.
MIN_CAPACITY_BYTES = 4096
# 1 TiB: far above any sane ring, low enough to catch a unit mistake (bits for bytes).
MAX_CAPACITY_BYTES = 1 << 40
# Polls a reader makes before it sleeps. Sleeping costs the writer a futex wake (a system
# call, microseconds) on its next record; a writer submitting one item every ~1.5 us would
# pay it on every item if the reader slept the moment it caught up. 256 empty polls are
# about 40 us of spinning, after which an idle reader sleeps.
SPIN_POLLS = 256
# Longest a sleeper goes without re-checking positions: bounds the cost of a lost wake-up
# (see the module NOTE) and how late a closed peer is noticed.
WAIT_SLICE_S = 0.02

# Control block at the start of the object (cache lines split by owner so the writer's and
# the reader's stores do not bounce one line between cores).
#   off  size  field          meaning
#     0     8  magic          b"SHMRING1": this object is one of our rings
#     8     4  layout_version RING_LAYOUT_VERSION; another version is reported, never read
#    12     4  header_size    bytes before the data region (HEADER_SIZE_BYTES)
#    16     8  capacity       bytes in the data region, a power of two
#    24     4  creator_pid    process that created the object
#    28     4  record_align   RECORD_ALIGN_BYTES
#    32     8  created_ns     wall clock at creation (time.time_ns), for reports
#    64     8  write_pos      end of the last published record (writer stores, reader loads)
#    72     4  writer_closed  1 once the writer closed: nothing more will be published
#    76     4  writer_pid     pid of the process writing
#   128     8  read_pos       everything before it is released and may be overwritten
#   136     4  reader_closed  1 once the reader closed: writes fail with RingClosedError
#   140     4  reader_pid     pid of the process reading
#   192    64  doorbell       name of the shared doorbell the writer rings too, NUL padded
RING_HEADER_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S8", "b'SHMRING1'"),
        ("layout_version", 8, "<u4", "RING_LAYOUT_VERSION"),
        ("header_size", 12, "<u4", "bytes before the data region"),
        ("capacity", 16, "<u8", "data region bytes, power of two"),
        ("creator_pid", 24, "<u4", "creating process"),
        ("record_align", 28, "<u4", "RECORD_ALIGN_BYTES"),
        ("created_ns", 32, "<u8", "creation wall clock"),
        ("write_pos", 64, "<u8", "end of published records"),
        ("writer_closed", 72, "<u4", "writer closed flag"),
        ("writer_pid", 76, "<u4", "writing process"),
        ("read_pos", 128, "<u8", "end of released records"),
        ("reader_closed", 136, "<u4", "reader closed flag"),
        ("reader_pid", 140, "<u4", "reading process"),
        ("doorbell", 192, "|S64", "doorbell semaphore name"),
    ],
    itemsize=256,
)
assert RING_HEADER_DTYPE.itemsize <= HEADER_SIZE_BYTES

# Record header, at the start of every record in the data region.
#   off  size  field      meaning
#     0     4  body_size  bytes of body after this header (unpadded)
#     4     2  kind       RECORD_DATA, or RECORD_WRAP: skip to the start of the data region
#     6     2  reserved   zero
#     8     8  pos        the record's own start position: a mismatch means a misread
RECORD_HEADER_DTYPE = checked_dtype(
    [
        ("body_size", 0, "<u4", "body bytes"),
        ("kind", 4, "<u2", "data or wrap"),
        ("pos", 8, "<u8", "own start position"),
    ],
    itemsize=16,
)
RECORD_HEADER_SIZE_BYTES = RECORD_HEADER_DTYPE.itemsize
assert RECORD_HEADER_SIZE_BYTES % RECORD_ALIGN_BYTES == 0
RECORD_DATA = 1
RECORD_WRAP = 2

_IDENTITY = struct_for(RING_HEADER_DTYPE, ["magic", "layout_version", "header_size", "capacity"])
_INIT = struct_for(
    RING_HEADER_DTYPE,
    ["magic", "layout_version", "header_size", "capacity", "creator_pid", "record_align", "created_ns"],
)
_RECORD = struct_for(RECORD_HEADER_DTYPE)
# Both positions in one read, for `unreleased_records` (nobody writes them then).
_POSITIONS = struct_for(RING_HEADER_DTYPE, ["write_pos", "read_pos"])
# The position and flag words are shared between processes while both run, so each is
# stored and loaded as one aligned access, through memoryviews cast to 'Q' and 'I' (an
# item assignment there is one memcpy of the item's size: one 8-byte move on x86-64).
# NOTE: struct.pack_into was rejected: it zero-fills its destination before packing, and a
# reader was seen loading write_pos = 0 mid-store. Native order is the layout's
# little-endian order on the hosts we support (asserted).
assert sys.byteorder == "little", "the ring layout is little-endian; native views assume it"
_OFF_WRITE_POS = field_offset(RING_HEADER_DTYPE, "write_pos")
_OFF_WRITER_CLOSED = field_offset(RING_HEADER_DTYPE, "writer_closed")
_OFF_WRITER_PID = field_offset(RING_HEADER_DTYPE, "writer_pid")
_OFF_READ_POS = field_offset(RING_HEADER_DTYPE, "read_pos")
_OFF_READER_CLOSED = field_offset(RING_HEADER_DTYPE, "reader_closed")
_OFF_READER_PID = field_offset(RING_HEADER_DTYPE, "reader_pid")
_OFF_DOORBELL = field_offset(RING_HEADER_DTYPE, "doorbell")
# Indexes of the shared words in the control block's u64 and u32 views.
_W_WRITE_POS = _OFF_WRITE_POS // 8
_W_READ_POS = _OFF_READ_POS // 8
_I_WRITER_CLOSED = _OFF_WRITER_CLOSED // 4
_I_WRITER_PID = _OFF_WRITER_PID // 4
_I_READER_CLOSED = _OFF_READER_CLOSED // 4
_I_READER_PID = _OFF_READER_PID // 4
assert _OFF_WRITE_POS % 8 == 0 and _OFF_READ_POS % 8 == 0


_ALIGN_MASK = RECORD_ALIGN_BYTES - 1


def align_up(n: int, align: int = RECORD_ALIGN_BYTES) -> int:
    return (n + align - 1) & ~(align - 1)


def max_body_bytes(capacity_bytes: int) -> int:
    """Largest record body a ring of this capacity takes.

    A record may take at most half the ring. A record that does not fit before the end of
    the data region wraps to its start, and the gap it skips is spent too. With a record of
    S <= capacity/2 bytes at offset o where o + S > capacity, o > capacity/2 >= S, so the
    skipped gap plus the record (capacity - o + S) is at most capacity: once the reader has
    caught up, it always fits. A bigger record could wait for space forever.
    """
    return capacity_bytes // 2 - RECORD_HEADER_SIZE_BYTES


def _sem_names(name: str) -> tuple[str, str]:
    return f"{name}.d", f"{name}.s"


def ring_footprint_bytes(capacity_bytes: int) -> int:
    """What a ring of `capacity_bytes` takes in /dev/shm: its object (header and data, all
    reserved at creation) and its two semaphores (`_sem_names`)."""
    return object_footprint_bytes(HEADER_SIZE_BYTES + capacity_bytes) + 2 * SEMAPHORE_FOOTPRINT_BYTES


def _wake(sem: posix_ipc.Semaphore) -> None:
    # Post only when no wake-up is pending, so the count stays bounded (module docstring).
    if sem.value == 0:
        sem.release()


def _sleep(sem: posix_ipc.Semaphore, deadline: float | None) -> bool:
    """Wait one slice at most; False once the deadline has passed."""
    if deadline is None:
        wait_s = WAIT_SLICE_S
    else:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        wait_s = min(WAIT_SLICE_S, remaining)
    try:
        sem.acquire(wait_s)
    except (posix_ipc.BusyError, posix_ipc.SignalError):
        pass  # a timeout, or a signal (a stop request): either way the caller looks again
    return True


@dataclass(slots=True)
class Record:
    """One record peeked from a ring: a zero-copy view of its body and where it ends.

    `body` is a read-only uint8 view into shared memory, valid until the record is released
    (the writer may then overwrite it). `end` is what `RingReader.release` takes.
    """

    start: int
    end: int
    body: np.ndarray


class SharedRing:
    """The mapping, control block and semaphores of one ring, shared by both sides.

    Owner: the process that created it unlinks it, exactly once (`unlink`); every process
    that opened it calls `close`. Not thread-safe: one thread per side.
    """

    def __init__(self, name: str, mapping: mmap.mmap, creator: bool) -> None:
        self.name = name
        self.is_creator = creator
        self._map = mapping
        # Identity first, read straight from the map: no view exists yet, so a caller that
        # gets StaleObjectError can still close the map.
        magic, version, header_size, capacity = _IDENTITY.unpack_from(mapping, 0)
        self._check_identity(magic, version, header_size, capacity, len(mapping))
        # The semaphores before any view too: a ring whose creator unlinked it between our
        # open of the memory and of its semaphores raises ObjectMissingError here, and the
        # caller's close of the map would fail on a live view (BufferError killed a broker).
        self._data_sem, self._space_sem = self._open_semaphores(name, creator)
        self._header = memoryview(mapping)[:HEADER_SIZE_BYTES]
        self._u64 = self._header.cast("Q")
        self._u32 = self._header.cast("I")
        self.capacity_bytes = capacity
        self._mask = capacity - 1
        self.max_body_bytes = max_body_bytes(capacity)
        # The data region as one uint8 array: the reader slices views out of it, the writer
        # copies into it. Whole-region views avoid a buffer export per record.
        self.data = np.frombuffer(mapping, dtype=np.uint8, count=capacity, offset=HEADER_SIZE_BYTES)
        # The same bytes as a memoryview: struct and slice assignment on it cost about half
        # of what they cost on the numpy array (measured: 53 ns against 176 ns a copy).
        self.buf = memoryview(mapping)[HEADER_SIZE_BYTES:]
        self._closed = False
        self._unlinked = False

    @staticmethod
    def _open_semaphores(name: str, creator: bool) -> tuple:
        """The ring's data and space semaphores, or neither (the first is closed if the
        second cannot be opened)."""
        data_name, space_name = _sem_names(name)
        data_sem = open_semaphore(data_name, create=creator)
        try:
            return data_sem, open_semaphore(space_name, create=creator)
        except BaseException:
            data_sem.close()
            raise

    def _check_identity(self, magic: bytes, version: int, header_size: int, capacity: int, size: int) -> None:
        where = f"ring {self.name}"
        if magic != RING_MAGIC:
            raise StaleObjectError(f"{where}: magic {magic!r} at offset 0, expected {RING_MAGIC!r}")
        if version != RING_LAYOUT_VERSION:
            raise StaleObjectError(
                f"{where}: layout version {version} at offset 8, this code reads {RING_LAYOUT_VERSION}"
            )
        if header_size != HEADER_SIZE_BYTES or capacity & (capacity - 1) or header_size + capacity != size:
            raise StaleObjectError(
                f"{where}: header size {header_size} and capacity {capacity} do not match "
                f"an object of {size} bytes"
            )

    @classmethod
    def _create_mapping(cls, name: str, capacity_bytes: int, doorbell: str | None) -> mmap.mmap:
        if capacity_bytes & (capacity_bytes - 1) or not MIN_CAPACITY_BYTES <= capacity_bytes <= MAX_CAPACITY_BYTES:
            raise ValueError(
                f"ring capacity {capacity_bytes} must be a power of two in "
                f"[{MIN_CAPACITY_BYTES}, {MAX_CAPACITY_BYTES}]"
            )
        bell = (doorbell or "").encode()
        if len(bell) > RING_HEADER_DTYPE.fields["doorbell"][0].itemsize:
            raise ValueError(f"doorbell name {doorbell!r} is longer than the header field")
        mapping, _ = create_shared_memory(name, HEADER_SIZE_BYTES + capacity_bytes)  # every page reserved
        # Touch every page now: a page's first write costs a fault (about 1 GB/s against
        # 8-9 GB/s for a page already mapped), which would otherwise land on the first lap
        # of the hot path. 64 MiB takes about 10 ms.
        zeros = np.frombuffer(mapping, dtype=np.uint8)
        zeros.fill(0)
        del zeros
        mapping[_OFF_DOORBELL:_OFF_DOORBELL + len(bell)] = bell
        # Identity last: an attacher that finds the magic finds the rest written.
        _INIT.pack_into(
            mapping, 0, RING_MAGIC, RING_LAYOUT_VERSION, HEADER_SIZE_BYTES, capacity_bytes,
            os.getpid(), RECORD_ALIGN_BYTES, time.time_ns(),
        )
        return mapping

    @classmethod
    def create(cls, name: str, capacity_bytes: int, *, doorbell: str | None = None, reattach: bool = False) -> Self:
        """Create a ring owner-only. With `reattach`, a leftover ring of the same layout and
        capacity (a crashed run of the same creator) is opened instead; one of another
        layout raises StaleObjectError, never gets read."""
        try:
            mapping = cls._create_mapping(name, capacity_bytes, doorbell)
        except ObjectExistsError:
            if not reattach:
                raise
            ring = cls.attach(name)
            if ring.capacity_bytes != capacity_bytes or ring.doorbell_name != doorbell:
                found = (ring.capacity_bytes, ring.doorbell_name)
                ring.close()
                raise StaleObjectError(
                    f"ring {name}: leftover has capacity/doorbell {found}, "
                    f"wanted {(capacity_bytes, doorbell)}"
                ) from None
            ring.is_creator = True
            return ring
        try:
            return cls(name, mapping, creator=True)
        except BaseException:
            mapping.close()
            unlink_quietly([name], list(_sem_names(name)))
            raise

    @classmethod
    def attach(cls, name: str) -> Self:
        """Open an existing ring after checking its control block (StaleObjectError if foreign)."""
        mapping, _ = attach_shared_memory(name)
        if len(mapping) < HEADER_SIZE_BYTES:
            size = len(mapping)
            mapping.close()
            raise StaleObjectError(f"ring {name}: object of {size} bytes is smaller than a ring header")
        try:
            return cls(name, mapping, creator=False)
        except BaseException:
            mapping.close()
            raise

    @property
    def doorbell_name(self) -> str | None:
        raw = bytes(self._header[_OFF_DOORBELL:_OFF_DOORBELL + 64]).rstrip(b"\0")
        return raw.decode() or None

    @property
    def write_pos(self) -> int:
        return self._u64[_W_WRITE_POS]

    @property
    def read_pos(self) -> int:
        return self._u64[_W_READ_POS]

    @property
    def writer_closed(self) -> bool:
        return bool(self._u32[_I_WRITER_CLOSED])

    @property
    def reader_closed(self) -> bool:
        return bool(self._u32[_I_READER_CLOSED])

    @property
    def writer_pid(self) -> int:
        """Process id of the last writer to attach (0 if none has)."""
        return self._u32[_I_WRITER_PID]

    def close(self) -> None:
        """Drop this process's mapping and semaphore handles (the objects stay until unlinked).

        A numpy view still held by the caller keeps the mapping alive until it is dropped;
        that is why this drops references rather than insisting on unmapping now.
        """
        if self._closed:
            return
        self._closed = True
        self._data_sem.close()
        self._space_sem.close()
        self.data = None  # type: ignore[assignment]
        for view in (self._u64, self._u32, self.buf, self._header):
            try:
                view.release()
            except BufferError:
                pass
        try:
            self._map.close()
        except BufferError:
            pass  # views still exported: unmapped when the last one goes

    def unlink(self) -> None:
        """Remove the ring's names from the system. Only the creator calls this, once."""
        if not self.is_creator:
            raise ShmError(f"ring {self.name}: only its creator unlinks it")
        if not self._unlinked:
            self._unlinked = True
            unlink_quietly([self.name], list(_sem_names(self.name)))

    @staticmethod
    def unlink_leftover(name: str) -> list[str]:
        """Remove a reported leftover ring's objects by name; returns what was there."""
        return unlink_quietly([name], list(_sem_names(name)))


def unreleased_records(name: str) -> list[bytes]:
    """The bodies of the records a ring holds that its reader has not released, in order,
    read without changing anything: no position, flag or pid is written and no semaphore
    is opened. For whoever takes stock of a stopped run (nobody reads or writes the ring
    any more): what a crashed reader left unstored. StaleObjectError if the object is not
    one of our rings or a record does not follow the layout; ObjectMissingError if it is
    gone. Each body is a copy: the mapping is closed before this returns."""
    mapping, _ = attach_shared_memory(name)
    try:
        if len(mapping) < HEADER_SIZE_BYTES:
            raise StaleObjectError(f"ring {name}: object of {len(mapping)} bytes is smaller than a ring header")
        magic, version, header_size, capacity = _IDENTITY.unpack_from(mapping, 0)
        if magic != RING_MAGIC or version != RING_LAYOUT_VERSION or header_size != HEADER_SIZE_BYTES \
                or capacity & (capacity - 1) or header_size + capacity != len(mapping):
            raise StaleObjectError(f"ring {name}: magic {magic!r}, version {version}, header size "
                                   f"{header_size}, capacity {capacity}: not a ring of this layout")
        write_pos, read_pos = _POSITIONS.unpack_from(mapping, _OFF_WRITE_POS)
        return _walk_records(name, memoryview(mapping)[HEADER_SIZE_BYTES:], capacity, read_pos, write_pos)
    finally:
        mapping.close()


def unfinished_ring(name: str) -> bool:
    """Whether the shared-memory object `name` is a ring its creator never finished making:
    empty (it died before sizing it) or with its identity block all zeros (before writing
    it; the identity is written last, `_create_mapping`). No writer ever had such a ring,
    so it holds no record: what a cleanup may remove although `unreleased_records` cannot
    read it. False for a ring, for anything else, and for what is gone."""
    try:
        with open(object_path(name), "rb") as file:
            size = os.fstat(file.fileno()).st_size
            identity = file.read(_IDENTITY.size)
    except FileNotFoundError:
        return False
    return size == 0 or (size >= HEADER_SIZE_BYTES and identity == bytes(_IDENTITY.size))


def _walk_records(name: str, data: memoryview, capacity: int, pos: int, end_pos: int) -> list[bytes]:
    """Copies of the bodies of the records in [pos, end_pos) of a ring's data region."""
    bodies = []
    try:
        while pos < end_pos:
            offset = pos & (capacity - 1)
            body_size, kind, own = _RECORD.unpack_from(data, offset)
            if kind == RECORD_WRAP and own == pos:
                pos += capacity - offset
                continue
            end = pos + RECORD_HEADER_SIZE_BYTES + align_up(body_size)
            if kind != RECORD_DATA or own != pos or end > end_pos:
                raise StaleObjectError(f"ring {name}: record at position {pos} has kind {kind}, size "
                                       f"{body_size}, own position {own}; write_pos {end_pos}")
            start = offset + RECORD_HEADER_SIZE_BYTES
            bodies.append(bytes(data[start:start + body_size]))
            pos = end
    finally:
        data.release()
    return bodies


class RingWriter(SharedRing):
    """The writing side: `reserve` space, fill it, `commit` it; or `write` bytes in one call.

    Owner: one process (usually a producer, which also creates the ring). Not thread-safe.

    Example, capacity 64 bytes, a 24-byte body (40 bytes with header, rounded to 48) at
    write_pos 32: offset 32 + 48 > 64, so a wrap marker fills 32..63, the record goes to
    offset 0, and write_pos becomes 32 + 32 + 48 = 112 (once the reader released up to 48).
    """

    def __init__(self, name: str, mapping: mmap.mmap, creator: bool) -> None:
        super().__init__(name, mapping, creator)
        self._doorbell: Doorbell | None = None
        try:
            self._write_pos = self.write_pos
            self._read_pos_seen = self.read_pos
            if self.writer_closed:
                self._u32[_I_WRITER_CLOSED] = 0  # a reattaching writer reopens it
            self._u32[_I_WRITER_PID] = os.getpid()
            self._pending_end: int | None = None
            bell = self.doorbell_name
            self._doorbell = Doorbell.attach(bell) if bell else None  # gone: its broker is stopping
        except BaseException:
            # The views go before the caller closes the map: a live view made that close
            # raise BufferError, which hid the real error.
            SharedRing.close(self)
            raise
        self._writer_closed = False

    def reserve(self, body_size_bytes: int, timeout_s: float | None = None) -> int:
        """Reserve a record of `body_size_bytes`; return its body's offset in `self.buf`
        (and `self.data`), 16-byte aligned.

        Blocks while the ring is full, up to `timeout_s` (None: forever), then raises
        RingTimeoutError. Nothing is visible to the reader until `commit`.
        """
        assert self._pending_end is None, "reserve() twice without commit()"
        if self._writer_closed:
            raise RingClosedError(f"ring {self.name}: the writer closed it")
        if not 0 <= body_size_bytes <= self.max_body_bytes:
            raise RecordTooLargeError(
                f"ring {self.name}: record body of {body_size_bytes} bytes, limit "
                f"{self.max_body_bytes} (half of capacity {self.capacity_bytes}, less the header)"
            )
        total = RECORD_HEADER_SIZE_BYTES + ((body_size_bytes + _ALIGN_MASK) & ~_ALIGN_MASK)
        pos = self._write_pos
        offset = pos & self._mask
        tail = self.capacity_bytes - offset
        need = total if total <= tail else tail + total
        # The reader's position is reloaded only when the last one seen leaves too little
        # room: one shared-memory load fewer per record on the common path.
        if pos + need - self._read_pos_seen > self.capacity_bytes:
            self._read_pos_seen = self._wait_for_space(pos + need, timeout_s)
        if total > tail:
            _RECORD.pack_into(self.buf, offset, tail - RECORD_HEADER_SIZE_BYTES, RECORD_WRAP, pos)
            pos += tail
            offset = 0
        _RECORD.pack_into(self.buf, offset, body_size_bytes, RECORD_DATA, pos)
        self._pending_end = pos + total
        return offset + RECORD_HEADER_SIZE_BYTES

    def _wait_for_space(self, end_pos: int, timeout_s: float | None) -> int:
        """Wait until the reader has released enough for a record ending at `end_pos`;
        returns the reader's position. A closed reader is noticed here, when room is
        needed: until then records go on landing in the ring, where a reader that attaches
        later (a restarted broker) finds them."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            read_pos = self._u64[_W_READ_POS]
            if self._u32[_I_READER_CLOSED]:
                raise RingClosedError(f"ring {self.name}: the reader closed it")
            if end_pos - read_pos <= self.capacity_bytes:
                return read_pos
            if not _sleep(self._space_sem, deadline):
                raise RingTimeoutError(
                    f"ring {self.name}: full for {timeout_s} s "
                    f"({end_pos - read_pos - self.capacity_bytes} more bytes needed)"
                )

    def commit(self) -> None:
        """Publish the reserved record and wake the reader."""
        end = self._pending_end
        assert end is not None, "commit() without reserve()"
        self._pending_end = None
        self._write_pos = end
        self._u64[_W_WRITE_POS] = end
        if self._data_sem.value == 0:  # _wake(), inlined: this runs once per submit
            self._data_sem.release()
        if self._doorbell is not None:
            self._doorbell.ring()

    def abort(self) -> None:
        """Drop a reservation without publishing it."""
        self._pending_end = None

    def write(self, body, timeout_s: float | None = None) -> None:
        """Copy one bytes-like record into the ring and publish it."""
        view = memoryview(body).cast("B")
        offset = self.reserve(view.nbytes, timeout_s)
        self.buf[offset:offset + view.nbytes] = view
        self.commit()

    def close(self, mark_closed: bool = True) -> None:
        """Close this handle. With `mark_closed` (the default) the writing side is marked
        closed: the reader drains what is there, then sees the end. Without it the ring
        stays open for a writer that attaches later."""
        if not self._closed and not self._writer_closed and mark_closed:
            self._writer_closed = True
            self._u32[_I_WRITER_CLOSED] = 1
            self._data_sem.release()
            if self._doorbell is not None:
                self._doorbell.ring()
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None
        super().close()


class RingReader(SharedRing):
    """The reading side: `peek` records in order, `release` them in order when done.

    Owner: one process (the broker for producer rings, a consumer for descriptor rings).
    Not thread-safe. Peeking advances a private cursor; releasing publishes `read_pos`, so
    records peeked but not released are peeked again by a reader that reattaches after a
    crash: the caller makes that idempotent.
    """

    def __init__(self, name: str, mapping: mmap.mmap, creator: bool) -> None:
        super().__init__(name, mapping, creator)
        self._cursor = self.read_pos
        self._write_pos_seen = self._cursor
        self._u32[_I_READER_PID] = os.getpid()
        if self.reader_closed:
            self._u32[_I_READER_CLOSED] = 0
        self._readonly = self.data.view()
        self._readonly.flags.writeable = False

    @property
    def cursor(self) -> int:
        """Position after the last peeked record."""
        return self._cursor

    def poll(self) -> Record | None:
        """The next record if one is published, else None. Never blocks."""
        cursor = self._cursor
        if cursor == self._write_pos_seen:
            self._write_pos_seen = self._u64[_W_WRITE_POS]
            if cursor == self._write_pos_seen:
                return None
        offset = cursor & self._mask
        body_size, kind, pos = _RECORD.unpack_from(self.buf, offset)
        if kind == RECORD_WRAP:
            self._check_record(cursor, pos, body_size + RECORD_HEADER_SIZE_BYTES, self.capacity_bytes - offset)
            cursor += self.capacity_bytes - offset
            offset = 0
            body_size, kind, pos = _RECORD.unpack_from(self.buf, 0)
        end = cursor + RECORD_HEADER_SIZE_BYTES + align_up(body_size)
        if kind != RECORD_DATA or pos != cursor or end > self._write_pos_seen:
            self._corrupt(cursor, body_size, kind, pos)
        self._cursor = end
        start = offset + RECORD_HEADER_SIZE_BYTES
        return Record(cursor, end, self._readonly[start:start + body_size])

    def _check_record(self, cursor: int, pos: int, size: int, expected: int) -> None:
        if pos != cursor or size != expected:
            self._corrupt(cursor, size, RECORD_WRAP, pos)

    def _corrupt(self, cursor: int, body_size: int, kind: int, pos: int) -> None:
        raise StaleObjectError(
            f"ring {self.name}: record at position {cursor} (data offset {cursor & self._mask}) "
            f"has kind {kind}, size {body_size}, own position {pos}; write_pos {self._write_pos_seen}. "
            f"The ring was written by something that does not follow this layout"
        )

    def peek(self, timeout_s: float | None = None) -> Record | None:
        """The next record, waiting up to `timeout_s` (None: forever); None on timeout.

        Raises RingClosedError once the writer has closed and every record was peeked.
        """
        poll = self.poll
        for _ in range(SPIN_POLLS):
            record = poll()
            if record is not None:
                return record
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.writer_closed:
                record = self.poll()  # the last records may have landed with the close
                if record is None:
                    raise RingClosedError(f"ring {self.name}: the writer closed it and all was read")
                return record
            if not _sleep(self._data_sem, deadline):
                return None
            record = self.poll()
            if record is not None:
                return record

    def release(self, end_pos: int) -> None:
        """Release every record before `end_pos` (a `Record.end`): the writer may reuse it."""
        assert self.read_pos <= end_pos <= self._cursor, (self.read_pos, end_pos, self._cursor)
        self._u64[_W_READ_POS] = end_pos
        _wake(self._space_sem)

    def close(self, mark_closed: bool = True) -> None:
        """Close this handle. With `mark_closed` (the default) the reading side is marked
        closed: a writer blocked or writing gets RingClosedError. Without it (a broker
        stopping to restart) the writer keeps writing until the ring fills."""
        if not self._closed:
            if mark_closed:
                self._u32[_I_READER_CLOSED] = 1
                self._space_sem.release()
            self._readonly = None  # type: ignore[assignment]
        super().close()
