"""pipeline.batchjob.tools: tool calling as vLLM's server does it with --tool-call-parser and
--enable-auto-tool-choice: what is refused without them, the JSON schema a forced tool
choice makes, and what the hermes parser reads from a text."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pipeline.batchjob.params import Refused
from pipeline.batchjob.tools import (
    MAX_TOOLS_BYTES,
    RequestTools,
    ToolCalling,
    answer_tool_calls,
    check_tools,
    keeps_special_tokens,
    tool_calling,
    tool_constraint,
)
from pipeline.wire.errors import SettingsError

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES = ToolCalling("hermes", auto=True)


def test_the_flags_are_checked_as_vllm_checks_them():
    assert tool_calling("hermes", True) == HERMES and tool_calling(None, False) == ToolCalling()
    with pytest.raises(SettingsError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        tool_calling(None, True)
    with pytest.raises(SettingsError, match="'mistral': this job reads hermes"):
        tool_calling("mistral", True)


def test_tool_choice_defaults_to_auto_with_tools_and_none_without():
    assert check_tools({"tools": [WEATHER]}, HERMES) == RequestTools([WEATHER], "auto")
    assert check_tools({}, HERMES) == RequestTools(None, "none")
    assert not RequestTools([WEATHER], "none").parsed and RequestTools([WEATHER], "auto").parsed


@pytest.mark.parametrize("body, calling, message", [
    ({"tools": [WEATHER]}, ToolCalling(), "--enable-auto-tool-choice and --tool-call-parser"),
    ({"tools": [WEATHER]}, ToolCalling("hermes"), "--enable-auto-tool-choice and --tool-call-parser"),
    ({"tools": [WEATHER], "tool_choice": "required"}, ToolCalling(), 'tool_choice="required" requires'),
    ({"tools": [WEATHER], "tool_choice": {"function": "get_weather"}}, HERMES, "Invalid value for `function`"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": ""}}}, HERMES, "Invalid `name`"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, HERMES, "parallel_tool_calls must be true or false"),
    ({"tools": {"a": 1}}, HERMES, "tools must be an array"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, HERMES,
     "parameters must be a JSON schema object"),
])
def test_what_vllm_refuses_is_refused(body, calling, message):
    with pytest.raises(Refused, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_tools(body, calling)


def test_tools_at_their_size_limit_and_one_byte_past():
    bare = len(json.dumps([{"type": "function", "function": {"name": "f", "description": ""}}],
                          separators=(",", ":")))
    at = [{"type": "function", "function": {"name": "f", "description": "x" * (MAX_TOOLS_BYTES - bare)}}]
    assert check_tools({"tools": at, "tool_choice": "none"}, ToolCalling()).tools == at
    past = [{"type": "function", "function": {"name": "f", "description": "x" * (MAX_TOOLS_BYTES - bare + 1)}}]
    with pytest.raises(Refused, match=f"more than the {MAX_TOOLS_BYTES:,}"):
        check_tools({"tools": past, "tool_choice": "none"}, ToolCalling())


def test_a_named_choice_constrains_the_output_to_its_parameters_and_required_to_a_list_of_calls():
    named = check_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                   "function": {"name": "get_weather"}}}, HERMES)
    kind, spec = tool_constraint(named)
    assert (kind, json.loads(spec)) == ("json", WEATHER["function"]["parameters"])
    required = check_tools({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
                           HERMES)
    schema = json.loads(tool_constraint(required)[1])
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call at most
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)  # its city is required
    assert tool_constraint(check_tools({"tools": [WEATHER]}, HERMES)) is None  # auto: not constrained


def test_hermes_keeps_special_tokens_where_it_reads_tool_calls():
    assert keeps_special_tokens(RequestTools([WEATHER], "auto"), HERMES)
    assert not keeps_special_tokens(RequestTools([WEATHER], "none"), HERMES)
    assert not keeps_special_tokens(RequestTools(None, "none"), HERMES)


@pytest.mark.parametrize("text, content, calls", [
    ("plain words", "plain words", []),
    ('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', "Sure.",
     [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}',
     None, [{"name": "a", "arguments": "{}"}, {"name": "b", "arguments": '{"x": 1}'}]),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
])
def test_hermes_reads_tool_calls_as_vllms_parser_does(text, content, calls):
    assert answer_tool_calls(text, RequestTools([WEATHER], "auto"), HERMES) == (content, calls)


def test_forced_choices_read_the_json_the_constraint_made():
    named = RequestTools([WEATHER], "get_weather", named=True)
    assert answer_tool_calls('{"city": "Oslo"}', named, HERMES) == (None, [{"name": "get_weather",
                                                                            "arguments": '{"city": "Oslo"}'}])
    assert answer_tool_calls("  ", named, HERMES) == (None, [])
    required = RequestTools([WEATHER], "required")
    assert answer_tool_calls('[{"name": "get_weather", "parameters": {"city": "Rome"}}]', required, HERMES) == (
        None, [{"name": "get_weather", "arguments": '{"city": "Rome"}'}])
    assert answer_tool_calls("[not json", required, HERMES) == (None, [])
    assert answer_tool_calls("words", RequestTools([WEATHER], "none"), HERMES) == ("words", [])
