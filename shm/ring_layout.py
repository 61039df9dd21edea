"""A ring's layout in shared memory: its control block and record headers (numpy dtypes whose
offset tables are checked at import), the sizes they imply, and the reads of a stopped ring
that open no semaphore and write nothing (`unreleased_records`, `unfinished_ring`). The
sides that write and read a live ring are `shm.ring`'s."""

from __future__ import annotations

import os

from shm.errors import StaleObjectError
from shm.layout import checked_dtype, field_offset, struct_for
from shm.objects import SEMAPHORE_FOOTPRINT_BYTES, attach_shared_memory, object_footprint_bytes, object_path

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

IDENTITY_STRUCT = struct_for(RING_HEADER_DTYPE, ["magic", "layout_version", "header_size", "capacity"])
RECORD_STRUCT = struct_for(RECORD_HEADER_DTYPE)
# Both positions in one read, for `unreleased_records` (nobody writes them then).
_POSITIONS = struct_for(RING_HEADER_DTYPE, ["write_pos", "read_pos"])
_POSITIONS_AT = field_offset(RING_HEADER_DTYPE, "write_pos")


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


def semaphore_names(name: str) -> tuple[str, str]:
    return f"{name}.d", f"{name}.s"


def ring_footprint_bytes(capacity_bytes: int) -> int:
    """What a ring of `capacity_bytes` takes in /dev/shm: its object (header and data, all
    reserved at creation) and its two semaphores (`semaphore_names`)."""
    return object_footprint_bytes(HEADER_SIZE_BYTES + capacity_bytes) + 2 * SEMAPHORE_FOOTPRINT_BYTES



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
        magic, version, header_size, capacity = IDENTITY_STRUCT.unpack_from(mapping, 0)
        if magic != RING_MAGIC or version != RING_LAYOUT_VERSION or header_size != HEADER_SIZE_BYTES \
                or capacity & (capacity - 1) or header_size + capacity != len(mapping):
            raise StaleObjectError(f"ring {name}: magic {magic!r}, version {version}, header size "
                                   f"{header_size}, capacity {capacity}: not a ring of this layout")
        write_pos, read_pos = _POSITIONS.unpack_from(mapping, _POSITIONS_AT)
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
            identity = file.read(IDENTITY_STRUCT.size)
    except FileNotFoundError:
        return False
    return size == 0 or (size >= HEADER_SIZE_BYTES and identity == bytes(IDENTITY_STRUCT.size))


def _walk_records(name: str, data: memoryview, capacity: int, pos: int, end_pos: int) -> list[bytes]:
    """Copies of the bodies of the records in [pos, end_pos) of a ring's data region."""
    bodies = []
    try:
        while pos < end_pos:
            offset = pos & (capacity - 1)
            body_size, kind, own = RECORD_STRUCT.unpack_from(data, offset)
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

