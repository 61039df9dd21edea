"""pipeline.batchjob.auditrules: the lines a job writes are OpenAI batch output lines, and each
way a line can differ from one is named; a 200 answer is held to its request (model, object,
choices, embeddings, usage); the tally sums as a job's summary does, and a summary that
disagrees is named figure by figure; problems keep the first examples, every one counted."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from pipeline.batchjob.auditrules import (
    INPUT_FILE,
    MISSING,
    OUTPUT_FILE,
    Problems,
    Tally,
    body_problem,
    custom_id_of,
    decode_line,
    line_problem,
    status_of,
    summary_problems,
)
from tests.batchjob.batchfiles import MODEL, answer, chat, completion


def embedding(custom_id: str = "e-1", **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": MODEL, "input": "A passage", **body}}


REQUESTS = [chat("c-1"), chat("c-3", n=3), completion("p-1"), completion("p-2", n=2), embedding("e-1"),
            embedding("e-3", input=["a", "b", "c"]), embedding("e-ids", input=[1, 2, 3])]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r["custom_id"])
@pytest.mark.parametrize("status", [200, 400, 500])
def test_the_lines_a_job_writes_are_well_formed_and_fit_their_request(request_: dict, status: int) -> None:
    found = decode_line(json.dumps(answer(request_, 7, status)).encode())
    assert line_problem(found) is None
    assert status_of(found) == status and custom_id_of(found) == request_["custom_id"]
    if status == 200:
        assert body_problem(request_["url"], request_["body"], found["response"]["body"]) is None


def test_a_failure_without_a_response_is_well_formed() -> None:
    line = {"id": "batch_req_1", "custom_id": "a", "response": None,
            "error": {"code": "batch_expired", "message": "This request could not be executed before the end."}}
    assert line_problem(line) is None and status_of(line) is None


def _damaged(change) -> dict:
    line = answer(chat("c-1"), 0)
    change(line)
    return line


LINE_DAMAGE = [
    (lambda line: line.pop("error"), "no 'error'"),
    (lambda line: line.update(extra=1), "unknown 'extra'"),
    (lambda line: line.update(id=""), "id must be a non-empty string"),
    (lambda line: line.update(custom_id=7), "custom_id must be a non-empty string, got an integer 7"),
    (lambda line: line.update(response=None), "response and error are both null"),
    (lambda line: line.update(error={"code": "x", "message": "y"}), "response and error are both given"),
    (lambda line: line["response"].update(status_code="200"), "response.status_code must be an HTTP status"),
    (lambda line: line["response"].update(status_code=99), "response.status_code must be an HTTP status"),
    (lambda line: line["response"].update(status_code=600), "response.status_code must be an HTTP status"),
    (lambda line: line["response"].pop("request_id"), "no 'request_id'"),
    (lambda line: line["response"].update(body=[]), "response.body must be an object"),
    (lambda line: line["response"].update(status_code=500), "OpenAI's error object"),
    (lambda line: line.update(response=None, error={"code": 1, "message": "m"}), "error.code must be a string"),
    (lambda line: line.update(response=None, error="boom"), "error must be an object or null"),
]


@pytest.mark.parametrize("change, words", LINE_DAMAGE, ids=[w for _, w in LINE_DAMAGE])
def test_each_way_a_line_is_not_an_openai_batch_output_line_is_named(change, words: str) -> None:
    why = line_problem(_damaged(change))
    assert why is not None and words in why, why


def test_an_error_body_needs_a_message_and_type_and_strings_or_null_for_param_and_code() -> None:
    line = answer(chat("c-1"), 0, 400)
    assert line_problem(line) is None
    for key, value, words in (("message", None, "error.message must be a string"),
                              ("type", 4, "error.type must be a string"),
                              ("param", 4, "error.param must be a string or null"),
                              ("code", [], "error.code must be a string or null")):
        broken = copy.deepcopy(line)
        broken["response"]["body"]["error"][key] = value
        assert words in line_problem(broken)


def test_what_is_not_json_or_not_an_object_is_said() -> None:
    assert decode_line(b'{"a": ').startswith("not JSON")
    assert line_problem(decode_line(b'{"a": ')).startswith("not JSON")
    assert line_problem(decode_line(b"[1, 2]")) == "not a JSON object: an array [1, 2]"
    assert decode_line(b'{"custom_id": "a\\ud800"}') == {"custom_id": "a\ud800"}  # JSON, though not UTF-8


def _body(request: dict, change=None) -> dict:
    body = answer(request, 0)["response"]["body"]
    if change is not None:
        change(body)
    return body


BODY_DAMAGE = [
    (chat("c"), lambda b: b.update(model="other"), 'model "other", the request asked for "tiny"'),
    (chat("c"), lambda b: b.update(object="text_completion"),
     "the answer of /v1/chat/completions is 'chat.completion'"),
    (completion("p"), lambda b: b.update(object="chat.completion"), "is 'text_completion'"),
    (embedding("e"), lambda b: b.update(object="embedding"), "the answer of /v1/embeddings is 'list'"),
    (chat("c", n=3), lambda b: b["choices"].pop(), "2 choices, the request asked for n=3"),
    (chat("c", n=2), lambda b: b["choices"].pop(), "1 choice, the request asked for n=2"),
    (chat("c"), lambda b: b["choices"].append(dict(b["choices"][0], index=1)), "2 choices, the request asked for one"),
    (chat("c", n=2), lambda b: b["choices"].reverse(), "choices[0] must be an object of index 0"),
    (chat("c"), lambda b: b["choices"][0].pop("message"), "choices[0].message must be an object with a role"),
    (completion("p"), lambda b: b["choices"][0].update(text=None), "choices[0].text must be a string"),
    (chat("c"), lambda b: b["choices"][0].update(finish_reason=None), "choices[0].finish_reason must be a string"),
    (embedding("e", input=["a", "b"]), lambda b: b["data"].pop(), "1 embedding, the request gave 2 inputs"),
    (embedding("e", input=["a"]), lambda b: b["data"].append(b["data"][0]), "2 embeddings, the request gave 1 input"),
    (embedding("e", input=["a", "b"]), lambda b: b["data"][1].update(index=0), "data[1] must be an embedding object"),
    (chat("c"), lambda b: b["usage"].update(total_tokens=1), "usage.total_tokens 1 is not prompt_tokens 12 + "
                                                               "completion_tokens 3"),
    (chat("c"), lambda b: b["usage"].pop("completion_tokens"), "usage.completion_tokens must be a count"),
    (chat("c"), lambda b: b["usage"].update(prompt_tokens=-1), "usage.prompt_tokens must be a count"),
    (chat("c"), lambda b: b["usage"]["prompt_tokens_details"].update(cached_tokens=13), "13 cached tokens of a "
                                                                                        "prompt of 12"),
    (chat("c"), lambda b: b.update(usage=None), "usage must be an object"),
    (embedding("e"), lambda b: b["usage"].update(total_tokens=0), "usage.total_tokens 0 is not prompt_tokens"),
]


@pytest.mark.parametrize("request_, change, words", BODY_DAMAGE, ids=[w[:40] for _, _, w in BODY_DAMAGE])
def test_each_way_a_200_answer_does_not_fit_its_request_is_named(request_: dict, change, words: str) -> None:
    assert body_problem(request_["url"], request_["body"], _body(request_)) is None
    why = body_problem(request_["url"], request_["body"], _body(request_, change))
    assert why is not None and words in why, why


def test_n_a_whole_number_asks_for_that_many_choices_as_the_job_reads_it() -> None:
    request_ = chat("c", n=2)
    body = _body(request_)
    assert body_problem(request_["url"], {**request_["body"], "n": 2.0}, body) is None
    assert "2 choices, the request asked for n=3" in body_problem(request_["url"], {**request_["body"], "n": 3.0}, body)


def test_an_endpoint_no_job_serves_is_held_to_its_model_and_usage_only() -> None:
    body = {"model": MODEL, "object": "response", "usage": {"prompt_tokens": 3, "total_tokens": 3}}
    assert body_problem("/v1/responses", {"model": MODEL}, body) is None
    assert "model" in body_problem("/v1/responses", {"model": "x"}, body)


def test_an_embeddings_answer_to_a_request_a_job_refuses_is_named() -> None:
    request_ = embedding("e", input=[])
    assert "answered 200, but the request is one a job refuses" in body_problem(
        request_["url"], request_["body"], _body(embedding("e")))


def _tally(*lines: dict) -> Tally:
    tally = Tally()
    for line in lines:
        tally.count(line)
    tally.check_invariants()
    return tally


def test_the_tally_counts_lines_by_status_and_sums_the_usage_of_the_200_answers() -> None:
    tally = _tally(answer(chat("a"), 0, tokens=(10, 2, 4)), answer(chat("b"), 1, tokens=(7, 1, 0)),
                   answer(chat("c"), 2, 400), answer(chat("d"), 3, 500), answer(embedding("e"), 4, tokens=(5, 0, 0)))
    assert (tally.completed, tally.failed, tally.lines) == (3, 2, 5)
    assert tally.failed_by_status() == {400: 1, 500: 1}
    assert tally.as_json()["usage"] == {"prompt_tokens": 22, "completion_tokens": 3, "total_tokens": 25,
                                        "cached_tokens": 4}


def _summary(tally: Tally, requests: int) -> dict:
    """A summary as the job writes it (job.JobSummary.as_json's figures)."""
    return {"job": {"request_counts": {"total": requests, "completed": tally.completed, "failed": tally.failed},
                    "failed_by_status": {str(k): v for k, v in tally.failed_by_status().items()},
                    "usage": {"prompt_tokens": tally.prompt_tokens, "completion_tokens": tally.completion_tokens,
                              "total_tokens": tally.total_tokens, "cached_tokens": tally.cached_tokens},
                    "cached_share": None, "this_run": {}, "output_written": True}}


def test_a_summary_that_agrees_says_nothing_and_each_figure_that_does_not_is_named() -> None:
    tally = _tally(answer(chat("a"), 0), answer(chat("b"), 1, 400))
    summary = _summary(tally, 2)
    assert summary_problems(summary, 2, tally) == []
    assert summary_problems(summary, 3, tally) == ["request_counts.total is 2, the input holds 3"]
    for path, value in (("request_counts.completed", 2), ("request_counts.failed", 0), ("usage.prompt_tokens", 1),
                        ("usage.completion_tokens", True), ("usage.total_tokens", "15"), ("usage.cached_tokens", None)):
        broken = copy.deepcopy(summary)
        outer, key = path.split(".")
        broken["job"][outer][key] = value
        (why,) = summary_problems(broken, 2, tally)
        assert why.startswith(f"{path} is {json.dumps(value)}, "), why
    broken = copy.deepcopy(summary)
    broken["job"]["failed_by_status"] = {"500": 1}
    assert summary_problems(broken, 2, tally) == ['failed_by_status is {"500": 1}, the files hold {"400": 1}']
    broken["job"] = dict(summary["job"], output_written=False)
    assert summary_problems(broken, 2, tally) == ["output_written is false: the job did not finish its output"]
    assert summary_problems([], 2, tally)[0].startswith('not a job\'s summary (no "job" object)')


def test_problems_are_all_counted_and_the_first_by_file_and_line_kept() -> None:
    problems = Problems(limit=3)
    for line in range(100, 0, -1):
        problems.add(MISSING, INPUT_FILE, line, f"line {line}")
        problems.check_invariants()
    problems.add(MISSING, OUTPUT_FILE, 1, "in the output")
    assert problems.count(MISSING) == 101 and problems.total == 101
    assert [e.line for e in problems.shown(MISSING)] == [1, 2, 3]
    problems.add_many(MISSING, INPUT_FILE, np.array([9, 0, 5, 7], dtype=np.uint64), np.array([90, 0, 50, 70]))
    problems.check_invariants()
    assert problems.count(MISSING) == 105
    assert [(e.line, e.offset, e.text) for e in problems.shown(MISSING)] == [(0, 0, None), (1, 0, "line 1"),
                                                                             (2, 0, "line 2")]
