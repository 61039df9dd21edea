"""pipeline.batchjob.requests: a scanned line's body, checked by parse_line: what the job
cannot serve becomes the request's error (answered 400, naming the parameter), never the
file's or another request's problem. The file's own rules are test_scan.py's."""

from __future__ import annotations

import json

import pytest

from pipeline.batchjob.requests import (
    CHAT_URL,
    COMPLETIONS_URL,
    KIND_CHAT,
    KIND_COMPLETION,
    BatchRequest,
    parse_line,
)
from pipeline.wire.generation import MAX_STOP_STRINGS, GenerationParams
from tests.batchjob.batchfiles import MODEL, chat, completion, encode


def one(line: object, index: int = 0, number: int = 1) -> BatchRequest:
    """The request of one line (a dict as JSON, or its bytes)."""
    return parse_line(encode(line), index, number, MODEL)


# --- a good line ------------------------------------------------------------------------------


def test_good_lines_give_their_requests_with_index_line_and_parameters() -> None:
    a = one(chat("a", max_completion_tokens=64, temperature=0, stop=["\n\n", "END"], seed=7, top_p=0.9), 0, 1)
    assert (a.index, a.line, a.custom_id, a.url, a.kind) == (0, 1, "a", CHAT_URL, KIND_CHAT)
    assert a.messages == [{"role": "user", "content": "Hi"}] and a.prompt is None and a.error is None
    assert a.params == GenerationParams(max_tokens=64, temperature=0, top_p=0.9, seed=7, stop=("\n\n", "END"))
    b = one(completion("b", prompt=[1, 2, 3], max_tokens=5, stop="."), 1, 4)
    assert (b.index, b.line, b.url, b.kind, b.prompt, b.messages) == (1, 4, COMPLETIONS_URL, KIND_COMPLETION,
                                                                      [1, 2, 3], None)
    assert b.params == GenerationParams(max_tokens=5, stop=(".",))
    c = one(completion("c", n=3), 2, 5)
    assert (c.index, c.line, c.error_param) == (2, 5, "n")


def test_a_line_the_scan_took_through_json_gives_the_same_request() -> None:
    """A line msgspec refuses and the json module takes (a lone surrogate) is parsed alike."""
    line = chat("s\ud800", messages=[{"role": "user", "content": "a \udfff b"}], max_tokens=3)
    request = one(line)
    assert request.custom_id == "s\ud800" and request.error is None
    assert request.messages == [{"role": "user", "content": "a \udfff b"}]
    assert request.params == GenerationParams(max_tokens=3)
    spaced = json.dumps(chat("t"), indent=2).replace("\n", " ").encode()
    assert one(spaced).messages == [{"role": "user", "content": "Hi"}]


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
def test_a_request_the_job_cannot_serve_keeps_its_error_naming_the_parameter(line: dict, param: str,
                                                                            why: str) -> None:
    bad = one({**line, "custom_id": "bad"}, 1, 2)
    assert bad.error_param == param
    assert why in bad.error
    assert (bad.index, bad.line, bad.custom_id) == (1, 2, "bad")
    assert bad.messages is None and bad.prompt is None and bad.params == GenerationParams()


def test_an_unsupported_endpoint_has_no_kind() -> None:
    assert one({**chat(), "url": "/v1/embeddings"}).kind is None


def test_stop_strings_at_the_limit_are_taken() -> None:
    stops = [str(k) for k in range(MAX_STOP_STRINGS)]
    assert one(chat(stop=stops)).params.stop == tuple(stops)


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
def test_what_the_engine_does_anyway_is_accepted(line: dict, params: GenerationParams) -> None:
    request = one(line)
    assert request.error is None, request.error
    assert request.params == params


def test_chat_messages_are_normalised_to_role_and_text() -> None:
    line = chat(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "Rule 1."}, {"type": "text", "text": "Rule 2."}]},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello.", "tool_calls": None, "refusal": None},
        {"role": "user", "content": ""},
    ])
    assert one(line).messages == [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": "Rule 1.\nRule 2."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": ""},
    ]


@pytest.mark.parametrize(("prompt", "expected"), [("text", "text"), (["text"], "text"), ([5, 6], [5, 6]),
                                                  ([[5, 6]], [5, 6]), ([0, 2**31 - 1], [0, 2**31 - 1])])
def test_one_prompt_as_text_or_token_ids_is_taken(prompt: object, expected: object) -> None:
    request = one(completion(prompt=prompt))
    assert request.error is None and request.prompt == expected and request.kind == KIND_COMPLETION

