"""OpenAI's objects from the service's records, the list pages, and the checks of what a
client sends: at each limit and past it."""

from __future__ import annotations

import json

import pytest

from pipeline.service.limits import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    COMPLETION_WINDOW_RANGE_S,
    PRIORITY_RANGE,
)
from pipeline.service.objects import (
    BatchRecord,
    FileRecord,
    batch_object,
    batch_record,
    check_endpoint_of_lines,
    check_limit,
    check_metadata,
    priority_of,
    window_seconds,
    error_body,
    file_object,
    file_record,
    list_page,
    not_found,
    parse_batch_create,
)
from pipeline.service.states import ANSWERED, CANCEL, FINALIZED, RUNNING, Lifecycle
from pipeline.wire.errors import ApiError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
# The Batch object's fields as OpenAI's reference lists them.
BATCH_FIELDS = {"id", "object", "endpoint", "model", "errors", "input_file_id", "completion_window", "status",
                "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at",
                "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at", "request_counts",
                "usage", "metadata"}
FILE_FIELDS = {"id", "object", "bytes", "created_at", "filename", "purpose", "status", "status_details",
               "expires_at"}


def a_batch(**fields) -> BatchRecord:
    return BatchRecord("batch_1", "team-a", 1, "file-in", "/v1/chat/completions", "tiny-llama",
                       Lifecycle.new(1000, 86_400), 10, **fields)


def test_a_batch_object_has_openais_fields_and_hides_its_files_until_it_ended():
    batch = a_batch(metadata={"k": "v"}, output_file_id="file-out", error_file_id="file-err")
    shown = batch_object(batch)
    assert set(shown) == BATCH_FIELDS
    assert shown["object"] == "batch" and shown["status"] == "validating" and shown["completion_window"] == "24h"
    assert shown["expires_at"] == 1000 + 86_400 and shown["in_progress_at"] is None
    assert shown["output_file_id"] is None and shown["error_file_id"] is None
    assert shown["request_counts"] == {"total": 10, "completed": 0, "failed": 0}
    batch.life.step(RUNNING, 1001)
    batch.life.step(ANSWERED, 1002)
    batch.life.step(FINALIZED, 1003)
    batch.usage = {"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 2}
    shown = batch_object(batch)
    assert (shown["status"], shown["output_file_id"], shown["error_file_id"]) == ("completed", "file-out", "file-err")
    assert shown["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 3,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10}
    assert shown["errors"] is None


def test_a_failed_batch_shows_its_errors_as_a_list():
    batch = a_batch(errors=[{"code": "job_failed", "message": "why", "param": None, "line": None}])
    assert batch_object(batch)["errors"] == {"object": "list", "data": batch.errors}


def test_records_round_trip_through_their_json_and_another_version_is_refused():
    batch = a_batch(metadata={"k": "v"})
    batch.life.step(CANCEL, 1001)
    again = batch_record(json.loads(json.dumps(batch.as_json())))
    assert again == batch
    record = FileRecord("file-1", "team-a", "in.jsonl", "batch", 12, 1000, 3, ["/v1/completions"], "ab" * 16)
    assert file_record(json.loads(json.dumps(record.as_json()))) == record
    assert set(file_object(record)) == FILE_FIELDS
    with pytest.raises(ValueError):
        file_record({**record.as_json(), "version": 99})


def test_a_record_that_breaks_the_invariants_is_refused():
    raw = a_batch().as_json()
    raw["life"]["status"] = "completed"  # without its completed_at
    with pytest.raises(AssertionError):
        batch_record(raw)


def test_error_body_is_openais():
    error = ApiError(400, "bad", "endpoint", "some_code")
    assert error_body(error) == {"error": {"message": "bad", "type": "invalid_request_error", "param": "endpoint",
                                           "code": "some_code"}}
    assert not_found("batch", "batch_x", "batch_id").status == 404


def test_a_page_goes_after_the_id_given_up_to_the_limit():
    objects = [{"id": f"o{k}"} for k in range(5)]
    first = list_page(objects, None, 2)
    assert [o["id"] for o in first["data"]] == ["o0", "o1"]
    assert (first["first_id"], first["last_id"], first["has_more"]) == ("o0", "o1", True)
    last = list_page(objects, "o2", 2)
    assert [o["id"] for o in last["data"]] == ["o3", "o4"] and last["has_more"] is False
    assert list_page(objects, "o4", 2) == {"object": "list", "data": [], "first_id": None, "last_id": None,
                                           "has_more": False}
    with pytest.raises(ApiError) as refused:
        list_page(objects, "o9", 2)
    assert refused.value.param == "after"


@pytest.mark.parametrize("value, ok", [(1, True), (100, True), (0, False), (101, False)])
def test_limit_at_its_bounds_and_past_them(value, ok):
    if ok:
        assert check_limit(value, 20, (1, 100)) == value
    else:
        with pytest.raises(ApiError):
            check_limit(value, 20, (1, 100))
    assert check_limit(None, 20, (1, 100)) == 20


def test_metadata_at_its_limits_and_past_them():
    at_limit = {f"k{i}".ljust(MAX_METADATA_KEY_CHARS, "x"): "v" * MAX_METADATA_VALUE_CHARS
                for i in range(MAX_METADATA_PAIRS)}
    assert check_metadata(at_limit) == at_limit
    too_many = {f"k{i}": "v" for i in range(MAX_METADATA_PAIRS + 1)}
    for wrong in (too_many, {"k" * (MAX_METADATA_KEY_CHARS + 1): "v"}, {"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)},
                  {"k": 1}, ["k"]):
        with pytest.raises(ApiError) as refused:
            check_metadata(wrong)
        assert refused.value.param == "metadata"


def test_a_create_body_is_checked_key_by_key():
    body = {"input_file_id": "file-1", "endpoint": "/v1/completions", "completion_window": "24h"}
    assert parse_batch_create(body, ENDPOINTS).endpoint == "/v1/completions"
    for wrong, param in (({**body, "endpoint": "/v1/responses"}, "endpoint"),
                         ({**body, "completion_window": "24 h"}, "completion_window"),
                         ({**body, "output_expires_after": {}}, "output_expires_after"),
                         ({k: v for k, v in body.items() if k != "input_file_id"}, "input_file_id")):
        with pytest.raises(ApiError) as refused:
            parse_batch_create(wrong, ENDPOINTS)
        assert (refused.value.status, refused.value.param) == (400, param)


def test_every_line_must_be_for_the_batchs_endpoint():
    check_endpoint_of_lines(["/v1/completions"], "/v1/completions")
    with pytest.raises(ApiError) as refused:
        check_endpoint_of_lines(["/v1/completions", "/v1/chat/completions"], "/v1/completions")
    assert refused.value.code == "mismatched_endpoint"


def test_a_priority_in_metadata_is_an_integer_in_its_range():
    low, high = PRIORITY_RANGE
    for value in (str(low), str(high), "0", " 7", "+3"):
        assert check_metadata({"priority": value}) == {"priority": value}
        assert priority_of({"priority": value}) == int(value)
    assert priority_of(None) == priority_of({"team": "a"}) == 0
    for value in (str(low - 1), str(high + 1), "high", "1.5", "", "1" * 13):
        with pytest.raises(ApiError, match="priority") as raised:
            check_metadata({"priority": value})
        assert raised.value.status == 400 and raised.value.param == "metadata"


def test_a_completion_window_is_a_duration_in_its_range():
    low, high = COMPLETION_WINDOW_RANGE_S
    body = {"input_file_id": "file-1", "endpoint": "/v1/completions"}
    for window, seconds in (("24h", 86_400), (f"{low}s", low), ("1m", 60), ("90m", 5_400), (f"{high // 3600}h", high)):
        assert window_seconds(window) == seconds
        assert parse_batch_create({**body, "completion_window": window}, ENDPOINTS).completion_window == window
    for window in (f"{low - 1}s", f"{high + 1}s", f"{high // 3600 + 1}h", "0m", "1d", "h", "24", "1.5h", "-1h",
                   "9" * 8 + "s"):
        with pytest.raises(ApiError, match="completion_window") as refused:
            window_seconds(window)
        assert (refused.value.status, refused.value.param) == (400, "completion_window")
