"""Frames: the records a producer writes into its ring, and item ids.

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

import struct
from dataclasses import dataclass
from typing import NewType, NoReturn

import numpy as np

from pipeline.wire.errors import FrameError
from pipeline.wire.shapes import POOL_SIGNATURE
from shm.layout import checked_dtype, struct_for

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
