"""What the fuzz campaign found, one regression test each: every one was
an untyped exception (or an input the store would later misread) before its fix."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.broker.ids import LaneId, LaneKey
from pipeline.storage import DiskTier
from pipeline.storage.identity import SegmentKeys
from pipeline.storage.segment import encode_entries
from pipeline.storage.segments import SegmentStore
from pipeline.storage.storelog import encode_lifecycle
from pipeline.consumer.reader import SegmentReader
from pipeline.producer.workload import MAX_TIMESTAMP_MS, load_workload
from pipeline.reporting.accounting import ITEM_ID_LIMIT, result_rows, summarize_results
from pipeline.wire.errors import (
    BatchFileError,
    FrameError,
    GenerationParamsError,
    ProtocolError,
    SegmentCorruptError,
    WorkloadError,
)
from pipeline.wire.generation import GenerationParams
from pipeline.wire.layouts.frames import (
    FRAME_HEADER_SIZE_BYTES,
    ITEM_HEADER_DTYPE,
    ITEM_HEADER_SIZE_BYTES,
    MAX_PRODUCER_ID,
    MAX_SEQ,
    parse_frame,
)
from pipeline.wire.layouts.storelog import LOG_CREATED, STORE_LOG_FILE
from pipeline.wire.protocol import validate
from tests.fuzz import mutations
from tests.support.segments import make_items
from tests.fuzz.targets import (
    load_batch,
    FRAME_PRODUCER,
    SEGMENT_ITEMS,
    SEGMENT_KEYS,
    SEGMENT_PATH,
    SEGMENT_SEEDS,
    SERVED_MODEL,
    chat_request,
    frame_bytes,
    result_line,
)

THREE = [(0, 0xA1, 3, 1, b""), (0, 0xA1, 4, 0, b"p"), (0, 0xA1, 2, 2, b"")]


def _item_field(index: int, name: str) -> tuple[int, int]:
    return (FRAME_HEADER_SIZE_BYTES + index * ITEM_HEADER_SIZE_BYTES + ITEM_HEADER_DTYPE.fields[name][1],
            ITEM_HEADER_DTYPE.fields[name][0].itemsize)


def _parse(data: bytes, producer_id: int | None = FRAME_PRODUCER):
    return parse_frame(np.frombuffer(data, dtype=np.uint8), where="ring r position 0", producer_id=producer_id)


def test_a_frame_of_its_producer_with_consecutive_ids_is_taken():
    frame = _parse(frame_bytes(FRAME_PRODUCER, MAX_SEQ - 2, THREE))  # up to the last sequence
    assert frame.items["seq"].tolist() == [MAX_SEQ - 2, MAX_SEQ - 1, MAX_SEQ]


def test_a_frame_naming_another_producer_is_refused():
    # Stored under the other id, its items would pass for that producer's, whose own items
    # would be skipped as already stored: a loss one bad producer causes another.
    with pytest.raises(FrameError, match="offset 8 names producer 8; the record is in producer 7's ring"):
        _parse(frame_bytes(8, 0, THREE))
    _parse(frame_bytes(8, 0, THREE), producer_id=None)  # an offline reader that knows no ring


def test_a_producer_id_past_the_item_id_bits_is_refused():
    _parse(frame_bytes(MAX_PRODUCER_ID, 0, THREE), producer_id=MAX_PRODUCER_ID)
    data = mutations.overwrite(frame_bytes(1, 0, THREE), 8, 4, MAX_PRODUCER_ID + 1)
    with pytest.raises(FrameError, match=f"producer {MAX_PRODUCER_ID + 1}, above the largest"):
        _parse(data, producer_id=None)


@pytest.mark.parametrize("index, name, value, match", [
    (1, "item_id", 12345, "item 1: item_id 12345 at offset 80 is not"),
    (0, "seq", MAX_SEQ + 1, f"item 0: seq {MAX_SEQ + 1} at offset 40 is above the largest"),
    (2, "seq", 7, "item 2: seq 7 at offset 136 does not follow seq 1"),
    (1, "prefix_len", 5, "item 1: prefix_len 5 at offset 120 is longer than the item's length"),
])
def test_an_item_header_the_producer_never_writes_is_refused_naming_its_offset(index, name, value, match):
    data = mutations.overwrite(frame_bytes(FRAME_PRODUCER, 0, THREE), *_item_field(index, name), value)
    if name == "seq" and value != 7:  # the id follows the seq, so only the seq is wrong
        data = mutations.overwrite(data, *_item_field(index, "item_id"), (FRAME_PRODUCER << 40) | (value & MAX_SEQ))
    elif name == "seq":
        data = mutations.overwrite(data, *_item_field(index, "item_id"), (FRAME_PRODUCER << 40) | value)
    with pytest.raises(FrameError, match=match):
        _parse(data)


def test_a_prefix_as_long_as_the_item_is_taken():
    _parse(mutations.overwrite(frame_bytes(FRAME_PRODUCER, 0, THREE), *_item_field(1, "prefix_len"), 4))


def _write(tmp_path, name: str, rows: list[dict]) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("timestamp", [10**400, -(10**400), MAX_TIMESTAMP_MS + 1])
def test_a_workload_timestamp_past_a_float_is_a_workload_error(tmp_path, timestamp):
    # 10**400 made math.isfinite raise OverflowError out of load_workload.
    path = _write(tmp_path, "w.jsonl", [{"suffix": [1], "timestamp_ms": timestamp}])
    with pytest.raises(WorkloadError, match="timestamp_ms must be a number of milliseconds"):
        load_workload(path)
    assert len(load_workload(_write(tmp_path, "ok.jsonl", [{"suffix": [1], "timestamp_ms": MAX_TIMESTAMP_MS}]))) == 1


@pytest.mark.parametrize("name", ["temperature", "top_p"])
def test_a_batch_parameter_past_a_float_refuses_that_request_alone(tmp_path, name):
    # 10**400 made math.isfinite raise OverflowError out of load_requests.
    path = _write(tmp_path, "b.jsonl", [chat_request("a", **{name: 10**400}), chat_request("b")])
    refused, served = load_batch(path, SERVED_MODEL)
    assert name in refused.error and refused.error_param == name
    assert served.error is None
    with pytest.raises(GenerationParamsError, match="temperature"):
        GenerationParams(temperature=-(10**400))


def test_a_results_line_whose_item_id_is_no_item_id_is_a_bad_line(tmp_path):
    # A negative or 65-bit item_id was a result row, and the launcher's np.fromiter(...,
    # uint64) of the ids raised OverflowError.
    results = tmp_path / "results"
    results.mkdir()
    rows = [result_line(ITEM_ID_LIMIT - 1), result_line(ITEM_ID_LIMIT), result_line(-1),
            result_line(5, item_id_note=[[1]] * 3)]
    path = _write(results, "c.jsonl", rows)
    assert [row["item_id"] for row in result_rows(path)] == [ITEM_ID_LIMIT - 1, 5]
    summary = summarize_results(str(results))
    assert summary.bad_lines == 2 and "is not an item id (0 to 18446744073709551615)" in summary.bad_line_examples[0]
    np.fromiter(summary.item_ids, dtype=np.uint64, count=len(summary.item_ids))


def test_a_results_field_that_is_a_container_is_described_not_dumped(tmp_path):
    path = _write(tmp_path, "c.jsonl", [result_line(1, status=[1] * 10_000)])
    summary = summarize_results(str(tmp_path))
    assert summary.bad_lines == 1 and summary.bad_line_examples[0].endswith(
        "field 'status' is a JSON array of 10000 elements, not str")
    assert not list(result_rows(path))


def test_an_empty_segment_file_is_damage_for_each_item_not_a_crash(tmp_path):
    # mmap of an empty file raises ValueError ("cannot mmap an empty file") out of read_batch.
    path = tmp_path / SEGMENT_PATH
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    reader = SegmentReader(str(tmp_path))
    try:
        got = reader.read_batch(SEGMENT_KEYS.model, SEGMENT_KEYS.signature, SEGMENT_ITEMS[1])
        assert got.item_ids == [] and len(got.failed) == 3
        assert all(isinstance(error, SegmentCorruptError) and "0 bytes" in str(error) for _, _, error in got.failed)
        with pytest.raises(SegmentCorruptError, match="0 bytes, but an entry is said to end at"):
            item = SEGMENT_ITEMS[1][0]
            reader.read(SEGMENT_KEYS.model, SEGMENT_KEYS.signature, SEGMENT_KEYS.lane, SEGMENT_KEYS.segment_seq,
                        int(item["offset"]), int(item["length"]), int(item["item_id"]))
    finally:
        reader.close()


@pytest.mark.parametrize("role", [{"a": 1}, ["user"], 3, None])
def test_a_chat_role_that_is_not_a_string_refuses_that_request_alone(tmp_path, role):
    # An object as the role made `role not in CHAT_ROLES` raise TypeError (unhashable)
    # out of load_requests.
    messages = [{"role": role, "content": "hi"}]
    path = _write(tmp_path, "b.jsonl", [chat_request("a", messages=messages), chat_request("b")])
    refused, served = load_batch(path, SERVED_MODEL)
    assert "'messages[0].role'" in refused.error and refused.error_param == "messages[0].role"
    assert served.error is None


@pytest.mark.parametrize("offset", [2**63, 2**64 - 16, 2**62])
def test_a_descriptor_offset_past_the_file_fails_that_item_alone(tmp_path, offset):
    # An offset of 2**63 or more wrapped negative in the reader's int64 columns and indexed
    # outside the mapping: IndexError out of read_batch.
    path = tmp_path / SEGMENT_PATH
    path.parent.mkdir(parents=True)
    path.write_bytes(SEGMENT_SEEDS[1])
    items = SEGMENT_ITEMS[1].copy()
    items["offset"][1] = offset
    reader = SegmentReader(str(tmp_path))
    try:
        got = reader.read_batch(SEGMENT_KEYS.model, SEGMENT_KEYS.signature, items)
    finally:
        reader.close()
    assert sorted(got.item_ids) == sorted(int(i) for i in items["item_id"][[0, 2]])
    (item_id, _length, error), = got.failed
    assert item_id == int(items["item_id"][1]) and isinstance(error, SegmentCorruptError)
    assert "an entry is said to end at" in str(error)


def test_a_life_record_no_segment_name_can_carry_is_named_and_the_store_opens(tmp_path):
    # A checksummed record for model 2**32 - 1 made recovery raise SegmentNameError (naming
    # the quarantine note of a "missing" segment): the broker could not start at all. And a
    # sequence past every name must not become the store's next one.
    path = tmp_path / SEGMENT_PATH
    path.parent.mkdir(parents=True)
    path.write_bytes(SEGMENT_SEEDS[1])
    records = [encode_lifecycle(LOG_CREATED, SegmentKeys(2**32 - 1, 2**64 - 1, 2**32 - 1, 7)),
               encode_lifecycle(LOG_CREATED, SegmentKeys(1, 2, 3, 2**64 - 1))]
    (tmp_path / STORE_LOG_FILE).write_bytes(b"".join(r.tobytes() for r in records))
    tier = DiskTier.open(str(tmp_path))
    try:
        assert tier.recovery.live_entries == 3
        problems = tier.recovery.catalog_problems
        assert any("model id 4294967295 does not fit a segment file name" in line for line in problems), problems
        assert any("name a segment sequence no segment name can carry" in line for line in problems), problems
        assert not tier.recovery.ok
    finally:
        tier.close()
    store = SegmentStore(str(tmp_path))
    store.recover()
    fill = encode_entries(*make_items(2), indices=np.arange(2), producer_id=1)
    fresh, _offset = store.append(LaneKey(1, 2, LaneId(3)), fill, now_s=0.0)
    assert store.segments[fresh].keys.segment_seq < 10  # appends go on
    store.close()


def test_an_unknown_message_type_is_described_not_dumped():
    # The type's whole repr went into the error (the broker logs it and sends it back): a
    # 30 KB message for a type that was a nested array, found by the slow fuzz variant.
    with pytest.raises(ProtocolError, match=r"^unknown message type a JSON array of 1 elements$"):
        validate({"type": [[1] * 10_000]})
    with pytest.raises(ProtocolError, match=r"^unknown message type 'x'$"):
        validate({"type": "x"})


WIDE = {f"k{i}": i for i in range(5_000)}


@pytest.mark.parametrize("line", [WIDE, {"suffix": [1], **WIDE}, {"suffix": [1], "hash_ids": [], **WIDE}])
def test_a_workload_line_of_many_keys_is_named_in_a_short_message(tmp_path, line):
    # Every key went into the message: 44 KB for a line of 5,000 keys.
    with pytest.raises(WorkloadError) as caught:
        load_workload(_write(tmp_path, "w.jsonl", [line]))
    assert len(str(caught.value)) < 1000 and "and 49" in str(caught.value)


def test_a_batch_line_or_body_of_many_keys_is_named_in_a_short_message(tmp_path):
    line = {**chat_request("a"), **WIDE}
    with pytest.raises(BatchFileError) as caught:
        load_batch(_write(tmp_path, "b.jsonl", [line]), SERVED_MODEL)
    assert len(str(caught.value)) < 1000 and "'k0', 'k1'" in str(caught.value) and "and 4990 more" in str(caught.value)
    request = chat_request("b")
    request["body"].update(WIDE)
    (refused,) = load_batch(_write(tmp_path, "c.jsonl", [request]), SERVED_MODEL)
    assert len(refused.error) < 1000 and refused.error.startswith("unsupported parameters 'k0', 'k1'")
