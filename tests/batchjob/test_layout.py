"""pipeline.batchjob.layout: a job item's payload names its job, version and request, and
nothing else decodes as one; an answer record that is torn, zero-filled or changed in any
byte fails its check, and the records after the first bad one are not read."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import xxhash

from pipeline.batchjob.layout import (
    ANSWER_RECORD_DTYPE,
    ANSWER_RECORD_SIZE_BYTES,
    JOB_FLAG_READS_BODY,
    JOB_PAYLOAD_DTYPE,
    JOB_PAYLOAD_MAGIC,
    JOB_PAYLOAD_SIZE_BYTES,
    JOB_PAYLOAD_VERSION,
    LOG_ERRORS,
    LOG_OUTPUT,
    MAX_RECORD_COUNT,
    answer_record,
    decode_job_payload,
    encode_job_payload,
    job_payload_flags,
    job_request_indices,
    record_check,
    valid_records,
)

JOB_ID = 0x1234_5678_9ABC_DEF0 >> 1
U64_MAX = (1 << 64) - 1


@pytest.mark.parametrize(("index", "offset", "length", "digest"), [
    (0, 0, 1, 0), (17, 1_000_003, 560, xxhash.xxh3_64_intdigest(b"line")), (U64_MAX, U64_MAX, (1 << 32) - 1, U64_MAX),
])
def test_a_payload_decodes_to_its_request_for_its_own_job(index: int, offset: int, length: int, digest: int) -> None:
    payload = encode_job_payload(JOB_ID, index, offset, length, digest)
    assert len(payload) == JOB_PAYLOAD_SIZE_BYTES == JOB_PAYLOAD_DTYPE.itemsize
    assert decode_job_payload(payload, JOB_ID) == (index, offset, length, digest, 0)
    record = np.frombuffer(payload, dtype=JOB_PAYLOAD_DTYPE)[0]
    assert (record["magic"], int(record["version"]), int(record["job_id"]), int(record["index"])) == (
        JOB_PAYLOAD_MAGIC, JOB_PAYLOAD_VERSION, JOB_ID, index)
    assert payload[6:8] == b"\0\0" and payload[36:40] == b"\0\0\0\0"  # no flags; reserved bytes are zero
    assert job_payload_flags(payload) == 0


def test_a_payloads_flags_ride_beside_its_request_and_do_not_change_it() -> None:
    flagged = encode_job_payload(JOB_ID, 5, 6, 7, 8, 9, flags=JOB_FLAG_READS_BODY)
    assert job_payload_flags(flagged) == JOB_FLAG_READS_BODY == int(np.frombuffer(flagged, JOB_PAYLOAD_DTYPE)[0]["flags"])
    assert decode_job_payload(flagged, JOB_ID) == decode_job_payload(encode_job_payload(JOB_ID, 5, 6, 7, 8, 9), JOB_ID)


def _with_version(payload: bytes, version: int) -> bytes:
    return payload[:4] + struct.pack("<H", version) + payload[6:]


PAYLOAD = encode_job_payload(JOB_ID, 5, 100, 60, 99)
NOT_THIS_JOBS = [
    ("another job id", encode_job_payload(JOB_ID + 1, 5, 100, 60, 99)),
    ("another version", _with_version(PAYLOAD, JOB_PAYLOAD_VERSION + 1)),
    ("version 0", _with_version(PAYLOAD, 0)),
    ("one byte short", PAYLOAD[:-1]),
    ("one byte long", PAYLOAD + b"\0"),
    ("another magic", b"SBJX" + PAYLOAD[4:]),
    ("empty", b""),
    ("digits, as `pipeline launch` items carry", b"5"),
    ("digits of the payload's length", b"1" * JOB_PAYLOAD_SIZE_BYTES),
]


@pytest.mark.parametrize("payload", [p for _, p in NOT_THIS_JOBS], ids=[name for name, _ in NOT_THIS_JOBS])
def test_a_payload_that_is_not_this_jobs_decodes_to_none(payload: bytes) -> None:
    assert decode_job_payload(payload, JOB_ID) is None


def test_the_requests_of_payload_tails_are_those_each_payload_decodes_to() -> None:
    """Rows checked at once accept exactly what `decode_job_payload` accepts of a tail of
    JOB_PAYLOAD_SIZE_BYTES (the lengths it refuses are never made rows), within `requests`."""
    requests = 10
    payloads = [p for _, p in NOT_THIS_JOBS if len(p) == JOB_PAYLOAD_SIZE_BYTES] + [
        encode_job_payload(JOB_ID, k, 100, 60, k) for k in (0, 3, requests - 1, requests, U64_MAX)]
    tails = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(-1, JOB_PAYLOAD_SIZE_BYTES)
    expected = [found[0] for found in map(lambda p: decode_job_payload(p, JOB_ID), payloads)
                if found is not None and found[0] < requests]
    assert job_request_indices(tails, JOB_ID, requests).tolist() == expected == [0, 3, requests - 1]
    assert job_request_indices(tails[:0], JOB_ID, requests).tolist() == []


def _record(index: int = 3, status: int = 200, log: int = LOG_OUTPUT) -> bytes:
    return answer_record(index, 4096 * index, 300 + index, status, log, 20 + index, 5, 16)


def test_a_record_reads_back_with_its_fields() -> None:
    raw = _record(7, 400, LOG_ERRORS) + answer_record(8, 0, 1, 200, LOG_OUTPUT, MAX_RECORD_COUNT, MAX_RECORD_COUNT,
                                                       MAX_RECORD_COUNT)
    records = valid_records(raw)
    assert records.dtype == ANSWER_RECORD_DTYPE and len(records) == 2
    first, second = records
    assert (int(first["index"]), int(first["log_offset"]), int(first["line_bytes"]), int(first["status_code"]),
            int(first["log"])) == (7, 4096 * 7, 307, 400, LOG_ERRORS)
    assert (int(first["prompt_tokens"]), int(first["completion_tokens"]), int(first["cached_tokens"])) == (27, 5, 16)
    assert int(second["prompt_tokens"]) == int(second["cached_tokens"]) == MAX_RECORD_COUNT


def test_a_count_past_the_records_limit_cannot_be_written() -> None:
    with pytest.raises(struct.error):
        answer_record(0, 0, 1, 200, LOG_OUTPUT, MAX_RECORD_COUNT + 1, 0, 0)


@pytest.mark.parametrize("position", range(ANSWER_RECORD_SIZE_BYTES))
def test_a_record_with_any_byte_changed_fails_its_check(position: int) -> None:
    raw = bytearray(_record())
    for flip in (0x01, 0x80, 0xFF):
        changed = bytearray(raw)
        changed[position] ^= flip
        assert len(valid_records(bytes(changed))) == 0, (position, flip)


def test_a_record_of_zeros_fails_its_check() -> None:
    assert len(valid_records(bytes(ANSWER_RECORD_SIZE_BYTES))) == 0
    assert len(valid_records(_record() + bytes(3 * ANSWER_RECORD_SIZE_BYTES))) == 1


def test_reading_stops_at_the_first_bad_record_and_ignores_a_torn_tail() -> None:
    good = [_record(k) for k in range(5)]
    bad = bytearray(good[2])
    bad[9] ^= 0x40
    records = valid_records(b"".join([good[0], good[1], bytes(bad), good[3], good[4]]))
    assert records["index"].tolist() == [0, 1]
    assert valid_records(b"".join(good) + good[0][:ANSWER_RECORD_SIZE_BYTES - 1])["index"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("size", [0, 1, ANSWER_RECORD_SIZE_BYTES - 1])
def test_less_than_one_record_holds_none(size: int) -> None:
    records = valid_records(_record()[:size])
    assert records.dtype == ANSWER_RECORD_DTYPE and len(records) == 0


def test_the_check_of_many_records_at_once_is_each_records_own() -> None:
    rng = random.Random(7)
    raw = b"".join(answer_record(rng.randrange(1 << 40), rng.randrange(1 << 50), rng.randrange(1, 1 << 20),
                                 rng.choice((200, 400, 500)), rng.choice((LOG_OUTPUT, LOG_ERRORS)),
                                 rng.randrange(1 << 32), rng.randrange(1 << 32), rng.randrange(1 << 32))
                   for _ in range(200))
    words = np.frombuffer(raw, dtype="<u4").reshape(200, -1)[:, :9]
    together = record_check(words)
    alone = [int(record_check(words[k:k + 1])[0]) for k in range(200)]
    assert together.tolist() == alone
    assert len(valid_records(raw)) == 200
