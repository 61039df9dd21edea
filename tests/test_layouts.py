"""Layouts shared by producer, broker, consumer and tools: descriptors round-trip and are
checked when read."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.errors import FrameError
from pipeline.layouts import (
    DESCRIPTOR_ITEM_DTYPE,
    descriptor_size_bytes,
    parse_descriptor,
    write_descriptor,
)


def make_items(count: int) -> np.ndarray:
    items = np.zeros(count, dtype=DESCRIPTOR_ITEM_DTYPE)
    items["lane"] = np.arange(count) % 3
    items["length"] = np.arange(count) + 1
    items["segment_seq"] = 7
    items["offset"] = 4096 + 128 * np.arange(count)
    items["item_id"] = (5 << 40) | np.arange(count)
    return items


def test_descriptor_round_trip():
    items = make_items(5)
    buf = np.zeros(descriptor_size_bytes(5), dtype=np.uint8)
    write_descriptor(buf, 0, batch_id=42, signature=(1 << 64) - 1, model=3, pad_to_tokens=64,
                     dispatch_ns=99, items=items)
    got = parse_descriptor(buf)
    assert (got.batch_id, got.signature, got.model, got.pad_to_tokens, got.dispatch_ns) == (
        42, (1 << 64) - 1, 3, 64, 99)
    assert np.array_equal(got.items, items)
    assert not got.items.flags.owndata  # a view of the record


def test_descriptor_checks():
    buf = np.zeros(descriptor_size_bytes(2), dtype=np.uint8)
    with pytest.raises(FrameError, match="magic"):
        parse_descriptor(buf, where="ring c1 record 0")
    write_descriptor(buf, 0, 1, 2, 3, 8, 0, make_items(2))
    with pytest.raises(FrameError, match="need"):
        parse_descriptor(buf[:-32])
    with pytest.raises(FrameError, match="shorter"):
        parse_descriptor(buf[:10])
