"""pipeline.batchjob.output: OpenAI Batch output lines with exactly OpenAI's keys and ids that
do not change between runs of a job, and an output file written whole or not at all."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.batchjob import output
from pipeline.batchjob.output import (
    CODE_CONTEXT_LENGTH,
    ID_HASH_CHARS,
    OUTPUT_FILE_MODE,
    Usage,
    error_line,
    response_line,
    row_line,
    usage_totals,
    write_output,
)
from pipeline.batchjob.requests import CHAT_URL, COMPLETIONS_URL, KIND_CHAT, KIND_COMPLETION, BatchRequest
from pipeline.consumer import results
from pipeline.wire.errors import BatchOutputError, StorageError
from pipeline.wire.generation import GenerationParams
from tests.consumer.tmpfs import fill, small_tmpfs

JOB = hashlib.sha256(b"the job's input file").hexdigest()
OTHER_JOB = hashlib.sha256(b"another input file").hexdigest()
CREATED = 1_760_000_000
MODEL = "tiny"

LINE_KEYS = {"id", "custom_id", "response", "error"}
RESPONSE_KEYS = {"status_code", "request_id", "body"}
BODY_KEYS = {"id", "object", "created", "model", "choices", "usage"}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
ERROR_KEYS = {"message", "type", "param", "code"}


def request(index: int = 3, kind: str | None = KIND_CHAT, error: str | None = None,
            param: str | None = None) -> BatchRequest:
    url = CHAT_URL if kind == KIND_CHAT else COMPLETIONS_URL
    messages = [{"role": "user", "content": "Hi"}] if kind == KIND_CHAT and error is None else None
    prompt = "Once" if kind == KIND_COMPLETION and error is None else None
    return BatchRequest(index, index + 1, f"req-{index}", url, kind, messages, prompt, GenerationParams(), error,
                        param)


def row(status: str = "ok", **fields: object) -> dict:
    base = {"item_id": 7, "batch_id": 1, "dispatch_ns": 10, "submit_ns": 11, "done_ns": 12, "pad_to_tokens": 32,
            "status": status, "prompt_tokens": 20, "cached_tokens": 16, "output_tokens": 5, "output": [1, 2, 3, 4, 5],
            "finish_reason": "stop", "payload": ""}
    return {**base, **fields}


def test_a_chat_response_has_exactly_openais_keys_and_values() -> None:
    line = json.loads(response_line(request(), row(), "Hello there.", MODEL, CREATED, JOB))
    tag = JOB[:ID_HASH_CHARS]
    assert set(line) == LINE_KEYS and line["error"] is None
    assert line["id"] == f"batch_req_{tag}_3" and line["custom_id"] == "req-3"
    response = line["response"]
    assert set(response) == RESPONSE_KEYS
    assert response["status_code"] == 200 and response["request_id"] == f"req_{tag}_3"
    body = response["body"]
    assert set(body) == BODY_KEYS
    assert body["id"] == f"chatcmpl-{tag}-3" and body["object"] == "chat.completion"
    assert body["created"] == CREATED and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "Hello there."}, "logprobs": None,
                      "finish_reason": "stop"}
    assert set(body["usage"]) == USAGE_KEYS
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
                             "prompt_tokens_details": {"cached_tokens": 16}}


def test_a_completion_response_has_exactly_openais_keys() -> None:
    line = json.loads(response_line(request(0, KIND_COMPLETION), row(finish_reason="length"), " there was", MODEL,
                                    CREATED, JOB))
    body = line["response"]["body"]
    assert set(line) == LINE_KEYS and set(line["response"]) == RESPONSE_KEYS and set(body) == BODY_KEYS
    assert body["id"] == f"cmpl-{JOB[:ID_HASH_CHARS]}-0" and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": " there was", "logprobs": None, "finish_reason": "length"}]
    assert set(body["usage"]) == USAGE_KEYS


def test_ids_are_the_same_on_every_run_and_differ_by_request_and_by_job() -> None:
    first = response_line(request(3), row(), "x", MODEL, CREATED, JOB)
    assert response_line(request(3), row(done_ns=999), "x", MODEL, CREATED, JOB) == first
    ids = {json.loads(response_line(request(k), row(), "x", MODEL, CREATED, job))["id"]
           for k in range(5) for job in (JOB, OTHER_JOB)}
    assert len(ids) == 10


def test_an_error_line_carries_openais_error_object_in_the_body() -> None:
    line = json.loads(error_line(request(2), 400, "n=2 is not supported", "n", job_hash=JOB))
    assert set(line) == LINE_KEYS and line["error"] is None
    assert line["id"] == f"batch_req_{JOB[:ID_HASH_CHARS]}_2" and line["custom_id"] == "req-2"
    assert set(line["response"]) == RESPONSE_KEYS and line["response"]["status_code"] == 400
    assert line["response"]["request_id"] == f"req_{JOB[:ID_HASH_CHARS]}_2"
    assert line["response"]["body"] == {"error": {"message": "n=2 is not supported", "type": "invalid_request_error",
                                                  "param": "n", "code": None}}
    server = json.loads(error_line(request(2), 500, "boom", job_hash=JOB))["response"]
    assert server["status_code"] == 500 and set(server["body"]["error"]) == ERROR_KEYS
    assert server["body"]["error"]["type"] == "server_error" and server["body"]["error"]["param"] is None


def test_an_error_line_takes_400_or_500_only() -> None:
    with pytest.raises(BatchOutputError, match="status code 404"):
        error_line(request(), 404, "no", job_hash=JOB)


def test_a_refused_request_is_answered_400_naming_its_parameter() -> None:
    refused = request(1, KIND_CHAT, error="unsupported parameter 'top_k'", param="top_k")
    line = json.loads(row_line(refused, None, None, served_model=MODEL, created=CREATED, job_hash=JOB))
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"] == {"message": "unsupported parameter 'top_k'",
                                                 "type": "invalid_request_error", "param": "top_k", "code": None}


@pytest.mark.parametrize(("status", "kind", "code", "param", "error_type", "words"), [
    ("too_long", KIND_CHAT, 400, "messages", "invalid_request_error", "the prompt is 20 tokens"),
    ("too_long", KIND_COMPLETION, 400, "prompt", "invalid_request_error", "the prompt is 20 tokens"),
    ("error", KIND_CHAT, 500, None, "server_error", "the engine failed this request: CUDA out of memory"),
    ("corrupt", KIND_COMPLETION, 500, None, "server_error", "damaged"),
])
def test_a_row_that_did_not_run_is_answered_by_its_status(status: str, kind: str, code: int, param: str | None,
                                                          error_type: str, words: str) -> None:
    line = json.loads(row_line(request(0, kind), row(status, error="CUDA out of memory", finish_reason=None),
                               None, served_model=MODEL, created=CREATED, job_hash=JOB))
    assert set(line) == LINE_KEYS and line["error"] is None
    assert line["response"]["status_code"] == code
    error = line["response"]["body"]["error"]
    assert set(error) == ERROR_KEYS and error["type"] == error_type and error["param"] == param
    assert words in error["message"]
    assert error["code"] == (CODE_CONTEXT_LENGTH if status == "too_long" else None)


def test_an_ok_row_is_answered_with_its_text() -> None:
    line = json.loads(row_line(request(), row(), "Hi!", served_model=MODEL, created=CREATED, job_hash=JOB))
    assert line["response"]["status_code"] == 200
    assert line["response"]["body"]["choices"][0]["message"]["content"] == "Hi!"


def test_the_row_statuses_are_the_results_files_words() -> None:
    assert (output.ROW_OK, output.ROW_TOO_LONG, output.ROW_CORRUPT, output.ROW_ERROR) == (
        results.STATUS_OK, results.STATUS_TOO_LONG, results.STATUS_CORRUPT, results.STATUS_ERROR)


@pytest.mark.parametrize(("make", "words"), [
    (lambda: response_line(request(), row("too_long"), "x", MODEL, CREATED, JOB), "did not run"),
    (lambda: response_line(request(error="bad", param="n"), row(), "x", MODEL, CREATED, JOB), "did not run"),
    (lambda: response_line(request(), row(), "x", MODEL, -1, JOB), "created -1"),
    (lambda: response_line(request(), row(), "x", MODEL, 1.5, JOB), "created 1.5"),
    (lambda: response_line(request(), row(prompt_tokens=-1), "x", MODEL, CREATED, JOB), "prompt_tokens -1"),
    (lambda: response_line(request(), row(output_tokens=None), "x", MODEL, CREATED, JOB), "output_tokens None"),
    (lambda: response_line(request(), row(finish_reason=None), "x", MODEL, CREATED, JOB), "finish_reason None"),
    (lambda: response_line(request(), row(), "x", MODEL, CREATED, "not-a-hash"), "job hash"),
    (lambda: response_line(request(), row(), "x", MODEL, CREATED, JOB[:ID_HASH_CHARS - 1]), "job hash"),
    (lambda: row_line(request(), None, None, served_model=MODEL, created=CREATED, job_hash=JOB), "no results row"),
    (lambda: row_line(request(), row("lost"), None, served_model=MODEL, created=CREATED, job_hash=JOB),
     "unknown status 'lost'"),
])
def test_what_cannot_make_a_line_is_a_typed_error(make, words: str) -> None:
    with pytest.raises(BatchOutputError, match=words):
        make()


def test_lines_are_ascii_json_that_reads_back_as_the_text() -> None:
    text = "Grüße, 世界 \U0001f600"
    odd = request()
    odd.custom_id = "id-\ud800"  # a lone surrogate: valid JSON, not UTF-8
    line = response_line(odd, row(), text, MODEL, CREATED, JOB)
    assert line.isascii() and "\n" not in line
    parsed = json.loads(line)
    assert parsed["custom_id"] == "id-\ud800" and parsed["response"]["body"]["choices"][0]["message"]["content"] == text


def test_usage_totals_sum_the_rows_that_ran() -> None:
    rows = [row(), row(prompt_tokens=100, cached_tokens=0, output_tokens=1), row("too_long", prompt_tokens=9999),
            row("error", prompt_tokens=50)]
    assert usage_totals(rows) == Usage(prompt_tokens=120, completion_tokens=6, total_tokens=126, cached_tokens=16)
    assert usage_totals([]) == Usage(0, 0, 0, 0)


# --- writing the file -------------------------------------------------------------------------


def _leftovers(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".tmp"))


def test_the_output_is_written_whole_owner_only_and_replaces_an_older_one(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text("old\n")
    os.chmod(path, 0o644)
    write_output(path, (f'{{"n":{k}}}' for k in range(3)))
    assert path.read_text() == '{"n":0}\n{"n":1}\n{"n":2}\n'
    assert os.stat(path).st_mode & 0o777 == OUTPUT_FILE_MODE
    assert _leftovers(tmp_path) == []
    write_output(path, [])
    assert path.read_text() == ""


def test_a_failure_in_the_middle_leaves_the_older_output_and_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text("the older output\n")

    def lines() -> Iterator[str]:
        yield '{"n":0}'
        yield "x" * (1 << 20)  # past the file object's buffer: some bytes reach the temporary file
        raise RuntimeError("the results went away")

    with pytest.raises(RuntimeError, match="went away"):
        write_output(path, lines())
    assert path.read_text() == "the older output\n"
    assert _leftovers(tmp_path) == []


def test_a_failure_without_an_older_output_leaves_nothing(tmp_path: Path) -> None:
    def lines() -> Iterator[str]:
        yield "{}"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_output(tmp_path / "results.jsonl", lines())
    assert os.listdir(tmp_path) == []


def test_a_full_disk_is_an_output_error_and_leaves_the_older_output(tmp_path: Path) -> None:
    with small_tmpfs(str(tmp_path / "disk")) as disk:
        path = Path(disk) / "results.jsonl"
        path.write_text("the older output\n")
        fill(disk)
        with pytest.raises(BatchOutputError, match="ENOSPC") as caught:
            write_output(path, ("y" * 1000 for _ in range(1000)))
        assert isinstance(caught.value, StorageError)
        assert "older output left as it was" in str(caught.value)
        assert path.read_text() == "the older output\n"
        assert _leftovers(Path(disk)) == []


def test_a_missing_directory_or_a_directory_in_the_way_is_an_output_error(tmp_path: Path) -> None:
    with pytest.raises(BatchOutputError, match="cannot create the output file's temporary file"):
        write_output(tmp_path / "absent" / "results.jsonl", ["{}"])
    (tmp_path / "results.jsonl").mkdir()
    with pytest.raises(BatchOutputError, match="writing the output failed"):
        write_output(tmp_path / "results.jsonl", ["{}"])
    assert _leftovers(tmp_path) == []
