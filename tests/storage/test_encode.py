"""encode_entries against a reference that builds each entry by hand, byte by byte, over
frames of equal-length items (the 2-D copy) and of mixed ones (the entry-at-a-time copy)."""

from __future__ import annotations

import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.storage.encode import encode_entries
from pipeline.wire.layouts.frames import ITEM_HEADER_DTYPE
from pipeline.wire.layouts.segments import ENTRY_CHECKSUM_FROM, ENTRY_HEADER_DTYPE, ENTRY_LIVE, entry_size_bytes


def _frame(lengths: list[int], payload_lens: list[int], seed: int):
    rng = np.random.default_rng(seed)
    items = np.zeros(len(lengths), dtype=ITEM_HEADER_DTYPE)
    items["length"], items["payload_len"] = lengths, payload_lens
    items["item_id"] = rng.integers(0, 2**63, len(lengths), dtype=np.uint64)
    items["seq"] = np.arange(len(lengths))
    items["prefix_len"] = [rng.integers(0, n + 1) for n in lengths]
    items["submit_ns"] = rng.integers(0, 2**62, len(lengths))
    items["signature"] = rng.integers(0, 2**63, len(lengths), dtype=np.uint64)
    tokens = rng.integers(-2**31, 2**31, sum(lengths), dtype=np.int64).astype(np.int32)
    payloads = rng.integers(0, 256, sum(payload_lens), dtype=np.uint8)
    return (items, tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), payloads,
            np.concatenate([[0], np.cumsum(payload_lens)]).astype(np.int64))


def _reference(items, tokens, token_starts, payloads, payload_starts, indices, producer_id: int) -> bytes:
    out = b""
    for i in indices.tolist():
        header = np.zeros(1, dtype=ENTRY_HEADER_DTYPE)
        header["state"], header["producer_id"] = ENTRY_LIVE, producer_id
        for name in ("length", "item_id", "seq", "prefix_len", "payload_len", "submit_ns", "signature"):
            header[name] = items[name][i]
        length, plen = int(items["length"][i]), int(items["payload_len"][i])
        body = (tokens[token_starts[i]:token_starts[i] + length].astype("<i4").tobytes()
                + payloads[payload_starts[i]:payload_starts[i] + plen].tobytes())
        entry = bytearray(header.tobytes() + body)
        entry += bytes(entry_size_bytes(length, plen) - len(entry))
        header["checksum"] = xxhash.xxh3_64_intdigest(bytes(entry[ENTRY_CHECKSUM_FROM:]), seed=length)
        out += header.tobytes() + bytes(entry[ENTRY_HEADER_DTYPE.itemsize:])
    return out


@settings(max_examples=200, deadline=None)
@given(count=st.integers(1, 40), uniform=st.booleans(), length=st.integers(1, 50),
       with_payloads=st.booleans(), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_encoded_entries_match_the_reference_byte_for_byte(count, uniform, length, with_payloads, seed, data):
    rng = np.random.default_rng(seed)
    lengths = [length] * count if uniform else rng.integers(1, 60, count).tolist()
    payload_lens = rng.integers(0, 20, count).tolist() if with_payloads else [0] * count
    frame = _frame(lengths, payload_lens, seed)
    chosen = data.draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=count, unique=True))
    indices = np.array(sorted(chosen) if data.draw(st.booleans()) else chosen, dtype=np.int64)
    encoded = encode_entries(*frame, indices, producer_id=7)
    assert encoded.data.tobytes() == _reference(*frame, indices, producer_id=7)
    sizes = [entry_size_bytes(lengths[i], payload_lens[i]) for i in indices.tolist()]
    assert encoded.sizes.tolist() == sizes
    assert encoded.offsets.tolist() == np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()


def test_a_frame_of_equal_lengths_whose_rows_are_not_at_multiples_still_encodes_exactly():
    # Tokens of equal-length items that do not start at multiples of the length (a frame whose
    # first item is longer): the 2-D copy must not be taken.
    items, tokens, starts, payloads, payload_starts = _frame([5, 3, 3, 3], [0] * 4, seed=1)
    indices = np.array([1, 2, 3])
    encoded = encode_entries(items, tokens, starts, payloads, payload_starts, indices, producer_id=1)
    assert encoded.data.tobytes() == _reference(items, tokens, starts, payloads, payload_starts, indices, 1)
