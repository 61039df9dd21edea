"""Batch descriptors: the records of a consumer's descriptor ring."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.wire.errors import FrameError
from shm.layout import checked_dtype, struct_for

# Batch descriptors (broker -> consumer, one record of the consumer's shared-memory ring)
#
# A descriptor names where each item of a batch lives; the consumer maps the segment files
# read-only and hands the engine views of the token ids, so no token is copied on the way.
#
#     record:  DESCRIPTOR_HEADER | DESCRIPTOR_ITEM x item_count

DESCRIPTOR_MAGIC = b"SBD1"
# Bump when a field below moves or changes meaning.
DESCRIPTOR_VERSION = 1

# Descriptor header.
#   off  size  field          meaning
#     0     4  magic          b"SBD1"
#     4     2  version        DESCRIPTOR_VERSION
#     6     2  header_size    DESCRIPTOR_HEADER_DTYPE.itemsize
#     8     8  batch_id       the broker's batch id (completions name it)
#    16     8  signature      the batch's shape: every item is of it
#    24     4  model          model id
#    28     4  pad_to_tokens  every prompt is padded to this for the batch
#    32     4  item_count     items that follow, >= 1
#    36     4  reserved       zero
#    40     8  dispatch_ns    broker's time.monotonic_ns() when it handed the batch out
DESCRIPTOR_HEADER_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S4", "b'SBD1'"),
        ("version", 4, "<u2", "DESCRIPTOR_VERSION"),
        ("header_size", 6, "<u2", "header bytes"),
        ("batch_id", 8, "<u8", "batch id"),
        ("signature", 16, "<u8", "shape"),
        ("model", 24, "<u4", "model id"),
        ("pad_to_tokens", 28, "<u4", "pad-to"),
        ("item_count", 32, "<u4", "items"),
        ("dispatch_ns", 40, "<u8", "dispatch time, monotonic ns"),
    ],
    itemsize=48,
)

# One item of a descriptor: the segment (by its keys: the consumer derives the path) and the
# entry's byte offset, with what the consumer checks against the entry header it reads.
#   off  size  field        meaning
#     0     4  lane         segment key: lane id (model and signature are the header's)
#     4     4  length       token count (checked against the entry)
#     8     8  segment_seq  segment key: sequence (one counter per store)
#    16     8  offset       the entry's byte offset in the segment file
#    24     8  item_id      checked against the entry
DESCRIPTOR_ITEM_DTYPE = checked_dtype(
    [
        ("lane", 0, "<u4", "lane id"),
        ("length", 4, "<u4", "tokens"),
        ("segment_seq", 8, "<u8", "segment sequence"),
        ("offset", 16, "<u8", "entry offset"),
        ("item_id", 24, "<u8", "item id"),
    ],
    itemsize=32,
)
DESCRIPTOR_HEADER_SIZE_BYTES = DESCRIPTOR_HEADER_DTYPE.itemsize
DESCRIPTOR_ITEM_SIZE_BYTES = DESCRIPTOR_ITEM_DTYPE.itemsize
DESCRIPTOR_HEADER_STRUCT = struct_for(DESCRIPTOR_HEADER_DTYPE)


@dataclass(slots=True)
class Descriptor:
    """A parsed batch descriptor: header fields and a zero-copy view of its items."""

    batch_id: int
    signature: int
    model: int
    pad_to_tokens: int
    dispatch_ns: int
    items: np.ndarray  # DESCRIPTOR_ITEM_DTYPE


def descriptor_size_bytes(item_count: int) -> int:
    return DESCRIPTOR_HEADER_SIZE_BYTES + item_count * DESCRIPTOR_ITEM_SIZE_BYTES


def write_descriptor(buf: memoryview | np.ndarray, offset: int, batch_id: int, signature: int, model: int,
                     pad_to_tokens: int, dispatch_ns: int, items: np.ndarray) -> None:
    """Write a descriptor at `offset` of `buf` (a ring reservation of descriptor_size_bytes)."""
    count = items.shape[0]
    assert count >= 1 and items.dtype == DESCRIPTOR_ITEM_DTYPE
    DESCRIPTOR_HEADER_STRUCT.pack_into(
        buf, offset, DESCRIPTOR_MAGIC, DESCRIPTOR_VERSION, DESCRIPTOR_HEADER_SIZE_BYTES,
        batch_id, signature, model, pad_to_tokens, count, dispatch_ns,
    )
    start = offset + DESCRIPTOR_HEADER_SIZE_BYTES
    memoryview(buf).cast("B")[start:start + count * DESCRIPTOR_ITEM_SIZE_BYTES] = items.view(np.uint8)


def parse_descriptor(body: np.ndarray, where: str = "descriptor") -> Descriptor:
    """Parse and check a descriptor record (FrameError naming `where` if it is not one)."""
    size = body.shape[0]
    if size < DESCRIPTOR_HEADER_SIZE_BYTES:
        raise FrameError(f"{where}: {size} bytes, shorter than a descriptor header")
    magic, version, header_size, batch_id, signature, model, pad_to, count, dispatch_ns = (
        DESCRIPTOR_HEADER_STRUCT.unpack_from(body, 0)
    )
    if magic != DESCRIPTOR_MAGIC or version != DESCRIPTOR_VERSION or header_size != DESCRIPTOR_HEADER_SIZE_BYTES:
        raise FrameError(f"{where}: offset 0: magic {magic!r}, version {version}, header size {header_size}")
    if count == 0 or size != descriptor_size_bytes(count):
        raise FrameError(f"{where}: {count} items need {descriptor_size_bytes(count)} bytes; the record has {size}")
    items = body[DESCRIPTOR_HEADER_SIZE_BYTES:].view(DESCRIPTOR_ITEM_DTYPE)
    return Descriptor(batch_id, signature, model, pad_to, dispatch_ns, items)
