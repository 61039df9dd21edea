"""Layouts shared by producer, broker, consumer and tools: every header written through its
one definition reads back field by field, by name (so two fields swapped in a table, or in a
positional pack or unpack, fail here); descriptors round-trip and are checked when read;
segment names have one format, one parser and checked limits."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from pipeline.storage.diskio import Durability
from pipeline.storage.paths import make_dirs, segment_path
from pipeline.storage.scan import boundary_checksum
from pipeline.storage.segment import SegmentFile, SegmentKeys, encode_entries, scan_segment
from pipeline.consumer.reader import SegmentReader
from pipeline.wire.errors import FrameError, SegmentNameError
from pipeline.wire.layouts.descriptors import (
    DESCRIPTOR_HEADER_DTYPE,
    DESCRIPTOR_ITEM_DTYPE,
    DESCRIPTOR_MAGIC,
    descriptor_size_bytes,
    parse_descriptor,
    write_descriptor,
)
from pipeline.wire.layouts.frames import (
    FRAME_HEADER_DTYPE,
    FRAME_MAGIC,
    FRAME_VERSION,
    ITEM_HEADER_DTYPE,
    ITEM_ID_SEQ_BITS,
    parse_frame,
)
from pipeline.wire.layouts.names import (
    LANE_ID_LIMIT,
    MODEL_ID_LIMIT,
    SEGMENT_SEQ_LIMIT,
    SIGNATURE_LIMIT,
    parse_model_dir,
    parse_segment_file,
    parse_segment_relpath,
    segment_relpath,
)
from pipeline.wire.layouts.segments import (
    ENTRY_ALIGN_BYTES,
    ENTRY_HEADER_DTYPE,
    ENTRY_LIVE,
    SEGMENT_HEADER_DTYPE,
    SEGMENT_HEADER_SIZE_BYTES,
    SEGMENT_IDENTITY_BYTES,
    SEGMENT_MAGIC,
    SEGMENT_VERSION,
    entry_checksum,
    entry_size_bytes,
)
from pipeline.storage.storelog import encode_lifecycle, lifecycle_keys
from pipeline.wire.layouts.storelog import (
    LOG_BOUNDARY,
    LOG_COMPLETED,
    LOG_MISSING,
    LOG_SEALED,
    STORE_LOG_DTYPE,
    STORE_LOG_FILE,
    STORE_LOG_MAGIC,
    STORE_LOG_VERSION,
    keys_tag,
    log_checksums,
)
from shm.layout import Field, struct_for
from tests.support.segments import shared_log


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
    # Model 123456 was once stored under m123456/ and skipped at restart (m(\d{5})).
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


def test_store_log_record_layout():
    assert STORE_LOG_DTYPE.itemsize == 64 and STORE_LOG_DTYPE.fields["checksum"][1] == 56


# ------------------------------------------------------------------ one definition per layout


def test_struct_for_takes_fields_in_offset_order_only():
    assert struct_for(SEGMENT_HEADER_DTYPE, ["entry_count", "data_end"]).format == "<QQ"
    with pytest.raises(AssertionError, match="offset order"):  # values would land in each other's fields
        struct_for(SEGMENT_HEADER_DTYPE, ["data_end", "entry_count"])
    field = Field(SEGMENT_HEADER_DTYPE, "deleted_count")
    buf = bytearray(SEGMENT_HEADER_DTYPE.itemsize)
    field.write(buf, 0x0102030405060708)
    assert np.frombuffer(buf, SEGMENT_HEADER_DTYPE)[0]["deleted_count"] == 0x0102030405060708
    assert field.read(buf) == 0x0102030405060708 and (field.offset, field.end) == (88, 96)


KEYS = SegmentKeys(model=3, signature=0x1122334455667788, lane=5, segment_seq=9)


def entry_items() -> tuple:
    """Two items whose every field holds a value no other field of the same width holds."""
    items = np.zeros(2, dtype=ITEM_HEADER_DTYPE)
    items["item_id"] = [0x0A0A0A0A0A0A0A01, 0x0A0A0A0A0A0A0A02]
    items["seq"] = [71, 72]
    items["signature"] = KEYS.signature
    items["submit_ns"] = [0x5B5B5B5B5B5B5B01, 0x5B5B5B5B5B5B5B02]
    items["model"] = KEYS.model
    items["length"] = [6, 7]
    items["prefix_len"] = [2, 3]
    items["payload_len"] = [4, 5]
    tokens = np.arange(13, dtype=np.int32) + 1000
    payloads = np.frombuffer(b"abcdVWXYZ", dtype=np.uint8)
    return items, tokens, np.array([0, 6, 13]), payloads, np.array([0, 4, 9])


def test_a_segment_header_reads_back_field_by_field(tmp_path):
    path = segment_path(str(tmp_path), KEYS.model, KEYS.signature, KEYS.lane, KEYS.segment_seq)
    make_dirs(os.path.dirname(path))
    segment = SegmentFile.create(path, KEYS, Durability.PROCESS, shared_log(str(tmp_path)))
    at = segment.append(encode_entries(*entry_items(), indices=np.arange(2), producer_id=11))
    segment.tombstone_many([at])
    segment.seal()
    data_end = segment.data_end
    segment.close()
    raw = np.fromfile(path, dtype=np.uint8, count=SEGMENT_HEADER_SIZE_BYTES)
    header = raw[:SEGMENT_HEADER_DTYPE.itemsize].view(SEGMENT_HEADER_DTYPE)[0]
    assert (bytes(header["magic"]), header["version"], header["header_size"]) == (
        SEGMENT_MAGIC, SEGMENT_VERSION, SEGMENT_HEADER_SIZE_BYTES)
    assert (header["model"], header["lane"], header["signature"], header["segment_seq"]) == (
        KEYS.model, KEYS.lane, KEYS.signature, KEYS.segment_seq)
    assert header["identity_checksum"] == xxhash.xxh3_64_intdigest(raw[:SEGMENT_IDENTITY_BYTES].tobytes())
    # Version 2: the words after the identity keep their creation values (an empty segment's
    # boundary); the seal, the boundary and the completion are store log records.
    assert (header["sealed"], header["entry_count"], header["deleted_count"], header["data_end"]) == (
        0, 0, 0, SEGMENT_HEADER_SIZE_BYTES)
    assert header["boundary_checksum"] == boundary_checksum(0, SEGMENT_HEADER_SIZE_BYTES)
    records = np.fromfile(os.path.join(str(tmp_path), STORE_LOG_FILE), dtype=STORE_LOG_DTYPE)
    bodies = np.ascontiguousarray(records["body"]).view("<u8").reshape(-1, 4)
    assert [int(r["kind"]) for r in records] == [LOG_BOUNDARY, LOG_COMPLETED, LOG_SEALED]
    assert records["epoch"].tolist() == [1, 1, 1]  # nothing synced between them (0: a compaction's)
    assert bodies[0, :2].tolist() == [2, data_end] and bodies[2, 0] == 2
    assert bodies[1:2].view("<u4")[0, 0] == at // ENTRY_ALIGN_BYTES  # the completion's slot
    assert (records["magic"] == STORE_LOG_MAGIC).all() and (records["version"] == STORE_LOG_VERSION).all()
    assert (records["segment_seq"] == KEYS.segment_seq).all()
    assert (records["keys_tag"] == keys_tag(KEYS.model, KEYS.signature, KEYS.lane)).all()
    words = records.view("<u8").reshape(-1, 8)
    assert (log_checksums(words[:, :7]) == words[:, 7]).all()
    assert scan_segment(path).keys == KEYS and scan_segment(path).counts_agree and scan_segment(path).sealed


def test_an_entry_header_reads_back_field_by_field_through_every_reader(tmp_path):
    items, tokens, token_starts, payloads, payload_starts = entry_items()
    encoded = encode_entries(items, tokens, token_starts, payloads, payload_starts, np.arange(2), 11)
    headers = np.stack([encoded.data[at:at + ENTRY_HEADER_DTYPE.itemsize] for at in encoded.offsets.tolist()])
    headers = headers.view(ENTRY_HEADER_DTYPE).reshape(-1)
    for name in ("item_id", "seq", "submit_ns", "length", "prefix_len", "payload_len"):
        assert headers[name].tolist() == items[name].tolist(), name
    assert headers["state"].tolist() == [ENTRY_LIVE] * 2 and headers["producer_id"].tolist() == [11, 11]
    ends = (encoded.offsets + encoded.sizes).tolist()
    assert headers["checksum"].tolist() == [entry_checksum(encoded.data, at, end, n) for at, end, n in
                                            zip(encoded.offsets.tolist(), ends, items["length"].tolist())]
    assert encoded.sizes.tolist() == [entry_size_bytes(6, 4), entry_size_bytes(7, 5)]
    # Each reader of the store: the scan and the broker's columns by name, the consumer's
    # one-entry read by position (ENTRY_HEADER_STRUCT) and its batch read by column.
    path = segment_path(str(tmp_path), KEYS.model, KEYS.signature, KEYS.lane, KEYS.segment_seq)
    make_dirs(os.path.dirname(path))
    segment = SegmentFile.create(path, KEYS, Durability.PROCESS, shared_log(str(tmp_path)))
    base = segment.append(encoded)
    offsets = encoded.offsets + base
    assert np.array_equal(scan_segment(path).headers, headers)
    assert np.array_equal(segment.entry_header_columns(offsets), headers)
    segment.close()
    reader = SegmentReader(str(tmp_path))
    for i, offset in enumerate(offsets.tolist()):
        got = reader.read(KEYS.model, KEYS.signature, KEYS.lane, KEYS.segment_seq, offset, int(items["length"][i]),
                          int(items["item_id"][i]))
        assert (got.item_id, got.prefix_len, got.submit_ns) == (items["item_id"][i], items["prefix_len"][i],
                                                                items["submit_ns"][i])
        assert got.payload == payloads[payload_starts[i]:payload_starts[i + 1]].tobytes()
        assert got.tokens.tolist() == tokens[token_starts[i]:token_starts[i + 1]].tolist()
    rows = np.zeros(2, dtype=DESCRIPTOR_ITEM_DTYPE)
    rows["lane"], rows["segment_seq"], rows["offset"] = KEYS.lane, KEYS.segment_seq, offsets
    rows["length"], rows["item_id"] = items["length"], items["item_id"]
    batch = reader.read_batch(KEYS.model, KEYS.signature, rows)
    assert not batch.failed and batch.item_ids == items["item_id"].tolist()
    assert batch.prefix_lens == items["prefix_len"].tolist() and batch.submit_ns == items["submit_ns"].tolist()
    reader.close()


def test_a_life_record_reads_back_field_by_field():
    words = encode_lifecycle(LOG_MISSING, KEYS, entry_count=77, time_ns=0x7171717171717171)
    record = words.view(STORE_LOG_DTYPE)[0, 0]
    assert (bytes(record["magic"]), record["version"], record["kind"]) == (STORE_LOG_MAGIC, STORE_LOG_VERSION,
                                                                           LOG_MISSING)
    body = np.frombuffer(bytes(record["body"]), dtype="<u4")
    assert (body[0], body[1], record["segment_seq"]) == (KEYS.model, KEYS.lane, KEYS.segment_seq)
    assert np.frombuffer(bytes(record["body"]), dtype="<u8")[1:].tolist() == [KEYS.signature, 77, 0x7171717171717171]
    assert record["keys_tag"] == keys_tag(KEYS.model, KEYS.signature, KEYS.lane)
    assert lifecycle_keys(words[0]) == KEYS


def test_descriptor_and_frame_headers_read_back_field_by_field():
    buf = np.zeros(descriptor_size_bytes(1), dtype=np.uint8)
    write_descriptor(buf, 0, batch_id=0x4242424242424201, signature=0x5353535353535301, model=6, pad_to_tokens=64,
                     dispatch_ns=0x6464646464646401, items=make_items(1))
    header = buf[:DESCRIPTOR_HEADER_DTYPE.itemsize].view(DESCRIPTOR_HEADER_DTYPE)[0]
    assert (bytes(header["magic"]), header["header_size"], header["item_count"]) == (
        DESCRIPTOR_MAGIC, DESCRIPTOR_HEADER_DTYPE.itemsize, 1)
    assert (header["batch_id"], header["signature"], header["dispatch_ns"]) == (
        0x4242424242424201, 0x5353535353535301, 0x6464646464646401)
    assert (header["model"], header["pad_to_tokens"]) == (6, 64)
    # A frame header written by name is read back by parse_frame's positional unpack.
    items = np.zeros(1, dtype=ITEM_HEADER_DTYPE)
    items["length"], items["payload_len"] = 3, 2
    items["item_id"] = 9 << ITEM_ID_SEQ_BITS  # producer 9's seq 0: parse_frame checks it
    head = np.zeros(1, dtype=FRAME_HEADER_DTYPE)
    head["magic"], head["version"], head["header_size"] = FRAME_MAGIC, FRAME_VERSION, FRAME_HEADER_DTYPE.itemsize
    head["producer_id"], head["item_count"], head["token_count"], head["payload_bytes"] = 9, 1, 3, 2
    body = np.frombuffer(head.tobytes() + items.tobytes() + np.arange(3, dtype=np.int32).tobytes() + b"pq",
                         dtype=np.uint8)
    frame = parse_frame(body)
    assert frame.producer_id == 9 and frame.item_tokens(0).tolist() == [0, 1, 2] and frame.item_payload(0) == b"pq"


def test_prompt_digests_match_prompt_digest_for_every_kind_of_array():
    from pipeline.wire.layouts.segments import prompt_digest, prompt_digests

    rng = np.random.default_rng(5)
    flat = rng.integers(-2**31, 2**31 - 1, size=1000, dtype=np.int64).astype(np.int32)
    views = [flat[0:10], flat[10:300], flat[300:301]]  # what a consumer reads: contiguous <i4
    mixed = [*views, flat[::2], flat[:7].astype(np.int64), flat[:9].astype(">i4")]
    for prompts in (views, mixed, []):
        assert prompt_digests(prompts) == [prompt_digest(p) for p in prompts]
    assert len(set(prompt_digests(mixed[3:]))) == 3 and prompt_digest(flat[:7].astype(np.int64)) == prompt_digest(flat[:7])
