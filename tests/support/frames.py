"""Builds producer frames (pipeline.wire.layouts) for the broker tests, without a ring."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.wire.layouts.frames import (
    FRAME_HEADER_SIZE_BYTES,
    FRAME_HEADER_STRUCT,
    FRAME_MAGIC,
    FRAME_VERSION,
    ITEM_HEADER_DTYPE,
    ITEM_HEADER_SIZE_BYTES,
    Frame,
    encode_chains,
    frame_size_bytes,
    make_item_id,
    parse_frame,
)


def token_ids(item_id: int, length: int) -> np.ndarray:
    """Deterministic token ids for an item, so a test can check what the store gives back."""
    return ((np.arange(length, dtype=np.int64) * 7919 + item_id) % 50_000).astype(np.int32)


def make_frame(
    producer_id: int,
    first_seq: int,
    shapes: Sequence[tuple[int, int]],
    lengths: Sequence[int],
    submit_ns: Sequence[int] | int = 0,
    payloads: Sequence[bytes] | None = None,
    chains: Sequence[tuple[int, tuple[int, ...]]] = (),
) -> Frame:
    """A parsed frame of len(lengths) items with seqs first_seq, first_seq + 1, ...; item i
    has shape shapes[i] = (model, signature), prefix_len = length // 2, and tokens
    token_ids(item_id, length); `chains` (model, chain) go in its chain section."""
    count = len(lengths)
    assert len(shapes) == count >= 1
    payloads = list(payloads) if payloads is not None else [b""] * count
    headers = np.zeros(count, dtype=ITEM_HEADER_DTYPE)
    seqs = np.arange(first_seq, first_seq + count, dtype=np.uint64)
    headers["seq"] = seqs
    headers["item_id"] = [make_item_id(producer_id, int(s)) for s in seqs]
    headers["model"] = [m for m, _ in shapes]
    headers["signature"] = np.array([s for _, s in shapes], dtype=np.uint64)
    headers["submit_ns"] = submit_ns
    headers["length"] = lengths
    headers["prefix_len"] = [length // 2 for length in lengths]
    headers["payload_len"] = [len(p) for p in payloads]
    tokens = np.concatenate([token_ids(int(i), int(n)) for i, n in zip(headers["item_id"], lengths)])
    blob = b"".join(payloads)
    section = encode_chains(list(chains)) if chains else b""
    body = bytearray(frame_size_bytes(count, int(tokens.size), len(blob), len(section)))
    FRAME_HEADER_STRUCT.pack_into(
        body, 0, FRAME_MAGIC, FRAME_VERSION, FRAME_HEADER_SIZE_BYTES, producer_id, count,
        int(tokens.size), len(blob), len(section),
    )
    items_end = FRAME_HEADER_SIZE_BYTES + count * ITEM_HEADER_SIZE_BYTES
    body[FRAME_HEADER_SIZE_BYTES:items_end] = headers.tobytes()
    tokens_end = items_end + tokens.nbytes
    body[items_end:tokens_end] = tokens.astype("<i4").tobytes()
    body[tokens_end:tokens_end + len(blob)] = blob
    body[tokens_end + len(blob):] = section
    return parse_frame(np.frombuffer(bytes(body), dtype=np.uint8))
