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
    MEMO_TEXT_CHARS,
    PARAMS_MEMO_ENTRIES,
    BatchRequest,
    _memo_params,
    parse_line,
)
from pipeline.batchjob.params import COMPLETION_DEFAULT_MAX_TOKENS
from pipeline.batchjob.tools import MAX_TOOLS_BYTES, ToolCalling
from pipeline.wire.generation import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_NEW_TOKENS,
    MAX_SAMPLES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STRUCTURED_OUTPUT_BYTES,
    GenerationParams,
)
from tests.batchjob.batchfiles import MODEL, chat, completion, encode

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _schema(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _deep(levels: int) -> dict:
    """A schema whose objects nest `levels` deep (vLLM counts objects and arrays)."""
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def _sized(size: int) -> dict:
    """A schema of exactly `size` bytes of compact JSON."""
    bare = len(json.dumps({"type": "string", "description": ""}, separators=(",", ":")))
    return {"type": "string", "description": "x" * (size - bare)}


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
    c = one(completion("c", n=3, logprobs=2, echo=True, max_tokens=None), 2, 5)
    assert (c.index, c.line, c.error_param) == (2, 5, "echo")  # echo with logprobs: the prompt's, not carried
    d = one(completion("d", n=3, top_k=5, min_p=0.1, repetition_penalty=1.1, ignore_eos=True))
    assert d.params == GenerationParams(max_tokens=16, n=3, top_k=5, min_p=0.1, repetition_penalty=1.1,
                                        ignore_eos=True)


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
    ("endpoint", {**chat(), "url": "/v1/rerank"}, "url", "unsupported endpoint '/v1/rerank'"),
    ("n 0", chat(n=0), "n", "n 0 must be an integer from 1"),
    ("n past the limit", chat(n=MAX_SAMPLES + 1), "n", f"n {MAX_SAMPLES + 1} must be an integer from 1 to {MAX_SAMPLES}"),
    ("n true", chat(n=True), "n", "n must be an integer, got a boolean true"),
    ("stream", chat(stream=True), "stream", "stream=true is not supported"),
    ("stream_options", chat(stream_options={"include_usage": True}), "stream_options", "only be defined when"),
    ("another model", chat(model="big"), "model", f"The model `big` does not exist (this job serves `{MODEL}`)."),
    ("another model, escaped and cut", chat(model="b\n" + "i" * 100), "model", f"The model `b\\n{'i' * 54}...` does"),
    ("no model", {**chat(), "body": {"messages": [{"role": "user", "content": "x"}]}}, "model",
     "you must provide a model"),
    ("model a number", chat(model=3), "model",
     "Invalid type for 'model': expected a string, but got an integer instead."),
    ("logprobs a number on chat", chat(logprobs=1), "logprobs", "logprobs must be true or false"),
    ("top_logprobs without logprobs", chat(top_logprobs=2), "top_logprobs", "`logprobs` must be set to true"),
    ("top_logprobs past the limit", chat(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), "top_logprobs",
     f"greater than max allowed: {MAX_LOGPROBS}"),
    ("top_logprobs -1", chat(logprobs=True, top_logprobs=-1), "top_logprobs", "the whole vocabulary"),
    ("completion logprobs past the limit", completion(logprobs=MAX_LOGPROBS + 1), "logprobs",
     f"greater than max allowed: {MAX_LOGPROBS}"),
    ("completion logprobs negative", completion(logprobs=-2), "logprobs", "must be a positive value or -1"),
    ("logit_bias past 100", chat(logit_bias={"50": -100.5}), "logit_bias", "from -100 to 100"),
    ("logit_bias a word", chat(logit_bias={"the": 5}), "logit_bias", "cannot be converted to integer token IDs"),
    ("logit_bias negative id", chat(logit_bias={"-1": 5}), "logit_bias", "out-of-vocab"),
    ("logit_bias too many", chat(logit_bias={str(k): 1 for k in range(MAX_LOGIT_BIAS_ENTRIES + 1)}), "logit_bias",
     f"at most {MAX_LOGIT_BIAS_ENTRIES:,}"),
    ("presence_penalty past 2", chat(presence_penalty=2.5), "presence_penalty", "presence_penalty 2.5"),
    ("repetition_penalty 0", chat(repetition_penalty=0), "repetition_penalty", "repetition_penalty 0"),
    ("top_k -2", chat(top_k=-2), "top_k", "top_k -2"),
    ("min_p past 1", chat(min_p=1.5), "min_p", "min_p 1.5"),
    ("min_tokens past max_tokens", chat(min_tokens=5, max_tokens=4), "min_tokens",
     "min_tokens must be less than or equal to max_tokens=4, got 5"),
    ("ignore_eos a string", chat(ignore_eos="yes"), "ignore_eos", "must be true or false"),
    ("stop_token_ids a string", chat(stop_token_ids="2"), "stop_token_ids", "only integers"),
    ("stop_token_ids too many", chat(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids",
     f"at most {MAX_STOP_TOKEN_IDS}"),
    ("best_of", completion(best_of=2), "best_of", "best_of must be 1"),
    ("echo with logprobs", completion(echo=True, logprobs=1), "echo", "prompt's log probabilities"),
    ("suffix", completion(suffix="!"), "suffix", "suffix"),
    ("beam search", chat(use_beam_search=True), "use_beam_search", "beam search"),
    ("guided_json", chat(guided_json={"type": "object"}), "guided_json", "structured_outputs: {'json': ...}"),
    ("tools empty", chat(tools=[]), "tools", "`tools` must not be an empty array"),
    ("tools auto without the flags", chat(tools=[TOOL]), "tool_choice", "--enable-auto-tool-choice"),
    ("tool_choice without tools", chat(tool_choice="auto"), "tool_choice", "`tools` must be set"),
    ("tool_choice named, no parser", chat(tools=[TOOL], tool_choice=NAMED), "tool_choice",
     'tool_choice=function "get_weather" requires --tool-call-parser'),
    ("tool_choice names another", chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "x"}}),
     "tool_choice", "does not match any of the specified `tools`"),
    ("tool_choice a word", chat(tools=[TOOL], tool_choice="always"), "tool_choice", "Invalid value for `tool_choice`"),
    ("a tool without a name", chat(tools=[{"type": "function", "function": {}}]), "tools[0]", "tools[0] must be"),
    ("tools too large", chat(tools=[{"type": "function", "function": {"name": "f", "description": "x" * MAX_TOOLS_BYTES}}]),
     "tools", f"more than the {MAX_TOOLS_BYTES:,}"),
    ("functions", chat(functions=[{"name": "f"}]), "functions", "give tools"),
    ("response_format json_schema without one", chat(response_format={"type": "json_schema"}), "response_format",
     "the 'json_schema' field must be provided"),
    ("response_format a bad schema", chat(response_format=_schema({"type": "objects"})), "response_format",
     "not a valid JSON schema: at type"),
    ("response_format nested too deep", chat(response_format=_schema(_deep(65))), "response_format",
     "nested too deeply"),
    ("response_format schema too large", chat(response_format=_schema(
        {"type": "object", "description": "x" * MAX_STRUCTURED_OUTPUT_BYTES})), "response_format",
     f"more than the {MAX_STRUCTURED_OUTPUT_BYTES:,}"),
    ("response_format structural_tag", chat(response_format={"type": "structural_tag"}), "response_format",
     "Invalid value: 'structural_tag'. Supported values are: 'text', 'json_object', and 'json_schema'. This job does "
     "not carry structural_tag."),
    ("response_format a string", chat(response_format="json"), "response_format",
     "Invalid type for 'response_format': expected an object, but got a string instead."),
    ("response_format without a type", chat(response_format={}), "response_format",
     "Invalid type for 'response_format.type': expected a string, but got null instead."),
    ("two constraints", chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a+"}),
     "structured_outputs", "multiple are specified"),
    ("structured_outputs two kinds", chat(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs",
     "multiple are specified: regex, choice"),
    ("structured_outputs empty choice", chat(structured_outputs={"choice": []}), "structured_outputs.choice",
     "non-empty list"),
    ("structured_outputs whitespace pattern", chat(structured_outputs={"regex": "a", "whitespace_pattern": " "}),
     "structured_outputs.whitespace_pattern", "not carried"),
    ("structured_outputs json_object false", chat(structured_outputs={"json_object": False}),
     "structured_outputs.json_object", "must be True if set"),
    ("structured_outputs an invalid regex", chat(structured_outputs={"regex": "(a+)+$("}), "structured_outputs.regex",
     'Grammar error: invalid regex "(a+)+$(": regex parse error at character 7: unclosed group'),
    ("structured_outputs an invalid grammar", chat(structured_outputs={"grammar": "root ::= ("}),
     "structured_outputs.grammar", "Invalid grammar specification: expected ')' at line 1"),
    ("chat_template_kwargs a list", chat(chat_template_kwargs=[1]), "chat_template_kwargs", "must be an object"),
    ("unknown", chat(prompt_logprobs=1), "prompt_logprobs", "unsupported parameter 'prompt_logprobs'"),
    ("unknowns listed", chat(bad_words=["x"], allowed_token_ids=[1], prompt_logprobs=1), "allowed_token_ids",
     "unsupported parameters 'allowed_token_ids', 'bad_words', 'prompt_logprobs'"),
    ("max_completion_tokens on a completion", completion(max_completion_tokens=5), "max_completion_tokens",
     "unsupported parameter 'max_completion_tokens'"),
    ("top_logprobs on a completion", completion(top_logprobs=5), "top_logprobs", "unsupported parameter"),
    ("no messages", {**chat(), "body": {"model": MODEL}}, "messages", "Missing required parameter: 'messages'."),
    ("messages an object", chat(messages={"role": "user"}), "messages", "must be a non-empty array"),
    ("messages empty", chat(messages=[]), "messages", "must be a non-empty array"),
    ("message a string", chat(**_messages("hi")), "messages[0]", "messages[0] must be an object"),
    ("role tool with tool_calls", chat(**_messages({"role": "tool", "content": "4", "tool_calls": [{}]})),
     "messages[0].tool_calls", "an assistant message's array of tool calls"),
    ("role unknown", chat(**_messages({"role": "robot", "content": "x"})), "messages[0].role",
     "Invalid value: 'robot'. Supported values are: 'system', 'developer', 'user', 'assistant', and 'tool'."),
    ("role a number", chat(**_messages({"role": 1, "content": "x"})), "messages[0].role",
     "Invalid type for 'messages[0].role': expected a string, but got an integer instead."),
    ("no role", chat(**_messages({"content": "x"})), "messages[0].role",
     "Missing required parameter: 'messages[0].role'."),
    ("tool_calls an object", chat(**_messages({"role": "assistant", "content": "x", "tool_calls": {}})),
     "messages[0].tool_calls", "array of tool calls"),
    ("audio", chat(**_messages({"role": "assistant", "content": "x", "audio": {}})), "messages[0].audio",
     "tool_call_id only"),
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
    ("no prompt", {**completion(), "body": {"model": MODEL}}, "prompt", "Missing required parameter: 'prompt'."),
    ("several prompts", completion(prompt=["a", "b"]), "prompt", "a list of 2 prompts"),
    ("several token prompts", completion(prompt=[[1], [2]]), "prompt", "a list of 2 prompts"),
    ("prompt an object", completion(prompt={"text": "x"}), "prompt", "must be a string or a non-empty array"),
    ("prompt empty", completion(prompt=""), "prompt", "the prompt is empty"),
    ("prompt no ids", completion(prompt=[]), "prompt", "non-empty array of token ids"),
    ("prompt negative id", completion(prompt=[1, -1]), "prompt", "prompt[1] is an integer -1, not a token id"),
    ("prompt id past int32", completion(prompt=[2**31]), "prompt", "not a token id"),
    ("prompt bool id", completion(prompt=[True]), "prompt", "prompt[0] is a boolean"),
    ("prompt float id", completion(prompt=[1.5]), "prompt", "not a token id"),
    ("prompt mixed", completion(prompt=["a", 1]), "prompt", "prompt[0] is a string"),
    ("max_tokens 0", chat(max_tokens=0), "max_tokens", "max_tokens must be at least 1, got 0."),
    ("max_completion_tokens 0", chat(max_completion_tokens=0), "max_completion_tokens",
     "max_completion_tokens must be at least 1, got 0."),
    ("max_tokens a string", completion(max_tokens="5"), "max_tokens", "expected an integer, but got a string instead"),
    ("max_tokens true", completion(max_tokens=True), "max_tokens", "expected an integer, but got a boolean instead"),
    ("max_tokens a fraction", completion(max_tokens=8.5), "max_tokens",
     "expected an integer, but got a number with a fractional part (8.5) instead."),
    ("seed a fraction", chat(seed=3.5), "seed", "seed must be an integer, got a number 3.5"),
    ("top_logprobs a fraction", chat(logprobs=True, top_logprobs=1.5), "top_logprobs",
     "`top_logprobs` must be an integer, got a number 1.5"),
    ("max_tokens past the limit", completion(max_tokens=MAX_NEW_TOKENS + 1), "max_tokens", "max_tokens 1048577"),
    ("temperature negative", chat(temperature=-0.5), "temperature", "temperature -0.5 must be a finite number"),
    ("temperature over 2", chat(temperature=2.5), "temperature", "temperature must be in [0, 2], got 2.5."),
    ("temperature a string", chat(temperature="hot"), "temperature", "temperature must be a finite number"),
    ("top_p 0", chat(top_p=0), "top_p", "top_p 0 must be a finite number in (0, 1]"),
    ("top_p past 1", completion(top_p=1.5), "top_p", "top_p 1.5"),
    ("seed past int64", chat(seed=2**63), "seed", "seed 9223372036854775808 must be an integer"),
    ("stop a number", chat(stop=5), "stop", "stop must be a string or an array of strings, got an integer 5"),
    ("stop list with a number", chat(stop=["a", 1]), "stop", "stop must be a string or an array of strings"),
    ("stop empty", chat(stop=""), "stop", "stop cannot contain an empty string."),
    ("too many stops", chat(stop=[str(k) for k in range(MAX_STOP_STRINGS + 1)]), "stop",
     f"{MAX_STOP_STRINGS + 1} stop strings, at most {MAX_STOP_STRINGS}"),
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
    assert one({**chat(), "url": "/v1/rerank"}).kind is None


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
    ("no-op values", chat(stream=False, logprobs=False, tool_choice="none", response_format={"type": "text"},
                          use_beam_search=False), GenerationParams()),
    ("completion no-op values", completion(best_of=1, echo=False, suffix=""),
     GenerationParams(max_tokens=COMPLETION_DEFAULT_MAX_TOKENS)),
    ("a completion's default max_tokens", completion(max_tokens=None),
     GenerationParams(max_tokens=COMPLETION_DEFAULT_MAX_TOKENS)),
    ("max_completion_tokens", chat(max_completion_tokens=32), GenerationParams(max_tokens=32)),
    ("max_tokens on chat", chat(max_tokens=16), GenerationParams(max_tokens=16)),
    ("max_completion_tokens wins, as in vLLM", chat(max_tokens=10, max_completion_tokens=20),
     GenerationParams(max_tokens=20)),
    ("stop a string", chat(stop="###"), GenerationParams(stop=("###",))),
    ("stop a list", completion(stop=["a", "b"]), GenerationParams(max_tokens=16, stop=("a", "b"))),
    ("stop an empty list", chat(stop=[]), GenerationParams()),
    ("greedy", completion(temperature=0, top_p=1, seed=-5),
     GenerationParams(max_tokens=16, temperature=0, top_p=1, seed=-5)),
    ("n and penalties", chat(n=4, presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, top_k=-1,
                             min_p=0.05, min_tokens=2),
     GenerationParams(n=4, presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, top_k=-1, min_p=0.05,
                      min_tokens=2)),
    ("output booleans", chat(ignore_eos=True, skip_special_tokens=False, include_stop_str_in_output=True),
     GenerationParams(ignore_eos=True, skip_special_tokens=False, include_stop_str_in_output=True)),
    ("stop token ids, repeats dropped", chat(stop_token_ids=[7, 3, 7]), GenerationParams(stop_token_ids=(7, 3))),
    ("logit bias", chat(logit_bias={"50": -100, "7": 2.5}), GenerationParams(logit_bias=((50, -100.0), (7, 2.5)))),
    ("logit bias at the limits", chat(logit_bias={str(k): 100 for k in range(MAX_LOGIT_BIAS_ENTRIES)}),
     GenerationParams(logit_bias=tuple((k, 100.0) for k in range(MAX_LOGIT_BIAS_ENTRIES)))),
    ("chat logprobs", chat(logprobs=True), GenerationParams(logprobs=0)),
    ("chat top_logprobs at the limit", chat(logprobs=True, top_logprobs=MAX_LOGPROBS),
     GenerationParams(logprobs=MAX_LOGPROBS)),
    ("completion logprobs", completion(logprobs=0), GenerationParams(max_tokens=16, logprobs=0)),
    ("json_object", chat(response_format={"type": "json_object"}), GenerationParams(structured=("json_object", ""))),
    ("json_schema", chat(response_format=_schema({"type": "object", "properties": {"a": {"type": "integer"}}})),
     GenerationParams(structured=("json", '{"type":"object","properties":{"a":{"type":"integer"}}}'))),
    ("json_schema nested at the limit", chat(response_format=_schema(_deep(64))),
     GenerationParams(structured=("json", json.dumps(_deep(64), separators=(",", ":"))))),
    ("json_schema at the size limit", chat(response_format=_schema(_sized(MAX_STRUCTURED_OUTPUT_BYTES))),
     GenerationParams(structured=("json", json.dumps(_sized(MAX_STRUCTURED_OUTPUT_BYTES), separators=(",", ":"))))),
    ("structured_outputs json text", chat(structured_outputs={"json": '{"type": "string"}'}),
     GenerationParams(structured=("json", '{"type":"string"}'))),
    ("structured_outputs regex", completion(structured_outputs={"regex": "[0-9]+", "whitespace_pattern": None}),
     GenerationParams(max_tokens=16, structured=("regex", "[0-9]+"))),
    ("structured_outputs choice", chat(structured_outputs={"choice": ["yes", "no"]}),
     GenerationParams(structured=("choice", '["yes", "no"]'))),
    ("structured_outputs grammar", chat(structured_outputs={"grammar": "root ::= \"a\""}),
     GenerationParams(structured=("grammar", "root ::= \"a\""))),
    ("structured_outputs options", chat(structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True,
                                                            "disable_additional_properties": True}),
     GenerationParams(structured=("json", '{"type":"object"}'), disable_any_whitespace=True,
                      disable_additional_properties=True)),
    ("tools with tool_choice none", chat(tools=[TOOL], tool_choice="none"), GenerationParams()),
    ("echo", completion(echo=True), GenerationParams(max_tokens=16)),
    ("chat_template_kwargs", chat(chat_template_kwargs={"enable_thinking": False}), GenerationParams()),
    # vLLM's pydantic models read an integer parameter in lax mode: 8.0 is 8.
    ("integers as whole numbers", chat(max_completion_tokens=8.0, n=2.0, seed=3.0, top_k=5.0, min_tokens=1.0,
                                       logprobs=True, top_logprobs=2.0),
     GenerationParams(max_tokens=8, n=2, seed=3, top_k=5, min_tokens=1, logprobs=2)),
    ("completion logprobs a whole number", completion(max_tokens=4.0, logprobs=1.0),
     GenerationParams(max_tokens=4, logprobs=1)),
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



def test_a_request_naming_a_lora_adapter_runs_on_its_model_id_and_reads_its_body_back() -> None:
    from pipeline.wire.generation import LORA_FIRST_MODEL

    adapters = ("sql", "chat")
    base = parse_line(encode(chat()), 0, 1, MODEL, adapters=adapters)
    assert (base.model_id, base.model, base.answer_reads_body) == (0, MODEL, False)
    second = parse_line(encode(chat(model="chat")), 0, 1, MODEL, adapters=adapters)
    assert (second.error, second.model_id, second.model) == (None, LORA_FIRST_MODEL + 1, "chat")
    assert second.answer_reads_body  # the answer names the adapter: the collector reads which
    other = parse_line(encode(chat(model="nope")), 0, 1, MODEL, adapters=adapters)
    assert other.error_param == "model" and "the LoRA adapters 'sql', 'chat'" in other.error


def test_a_number_past_pythons_digit_bound_and_a_fractional_max_tokens_are_worded_as_such() -> None:
    from pipeline.wire.errors import BadInputError

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": body})
    with pytest.raises(BadInputError, match="a number of more than 4,300 digits, more than any parameter takes"):
        parse_line(line.replace('"hi"}]', '"hi"}], "seed": ' + "9" * 5000).encode(), 0, 1, "m")
    request = parse_line(line.replace('"hi"}]', '"hi"}], "max_completion_tokens": 8.5').encode(), 0, 1, "m")
    assert request.error == ("Invalid type for 'max_completion_tokens': expected an integer, but got a "
                             "number with a fractional part (8.5) instead.")


# --- parameter sets are checked once --------------------------------------------------------


def test_a_kept_parameter_set_answers_as_checking_it_does() -> None:
    """The memo of checked parameter sets tells values apart by type as JSON does (1, 1.0
    and true are one key in Python), keeps no refusal, and gives each kind its own."""
    for _ in range(2):  # the second pass from the memo
        assert one(chat("a", ignore_eos=True)).params.ignore_eos is True
        assert one(chat("b", ignore_eos=1)).error_param == "ignore_eos"
        assert one(chat("c", n=1)).params.samples == 1
        assert one(chat("d", n=True)).error_param == "n"
        assert one(chat("e", max_tokens=16)).params.max_tokens == 16
        assert one(chat("f", max_tokens=16.5)).error_param == "max_tokens"
        assert one(chat("g", echo=True)).error is None and one(completion("g", echo=True)).error is None
        assert one(completion("h", max_tokens=None)).params.max_tokens == COMPLETION_DEFAULT_MAX_TOKENS
        assert one(chat("i", max_tokens=None)).params.max_tokens is None
        assert one(chat("j", prompt="x")).error_param == "prompt"  # another kind's prompt key is a parameter
        assert one(completion("k", messages="x")).error_param == "messages"


def test_parameter_sets_are_kept_for_short_scalars_at_the_bound_and_not_past_it() -> None:
    _memo_params.cache_clear()
    at, past = "x" * MEMO_TEXT_CHARS, "x" * (MEMO_TEXT_CHARS + 1)
    for _ in range(2):
        assert one(chat("a", user=at)).error is None
    assert _memo_params.cache_info().hits == 1
    for _ in range(2):
        assert one(chat("b", user=past)).error is None
        assert one(chat("c", stop=["."])).params.stop == (".",)  # a list: checked every time
    assert _memo_params.cache_info().hits == 1 and _memo_params.cache_info().currsize == 1


def test_the_memo_holds_at_most_its_entries_and_stays_right_past_them() -> None:
    _memo_params.cache_clear()
    for k in range(PARAMS_MEMO_ENTRIES + 10):
        assert one(chat("a", max_tokens=k + 1)).params.max_tokens == k + 1
    assert _memo_params.cache_info().currsize == PARAMS_MEMO_ENTRIES
    assert one(chat("a", max_tokens=1)).params.max_tokens == 1  # evicted, checked again
