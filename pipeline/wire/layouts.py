"""Every record layout of the pipeline, declared once: producer, broker, consumer and tools
import it from here.

A producer submits work as *frames*: one ring record holding one or more items. A frame is a
header, an array of fixed-size item headers, all items' token ids back to back (int32), then
all payloads back to back. One frame per batch is what lets a batch submit be three copies
(headers, tokens, payloads) instead of three per item.

    frame body:  FRAME_HEADER | ITEM_HEADER x item_count | int32 x token_count | payload bytes
                 | shape chains (chain_bytes, usually 0)

Item i's tokens start at the sum of the lengths before it; its payload likewise. Token ids
start 16-byte aligned (the header sizes are multiples of 16 and ring records are 16-aligned),
so a reader maps them as a numpy int32 array without copying.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType, NoReturn, TypeVar

import numpy as np
import xxhash

from pipeline.wire.errors import FrameError, SegmentNameError
from pipeline.wire.shapes import POOL_SIGNATURE
from shm.layout import Field, checked_dtype, field_offset, struct_for

ItemId = NewType("ItemId", int)
ProducerId = NewType("ProducerId", int)

FRAME_MAGIC = b"SBF1"
# Bump when a field below moves or changes meaning; frames of another version are refused.
# 2: chain_bytes (shape lineage, SPEC §4b) in what was reserved.
FRAME_VERSION = 2
# Item ids are (producer id << 40) | sequence: 2**40 items per producer (a trillion) and
# 2**24 producer ids (16 million registrations) both outlast any run.
ITEM_ID_SEQ_BITS = 40
MAX_PRODUCER_ID = (1 << (64 - ITEM_ID_SEQ_BITS)) - 1
MAX_SEQ = (1 << ITEM_ID_SEQ_BITS) - 1

# Frame header.
#   off  size  field          meaning
#     0     4  magic          b"SBF1"
#     4     2  version        FRAME_VERSION
#     6     2  header_size    FRAME_HEADER_DTYPE.itemsize, so a reader can check it
#     8     4  producer_id    registered producer that wrote the frame
#    12     4  item_count     items in the frame, >= 1
#    16     8  token_count    sum of the items' lengths
#    24     4  payload_bytes  sum of the items' payload sizes
#    28     4  chain_bytes    bytes of shape chains after the payloads (0: none)
FRAME_HEADER_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S4", "b'SBF1'"),
        ("version", 4, "<u2", "FRAME_VERSION"),
        ("header_size", 6, "<u2", "frame header bytes"),
        ("producer_id", 8, "<u4", "producer"),
        ("item_count", 12, "<u4", "items"),
        ("token_count", 16, "<u8", "sum of lengths"),
        ("payload_bytes", 24, "<u4", "sum of payload sizes"),
        ("chain_bytes", 28, "<u4", "bytes of shape chains"),
    ],
    itemsize=32,
)

# Shape chains (SPEC §4b), after a frame's payloads: a producer declares each shape's chain
# of prefix signatures (the signature of components[:1], [:2], ..., the last one the shape's
# own) once per shape per connection, in the first frame it writes after the declaration;
# the broker keeps them in a trie per model and never sees a token of them. Each chain:
#   off  size  field   meaning
#     0     4  model   the model the shape is for
#     4     4  depth   signatures that follow, 1 to MAX_CHAIN_DEPTH
#     8  8 x depth     the chain, uint64 little-endian, outermost prefix first
CHAIN_HEADER_DTYPE = checked_dtype(
    [
        ("model", 0, "<u4", "model id"),
        ("depth", 4, "<u4", "signatures in the chain"),
    ],
    itemsize=8,
)
CHAIN_HEADER_STRUCT = struct_for(CHAIN_HEADER_DTYPE)
SIGNATURE_DTYPE = np.dtype("<u8")
# Prefix levels a chain keeps: a system prompt, tool schema, few-shot block and some 60
# turns of conversation. A deeper chain keeps its first MAX_CHAIN_DEPTH - 1 levels and its
# shape's own signature (the shape hangs one level up from where it would: ordering is a
# little coarser there, nothing else changes).
MAX_CHAIN_DEPTH = 64

# Item header, one per item, right after the frame header.
#   off  size  field       meaning
#     0     8  item_id     (producer_id << 40) | seq: unique across producers
#     8     8  seq         per-producer sequence, from 0, no gaps
#    16     8  signature   the shape (SPEC §1)
#    24     8  submit_ns   time.monotonic_ns() at submit (one clock per machine), for latency
#    32     4  model       model id
#    36     4  length      token count, >= 1
#    40     4  prefix_len  leading tokens the shape's components cover (cache accounting only)
#    44     4  payload_len opaque payload bytes returned with the result
ITEM_HEADER_DTYPE = checked_dtype(
    [
        ("item_id", 0, "<u8", "unique item id"),
        ("seq", 8, "<u8", "per-producer sequence"),
        ("signature", 16, "<u8", "shape signature"),
        ("submit_ns", 24, "<u8", "submit time, monotonic ns"),
        ("model", 32, "<u4", "model id"),
        ("length", 36, "<u4", "tokens"),
        ("prefix_len", 40, "<u4", "prefix tokens"),
        ("payload_len", 44, "<u4", "payload bytes"),
    ],
    itemsize=48,
)
FRAME_HEADER_SIZE_BYTES = FRAME_HEADER_DTYPE.itemsize
ITEM_HEADER_SIZE_BYTES = ITEM_HEADER_DTYPE.itemsize
TOKEN_DTYPE = np.dtype("<i4")
TOKEN_SIZE_BYTES = TOKEN_DTYPE.itemsize
assert FRAME_HEADER_SIZE_BYTES % 16 == 0 and ITEM_HEADER_SIZE_BYTES % 16 == 0

FRAME_HEADER_STRUCT = struct_for(FRAME_HEADER_DTYPE)
ITEM_HEADER_STRUCT = struct_for(ITEM_HEADER_DTYPE)
# Frame header and one item header packed in one call: the single-item submit path.
SINGLE_ITEM_FRAME_STRUCT = struct.Struct("<" + FRAME_HEADER_STRUCT.format[1:] + ITEM_HEADER_STRUCT.format[1:])
assert SINGLE_ITEM_FRAME_STRUCT.size == FRAME_HEADER_SIZE_BYTES + ITEM_HEADER_SIZE_BYTES


def frame_size_bytes(item_count: int, token_count: int, payload_bytes: int, chain_bytes: int = 0) -> int:
    """Body size of a frame holding these items (and shape chains)."""
    return (
        FRAME_HEADER_SIZE_BYTES
        + item_count * ITEM_HEADER_SIZE_BYTES
        + token_count * TOKEN_SIZE_BYTES
        + payload_bytes
        + chain_bytes
    )


def encode_chains(chains: list[tuple[int, tuple[int, ...]]]) -> bytes:
    """The chain section of a frame: each (model, chain) as CHAIN_HEADER then the chain."""
    parts = []
    for model, chain in chains:
        assert 1 <= len(chain) <= MAX_CHAIN_DEPTH, len(chain)
        parts.append(CHAIN_HEADER_STRUCT.pack(model, len(chain)))
        parts.append(np.asarray(chain, dtype=SIGNATURE_DTYPE).tobytes())
    return b"".join(parts)


_POOL_REFUSED = "is the solitary pool's own signature, which no producer may use"


def decode_chains(section: np.ndarray, where: str = "chains") -> list[tuple[int, tuple[int, ...]]]:
    """A frame's chain section as (model, chain) pairs; FrameError naming the byte offset
    for one that does not fill it exactly or breaks the limits."""
    chains = []
    at, size = 0, section.shape[0]
    while at < size:
        if at + CHAIN_HEADER_DTYPE.itemsize > size:
            raise FrameError(f"{where}: a chain header at byte {at} runs past the section's {size} bytes")
        model, depth = CHAIN_HEADER_STRUCT.unpack_from(section, at)
        end = at + CHAIN_HEADER_DTYPE.itemsize + depth * SIGNATURE_DTYPE.itemsize
        if not 1 <= depth <= MAX_CHAIN_DEPTH or end > size:
            raise FrameError(f"{where}: the chain at byte {at} has depth {depth} (1 to {MAX_CHAIN_DEPTH}) and "
                             f"would end at byte {end} of {size}")
        signatures = section[at + CHAIN_HEADER_DTYPE.itemsize:end].view(SIGNATURE_DTYPE)
        if (signatures == np.uint64(POOL_SIGNATURE)).any():
            raise FrameError(f"{where}: the chain at byte {at} holds signature {POOL_SIGNATURE:#018x}, which "
                             f"{_POOL_REFUSED}")
        chains.append((int(model), tuple(int(s) for s in signatures)))
        at = end
    return chains


def make_item_id(producer_id: int, seq: int) -> ItemId:
    return ItemId((producer_id << ITEM_ID_SEQ_BITS) | seq)


@dataclass(slots=True)
class Frame:
    """A parsed frame: zero-copy views into the ring record it came from.

    `items` is a structured array (ITEM_HEADER_DTYPE), `tokens` every item's token ids back to
    back, `token_starts[i]` where item i's tokens begin in `tokens` (length item_count + 1),
    `payloads` every payload back to back, `payload_starts` likewise.
    """

    producer_id: int
    items: np.ndarray
    tokens: np.ndarray
    token_starts: np.ndarray
    payloads: np.ndarray
    payload_starts: np.ndarray
    chain_section: np.ndarray  # the shape chains' bytes (`decode_chains`); empty: none

    def item_tokens(self, i: int) -> np.ndarray:
        return self.tokens[self.token_starts[i]:self.token_starts[i + 1]]

    def item_payload(self, i: int) -> bytes:
        return self.payloads[self.payload_starts[i]:self.payload_starts[i + 1]].tobytes()


def parse_frame(body: np.ndarray, where: str = "frame", producer_id: int | None = None) -> Frame:
    """Parse and validate a frame from a uint8 view, without copying token data.

    Everything is checked against everything else (magic, version, sizes, the sums of the
    item lengths and payload sizes, each item's id against its producer and sequence, the
    sequences consecutive, prefixes within their items) so a record written by anything
    else is refused with FrameError naming `where` and the byte offset, never misread.
    `producer_id`: the producer whose ring the record came from; a frame that names another
    is refused (stored under that id, its items would pass for the other producer's, whose
    own would then be skipped as already stored).
    """
    size = body.shape[0]
    if size < FRAME_HEADER_SIZE_BYTES:
        raise FrameError(f"{where}: {size} bytes, shorter than a frame header ({FRAME_HEADER_SIZE_BYTES})")
    magic, version, header_size, frame_producer, count, token_count, payload_bytes, chain_bytes = (
        FRAME_HEADER_STRUCT.unpack_from(body, 0)
    )
    if magic != FRAME_MAGIC or version != FRAME_VERSION or header_size != FRAME_HEADER_SIZE_BYTES:
        raise FrameError(
            f"{where}: header at offset 0 has magic {magic!r}, version {version}, header size "
            f"{header_size}; expected {FRAME_MAGIC!r}, {FRAME_VERSION}, {FRAME_HEADER_SIZE_BYTES}"
        )
    expected = frame_size_bytes(count, token_count, payload_bytes, chain_bytes)
    if count == 0 or expected != size:
        raise FrameError(
            f"{where}: {count} items, {token_count} tokens, {payload_bytes} payload bytes and {chain_bytes} "
            f"chain bytes need {expected} bytes; the record has {size}"
        )
    items_end = FRAME_HEADER_SIZE_BYTES + count * ITEM_HEADER_SIZE_BYTES
    tokens_end = items_end + token_count * TOKEN_SIZE_BYTES
    items = body[FRAME_HEADER_SIZE_BYTES:items_end].view(ITEM_HEADER_DTYPE)
    lengths = items["length"]
    payload_lens = items["payload_len"]
    token_starts = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(lengths, out=token_starts[1:])
    payload_starts = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(payload_lens, out=payload_starts[1:])
    if token_starts[-1] != token_count or payload_starts[-1] != payload_bytes or lengths.min() == 0:
        raise FrameError(
            f"{where}: item lengths sum to {int(token_starts[-1])} (header says {token_count}), "
            f"payloads to {int(payload_starts[-1])} (header says {payload_bytes}), "
            f"shortest item {int(lengths.min())} tokens (must be >= 1); item headers at offset "
            f"{FRAME_HEADER_SIZE_BYTES}"
        )
    if producer_id is not None and frame_producer != producer_id:
        raise FrameError(f"{where}: header at offset 8 names producer {frame_producer}; the record is in "
                         f"producer {producer_id}'s ring")
    _check_item_ids(items, frame_producer, count, where)
    pooled = items["signature"] == np.uint64(POOL_SIGNATURE)
    if pooled.any():
        _item_refused(items, int(np.flatnonzero(pooled)[0]), "signature", _POOL_REFUSED, where)
    return Frame(
        producer_id=frame_producer,
        items=items,
        tokens=body[items_end:tokens_end].view(TOKEN_DTYPE),
        token_starts=token_starts,
        payloads=body[tokens_end:tokens_end + payload_bytes],
        payload_starts=payload_starts,
        chain_section=body[tokens_end + payload_bytes:],
    )


_ITEM_FIELD_AT = {name: ITEM_HEADER_DTYPE.fields[name][1] for name in ITEM_HEADER_DTYPE.names}


def _check_item_ids(items: np.ndarray, producer_id: int, count: int, where: str) -> None:
    """FrameError naming the first item (and its header's byte offset) whose id is not
    (producer_id << ITEM_ID_SEQ_BITS) | seq, whose sequence does not follow the one before
    it or passes MAX_SEQ, or whose prefix is longer than the item: a producer writes none of
    these, and the store would misread them (the recovery scan takes an entry whose prefix
    is longer than its tokens for damage; StoredSeqs relies on sequences without gaps)."""
    if producer_id > MAX_PRODUCER_ID:
        raise FrameError(f"{where}: header at offset 8 names producer {producer_id}, above the largest "
                         f"producer id {MAX_PRODUCER_ID}")
    base = producer_id << ITEM_ID_SEQ_BITS
    seqs = items["seq"]
    # NOTE: the well-formed frame takes one pass (scalars for a single item): the checks
    # field by field below cost 6.4 us a single-item frame, this 0.4 us, on a parse_frame of
    # 7.6 us (timeit of parse_frame on tests/broker/broker_frames.make_frame's bodies).
    if count == 1:
        item_id, seq, _sig, _ns, _model, length, prefix_len, _payload = ITEM_HEADER_STRUCT.unpack(items.tobytes())
        if seq <= MAX_SEQ and item_id == base | seq and prefix_len <= length:
            return
    elif (int(seqs[-1]) <= MAX_SEQ and int(seqs[-1]) - int(seqs[0]) == count - 1 and (np.diff(seqs) == 1).all()
          and (items["item_id"] == (seqs | np.uint64(base))).all() and (items["prefix_len"] <= items["length"]).all()):
        return
    checks = (
        ("seq", seqs > MAX_SEQ, f"is above the largest sequence {MAX_SEQ}"),
        ("item_id", items["item_id"] != (seqs & np.uint64(MAX_SEQ)) | np.uint64(base),
         f"is not (producer {producer_id} << {ITEM_ID_SEQ_BITS}) | seq"),
        ("prefix_len", items["prefix_len"] > items["length"], "is longer than the item's length"),
    )
    for name, bad, why in checks:
        if bad.any():
            _item_refused(items, int(np.flatnonzero(bad)[0]), name, why, where)
    if count > 1:
        gaps = np.flatnonzero(np.diff(seqs) != 1)
        if gaps.size:
            _item_refused(items, int(gaps[0]) + 1, "seq", f"does not follow seq {int(seqs[gaps[0]])}", where)


def _item_refused(items: np.ndarray, index: int, name: str, why: str, where: str) -> NoReturn:
    offset = FRAME_HEADER_SIZE_BYTES + index * ITEM_HEADER_SIZE_BYTES + _ITEM_FIELD_AT[name]
    raise FrameError(f"{where}: item {index}: {name} {int(items[name][index])} at offset {offset} {why}")


# ---------------------------------------------------------------------------------------------
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
# ENTRY_LIVE; completions, the commit boundary and the seal are records of the segment's
# journal (SEGMENT_JOURNAL_DTYPE, a file beside it). Why: a sector being written when the
# power goes may read back as garbage (RELIABILITY.md), and an in-place 4-byte tombstone or
# header word shares its sector with acknowledged bytes. For the same reason, in `power`
# each synced group of appends starts on a SYNC_ALIGN_BYTES boundary (zeros before it), so
# an append never rewrites a sector that holds synced bytes.

SEGMENT_MAGIC = b"SBSEGMT1"
# Bump when a field below moves or changes meaning; segments of another version are refused
# (version 1 rewrote tombstones and header words in place: no migration, see above).
# Version 3: the entry's shape (`signature`) in what was reserved; a version 2 entry has
# zeros there, which would read as a shape.
SEGMENT_VERSION = 3
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
# `power` starts each synced group of appends (and of journal records) at a multiple of
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
#    64     4  sealed             0 (version 2: the seal is a journal record)
#    72     8  entry_count        0 (version 2: the boundary is a journal record)
#    80     8  data_end           SEGMENT_HEADER_SIZE_BYTES, the boundary of an empty segment
#    88     8  deleted_count      0 (version 2: completions are journal records)
#    96     8  boundary_checksum  xxh3-64 of bytes 72..88 (entry_count, data_end)
# Bytes 64..104 are written once, at creation, as an empty segment's boundary: the scan's
# boundary when the journal holds none.
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


# Where segments live under a data directory (the whole tree is documented in
# pipeline.broker.storage.paths): names sort by model, shape, lane and sequence.
#
#     SEGMENTS_DIR/m{model:05d}/s{signature:016x}/l{lane:04d}-{segment_seq:010d}.seg
#
# This is the one definition of the names: `segment_relpath` formats them and the `parse_*`
# functions below read them back, and the limits are what the fixed-width fields hold. A key
# past its limit would make a name the parser does not read back (m123456), and its items
# would be stored and then skipped at restart: so every limit is checked where a segment is
# named (`segment_relpath` raises SegmentNameError) and exported for the edges (producers,
# registration, configuration) to check first.
SEGMENTS_DIR = "segments"
SEGMENT_SUFFIX = ".seg"
# A segment's journal: its path plus this suffix (SEGMENT_JOURNAL_DTYPE records).
SEGMENT_JOURNAL_SUFFIX = ".journal"
# The broker's state file in a data directory (pipeline.broker.service.BrokerState: JSON with
# the next producer id and the start count, "generation"): a witness that a broker ran here,
# so that a store whose catalog and segments are both gone is not taken for a fresh one.
BROKER_STATE_NAME = "broker-state.json"
MODEL_ID_DIGITS = 5
LANE_ID_DIGITS = 4
SEGMENT_SEQ_DIGITS = 10
SIGNATURE_HEX_DIGITS = 16
# Model ids a model directory name holds: m00000 .. m99999. Every `max_models` setting
# (producer limits, the broker's configuration) is at most this.
MODEL_ID_LIMIT = 10**MODEL_ID_DIGITS
# Model ids index per-model broker state; one node serves a handful, 1,024 leaves room. The
# default of both the producer's and the broker's `max_models`.
DEFAULT_MAX_MODELS = 1024
# Lane ids (per shape) a segment file name holds: l0000 .. l9999 (LaneConfig.max_lanes).
LANE_ID_LIMIT = 10**LANE_ID_DIGITS
# Segment sequences per lane a file name holds: 10 billion rotations, never reached.
SEGMENT_SEQ_LIMIT = 10**SEGMENT_SEQ_DIGITS
# Signatures are unsigned 64-bit: 16 hex digits always hold them.
SIGNATURE_LIMIT = 16**SIGNATURE_HEX_DIGITS

_MODEL_DIR_RE = re.compile(rf"^m(\d{{{MODEL_ID_DIGITS}}})$")
_SHAPE_DIR_RE = re.compile(rf"^s([0-9a-f]{{{SIGNATURE_HEX_DIGITS}}})$")
_SEGMENT_FILE_RE = re.compile(rf"^l(\d{{{LANE_ID_DIGITS}}})-(\d{{{SEGMENT_SEQ_DIGITS}}}){re.escape(SEGMENT_SUFFIX)}$")


def check_segment_keys(model: int, signature: int, lane: int, segment_seq: int) -> None:
    """SegmentNameError unless every key fits its field of the segment file names."""
    for what, value, limit in (("model id", model, MODEL_ID_LIMIT), ("lane id", lane, LANE_ID_LIMIT),
                               ("segment sequence", segment_seq, SEGMENT_SEQ_LIMIT),
                               ("signature", signature, SIGNATURE_LIMIT)):
        if not 0 <= value < limit:
            raise SegmentNameError(
                f"{what} {value} does not fit a segment file name: {what}s are 0 .. {limit - 1} "
                f"({SEGMENTS_DIR}/m{{model:05d}}/s{{signature:016x}}/l{{lane:04d}}-{{seq:010d}}{SEGMENT_SUFFIX})"
            )


def segment_relpath(model: int, signature: int, lane: int, segment_seq: int) -> str:
    """A segment's path below SEGMENTS_DIR: m{model}/s{signature}/l{lane}-{seq}.seg.
    SegmentNameError for a key past its limit (see above)."""
    if not (0 <= model < MODEL_ID_LIMIT and 0 <= lane < LANE_ID_LIMIT and 0 <= segment_seq < SEGMENT_SEQ_LIMIT
            and 0 <= signature < SIGNATURE_LIMIT):
        check_segment_keys(model, signature, lane, segment_seq)  # raises, naming the value
    return os.path.join(
        f"m{model:05d}", f"s{signature:016x}", f"l{lane:04d}-{segment_seq:010d}{SEGMENT_SUFFIX}"
    )


def parse_model_dir(name: str) -> int | None:
    """The model id a model directory name holds (m00042 -> 42), or None if it is not one."""
    match = _MODEL_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def parse_shape_dir(name: str) -> int | None:
    """The signature a shape directory name holds, or None if it is not one."""
    match = _SHAPE_DIR_RE.match(name)
    return int(match.group(1), 16) if match else None


def parse_segment_file(name: str) -> tuple[int, int] | None:
    """(lane id, segment sequence) a segment file name holds, or None if it is not one."""
    match = _SEGMENT_FILE_RE.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def parse_segment_relpath(relpath: str) -> tuple[int, int, int, int] | None:
    """(model, signature, lane, segment_seq) of a path that ends in a segment's three name
    components (below SEGMENTS_DIR or the quarantine), or None."""
    parts = os.path.normpath(relpath).split(os.sep)
    if len(parts) < 3:
        return None
    model, signature, name = parse_model_dir(parts[-3]), parse_shape_dir(parts[-2]), parse_segment_file(parts[-1])
    if model is None or signature is None or name is None:
        return None
    return model, signature, name[0], name[1]


# ---------------------------------------------------------------------------------------------
# The segment catalog (DATA_DIR/segments.catalog): what the store holds, so that a segment
# file that disappears is noticed. One record per segment lifecycle event, never per item;
# appended in place into preallocated space (zeros past the last record), rewritten whole
# (compacted) at recovery and when it grows. A record whose checksum fails is damage; one
# that is the last non-zero record is a torn append and is ignored. The file has a mirror,
# CATALOG_MIRROR_FILE, of the same layout and the same records at the same offsets, written
# after the catalog's fdatasync in `power` (pipeline/broker/storage/catalog.py says why).
#   off  size  field        meaning
#     0     4  magic        b"SBC1"
#     4     2  version      CATALOG_VERSION
#     6     2  kind         CATALOG_CREATED / _SEALED / _DELETED / _QUARANTINED / _MISSING
#     8     4  model        the segment's keys
#    12     4  lane
#    16     8  signature
#    24     8  segment_seq
#    32     8  entry_count  SEALED: entries in the segment; MISSING: as last known, or
#                           CATALOG_COUNT_UNKNOWN (it was still open); else zero
#    40     8  time_ns      wall clock when recorded (time.time_ns)
#    48     8  reserved     zero
#    56     8  checksum     xxh3-64 of bytes 0..56
CATALOG_FILE = "segments.catalog"
CATALOG_MIRROR_FILE = CATALOG_FILE + ".mirror"
CATALOG_MAGIC = b"SBC1"
# Bump when a field below moves or changes meaning.
CATALOG_VERSION = 1
CATALOG_CREATED = 1  # renamed into place (recorded after the rename)
CATALOG_SEALED = 2  # no more appends; entry_count is final (recorded before the seal)
CATALOG_DELETED = 3  # fully tombstoned (recorded before the unlink)
CATALOG_QUARANTINED = 4  # moved to quarantine/ (recorded before the move)
CATALOG_MISSING = 5  # a note file in quarantine/: recovery found the segment gone
CATALOG_KIND_NAMES = {CATALOG_CREATED: "created", CATALOG_SEALED: "sealed", CATALOG_DELETED: "deleted",
                      CATALOG_QUARANTINED: "quarantined", CATALOG_MISSING: "missing"}
CATALOG_COUNT_UNKNOWN = (1 << 64) - 1
CATALOG_RECORD_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S4", "b'SBC1'"),
        ("version", 4, "<u2", "CATALOG_VERSION"),
        ("kind", 6, "<u2", "lifecycle event"),
        ("model", 8, "<u4", "model id"),
        ("lane", 12, "<u4", "lane id"),
        ("signature", 16, "<u8", "shape"),
        ("segment_seq", 24, "<u8", "segment sequence"),
        ("entry_count", 32, "<u8", "entries (sealed, missing)"),
        ("time_ns", 40, "<u8", "wall clock"),
        ("checksum", 56, "<u8", "xxh3 of bytes 0..56"),
    ],
    itemsize=64,
)
CATALOG_RECORD_SIZE_BYTES = CATALOG_RECORD_DTYPE.itemsize
CATALOG_CHECKSUM_FROM = field_offset(CATALOG_RECORD_DTYPE, "checksum")
CATALOG_RECORD_STRUCT = struct_for(CATALOG_RECORD_DTYPE)


# ---------------------------------------------------------------------------------------------
# A segment's journal (its path + SEGMENT_JOURNAL_SUFFIX): what changes about a segment once
# its entries are written, appended and never rewritten (storage/journal.py). Completions
# (one record per completed entry), the commit boundary (after each group commit) and the
# seal. Records are 32 bytes at multiples of 32 from offset 0; zeros are preallocated space
# or, in `power`, the padding to the next SYNC_ALIGN_BYTES boundary before each synced group
# of records. A record whose checksum fails is damage when a valid record follows it, and a
# torn append (ignored) when none does.
#   off  size  field     meaning
#     0     4  magic     b"SBJ1"
#     4     2  version   SEGMENT_JOURNAL_VERSION
#     6     2  kind      JOURNAL_COMPLETED / _BOUNDARY / _SEALED
#     8     8  value     COMPLETED: the entry's offset; BOUNDARY, SEALED: entry_count
#    16     8  value2    BOUNDARY: data_end (the end of the entries it counts); else zero
#    24     8  checksum  `journal_checksums` of bytes 0..24, seeded with the segment's
#                        sequence and lane (a journal put beside another segment fails)
SEGMENT_JOURNAL_MAGIC = b"SBJ1"
# Bump when a field above moves or changes meaning.
SEGMENT_JOURNAL_VERSION = 1
JOURNAL_COMPLETED = 1  # the entry at `value` is done (was a tombstone in place, version 1)
JOURNAL_BOUNDARY = 2  # entries [SEGMENT_HEADER_SIZE_BYTES, value2) are written: `value` of them
JOURNAL_SEALED = 3  # no more appends; `value` entries in all
JOURNAL_KIND_NAMES = {JOURNAL_COMPLETED: "completed", JOURNAL_BOUNDARY: "boundary", JOURNAL_SEALED: "sealed"}
SEGMENT_JOURNAL_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S4", "b'SBJ1'"),
        ("version", 4, "<u2", "SEGMENT_JOURNAL_VERSION"),
        ("kind", 6, "<u2", "completed / boundary / sealed"),
        ("value", 8, "<u8", "offset or entry count"),
        ("value2", 16, "<u8", "data_end or zero"),
        ("checksum", 24, "<u8", "journal_checksums of bytes 0..24"),
    ],
    itemsize=32,
)
JOURNAL_RECORD_SIZE_BYTES = SEGMENT_JOURNAL_DTYPE.itemsize
assert SYNC_ALIGN_BYTES % JOURNAL_RECORD_SIZE_BYTES == 0
# The first word of a record (magic, version, kind) as one little-endian uint64.
JOURNAL_HEAD_WORD_BASE = int.from_bytes(SEGMENT_JOURNAL_MAGIC, "little") | SEGMENT_JOURNAL_VERSION << 32
_MIX_PRIMES = tuple(np.uint64(p) for p in (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9))
_MIX_SHIFTS = (np.uint64(31), np.uint64(29))


def journal_checksums(words: np.ndarray, seed: int) -> np.ndarray:
    """Checksums of journal records given as an (n, 3) uint64 array of their first three
    words: a 64-bit multiply-xorshift mix (the finaliser of xxh64) per word, one numpy pass
    for any n (uint64 array products wrap without a warning).
    NOTE: per-record xxh3 through the Python binding was rejected: one call per completion,
    about 0.2 us each, where this is about 5 us per batch of 64."""
    h = words[:, 0] ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    for column in range(3):
        if column:
            h ^= words[:, column]
        h *= _MIX_PRIMES[column]
        h ^= h >> _MIX_SHIFTS[0]
    h *= _MIX_PRIMES[0]
    h ^= h >> _MIX_SHIFTS[1]
    return h


def journal_seed(model: int, lane: int, segment_seq: int) -> int:
    """The checksum seed of a segment's journal (SEGMENT_JOURNAL_DTYPE): from its keys, so a
    journal beside the wrong segment fails its checksums instead of completing foreign offsets."""
    return (segment_seq * 0x100000001B3 ^ lane << 40 ^ model << 20) & 0xFFFFFFFFFFFFFFFF


def journal_completions(data: bytes, seed: int) -> tuple[np.ndarray, int]:
    """The COMPLETED offsets among the whole, valid records at the start of `data` (bytes of
    a journal from a record boundary on, zeros skipped as padding), and how many bytes they
    span: a reader following a journal the broker is appending to stops at the first record
    that fails its checks (one being written, or damage) and reads on from there next time."""
    whole = len(data) // JOURNAL_RECORD_SIZE_BYTES
    words = np.frombuffer(data, dtype="<u8", count=whole * 4).reshape(whole, 4)
    nonzero = words.any(axis=1)
    good = ((words[:, 0] & np.uint64(0xFFFFFFFFFFFF)) == np.uint64(JOURNAL_HEAD_WORD_BASE)) & (
        journal_checksums(words[:, :3], seed) == words[:, 3])
    bad = np.flatnonzero(nonzero & ~good)
    stop = int(bad[0]) if bad.size else int(np.flatnonzero(nonzero)[-1]) + 1 if nonzero.any() else 0
    kinds = words[:stop, 0] >> np.uint64(48)
    chosen = good[:stop] & (kinds == np.uint64(JOURNAL_COMPLETED))
    return words[:stop, 1][chosen].astype(np.int64), stop * JOURNAL_RECORD_SIZE_BYTES


# ---------------------------------------------------------------------------------------------
# The lineage file (DATA_DIR/shapes.lineage): the shapes' chains (SPEC §4b), so that shapes
# recovered from disk after a restart come back in prefix order although no producer sends
# their chains again. One record per trie node newly declared (a prefix level or a shape's
# own signature, with its parent), not per chain: a conversation of 60 turns is 60 records,
# where its 60 chains hold 1,830 signatures. A file header, then records appended in place
# into preallocated space (zeros past the last), rewritten at recovery holding only the
# nodes of live shapes' chains. A record whose checksum fails is damage; the last non-zero
# one is a torn append, ignored.
#   header:  off  size  field        meaning
#              0     8  magic        b"SBLINEA1"
#              8     4  version      LINEAGE_VERSION
#             12     4  record_size  LINEAGE_RECORD_SIZE_BYTES (the header takes one slot)
#             16     8  created_ns   wall clock when written (time.time_ns)
#             56     8  checksum     xxh3-64 of bytes 0..56
#   record:   off  size  field        meaning
#              0     2  kind         LINEAGE_NODE (zero: preallocated space)
#              2     2  depth        the node's chain level, 1 to MAX_CHAIN_DEPTH
#              4     4  model        model id
#              8     8  signature    the node: the prefix signature at that level
#             16     8  parent       the signature one level up (zero at depth 1)
#             24     8  time_ns      wall clock when recorded
#             56     8  checksum     xxh3-64 of bytes 0..56
LINEAGE_FILE = "shapes.lineage"
LINEAGE_MAGIC = b"SBLINEA1"
# Bump when a field below moves or changes meaning; a file of another version is not read
# (its chains are lost: those shapes come back as chains of one) and is rewritten.
LINEAGE_VERSION = 1
LINEAGE_NODE = 1
LINEAGE_HEADER_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S8", "b'SBLINEA1'"),
        ("version", 8, "<u4", "LINEAGE_VERSION"),
        ("record_size", 12, "<u4", "record bytes"),
        ("created_ns", 16, "<u8", "wall clock"),
        ("checksum", 56, "<u8", "xxh3 of bytes 0..56"),
    ],
    itemsize=64,
)
LINEAGE_RECORD_DTYPE = checked_dtype(
    [
        ("kind", 0, "<u2", "LINEAGE_NODE"),
        ("depth", 2, "<u2", "chain level"),
        ("model", 4, "<u4", "model id"),
        ("signature", 8, "<u8", "the node's prefix signature"),
        ("parent", 16, "<u8", "the level above's signature"),
        ("time_ns", 24, "<u8", "wall clock"),
        ("checksum", 56, "<u8", "xxh3 of bytes 0..56"),
    ],
    itemsize=64,
)
LINEAGE_RECORD_SIZE_BYTES = LINEAGE_RECORD_DTYPE.itemsize
assert LINEAGE_HEADER_DTYPE.itemsize == LINEAGE_RECORD_SIZE_BYTES  # the header takes slot 0
LINEAGE_CHECKSUM_FROM = field_offset(LINEAGE_RECORD_DTYPE, "checksum")
assert LINEAGE_CHECKSUM_FROM == field_offset(LINEAGE_HEADER_DTYPE, "checksum")
LINEAGE_HEADER_STRUCT = struct_for(LINEAGE_HEADER_DTYPE)
LINEAGE_RECORD_STRUCT = struct_for(LINEAGE_RECORD_DTYPE)



# ---------------------------------------------------------------------------------------------
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
#     8     8  segment_seq  segment key: sequence within the lane
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
