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
from shm.layout import field_offset, struct_for
from shm.objects import Doorbell, attach_shared_memory, create_shared_memory, open_semaphore, unlink_quietly
from shm.ring_layout import (
    HEADER_SIZE_BYTES,
    IDENTITY_STRUCT,
    MAX_CAPACITY_BYTES,
    MIN_CAPACITY_BYTES,
    RECORD_ALIGN_BYTES,
    RECORD_DATA,
    RECORD_HEADER_SIZE_BYTES,
    RECORD_STRUCT,
    RECORD_WRAP,
    RING_HEADER_DTYPE,
    RING_LAYOUT_VERSION,
    RING_MAGIC,
    align_up,
    max_body_bytes,
    semaphore_names,
)

# Polls a reader makes before it sleeps. Sleeping costs the writer a futex wake (a system
# call, microseconds) on its next record; a writer submitting one item every ~1.5 us would
# pay it on every item if the reader slept the moment it caught up. 256 empty polls are
# about 40 us of spinning, after which an idle reader sleeps.
SPIN_POLLS = 256
# Longest a sleeper goes without re-checking positions: bounds the cost of a lost wake-up
# (see the module NOTE) and how late a closed peer is noticed.
WAIT_SLICE_S = 0.02

_INIT = struct_for(
    RING_HEADER_DTYPE,
    ["magic", "layout_version", "header_size", "capacity", "creator_pid", "record_align", "created_ns"],
)
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
        magic, version, header_size, capacity = IDENTITY_STRUCT.unpack_from(mapping, 0)
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
        data_name, space_name = semaphore_names(name)
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
            unlink_quietly([name], list(semaphore_names(name)))
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
            unlink_quietly([self.name], list(semaphore_names(self.name)))

    @staticmethod
    def unlink_leftover(name: str) -> list[str]:
        """Remove a reported leftover ring's objects by name; returns what was there."""
        return unlink_quietly([name], list(semaphore_names(name)))



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
            RECORD_STRUCT.pack_into(self.buf, offset, tail - RECORD_HEADER_SIZE_BYTES, RECORD_WRAP, pos)
            pos += tail
            offset = 0
        RECORD_STRUCT.pack_into(self.buf, offset, body_size_bytes, RECORD_DATA, pos)
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
        body_size, kind, pos = RECORD_STRUCT.unpack_from(self.buf, offset)
        if kind == RECORD_WRAP:
            self._check_record(cursor, pos, body_size + RECORD_HEADER_SIZE_BYTES, self.capacity_bytes - offset)
            cursor += self.capacity_bytes - offset
            offset = 0
            body_size, kind, pos = RECORD_STRUCT.unpack_from(self.buf, 0)
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
