"""pipeline.batchjob.requests: a batch file is checked whole; the file's problems refuse the job
(path:line named, the first 10 and the total), a request's own problems become its error."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pipeline.batchjob import requests as batch_requests
from pipeline.batchjob.requests import (
    CHAT_URL,
    COMPLETIONS_URL,
    KIND_CHAT,
    KIND_COMPLETION,
    MAX_REQUEST_LINE_BYTES,
    load_requests,
)
from pipeline.producer.workload import MAX_LISTED_ERRORS
from pipeline.wire.errors import BadInputError, BatchFileError, WorkloadError
from pipeline.wire.generation import MAX_STOP_STRINGS, GenerationParams

MODEL = "tiny"


def chat(custom_id: str = "req-1", **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body}}


def completion(custom_id: str = "req-1", **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS_URL,
            "body": {"model": MODEL, "prompt": "Once upon a time", **body}}


def write(path: Path, *lines: object) -> Path:
    """Each line: a dict (as JSON), or a str / bytes written as it is."""
    data = b"".join((line if isinstance(line, bytes) else
                     (line if isinstance(line, str) else json.dumps(line)).encode()) + b"\n" for line in lines)
    path.write_bytes(data)
    return path


def one(tmp_path: Path, line: dict):
    """The one request of a file holding `line`."""
    (request,) = load_requests(write(tmp_path / "in.jsonl", line), MODEL).requests
    return request


def refusal(tmp_path: Path, *lines: object) -> str:
    with pytest.raises(BatchFileError) as caught:
        load_requests(write(tmp_path / "in.jsonl", *lines), MODEL)
    return str(caught.value)


# --- a good file ------------------------------------------------------------------------------


def test_a_good_file_gives_its_requests_in_order_with_their_lines_hash_and_counts(tmp_path: Path) -> None:
    path = write(tmp_path / "in.jsonl",
                 chat("a", max_completion_tokens=64, temperature=0, stop=["\n\n", "END"], seed=7, top_p=0.9),
                 "", "   ",
                 completion("b", prompt=[1, 2, 3], max_tokens=5, stop="."),
                 completion("c", n=3))
    batch = load_requests(path, MODEL)
    a, b, c = batch.requests
    assert (a.index, a.line, a.custom_id, a.url, a.kind) == (0, 1, "a", CHAT_URL, KIND_CHAT)
    assert a.messages == [{"role": "user", "content": "Hi"}] and a.prompt is None and a.error is None
    assert a.params == GenerationParams(max_tokens=64, temperature=0, top_p=0.9, seed=7, stop=("\n\n", "END"))
    assert (b.index, b.line, b.kind, b.prompt, b.messages) == (1, 4, KIND_COMPLETION, [1, 2, 3], None)
    assert b.params == GenerationParams(max_tokens=5, stop=(".",))
    assert (c.index, c.line, c.error_param) == (2, 5, "n")
    assert batch.path == str(path)
    assert batch.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (batch.chat_count, batch.completion_count, batch.error_count) == (1, 1, 1)


def test_the_error_is_a_workload_error_and_a_bad_input_error() -> None:
    assert issubclass(BatchFileError, WorkloadError) and issubclass(BatchFileError, BadInputError)


def test_a_file_without_a_last_newline_reads_its_last_line(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(chat("a")) + "\n" + json.dumps(chat("b")))
    assert [r.custom_id for r in load_requests(path, MODEL).requests] == ["a", "b"]


# --- the file's problems ----------------------------------------------------------------------


def _without(line: dict, key: str) -> dict:
    line = dict(line)
    del line[key]
    return line


FILE_PROBLEMS = [
    ("not json", '{"custom_id": "x",', "not JSON"),
    ("not utf-8", b'{"custom_id": "\xff"}', "not UTF-8"),
    ("an array", "[1, 2]", "must be a JSON object, got an array"),
    ("a string", '"hello"', "must be a JSON object, got a string"),
    ("no custom_id", _without(chat(), "custom_id"), "missing 'custom_id'"),
    ("no method", _without(chat(), "method"), "missing 'method'"),
    ("no url", _without(chat(), "url"), "missing 'url'"),
    ("no body", _without(chat(), "body"), "missing 'body'"),
    ("two missing", _without(_without(chat(), "body"), "url"), "missing 'url', 'body'"),
    ("unknown key", {**chat(), "priority": 1}, "unknown key 'priority'"),
    ("custom_id a number", {**chat(), "custom_id": 17}, "custom_id must be a non-empty string, got a number 17"),
    ("custom_id empty", {**chat(), "custom_id": ""}, "custom_id must be a non-empty string"),
    ("custom_id null", {**chat(), "custom_id": None}, "custom_id must be a non-empty string, got null"),
    ("method GET", {**chat(), "method": "GET"}, "method must be 'POST'"),
    ("method lower case", {**chat(), "method": "post"}, "method must be 'POST'"),
    ("url a number", {**chat(), "url": 5}, "url must be a string"),
    ("body an array", {**chat(), "body": []}, "body must be a JSON object"),
    ("body null", {**chat(), "body": None}, "body must be a JSON object (the endpoint's request), got null"),
]


@pytest.mark.parametrize(("line", "why"), [(line, why) for _, line, why in FILE_PROBLEMS],
                         ids=[name for name, _, _ in FILE_PROBLEMS])
def test_a_line_that_is_not_a_request_refuses_the_file_naming_path_and_line(tmp_path: Path, line: object,
                                                                            why: str) -> None:
    message = refusal(tmp_path, chat("good"), line)
    path = tmp_path / "in.jsonl"
    assert f"{path}: 1 bad line;" in message and "the job does not start" in message
    assert f"{path}:2: " in message and why in message
    assert f"{path}:1:" not in message


def test_the_first_ten_bad_lines_are_listed_with_the_total(tmp_path: Path) -> None:
    bad = [{**chat(f"r{k}"), "method": "GET"} for k in range(15)]
    message = refusal(tmp_path, chat("good"), *bad)
    path = tmp_path / "in.jsonl"
    assert "15 bad lines" in message and f"the first {MAX_LISTED_ERRORS}" in message
    listed = [line.removeprefix(f"  {path}:") for line in message.splitlines()[1:]]
    assert [line.split(":")[0] for line in listed] == [str(n) for n in range(2, 2 + MAX_LISTED_ERRORS)]


def test_a_duplicate_custom_id_names_both_lines(tmp_path: Path) -> None:
    message = refusal(tmp_path, chat("a"), chat("b"), completion("a"))
    assert f"{tmp_path / 'in.jsonl'}:3: custom_id 'a' is used by line 1 too" in message


def test_every_duplicate_is_named_against_the_first_line(tmp_path: Path) -> None:
    message = refusal(tmp_path, chat("a"), chat("a"), chat("a"))
    assert "2 bad lines" in message
    assert ":2: custom_id 'a' is used by line 1" in message and ":3: custom_id 'a' is used by line 1" in message


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "blank"])
def test_a_file_without_requests_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(text)
    with pytest.raises(BatchFileError, match="no requests"):
        load_requests(path, MODEL)


def test_a_missing_file_a_directory_and_a_device_are_refused(tmp_path: Path) -> None:
    with pytest.raises(BatchFileError, match="cannot read the batch file"):
        load_requests(tmp_path / "absent.jsonl", MODEL)
    with pytest.raises(BatchFileError, match="cannot read the batch file"):
        load_requests(tmp_path, MODEL)
    with pytest.raises(BatchFileError, match="must be a file or a pipe, not a device"):
        load_requests("/dev/zero", MODEL)


def _line_of(size: int) -> bytes:
    """A chat request line of exactly `size` bytes (without its newline)."""
    line = chat("big")
    line["body"]["messages"][0]["content"] = ""
    pad = size - len(json.dumps(line).encode())
    line["body"]["messages"][0]["content"] = "a" * pad
    raw = json.dumps(line).encode()
    assert len(raw) == size
    return raw


def test_a_line_at_the_size_limit_is_read_and_one_byte_more_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "in.jsonl", _line_of(MAX_REQUEST_LINE_BYTES), chat("next"))
    batch = load_requests(path, MODEL)
    assert [r.custom_id for r in batch.requests] == ["big", "next"]
    assert len(batch.requests[0].messages[0]["content"]) > MAX_REQUEST_LINE_BYTES - 200
    message = refusal(tmp_path, chat("first"), _line_of(MAX_REQUEST_LINE_BYTES + 1), chat("next"))
    assert f"{tmp_path / 'in.jsonl'}:2: longer than {MAX_REQUEST_LINE_BYTES:,} bytes" in message
    assert "1 bad line;" in message


def test_requests_up_to_the_limit_are_read_and_one_more_stops_the_file(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The real limit is a million requests; the check is the same at 3.
    monkeypatch.setattr(batch_requests, "MAX_BATCH_REQUESTS", 3)
    lines = [chat(f"r{k}") for k in range(4)]
    assert len(load_requests(write(tmp_path / "in.jsonl", *lines[:3]), MODEL).requests) == 3
    message = refusal(tmp_path, *lines, {"not": "a request"})
    assert f"{tmp_path / 'in.jsonl'}:4: more than 3 requests in one file" in message
    assert "up to line 4, where reading stopped" in message and ":5:" not in message


def test_a_request_with_an_error_counts_against_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_requests, "MAX_BATCH_REQUESTS", 2)
    message = refusal(tmp_path, chat("a", n=2), chat("b", top_k=1), chat("c"))
    assert ":3: more than 2 requests" in message


# --- a request's own problems -----------------------------------------------------------------


def _messages(*messages: object) -> dict:
    return {"messages": list(messages)}


REQUEST_PROBLEMS = [
    # (name, the line, the parameter named, in the message)
    ("endpoint", {**chat(), "url": "/v1/embeddings"}, "url", "unsupported endpoint '/v1/embeddings'"),
    ("n 2", chat(n=2), "n", "n=2 is not supported"),
    ("n true", chat(n=True), "n", "n=true is not supported"),
    ("stream", chat(stream=True), "stream", "stream=true is not supported"),
    ("stream_options", chat(stream_options={"include_usage": True}), "stream_options", "not streamed"),
    ("another model", chat(model="big"), "model", "the model a string \"big\" is not served by this job"),
    ("no model", {**chat(), "body": {"messages": [{"role": "user", "content": "x"}]}}, "model",
     "you must provide a model"),
    ("model a number", chat(model=3), "model", "a number 3"),
    ("logprobs", chat(logprobs=True), "logprobs", "log probabilities"),
    ("top_logprobs", chat(top_logprobs=2), "top_logprobs", "top_logprobs=2"),
    ("completion logprobs", completion(logprobs=1), "logprobs", "logprobs=1"),
    ("logit_bias", chat(logit_bias={"50256": -100}), "logit_bias", "bias"),
    ("presence_penalty", chat(presence_penalty=0.5), "presence_penalty", "presence_penalty=0.5"),
    ("frequency_penalty", chat(frequency_penalty=1), "frequency_penalty", "frequency penalty"),
    ("best_of", completion(best_of=2), "best_of", "best_of must be 1"),
    ("echo", completion(echo=True), "echo", "not echoed"),
    ("suffix", completion(suffix="!"), "suffix", "suffix"),
    ("tools", chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "no tool calls"),
    ("tool_choice", chat(tool_choice="auto"), "tool_choice", "tool_choice=\"auto\""),
    ("functions", chat(functions=[{"name": "f"}]), "functions", "function calls"),
    ("response_format", chat(response_format={"type": "json_object"}), "response_format", "only text"),
    ("unknown", chat(top_k=5), "top_k", "unsupported parameter 'top_k'"),
    ("unknowns listed", chat(top_k=5, min_p=0.1, repetition_penalty=1.1), "min_p",
     "unsupported parameters 'min_p', 'repetition_penalty', 'top_k'"),
    ("max_completion_tokens on a completion", completion(max_completion_tokens=5), "max_completion_tokens",
     "unsupported parameter 'max_completion_tokens'"),
    ("no messages", {**chat(), "body": {"model": MODEL}}, "messages", "missing required parameter 'messages'"),
    ("messages an object", chat(messages={"role": "user"}), "messages", "must be a non-empty array"),
    ("messages empty", chat(messages=[]), "messages", "must be a non-empty array"),
    ("message a string", chat(**_messages("hi")), "messages[0]", "messages[0] must be an object"),
    ("role tool", chat(**_messages({"role": "tool", "content": "42", "tool_call_id": "c"})), "messages[0].tool_call_id",
     "'tool_call_id'"),
    ("role tool alone", chat(**_messages({"role": "tool", "content": "42"})), "messages[0].role", "\"tool\""),
    ("role unknown", chat(**_messages({"role": "robot", "content": "x"})), "messages[0].role", "\"robot\""),
    ("no role", chat(**_messages({"content": "x"})), "messages[0].role", "role null"),
    ("tool_calls", chat(**_messages({"role": "assistant", "content": "x", "tool_calls": []})),
     "messages[0].tool_calls", "no tool calls"),
    ("content a number", chat(**_messages({"role": "user", "content": 5})), "messages[0].content",
     "content must be a string or a non-empty array of text parts"),
    ("no content", chat(**_messages({"role": "user"})), "messages[0].content", "got null"),
    ("content parts empty", chat(**_messages({"role": "user", "content": []})), "messages[0].content",
     "non-empty array"),
    ("an image part", chat(**_messages({"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]})),
     "messages[1].content[1]", "messages[1].content[1] is of type 'image_url': this job takes text only"),
    ("an audio part", chat(**_messages({"role": "user", "content": [{"type": "input_audio"}]})),
     "messages[0].content[0]", "'input_audio'"),
    ("a text part without text", chat(**_messages({"role": "user", "content": [{"type": "text"}]})),
     "messages[0].content[0]", "must be a text part"),
    ("a part a string", chat(**_messages({"role": "user", "content": ["x"]})), "messages[0].content[0]",
     "must be a text part"),
    ("name a number", chat(**_messages({"role": "user", "content": "x", "name": 5})), "messages[0].name",
     "name must be a string"),
    ("no prompt", {**completion(), "body": {"model": MODEL}}, "prompt", "missing required parameter 'prompt'"),
    ("several prompts", completion(prompt=["a", "b"]), "prompt", "a list of 2 prompts"),
    ("several token prompts", completion(prompt=[[1], [2]]), "prompt", "a list of 2 prompts"),
    ("prompt an object", completion(prompt={"text": "x"}), "prompt", "must be a string or a non-empty array"),
    ("prompt empty", completion(prompt=""), "prompt", "the prompt is empty"),
    ("prompt no ids", completion(prompt=[]), "prompt", "non-empty array of token ids"),
    ("prompt negative id", completion(prompt=[1, -1]), "prompt", "prompt[1] is a number -1, not a token id"),
    ("prompt id past int32", completion(prompt=[2**31]), "prompt", "not a token id"),
    ("prompt bool id", completion(prompt=[True]), "prompt", "prompt[0] is a boolean"),
    ("prompt float id", completion(prompt=[1.5]), "prompt", "not a token id"),
    ("prompt mixed", completion(prompt=["a", 1]), "prompt", "prompt[0] is a string"),
    ("max_tokens 0", chat(max_tokens=0), "max_tokens", "invalid max_tokens: generation parameters: max_tokens 0"),
    ("max_completion_tokens 0", chat(max_completion_tokens=0), "max_completion_tokens",
     "invalid max_completion_tokens: generation parameters: max_tokens 0 must be an integer"),
    ("max_tokens a string", completion(max_tokens="5"), "max_tokens", "must be an integer"),
    ("both max tokens, different", chat(max_tokens=10, max_completion_tokens=20), "max_tokens",
     "max_tokens=10 and max_completion_tokens=20 differ"),
    ("temperature negative", chat(temperature=-0.5), "temperature", "temperature -0.5 must be a finite number"),
    ("temperature a string", chat(temperature="hot"), "temperature", "temperature 'hot'"),
    ("top_p 0", chat(top_p=0), "top_p", "top_p 0 must be a number in (0, 1]"),
    ("top_p past 1", completion(top_p=1.5), "top_p", "top_p 1.5"),
    ("seed past int64", chat(seed=2**63), "seed", "must be a 64-bit signed integer"),
    ("stop a number", chat(stop=5), "stop", "stop must be a string or an array of strings, got a number 5"),
    ("stop list with a number", chat(stop=["a", 1]), "stop", "stop must be a string or an array of strings"),
    ("stop empty", chat(stop=""), "stop", "non-empty strings"),
    ("too many stops", chat(stop=[str(k) for k in range(MAX_STOP_STRINGS + 1)]), "stop",
     f"{MAX_STOP_STRINGS + 1} stop strings, limit {MAX_STOP_STRINGS}"),
]


@pytest.mark.parametrize(("line", "param", "why"), [(line, param, why) for _, line, param, why in REQUEST_PROBLEMS],
                         ids=[name for name, *_ in REQUEST_PROBLEMS])
def test_a_request_the_job_cannot_serve_keeps_its_error_naming_the_parameter(tmp_path: Path, line: dict, param: str,
                                                                            why: str) -> None:
    path = write(tmp_path / "in.jsonl", chat("before"), {**line, "custom_id": "bad"}, completion("after"))
    batch = load_requests(path, MODEL)
    before, bad, after = batch.requests
    assert before.error is None and after.error is None
    assert bad.error_param == param
    assert why in bad.error
    assert (bad.index, bad.line, bad.custom_id) == (1, 2, "bad")
    assert bad.messages is None and bad.prompt is None and bad.params == GenerationParams()
    assert batch.error_count == 1 and batch.chat_count + batch.completion_count == 2


def test_an_unsupported_endpoint_has_no_kind(tmp_path: Path) -> None:
    assert one(tmp_path, {**chat(), "url": "/v1/embeddings"}).kind is None


def test_stop_strings_at_the_limit_are_taken(tmp_path: Path) -> None:
    stops = [str(k) for k in range(MAX_STOP_STRINGS)]
    assert one(tmp_path, chat(stop=stops)).params.stop == tuple(stops)


# --- what is accepted -------------------------------------------------------------------------


ACCEPTED = [
    ("nulls are not given", chat(max_tokens=None, logprobs=None, top_k=None, stop=None, tools=None, n=None),
     GenerationParams()),
    ("ignored bookkeeping", chat(user="u-1", metadata={"k": "v"}, store=False, service_tier="auto",
                                 prompt_cache_key="p", safety_identifier="s", parallel_tool_calls=True),
     GenerationParams()),
    ("no-op values", chat(n=1, stream=False, logprobs=False, presence_penalty=0, frequency_penalty=0.0,
                          logit_bias={}, tools=[], tool_choice="none", response_format={"type": "text"}),
     GenerationParams()),
    ("completion no-op values", completion(best_of=1, echo=False, suffix="", logprobs=None), GenerationParams()),
    ("max_completion_tokens", chat(max_completion_tokens=32), GenerationParams(max_tokens=32)),
    ("max_tokens on chat", chat(max_tokens=16), GenerationParams(max_tokens=16)),
    ("both max tokens, equal", chat(max_tokens=16, max_completion_tokens=16), GenerationParams(max_tokens=16)),
    ("stop a string", chat(stop="###"), GenerationParams(stop=("###",))),
    ("stop a list", completion(stop=["a", "b"]), GenerationParams(stop=("a", "b"))),
    ("stop an empty list", chat(stop=[]), GenerationParams()),
    ("greedy", completion(temperature=0, top_p=1, seed=-5), GenerationParams(temperature=0, top_p=1, seed=-5)),
]


@pytest.mark.parametrize(("line", "params"), [(line, params) for _, line, params in ACCEPTED],
                         ids=[name for name, *_ in ACCEPTED])
def test_what_the_engine_does_anyway_is_accepted(tmp_path: Path, line: dict, params: GenerationParams) -> None:
    request = one(tmp_path, line)
    assert request.error is None, request.error
    assert request.params == params


def test_chat_messages_are_normalised_to_role_and_text(tmp_path: Path) -> None:
    line = chat(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "Rule 1."}, {"type": "text", "text": "Rule 2."}]},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello.", "tool_calls": None, "refusal": None},
        {"role": "user", "content": ""},
    ])
    assert one(tmp_path, line).messages == [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": "Rule 1.\nRule 2."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": ""},
    ]


@pytest.mark.parametrize(("prompt", "expected"), [("text", "text"), (["text"], "text"), ([5, 6], [5, 6]),
                                                  ([[5, 6]], [5, 6]), ([0, 2**31 - 1], [0, 2**31 - 1])])
def test_one_prompt_as_text_or_token_ids_is_taken(tmp_path: Path, prompt: object, expected: object) -> None:
    request = one(tmp_path, completion(prompt=prompt))
    assert request.error is None and request.prompt == expected and request.kind == KIND_COMPLETION

