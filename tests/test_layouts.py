"""Layouts shared by producer, broker, consumer and tools: descriptors round-trip and are
checked when read; segment names have one format, one parser and checked limits."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.errors import FrameError, SegmentNameError
from pipeline.layouts import (
    CATALOG_RECORD_DTYPE,
    DESCRIPTOR_ITEM_DTYPE,
    LANE_ID_LIMIT,
    MODEL_ID_LIMIT,
    SEGMENT_SEQ_LIMIT,
    SIGNATURE_LIMIT,
    descriptor_size_bytes,
    parse_descriptor,
    parse_model_dir,
    parse_segment_file,
    parse_segment_relpath,
    segment_relpath,
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


# ------------------------------------------------------------------ segment names and limits

def test_segment_names_round_trip_at_every_limit():
    for keys in [(0, 0, 0, 0), (MODEL_ID_LIMIT - 1, SIGNATURE_LIMIT - 1, LANE_ID_LIMIT - 1, SEGMENT_SEQ_LIMIT - 1),
                 (42, 0xDEADBEEF, 7, 123)]:
        assert parse_segment_relpath(segment_relpath(*keys)) == keys


@pytest.mark.parametrize("index,limit,what", [(0, MODEL_ID_LIMIT, "model id"), (1, SIGNATURE_LIMIT, "signature"),
                                              (2, LANE_ID_LIMIT, "lane id"), (3, SEGMENT_SEQ_LIMIT, "segment sequence")])
def test_a_key_one_past_its_limit_is_refused_naming_the_value(index, limit, what):
    # Issue 11: model 123456 was stored under m123456/ and skipped at restart (m(\d{5})).
    keys = [1, 2, 3, 4]
    keys[index] = limit - 1
    segment_relpath(*keys)  # at the limit: fits
    keys[index] = limit
    with pytest.raises(SegmentNameError, match=f"{what} {limit} does not fit"):
        segment_relpath(*keys)
    keys[index] = -1
    with pytest.raises(SegmentNameError):
        segment_relpath(*keys)


def test_limits_are_what_the_names_hold():
    assert (MODEL_ID_LIMIT, LANE_ID_LIMIT, SEGMENT_SEQ_LIMIT) == (100_000, 10_000, 10**10)
    assert parse_model_dir("m99999") == 99999 and parse_model_dir("m123456") is None
    assert parse_model_dir("m0042") is None and parse_model_dir("m00042") == 42
    assert parse_segment_file("l9999-0000000001.seg") == (9999, 1) and parse_segment_file("l10000-0000000001.seg") is None
    assert parse_segment_file("l0001-0000000001.seg.creating") is None


def test_catalog_record_layout():
    assert CATALOG_RECORD_DTYPE.itemsize == 64 and CATALOG_RECORD_DTYPE.fields["checksum"][1] == 56
