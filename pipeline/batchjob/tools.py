"""Tool calling in a batch job, as vLLM's OpenAI server does it with `--tool-call-parser` and
`--enable-auto-tool-choice`.

    calling = ToolCalling(parser="hermes", auto=True)          # the job's settings
    request_tools = check_tools(body, calling)                   # RequestTools, or Refused
    content, calls = answer_tool_calls(text, request_tools, calling)

A chat request's `tools` go to the chat template (`chat.py` renders them), and its
`tool_choice` decides how the answer is read:
- "none" (the default without tools): the text is the answer.
- "auto" (the default with tools): needs both flags, as vLLM's server does; the text is read
  by the tool-call parser, and the calls it finds are the message's tool_calls (finish reason
  "tool_calls"), the text before them its content.
- "required", or a named function: needs the parser; the output is constrained by a JSON
  schema made from the tools (a named function's parameters; for "required", an array of
  {name, parameters} of any tool), carried in the envelope as any structured output, and
  the JSON the model wrote is the call(s).
This is vLLM's tool calling with VLLM_ENFORCE_STRICT_TOOL_CALLING=0 (the JSON-schema
constraints above). NOTE: vLLM's default since 0.2x constrains every tool choice with the
parser's structural tag (xgrammar's format for each model family); carrying that would mean
a copy of vLLM's per-model tag builders, so it is not done: "auto" is unconstrained here.

Parsers (TOOL_PARSERS): "hermes" (<tool_call>{"name": ..., "arguments": {...}}</tool_call>,
the format of Hermes, Qwen 2.5 and 3 and many fine-tunes), as vLLM's Hermes2ProToolParser
reads it. With hermes and tools a request's special tokens are kept in its text (vLLM's
parser turns skip_special_tokens off: the tags are special tokens in some models).
Tool-call ids are the job's own (`call_<request>_<k>`), so a resumed job writes the same
output; vLLM draws random ones.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pipeline.batchjob.params import Refused

# The tool-call parsers this job carries, by vLLM's names.
TOOL_PARSERS = ("hermes",)
# Bytes of a request's tools (as compact JSON): they are rendered into its prompt, and for
# "required" or a named function they become its output's JSON schema, which the envelope
# carries up to MAX_STRUCTURED_OUTPUT_BYTES; 32 KiB is dozens of tools with long schemas.
MAX_TOOLS_BYTES = 32 << 10
TOOL_CHOICES = ("none", "auto", "required")
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
HERMES_START = "<tool_call>"


@dataclass(slots=True, frozen=True)
class ToolCalling:
    """The job's tool-call settings: vLLM's --tool-call-parser and --enable-auto-tool-choice."""

    parser: str | None = None
    auto: bool = False

    def problem(self) -> str | None:
        """Why these settings cannot run (a one-line error before the job starts), or None."""
        if self.parser is not None and self.parser not in TOOL_PARSERS:
            return f"--tool-call-parser {self.parser!r}: this job reads {', '.join(TOOL_PARSERS)}"
        if self.auto and self.parser is None:
            return "--enable-auto-tool-choice requires --tool-call-parser"
        return None


@dataclass(slots=True, frozen=True)
class RequestTools:
    """A chat request's tools (None: none given), its tool choice (a TOOL_CHOICES word, or a
    function's name for a named choice) and whether several calls may be made."""

    tools: list[dict[str, Any]] | None
    choice: str
    named: bool = False
    parallel: bool = True

    @property
    def parsed(self) -> bool:
        """Whether the answer is read for tool calls."""
        return self.tools is not None and self.choice != "none"


def check_tools(given: dict[str, Any], calling: ToolCalling) -> RequestTools:
    """A chat request's tools and tool choice, checked as vLLM checks them; Refused naming
    the parameter."""
    tools = given.get("tools")
    if tools is not None:
        _check_tool_list(tools)
    choice = given.get("tool_choice", "auto" if tools else "none")
    parallel = given.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise Refused(f"parallel_tool_calls must be true or false, got {json.dumps(parallel)[:60]}",
                      "parallel_tool_calls")
    if choice == "none":
        return RequestTools(tools, "none", parallel=parallel)
    if tools is None:
        raise Refused("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, dict):
        name = _named_choice(choice, tools)
        request = RequestTools(tools, name, named=True, parallel=parallel)
    elif choice in TOOL_CHOICES:
        request = RequestTools(tools, choice, parallel=parallel)
    else:
        raise Refused(f'Invalid value for `tool_choice`: {json.dumps(choice)[:60]}! Only named tools, "none", "auto" '
                      f'or "required" are supported.', "tool_choice")
    if request.choice == "auto" and not request.named and not (calling.auto and calling.parser):
        raise Refused('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                      "tool_choice")
    if calling.parser is None:
        what = f'function "{request.choice}"' if request.named else f'"{request.choice}"'
        raise Refused(f"tool_choice={what} requires --tool-call-parser to be set", "tool_choice")
    return request


def _check_tool_list(tools: object) -> None:
    if tools == []:
        raise Refused("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                      "entirely.", "tools")
    if not isinstance(tools, list):
        raise Refused(f"tools must be an array of tools, got {json.dumps(tools)[:60]}", "tools")
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise Refused(f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                          f"\"parameters\": {{...}}}}}}", f"tools[{k}]")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise Refused(f"tools[{k}].function.parameters must be a JSON schema object", f"tools[{k}]")
    size = len(json.dumps(tools, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))
    if size > MAX_TOOLS_BYTES:
        raise Refused(f"tools are {size:,} bytes of JSON, more than the {MAX_TOOLS_BYTES:,} this job takes per "
                      f"request", "tools")


def _named_choice(choice: dict, tools: list[dict[str, Any]]) -> str:
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = choice.get("function")
    if not isinstance(function, dict):
        raise Refused(f"Invalid value for `function`: `{json.dumps(function)[:60]}` in `tool_choice`! {usage}",
                      "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise Refused(f"Invalid `name` in `function`: `{json.dumps(name)[:60]}` in `tool_choice`! {usage}",
                      "tool_choice.function.name")
    if not any(tool["function"]["name"] == name for tool in tools):
        raise Refused("The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")
    return name


def tool_constraint(request: RequestTools) -> tuple[str, str] | None:
    """The structured-output constraint a tool choice makes (vLLM's
    get_json_schema_from_tools): a named function's parameters, or for "required" an
    array of calls of any tool; None for "auto" and "none"."""
    if request.tools is None:
        return None
    if request.named:
        tool = next(t for t in request.tools if t["function"]["name"] == request.choice)
        return "json", _compact(_parameters(tool))
    if request.choice != "required":
        return None
    defs: dict[str, Any] = {}
    calls = []
    for tool in request.tools:
        parameters = dict(_parameters(tool))
        for name, schema in (parameters.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise Refused(f"Tool definition '{name}' has multiple schemas, which is not supported.", "tools")
            defs[name] = schema
        calls.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                     "parameters": parameters}, "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not request.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return "json", _compact(schema)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def keeps_special_tokens(request: RequestTools, calling: ToolCalling) -> bool:
    """Whether the parser needs the special tokens in the text (vLLM's hermes parser turns
    skip_special_tokens off for a request with tools and a tool choice other than none)."""
    return calling.parser == "hermes" and request.tools is not None and request.choice != "none"


def answer_tool_calls(text: str, request: RequestTools, calling: ToolCalling) -> tuple[str | None, list[dict]]:
    """(content, [{"name", "arguments"}]) of a generated text: what vLLM's serving code makes
    of it for the request's tool choice (no calls: the text is the content)."""
    if not request.parsed or calling.parser is None:
        return text, []
    if request.named:
        if not text.strip():
            return None, []
        return None, [{"name": request.choice, "arguments": text}]
    if request.choice == "required":
        try:
            found = json.loads(text)
        except ValueError:
            return None, []
        if not isinstance(found, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c for c in found):
            return None, []
        return None, [{"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)}
                      for c in found]
    return _hermes(text)


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    """vLLM's Hermes2ProToolParser.extract_tool_calls: every <tool_call> JSON; any that does
    not parse leaves the whole text as the content and no calls."""
    if HERMES_START not in text:
        return text, []
    try:
        found = [json.loads(a if a else b) for a, b in _HERMES_CALL.findall(text)]
        calls = [{"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)} for c in found]
    except (ValueError, TypeError, KeyError):
        return text, []
    content = text[:text.find(HERMES_START)]
    return (content or None), calls


def tool_calling(parser: str | None, auto: bool) -> ToolCalling:
    """The job's tool-call settings from vLLM's two flags, or SettingsError (one line)."""
    from pipeline.wire.errors import SettingsError

    calling = ToolCalling(parser, auto)
    problem = calling.problem()
    if problem is not None:
        raise SettingsError(problem)
    return calling

