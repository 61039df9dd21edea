"""`pipeline run-batch` with /v1/embeddings requests on the sim engine: one OpenAI embeddings
response per request (one embedding per input, in order, with usage), the same input always
the same embedding, and each endpoint the runner does not serve answered 400 with vLLM's
run-batch message."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.support.jobs import build_model, chat, embedding, rows_by_id, run_batch, write_requests

pytestmark = pytest.mark.integration

# The tiny model's hidden size: the sim's embeddings are as large as the model's.
TINY_EMBEDDING_SIZE = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def _vectors(body: dict) -> list[np.ndarray]:
    out = []
    for k, item in enumerate(body["data"]):
        assert item["object"] == "embedding" and item["index"] == k
        value = item["embedding"]
        out.append(np.frombuffer(base64.b64decode(value), "<f4") if isinstance(value, str) else np.array(value))
    return out


def test_an_embeddings_job_answers_each_request_in_one_line_with_every_input_and_usage(tmp_path, model_dir):
    records = [embedding(f"text-{k}", f"passage number {k} " * (1 + k % 5)) for k in range(24)]
    records += [embedding("list", ["passage number 3 " * 4, "another one", "a third"]),
                embedding("ids", [[5, 6, 7], [8, 9]]), embedding("one-ids", [11, 12, 13, 14]),
                embedding("base64", ["another one"], encoding_format="base64", user="someone"),
                embedding("dimensions", "x", dimensions=8), chat("chat")]
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(write_requests(tmp_path / "r.jsonl", records)), "-o", str(out), "--model", model_dir,
                     "--runner", "pooling")
    assert done.returncode == 0, done.stderr
    rows = rows_by_id(out)
    assert list(rows) == [r["custom_id"] for r in records]  # one line each, in input order
    bodies = {name: row["response"]["body"] for name, row in rows.items() if row["response"]["status_code"] == 200}
    assert set(rows) - set(bodies) == {"dimensions", "chat"}
    for name, body in bodies.items():
        assert (body["object"], body["model"], body["id"].startswith("embd-")) == ("list", "tiny-llama", True)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        for vector in _vectors(body):
            assert vector.shape == (TINY_EMBEDDING_SIZE,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-5
    assert [len(body["data"]) for body in (bodies["list"], bodies["ids"], bodies["one-ids"])] == [3, 2, 1]
    assert bodies["ids"]["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    assert bodies["one-ids"]["usage"]["prompt_tokens"] == 4
    text_3 = _vectors(bodies["text-3"])[0]
    assert np.array_equal(_vectors(bodies["list"])[0], text_3.astype(np.float32))  # the same input, the same answer
    assert np.array_equal(_vectors(bodies["base64"])[0], _vectors(bodies["list"])[1].astype(np.float32))
    assert isinstance(bodies["base64"]["data"][0]["embedding"], str)
    errors = {name: rows[name]["response"]["body"]["error"] for name in ("dimensions", "chat")}
    assert "does not support Matryoshka embeddings" in errors["dimensions"]["message"]
    assert errors["chat"]["message"] == "Model does not support endpoint: /v1/chat/completions"
    assert "28 completed, 2 failed (2 with status 400)" in done.stderr


def test_a_generating_job_refuses_embeddings_with_vllms_message_and_runs_the_rest(tmp_path, model_dir):
    records = [chat("chat"), embedding("embed")]
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(write_requests(tmp_path / "r.jsonl", records)), "-o", str(out), "--model", model_dir)
    assert done.returncode == 0, done.stderr
    rows = rows_by_id(out)
    assert rows["chat"]["response"]["status_code"] == 200
    error = rows["embed"]["response"]["body"]["error"]
    assert rows["embed"]["response"]["status_code"] == 400
    assert (error["message"], error["param"]) == ("Model does not support endpoint: /v1/embeddings", "url")


def test_inputs_past_the_context_or_past_one_item_together_are_refused_naming_the_limit(tmp_path, model_dir):
    records = [embedding("long", ["short", "word " * 3000]), embedding("together", [[5] * 60, [6] * 60]),
               embedding("fits", [[5] * 60, [6] * 40])]
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(write_requests(tmp_path / "r.jsonl", records)), "-o", str(out), "--model", model_dir,
                     "--runner", "pooling", "--max-input-len", "100")
    assert done.returncode == 0, done.stderr
    rows = rows_by_id(out)
    long, together = (rows[name]["response"]["body"]["error"] for name in ("long", "together"))
    assert "maximum context length is 2048 tokens" in long["message"] and "(input 1)" in long["message"]
    assert long["code"] == together["code"] == "context_length_exceeded" and long["param"] == "input"
    assert "the 2 inputs are 120 tokens together, more than the 100" in together["message"]
    assert rows["fits"]["response"]["body"]["usage"]["prompt_tokens"] == 100  # at the limit


def test_an_input_with_no_tokens_or_an_id_past_the_vocabulary_is_named_as_an_embeddings_input(tmp_path, model_dir):
    records = [embedding("empty", ""), embedding("second-empty", ["a passage", ""]),
               embedding("past-vocabulary", [[5], [1_000_000]]), embedding("int8", "x", encoding_format="int8")]
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(write_requests(tmp_path / "r.jsonl", records)), "-o", str(out), "--model", model_dir,
                     "--runner", "pooling")
    assert done.returncode == 0, done.stderr
    errors = {name: row["response"]["body"]["error"] for name, row in rows_by_id(out).items()}
    assert {name: error["param"] for name, error in errors.items()} == {
        "empty": "input", "second-empty": "input", "past-vocabulary": "input", "int8": "encoding_format"}
    assert errors["empty"]["message"] == 'the embeddings input has no tokens, got a string ""'
    assert errors["second-empty"]["message"] == 'the embeddings input[1] has no tokens, got a string ""'
    assert errors["past-vocabulary"]["message"].startswith("input[1][0] is an integer 1000000: a token id is an "
                                                           "integer in [0, ")
    assert errors["int8"]["message"] == "Invalid value: 'int8'. Supported values are: 'float' and 'base64'."
