"""A batch file's request, its body checked: what a producer makes a prompt of.

One JSON object a line, as OpenAI's Batch API and `vllm run-batch` take it:

    {"custom_id": "req-17", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
              "max_completion_tokens": 64, "temperature": 0}}

The file's own rules (a line that is not a request at all) are `scan.py`'s, checked once
before the job starts. Here, a well-formed line whose body this job cannot serve: the
request keeps its error (`BatchRequest.error`, the parameter in `error_param`) and is
answered with status 400 in the output, as OpenAI answers a bad request inside a batch,
while the others run:
an endpoint other than CHAT_URL and COMPLETIONS_URL; a body.model other than the served
model (or none); messages that are not a non-empty list of {role, content} with a role
of CHAT_ROLES; content that is not text (a string, or a list of {"type": "text"} parts
joined with "\\n" as vLLM joins them: an image, audio or file part is refused, named); a
prompt that is not one string or one list of token ids (several prompts: refused); a
parameter the engine cannot honour (below); a value GenerationParams refuses (its
message, prefixed with the parameter's name).

Parameters. The engine carries max_tokens, temperature, top_p, seed and stop (a string or a
list of strings) per item (`pipeline/wire/generation.py`); for chat, max_completion_tokens
is max_tokens (OpenAI's current name; both given and different: refused, because which one
wins is a guess). Every other parameter is refused, listed, unless it is one of
- NO_OP_VALUES at its no-op value (n 1, stream false, logprobs false, penalties 0, no
  tools, response_format text, ...): what the engine does anyway, so nothing is dropped;
- IGNORED_PARAMS (user, metadata, store, service_tier, ...): bookkeeping and routing hints
  that do not change what is generated;
- null: OpenAI's "not given", for every parameter (clients write `"logprobs": null`).
NOTE: accepting and dropping what we cannot honour (as many servers do) was rejected: a
request for logprobs, top_k or a JSON schema would get an answer that looks right and is not
what it asked for. Refused, the user learns it from the output, request by request.
NOTE: vLLM's own extras (top_k, min_p, repetition_penalty, ...) are refused too, for the
same reason: the envelope does not carry them (a new GenerationParams field would).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from pipeline.batchjob.scan import envelope
from pipeline.producer.signature import INT32_MAX
from pipeline.wire.errors import GenerationParamsError
from pipeline.wire.generation import GenerationParams
from pipeline.wire.textfiles import listed

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
KIND_CHAT = "chat"
KIND_COMPLETION = "completion"
ENDPOINTS = {CHAT_URL: KIND_CHAT, COMPLETIONS_URL: KIND_COMPLETION}

# Chat roles a message may take. OpenAI's "developer" is its newer name for "system" (the
# chat template decides how to render it); "tool" and "function" answer tool calls, which
# this job does not make.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})
# Keys of a chat message: "name" is kept for the chat template; others (tool_calls, audio,
# refusal) describe what this job does not do.
MESSAGE_KEYS = frozenset({"role", "content", "name"})
# What separates the text parts of one message's content: vLLM's join, so a file gives the
# same prompt here as with `vllm run-batch`.
TEXT_PART_SEPARATOR = "\n"
# OpenAI's range of temperature is 0 to 2: above it sampling is noise, and a file written
# for OpenAI never holds more.
MAX_TEMPERATURE = 2.0
# Generation parameters the engine carries (besides max_completion_tokens for chat).
CARRIED_PARAMS = ("max_tokens", "temperature", "top_p", "seed", "stop")
# Accepted and ignored: bookkeeping (user, metadata, safety_identifier), storage and routing
# hints of OpenAI's service (store, service_tier, prompt_cache_key: the broker caches
# prefixes anyway), and parallel_tool_calls, which means nothing without tools. None of them
# changes what is generated.
IGNORED_PARAMS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                            "parallel_tool_calls"})
# The keys of each kind's body besides the carried parameters: the model, the prompt and,
# for chat, max_completion_tokens (its name for max_tokens).
KIND_KEYS = {KIND_CHAT: frozenset({"model", "messages", "max_completion_tokens"}),
               KIND_COMPLETION: frozenset({"model", "prompt"})}


def _exactly(expected: object) -> Callable[[object], bool]:
    # type too: True == 1 and 0 == False in Python, not in JSON
    return lambda value: type(value) is type(expected) and value == expected


def _zero(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


# Parameters accepted only at the value that does what the engine does anyway: (is it that
# value, what to say when it is not). Any other value is refused, never dropped.
NO_OP_VALUES: dict[str, tuple[Callable[[object], bool], str]] = {
    "n": (_exactly(1), "one choice per request is generated (n must be 1)"),
    "stream": (_exactly(False), "a batch's responses are not streamed"),
    "stream_options": (lambda v: False, "a batch's responses are not streamed"),
    "logprobs": (_exactly(False), "log probabilities are not returned"),
    "top_logprobs": (lambda v: False, "log probabilities are not returned"),
    "logit_bias": (_exactly({}), "the engine does not bias logits"),
    "presence_penalty": (_zero, "the engine applies no presence penalty (it must be 0)"),
    "frequency_penalty": (_zero, "the engine applies no frequency penalty (it must be 0)"),
    "best_of": (_exactly(1), "one sequence per request is generated (best_of must be 1)"),
    "echo": (_exactly(False), "the prompt is not echoed"),
    "suffix": (_exactly(""), "no suffix is inserted"),
    "tools": (_exactly([]), "this job makes no tool calls"),
    "functions": (_exactly([]), "this job makes no function calls"),
    "tool_choice": (_exactly("none"), "this job makes no tool calls"),
    "function_call": (_exactly("none"), "this job makes no function calls"),
    "response_format": (_exactly({"type": "text"}), "only text responses are made (no JSON mode or schema)"),
}


@dataclass(slots=True)
class BatchRequest:
    """One request of a batch file. `index`: its place among the file's requests (0-based,
    file order; the output's ids derive from it); `line`: its 1-based line in the file.
    `kind` is KIND_CHAT or KIND_COMPLETION (None: an unsupported endpoint); `messages`
    (chat: [{"role", "content": text, ["name"]}], text parts joined) or `prompt` (a
    completion: text, or token ids). `error`: why it cannot run (answered with status 400,
    `error_param` the parameter named in OpenAI's error object), or None."""

    index: int
    line: int
    custom_id: str
    url: str
    kind: str | None
    messages: list[dict[str, str]] | None
    prompt: str | list[int] | None
    params: GenerationParams
    error: str | None = None
    error_param: str | None = None


class _Refused(Exception):
    """A request this job cannot serve: the message and the parameter it names. Internal:
    caught in `_request` and kept as the request's error, never raised out of this module."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def parse_line(raw: bytes, index: int, line: int, served_model: str) -> BatchRequest:
    """The request on one line of a scanned batch file (`scan.py` accepted it: its envelope
    is well-formed); what its body asks that this job cannot serve is kept as its error."""
    env = envelope(raw)
    try:
        body = msgspec.json.decode(env.body)
    except msgspec.DecodeError:  # valid JSON msgspec does not take (a lone surrogate)
        body = json.loads(bytes(env.body))
    return _request(index, line, env.custom_id, env.url, body, served_model)


def _request(index: int, line: int, custom_id: str, url: str, body: dict, served_model: str) -> BatchRequest:
    """The request of a well-formed line; what it cannot be served with is kept as its error."""
    kind = ENDPOINTS.get(url)
    try:
        if kind is None:
            raise _Refused(f"unsupported endpoint {url!r}: this job serves {CHAT_URL} and {COMPLETIONS_URL}", "url")
        given = {key: value for key, value in body.items() if value is not None}  # null: not given
        _check_model(given.get("model"), served_model)
        _check_params(given, kind)
        if kind == KIND_CHAT:
            messages, prompt = _messages(given.get("messages")), None
        else:
            messages, prompt = None, _prompt(given.get("prompt"))
        params = _params(given, kind)
    except _Refused as refused:
        return BatchRequest(index, line, custom_id, url, kind, None, None, GenerationParams(), str(refused),
                            refused.param)
    return BatchRequest(index, line, custom_id, url, kind, messages, prompt, params)


def _check_model(model: object, served_model: str) -> None:
    if model is None:
        raise _Refused("you must provide a model parameter", "model")
    if model != served_model:
        raise _Refused(f"the model {_show(model)} is not served by this job, which serves {served_model!r}", "model")


def _check_params(given: dict, kind: str) -> None:
    """Refuse every parameter the engine would drop: unknown ones (all listed), then known
    ones at a value other than their no-op."""
    known = KIND_KEYS[kind] | set(CARRIED_PARAMS) | IGNORED_PARAMS | set(NO_OP_VALUES)
    unknown = sorted(set(given) - known)
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        carried = [*CARRIED_PARAMS, *(["max_completion_tokens"] if kind == KIND_CHAT else [])]
        raise _Refused(f"unsupported parameter{plural} {listed(unknown)}: the engine carries only "
                       f"{', '.join(carried[:-1])} and {carried[-1]}, and a parameter it would drop is refused",
                       unknown[0])
    for name, (is_no_op, why) in NO_OP_VALUES.items():
        if name in given and not is_no_op(given[name]):
            raise _Refused(f"{name}={_json(given[name])} is not supported: {why}", name)


def _messages(raw: object) -> list[dict[str, str]]:
    """A chat request's messages as [{"role", "content": text, ["name"]}]."""
    if raw is None:
        raise _Refused("missing required parameter 'messages'", "messages")
    if not isinstance(raw, list) or not raw:
        raise _Refused(f"messages must be a non-empty array of {{role, content}} objects, got {_show(raw)}",
                       "messages")
    out = []
    for k, message in enumerate(raw):
        where = f"messages[{k}]"
        if not isinstance(message, dict):
            raise _Refused(f"{where} must be an object with role and content, got {_show(message)}", where)
        message = {key: value for key, value in message.items() if value is not None}
        unknown = sorted(set(message) - MESSAGE_KEYS)
        if unknown:
            raise _Refused(f"{where} has {listed(unknown)}: a message has role, content and name "
                           f"only (this job makes no tool calls)", f"{where}.{unknown[0]}")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:  # an object is not hashable
            raise _Refused(f"{where}.role {_show(role)} is not one of {', '.join(sorted(CHAT_ROLES))}",
                           f"{where}.role")
        normal = {"role": role, "content": _content(message.get("content"), where)}
        if "name" in message:
            if not isinstance(message["name"], str):
                raise _Refused(f"{where}.name must be a string, got {_show(message['name'])}", f"{where}.name")
            normal["name"] = message["name"]
        out.append(normal)
    return out


def _content(content: object, where: str) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise _Refused(f"{where}.content must be a string or a non-empty array of text parts, got "
                       f"{_show(content)}", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" and isinstance(kind, str):
            raise _Refused(f"{at} is of type {kind!r}: this job takes text only", at)
        if kind != "text" or set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise _Refused(f"{at} must be a text part {{\"type\": \"text\", \"text\": string}}, got {_show(part)}",
                           at)
        texts.append(part["text"])
    return TEXT_PART_SEPARATOR.join(texts)


def _prompt(raw: object) -> str | list[int]:
    """A completion's one prompt: non-empty text, or a non-empty list of token ids (a list
    holding one of these is that prompt)."""
    if raw is None:
        raise _Refused("missing required parameter 'prompt'", "prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # ["text"] and [[1, 2]] are one prompt
    elif isinstance(raw, list) and len(raw) > 1 and all(isinstance(p, (str, list)) for p in raw):
        raise _Refused(f"a list of {len(raw)} prompts: this job takes one prompt per request (split them into "
                       f"several requests)", "prompt")
    if isinstance(raw, str):
        if not raw:
            raise _Refused("the prompt is empty", "prompt")
        return raw
    if not isinstance(raw, list) or not raw:
        raise _Refused(f"prompt must be a string or a non-empty array of token ids, got {_show(raw)}", "prompt")
    for k, token in enumerate(raw):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT32_MAX:
            raise _Refused(f"prompt[{k}] is {_show(token)}, not a token id (an integer from 0 to {INT32_MAX})",
                           "prompt")
    return list(raw)


def _params(given: dict, kind: str) -> GenerationParams:
    """The request's generation parameters, each checked by GenerationParams on its own so
    that the error names the request's parameter."""
    max_tokens, max_name = given.get("max_tokens"), "max_tokens"
    if kind == KIND_CHAT and "max_completion_tokens" in given:
        newer = given["max_completion_tokens"]
        if "max_tokens" in given and not (type(max_tokens) is type(newer) and max_tokens == newer):
            raise _Refused(f"max_tokens={_json(max_tokens)} and max_completion_tokens={_json(newer)} differ: give "
                           f"one (max_tokens is the deprecated name of max_completion_tokens)", "max_tokens")
        max_tokens, max_name = newer, "max_completion_tokens"
    stop = given.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise _Refused(f"stop must be a string or an array of strings, got {_show(stop)}", "stop")
    values = {"max_tokens": max_tokens, "temperature": given.get("temperature"), "top_p": given.get("top_p"),
              "seed": given.get("seed"), "stop": stop}
    temperature = values["temperature"]
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > MAX_TEMPERATURE:
        raise _Refused(f"temperature {_json(temperature)} is over {MAX_TEMPERATURE:g}: OpenAI's API takes 0 to "
                       f"{MAX_TEMPERATURE:g}", "temperature")
    try:
        return GenerationParams(**values)
    except GenerationParamsError:
        pass
    for name, value in values.items():  # which one: checked alone, so the error names it
        try:
            GenerationParams(**{name: value})
        except GenerationParamsError as exc:
            param = max_name if name == "max_tokens" else name
            raise _Refused(f"invalid {param}: {exc}", param) from None
    raise AssertionError(f"parameters {values!r} fail together but not one by one")


def _json(value: object) -> str:
    """A value as JSON for a message, cut to 60 characters."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 60 else text[:57] + "..."


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def _show(value: object) -> str:
    """A JSON value for a message: its JSON type and a bounded rendering."""
    kind = _JSON_TYPES.get(type(value), type(value).__name__)
    return "null" if value is None else f"{kind} {_json(value)}"
