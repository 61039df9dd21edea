"""Segment files (the disk tier): the segment header, its entries, their checksums and the prompt
digest of their tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import xxhash

from pipeline.wire.layouts.frames import TOKEN_SIZE_BYTES
from shm.layout import Field, checked_dtype, struct_for

# Segment files (the disk tier, SPEC §5)
#
# A segment holds entries of one (model, signature, lane), so shape purity is a property of
# the layout; every entry also names its own shape (`signature`), which is the segment's,
# but in the segments of a model's solitary pool (signature POOL_SIGNATURE,
# `pipeline.wire.shapes`), whose entries are of many shapes that share nothing.
# The header page holds the routing keys once. Entries follow from
# SEGMENT_HEADER_SIZE_BYTES on, 16-aligned:
#
#     file:  SEGMENT_HEADER (one page) | ENTRY_HEADER tokens payload pad | ENTRY_HEADER ... | zeros
#
# Space past the last entry reads as zeros (files are preallocated), and a zero state word
# means "no entry here": a scan skips to the next SYNC_ALIGN_BYTES boundary and stops there
# if that holds no entry either (the padding of `power`, below).
#
# Version 2: a segment is written once. Nothing written is ever rewritten in place: the
# header's words after the identity keep their creation values, a state word stays
# ENTRY_LIVE; completions, the commit boundary and the seal are records of the store log
# (STORE_LOG_DTYPE, one file for the data directory). Why: a sector being written when the
# power goes may read back as garbage (RELIABILITY.md), and an in-place 4-byte tombstone or
# header word shares its sector with acknowledged bytes. For the same reason, in `power`
# each synced group of appends starts on a SYNC_ALIGN_BYTES boundary (zeros before it), so
# an append never rewrites a sector that holds synced bytes.

SEGMENT_MAGIC = b"SBSEGMT1"
# Bump when a field below moves or changes meaning, or where what changes about a segment is
# kept; segments of another version are refused, never migrated: an older layout could
# rewrite synced sectors in place (see above), an older entry has zeros where the shape
# (`signature`) is, which would read as a shape, and an older store kept its completions in a
# journal beside each segment, where this one reads the store log (both releases would
# deliver every completed entry again from the other's store).
SEGMENT_VERSION = 4
# One page: entries start page-aligned, and the header's mutable words stay in one page.
SEGMENT_HEADER_SIZE_BYTES = 4096
# Entries start on 16-byte boundaries so token ids (after a 64-byte header) are 16-aligned
# for a zero-copy numpy view in the consumer.
ENTRY_ALIGN_BYTES = 16
# State words. Non-zero and unlike each other in every byte, so a torn or zeroed word is
# never taken for either state.
ENTRY_LIVE = 0x4556494C  # b"LIVE" little-endian
ENTRY_TOMBSTONE = 0x424D4F54  # b"TOMB"
ENTRY_NONE = 0  # preallocated space: the end of the data (or `power` padding)
# `power` starts each synced group of appends (and of store log records) at a multiple of
# this: the larger of the two sector sizes disks write (512, 4096), so that no write ever
# lands in a sector holding bytes already synced. SQLite's WAL pads its commits to the
# sector size for the same reason when the disk does not promise powersafe overwrite.
SYNC_ALIGN_BYTES = 4096

# Segment header.
#   off  size  field              meaning
#     0     8  magic              b"SBSEGMT1"
#     8     4  version            SEGMENT_VERSION
#    12     4  header_size        SEGMENT_HEADER_SIZE_BYTES: where entries start
#    16     4  model              routing key: model id
#    20     4  lane               routing key: lane id within the shape
#    24     8  signature          routing key: the shape
#    32     8  segment_seq        sequence of this segment within its (model, signature, lane)
#    40     8  created_ns         wall clock at creation (time.time_ns)
#    48     8  identity_checksum  xxh3-64 of bytes 0..48: the routing keys are never misread
#    64     4  sealed             0 (version 2: the seal is a log record)
#    72     8  entry_count        0 (version 2: the boundary is a log record)
#    80     8  data_end           SEGMENT_HEADER_SIZE_BYTES, the boundary of an empty segment
#    88     8  deleted_count      0 (version 2: completions are log records)
#    96     8  boundary_checksum  xxh3-64 of bytes 72..88 (entry_count, data_end)
# Bytes 64..104 are written once, at creation, as an empty segment's boundary: the scan's
# boundary when the log holds none.
SEGMENT_HEADER_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S8", "b'SBSEGMT1'"),
        ("version", 8, "<u4", "SEGMENT_VERSION"),
        ("header_size", 12, "<u4", "where entries start"),
        ("model", 16, "<u4", "model id"),
        ("lane", 20, "<u4", "lane id"),
        ("signature", 24, "<u8", "shape"),
        ("segment_seq", 32, "<u8", "segment sequence in its lane"),
        ("created_ns", 40, "<u8", "creation wall clock"),
        ("identity_checksum", 48, "<u8", "xxh3 of bytes 0..48"),
        ("sealed", 64, "<u4", "sealed flag"),
        ("entry_count", 72, "<u8", "entries written"),
        ("data_end", 80, "<u8", "end of whole entries"),
        ("deleted_count", 88, "<u8", "entries tombstoned"),
        ("boundary_checksum", 96, "<u8", "xxh3 of bytes 72..88"),
    ],
    itemsize=128,
)
SEGMENT_IDENTITY_BYTES = 48

# Entry header.
#   off  size  field        meaning
#     0     4  state        ENTRY_LIVE (written once; ENTRY_TOMBSTONE only in what a scan reports)
#     4     4  length       token count, >= 1
#     8     8  checksum     xxh3-64, seeded with `length`, of bytes 16..end of the entry body
#                           (this header from item_id on, the tokens, the payload): the state
#                           word can change without touching it, and a damaged length is caught
#    16     8  item_id      the producer's unique item id
#    24     8  seq          the producer's sequence number
#    32     4  producer_id  the producer
#    36     4  prefix_len   leading tokens the shape's components cover
#    40     4  payload_len  opaque payload bytes after the tokens
#    44     4  reserved     zero
#    48     8  submit_ns    producer's submit time (monotonic ns), for latency
#    56     8  signature    the item's shape (SPEC §1): the segment's, but in a pool segment
# Then `length` int32 token ids (16-aligned), the payload, and zeros to the next 16 bytes.
ENTRY_HEADER_DTYPE = checked_dtype(
    [
        ("state", 0, "<u4", "live or tombstone"),
        ("length", 4, "<u4", "tokens"),
        ("checksum", 8, "<u8", "xxh3 of bytes 16..end, seeded with length"),
        ("item_id", 16, "<u8", "item id"),
        ("seq", 24, "<u8", "producer sequence"),
        ("producer_id", 32, "<u4", "producer"),
        ("prefix_len", 36, "<u4", "prefix tokens"),
        ("payload_len", 40, "<u4", "payload bytes"),
        ("submit_ns", 48, "<u8", "submit time"),
        ("signature", 56, "<u8", "the item's shape"),
    ],
    itemsize=64,
)
ENTRY_HEADER_SIZE_BYTES = ENTRY_HEADER_DTYPE.itemsize
# Where the checksummed part of an entry starts.
ENTRY_CHECKSUM_FROM = 16
assert ENTRY_HEADER_SIZE_BYTES % ENTRY_ALIGN_BYTES == 0
assert SEGMENT_HEADER_SIZE_BYTES % ENTRY_ALIGN_BYTES == 0
# The segment header words after the identity, each read and written alone through a struct
# derived from the dtype (the identity block's structs are `storage.identity`'s).
SEGMENT_SEALED = Field(SEGMENT_HEADER_DTYPE, "sealed")
SEGMENT_ENTRY_COUNT = Field(SEGMENT_HEADER_DTYPE, "entry_count")
SEGMENT_DATA_END = Field(SEGMENT_HEADER_DTYPE, "data_end")
SEGMENT_DELETED_COUNT = Field(SEGMENT_HEADER_DTYPE, "deleted_count")
SEGMENT_BOUNDARY_CHECKSUM = Field(SEGMENT_HEADER_DTYPE, "boundary_checksum")
assert SEGMENT_DATA_END.offset == SEGMENT_ENTRY_COUNT.end  # the pair the boundary checksum covers
# A whole entry header (one entry read alone), and its state word.
ENTRY_HEADER_STRUCT = struct_for(ENTRY_HEADER_DTYPE)
ENTRY_STATE = Field(ENTRY_HEADER_DTYPE, "state")
assert ENTRY_STATE.offset == 0  # scans and tombstones read state words as a uint32 column at entry offsets
# An int, or an int64 column of them.
_Sizes = TypeVar("_Sizes", int, np.ndarray)
# An entry header as 8-byte words from the entry's start (entries start 16-aligned): the
# index pattern that moves many headers at once (`gather_entry_headers`, `scatter_...`).
_ENTRY_HEADER_WORDS = np.arange(ENTRY_HEADER_SIZE_BYTES // 8, dtype=np.int64)


def entry_size_bytes(length: _Sizes, payload_len: _Sizes) -> _Sizes:
    """Bytes an entry takes in a segment, padding to the next ENTRY_ALIGN_BYTES included: of
    one entry (ints) or of many (int64 columns; a uint32 column could overflow)."""
    raw = ENTRY_HEADER_SIZE_BYTES + length * TOKEN_SIZE_BYTES + payload_len
    return (raw + ENTRY_ALIGN_BYTES - 1) & ~(ENTRY_ALIGN_BYTES - 1)


def gather_entry_headers(words: np.ndarray, offsets: np.ndarray,
                         limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The entry headers at `offsets` (int64) of a buffer viewed as uint64 `words`, gathered
    at once and checked as columns: (headers as ENTRY_HEADER_DTYPE, each entry's end offset,
    `good`). `good`: the offset is 16-aligned and holds a live entry of at least one token
    that ends at or before `limit`. Every header must lie within `words`: the caller knows
    which part of its buffer may be read, and checks that first.

    Example: entries at 4096 (live, 10 tokens, no payload: 112 bytes) and 4208 (tombstoned),
    limit 8192 -> ends [4208, ...], good [True, False]."""
    headers = words[(offsets >> 3)[:, None] + _ENTRY_HEADER_WORDS].view(ENTRY_HEADER_DTYPE).reshape(-1)
    lengths = headers["length"]
    ends = offsets + entry_size_bytes(lengths.astype(np.int64), headers["payload_len"].astype(np.int64))
    good = ((headers["state"] == ENTRY_LIVE) & (lengths != 0) & (ends <= limit)
            & ((offsets & (ENTRY_ALIGN_BYTES - 1)) == 0))
    return headers, ends, good


def scatter_entry_headers(words: np.ndarray, offsets: np.ndarray, headers: np.ndarray) -> None:
    """Write `headers` (ENTRY_HEADER_DTYPE) into a buffer viewed as uint64 `words` at byte
    `offsets` (int64, 16-aligned), all at once: `gather_entry_headers` read backwards."""
    words[(offsets >> 3)[:, None] + _ENTRY_HEADER_WORDS] = headers.view(np.uint64).reshape(-1, _ENTRY_HEADER_WORDS.size)


def entry_checksum(buf, offset: int, end: int, length: int) -> int:
    """The checksum the entry at [offset, end) of `buf` must carry (see ENTRY_HEADER_DTYPE).
    `buf` should be a memoryview or numpy array: slicing those copies nothing."""
    return xxhash.xxh3_64_intdigest(buf[offset + ENTRY_CHECKSUM_FROM:end], seed=length)


def prompt_digest(tokens: np.ndarray) -> int:
    """The digest a results line carries of the prompt the engine was given (`prompt_xxh3`):
    xxh3-64 of its token ids as little-endian int32, unseeded. A checker computes the same
    from what the producer submitted, so an item delivered with other tokens than it was
    submitted with (damage anywhere from the producer's array to the engine) is caught end
    to end, not only where a checksum covers it. Entries hold little-endian int32 ids, so a
    view read from a segment hashes without a copy."""
    ids = np.ascontiguousarray(tokens, dtype="<i4")
    return xxhash.xxh3_64_intdigest(ids)


def entry_prompt_digest(buf, tokens_at: int, tokens_end: int) -> int:
    """`prompt_digest` of an entry's tokens at [tokens_at, tokens_end) of `buf` (a
    memoryview or numpy array of a segment: entries hold little-endian int32 ids, so the
    bytes hash as they lie, without a view or a copy)."""
    return xxhash.xxh3_64_intdigest(buf[tokens_at:tokens_end])


def prompt_digests(prompts: Sequence[np.ndarray]) -> list[int]:
    """`prompt_digest` of each prompt: one xxh3 call each when every prompt is already
    contiguous little-endian int32 (the Redis peer's consumers' views of stream entries;
    the broker's consumers digest entries as they read them: pipeline/consumer/reader.py),
    which saves about half the per-prompt cost (160 against 340 ns for 256-token prompts)."""
    if all(p.dtype == _PROMPT_DTYPE and p.flags.c_contiguous for p in prompts):
        digest = xxhash.xxh3_64_intdigest
        return [digest(p) for p in prompts]
    return [prompt_digest(p) for p in prompts]


_PROMPT_DTYPE = np.dtype("<i4")
