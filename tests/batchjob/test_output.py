"""pipeline.batchjob.output: OpenAI Batch output lines with exactly OpenAI's keys, ids that do
not change between runs of a job, and an error line for every results status that answers."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.batchjob import output
from pipeline.batchjob.output import (
    CODE_CONTEXT_LENGTH,
    RequestRef,
    error_line,
    response_line,
    row_error,
    row_usage,
)
from pipeline.batchjob.requests import KIND_CHAT, KIND_COMPLETION, KIND_EMBEDDING
from pipeline.consumer import results
from pipeline.wire.errors import BatchOutputError

TAG = "0123456789ab"
OTHER_TAG = "ba9876543210"
CREATED = 1_760_000_000
MODEL = "tiny"

LINE_KEYS = {"id", "custom_id", "response", "error"}
RESPONSE_KEYS = {"status_code", "request_id", "body"}
BODY_KEYS = {"id", "object", "created", "model", "choices", "usage"}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
ERROR_KEYS = {"message", "type", "param", "code"}


def request(index: int = 3, kind: str | None = KIND_CHAT, custom_id: str | None = None) -> RequestRef:
    return RequestRef(custom_id if custom_id is not None else f"req-{index}", kind, index)


def row(status: str = "ok", **fields: object) -> dict:
    base = {"item_id": 7, "batch_id": 1, "dispatch_ns": 10, "submit_ns": 11, "done_ns": 12, "pad_to_tokens": 32,
            "status": status, "prompt_tokens": 20, "cached_tokens": 16, "output_tokens": 5, "output": [1, 2, 3, 4, 5],
            "finish_reason": "stop", "payload": ""}
    return {**base, **fields}


def test_a_chat_response_has_exactly_openais_keys_and_values() -> None:
    line = json.loads(response_line(request(), row(), "Hello there.", MODEL, CREATED, TAG))
    assert set(line) == LINE_KEYS and line["error"] is None
    assert line["id"] == f"batch_req_{TAG}_3" and line["custom_id"] == "req-3"
    response = line["response"]
    assert set(response) == RESPONSE_KEYS
    assert response["status_code"] == 200 and response["request_id"] == f"req_{TAG}_3"
    body = response["body"]
    assert set(body) == BODY_KEYS
    assert body["id"] == f"chatcmpl-{TAG}-3" and body["object"] == "chat.completion"
    assert body["created"] == CREATED and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "Hello there."}, "logprobs": None,
                      "finish_reason": "stop"}
    assert set(body["usage"]) == USAGE_KEYS
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
                             "prompt_tokens_details": {"cached_tokens": 16}}


@pytest.mark.parametrize("kind", [KIND_COMPLETION, None], ids=["completion", "no kind"])
def test_a_completion_response_has_exactly_openais_keys(kind: str | None) -> None:
    line = json.loads(response_line(request(0, kind), row(finish_reason="length"), " there was", MODEL, CREATED, TAG))
    body = line["response"]["body"]
    assert set(line) == LINE_KEYS and set(line["response"]) == RESPONSE_KEYS and set(body) == BODY_KEYS
    assert body["id"] == f"cmpl-{TAG}-0" and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": " there was", "logprobs": None, "finish_reason": "length"}]
    assert set(body["usage"]) == USAGE_KEYS


def test_ids_are_the_same_on_every_run_and_differ_by_request_and_by_job() -> None:
    first = response_line(request(3), row(), "x", MODEL, CREATED, TAG)
    assert response_line(request(3), row(done_ns=999, item_id=8), "x", MODEL, CREATED, TAG) == first
    ids = {json.loads(response_line(request(k), row(), "x", MODEL, CREATED, tag))["id"]
           for k in range(5) for tag in (TAG, OTHER_TAG)}
    assert len(ids) == 10


def test_an_error_line_carries_openais_error_object_in_the_body() -> None:
    line = json.loads(error_line(request(2), 400, "n=2 is not supported", "n", tag=TAG))
    assert set(line) == LINE_KEYS and line["error"] is None
    assert line["id"] == f"batch_req_{TAG}_2" and line["custom_id"] == "req-2"
    assert set(line["response"]) == RESPONSE_KEYS and line["response"]["status_code"] == 400
    assert line["response"]["request_id"] == f"req_{TAG}_2"
    assert line["response"]["body"] == {"error": {"message": "n=2 is not supported", "type": "invalid_request_error",
                                                  "param": "n", "code": None}}
    server = json.loads(error_line(request(2), 500, "boom", tag=TAG, code="x"))["response"]
    assert server["status_code"] == 500 and set(server["body"]["error"]) == ERROR_KEYS
    assert server["body"]["error"] == {"message": "boom", "type": "server_error", "param": None, "code": "x"}


@pytest.mark.parametrize("status", [200, 404, 429, 0])
def test_an_error_line_takes_400_or_500_only(status: int) -> None:
    with pytest.raises(BatchOutputError, match=f"status code {status}"):
        error_line(request(), status, "no", tag=TAG)


@pytest.mark.parametrize(("status", "kind", "code", "param", "error_type", "words"), [
    ("too_long", KIND_CHAT, 400, "messages", "invalid_request_error", "the prompt is 20 tokens"),
    ("too_long", KIND_COMPLETION, 400, "prompt", "invalid_request_error", "the prompt is 20 tokens"),
    ("error", KIND_CHAT, 500, None, "server_error", "the engine failed this request: CUDA out of memory"),
    ("error", KIND_COMPLETION, 500, None, "server_error", "CUDA out of memory"),
])
def test_a_row_that_did_not_run_is_answered_by_its_status(status: str, kind: str, code: int, param: str | None,
                                                          error_type: str, words: str) -> None:
    text, status_code = row_error(request(0, kind), row(status, error="CUDA out of memory", finish_reason=None), TAG)
    line = json.loads(text)
    assert status_code == code
    assert set(line) == LINE_KEYS and line["error"] is None
    assert line["response"]["status_code"] == code
    error = line["response"]["body"]["error"]
    assert set(error) == ERROR_KEYS and error["type"] == error_type and error["param"] == param
    assert words in error["message"]
    assert error["code"] == (CODE_CONTEXT_LENGTH if status == "too_long" else None)


@pytest.mark.parametrize(("status", "words"), [("corrupt", "answers nothing"), ("ok", "answers nothing"),
                                               ("lost", "status 'lost' answers nothing"), (None, "None")])
def test_a_row_status_that_answers_nothing_makes_no_error_line(status: object, words: str) -> None:
    with pytest.raises(BatchOutputError, match=words):
        row_error(request(), row(status), TAG)


def test_the_row_statuses_are_the_results_files_words() -> None:
    assert (output.ROW_OK, output.ROW_TOO_LONG, output.ROW_CORRUPT, output.ROW_ERROR, output.ROW_CANCELLED) == (
        results.STATUS_OK, results.STATUS_TOO_LONG, results.STATUS_CORRUPT, results.STATUS_ERROR,
        results.STATUS_CANCELLED)


def test_the_usage_of_a_row_is_its_counts() -> None:
    assert row_usage(row()) == (20, 5, 16)
    assert row_usage(row(prompt_tokens=0, output_tokens=0, cached_tokens=0)) == (0, 0, 0)


@pytest.mark.parametrize(("make", "words"), [
    (lambda: response_line(request(), row("too_long"), "x", MODEL, CREATED, TAG), "did not run"),
    (lambda: response_line(request(), row("error"), "x", MODEL, CREATED, TAG), "status 'error'"),
    (lambda: response_line(request(), row(), "x", MODEL, -1, TAG), "created -1"),
    (lambda: response_line(request(), row(), "x", MODEL, 1.5, TAG), "created 1.5"),
    (lambda: response_line(request(), row(), "x", MODEL, True, TAG), "created True"),
    (lambda: response_line(request(), row(prompt_tokens=-1), "x", MODEL, CREATED, TAG), "prompt_tokens -1"),
    (lambda: response_line(request(), row(output_tokens=None), "x", MODEL, CREATED, TAG), "output_tokens None"),
    (lambda: response_line(request(), row(cached_tokens=True), "x", MODEL, CREATED, TAG), "cached_tokens True"),
    (lambda: response_line(request(), row(cached_tokens="3"), "x", MODEL, CREATED, TAG), "cached_tokens '3'"),
    (lambda: response_line(request(), row(finish_reason=None), "x", MODEL, CREATED, TAG), "finish_reason None"),
    (lambda: row_usage({"prompt_tokens": 1, "output_tokens": 2, "item_id": 9}), "item 9: cached_tokens None"),
])
def test_what_cannot_make_a_line_is_a_typed_error(make, words: str) -> None:
    with pytest.raises(BatchOutputError, match=words):
        make()


def test_lines_are_ascii_json_that_reads_back_as_the_text() -> None:
    text = "Grüße, 世界 \U0001f600 \ud800"
    odd = request(custom_id="id-\ud800 \n")  # a lone surrogate: valid JSON, not UTF-8
    for line in (response_line(odd, row(), text, MODEL, CREATED, TAG), error_line(odd, 400, text, "p\udfff", tag=TAG)):
        assert line.isascii() and "\n" not in line
        parsed = json.loads(line)
        assert parsed["custom_id"] == "id-\ud800 \n"
    parsed = json.loads(response_line(odd, row(), text, MODEL, CREATED, TAG))
    assert parsed["response"]["body"]["choices"][0]["message"]["content"] == text


def test_an_embeddings_answer_is_openais_list_of_embeddings_in_input_order_with_usage():
    vectors = [np.array([0.6, -0.8], dtype="<f4"), np.array([1.0, 0.0], dtype="<f4")]
    encoded = [base64.b64encode(v.tobytes()).decode() for v in vectors]
    ran = row(prompt_tokens=9, output=[], output_tokens=0, finish_reason="stop", embeddings=encoded)
    line = json.loads(output.embedding_line(request(4, KIND_EMBEDDING), ran, "float", MODEL, CREATED, TAG))
    assert set(line) == LINE_KEYS and line["response"]["status_code"] == 200
    body = line["response"]["body"]
    assert body == {"id": f"embd-{TAG}-4", "object": "list", "created": CREATED, "model": MODEL,
                    "data": [{"object": "embedding", "index": 0, "embedding": vectors[0].tolist()},
                             {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]}],
                    "usage": {"prompt_tokens": 9, "total_tokens": 9}}
    as_base64 = json.loads(output.embedding_line(request(4, KIND_EMBEDDING), ran, "base64", MODEL, CREATED, TAG))
    assert [d["embedding"] for d in as_base64["response"]["body"]["data"]] == encoded  # vLLM's: float32, little-endian


@pytest.mark.parametrize("embeddings", [None, [], [7], ["not base64!"], [base64.b64encode(b"abc").decode()]])
def test_an_embeddings_row_without_whole_embeddings_is_refused(embeddings):
    with pytest.raises((BatchOutputError, ValueError)):
        output.embedding_line(request(4, KIND_EMBEDDING), row(embeddings=embeddings), "float", MODEL, CREATED, TAG)


TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=40)  # lone surrogates too


@settings(max_examples=300, derandomize=True, deadline=None)
@given(custom_id=TEXT, text=st.none() | TEXT, model=TEXT, finish=TEXT, kind=st.sampled_from([KIND_CHAT, KIND_COMPLETION]),
       index=st.integers(0, 1 << 40), created=st.integers(0, 1 << 40), counts=st.tuples(*[st.integers(0, 1 << 40)] * 3),
       tag=st.text("0123456789abcdef", min_size=1, max_size=12))
def test_a_plain_response_line_is_json_dumps_of_its_object(custom_id, text, model, finish, kind, index, created,
                                                          counts, tag):
    prompt, completion, cached = counts
    row = {"status": output.ROW_OK, "prompt_tokens": prompt, "output_tokens": completion, "cached_tokens": cached,
           "finish_reason": finish}
    request = RequestRef(custom_id, kind, index)
    line = response_line(request, row, text, model, created, tag)
    body = output._response_body(request, text, model, created, tag, finish, (prompt, completion, cached))
    assert line == output._line(request, tag, output.HTTP_OK, body)
    assert line.isascii() and json.loads(line)["response"]["body"]["usage"]["total_tokens"] == prompt + completion
