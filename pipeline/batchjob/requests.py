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
an endpoint other than CHAT_URL, COMPLETIONS_URL and EMBEDDINGS_URL (`embeddings.py`); a
body.model other than the served model or one of its LoRA adapters (`--lora-modules`: a
request naming adapter k runs on the broker's model LORA_FIRST_MODEL + k) (or none);
messages that are not a non-empty list of {role, content} with a role of CHAT_ROLES; content that is not text (a string, or a list of {"type": "text"} parts
joined with "\\n" as vLLM joins them: an image, audio or file part is refused, named); a
prompt that is not one string or one list of token ids (several prompts: refused); a
parameter the job does not carry, or a value vLLM refuses (`params.py`, `tools.py`).

Parameters. Every sampling and output parameter vLLM's OpenAI server takes for the two
endpoints is carried (`params.CARRIED`; tools and tool_choice as `tools.py` reads them, and
chat_template_kwargs to the chat template); other parameters are refused, listed, unless
- NO_OP_VALUES at its no-op value (stream false, best_of 1, no suffix, no functions, no beam
  search): what the engine does anyway, so nothing is dropped;
- IGNORED_PARAMS (user, metadata, store, service_tier, ...): bookkeeping and routing hints
  that do not change what is generated;
- null: OpenAI's "not given", for every parameter (clients write `"logprobs": null`).
NOTE: accepting and dropping what we cannot honour (as many servers do) was rejected: a
request for prompt logprobs or beam search would get an answer that looks right and is not
what it asked for. Refused, the user learns it from the output, request by request.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import msgspec

from pipeline.batchjob.embeddings import (
    EMBEDDING_KEYS,
    EMBEDDINGS_URL,
    KIND_EMBEDDING,
    EmbeddingInputs,
    embedding_inputs,
)
from pipeline.batchjob.params import (
    CARRIED,
    KIND_CHAT,
    KIND_COMPLETION,
    REMOVED_GUIDED,
    Refused,
    json_snippet,
    sampling_params,
)
from pipeline.batchjob.scan import envelope, invalid_type, invalid_value, show, snippet
from pipeline.batchjob.tools import RequestTools, ToolCalling, check_tools, keeps_special_tokens, tool_constraint
from pipeline.producer.signature import INT32_MAX
from pipeline.wire.errors import BadInputError, GenerationParamsError
from pipeline.wire.generation import LORA_FIRST_MODEL, GenerationParams
from pipeline.wire.textfiles import listed

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = {CHAT_URL: KIND_CHAT, COMPLETIONS_URL: KIND_COMPLETION, EMBEDDINGS_URL: KIND_EMBEDDING}
# The body key a request's prompt is in, by kind (an error's `param`).
PROMPT_PARAMS = {KIND_CHAT: "messages", KIND_COMPLETION: "prompt", KIND_EMBEDDING: "input"}

# Chat roles a message may take. OpenAI's "developer" is its newer name for "system" (the
# chat template decides how to render it); "tool" answers a tool call of an earlier turn.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Keys of a chat message, all passed to the chat template: "name", an assistant's earlier
# "tool_calls" and a tool message's "tool_call_id"; others (audio, refusal) are refused.
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
# What separates the text parts of one message's content: vLLM's join, so a file gives the
# same prompt here as with `vllm run-batch`.
TEXT_PART_SEPARATOR = "\n"
# Accepted and ignored: bookkeeping (user, metadata, safety_identifier), storage and routing
# hints of OpenAI's service (store, service_tier, prompt_cache_key: the broker caches
# prefixes anyway). None of them changes what is generated.
IGNORED_PARAMS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
# The keys of each kind's body besides the carried parameters: the model and the prompt.
KIND_KEYS = {KIND_CHAT: frozenset({"model", "messages"}), KIND_COMPLETION: frozenset({"model", "prompt"})}
PROMPT_KEYS = {KIND_CHAT: "messages", KIND_COMPLETION: "prompt"}
# Checked parameter sets kept (`_params_of`): a file's requests use a handful; each entry
# holds its key (values of at most MEMO_TEXT_CHARS) and one GenerationParams.
PARAMS_MEMO_ENTRIES = 1024
MEMO_TEXT_CHARS = 256
MEMO_SCALARS = frozenset({str, int, float, bool})


def _exactly(expected: object) -> Callable[[object], bool]:
    # type too: True == 1 and 0 == False in Python, not in JSON
    return lambda value: type(value) is type(expected) and value == expected


# Parameters accepted only at the value that does what the engine does anyway: (is it that
# value, what to say when it is not). Any other value is refused, never dropped.
NO_OP_VALUES: dict[str, tuple[Callable[[object], bool], str]] = {
    "stream": (_exactly(False), "a batch's responses are not streamed"),
    "stream_options": (lambda v: False, "Stream options can only be defined when `stream=True`."),
    "best_of": (_exactly(1), "one sequence per sample is generated (best_of must be 1)"),
    "suffix": (_exactly(""), "no suffix is inserted"),
    "functions": (_exactly([]), "functions are OpenAI's deprecated tools: give tools"),
    "function_call": (_exactly("none"), "function_call is OpenAI's deprecated tool_choice: give tool_choice"),
    "use_beam_search": (_exactly(False), "beam search is not carried by this job"),
}


@dataclass(slots=True)
class BatchRequest:
    """One request of a batch file. `index`: its place among the file's requests (0-based,
    file order; the output's ids derive from it); `line`: its 1-based line in the file.
    `kind` is KIND_CHAT, KIND_COMPLETION or KIND_EMBEDDING (None: an unsupported endpoint);
    `embedding`: an embeddings request's inputs and answer form; `messages`
    (chat: [{"role", "content": text, ...}], text parts joined) or `prompt` (a completion:
    text, or token ids). `params`: the generation parameters it gives (the producer fills
    in the defaults: `sampling.py`); `tools`, `template_kwargs` (chat_template_kwargs) and
    `echo` what its prompt and answer are made with. `error`: why it cannot run (answered
    with status 400, `error_param` the parameter named in OpenAI's error object), or None."""

    index: int
    line: int
    custom_id: str
    url: str
    kind: str | None
    messages: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    params: GenerationParams
    error: str | None = None
    error_param: str | None = None
    tools: RequestTools = field(default_factory=lambda: RequestTools(None, "none"))
    template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    embedding: EmbeddingInputs | None = None
    model_id: int = 0  # 0: the served model; LORA_FIRST_MODEL + k: its adapter k
    model: str | None = None  # the model the body names, where it is one this job serves

    @property
    def answer_reads_body(self) -> bool:
        """Whether its answer is made with more than its results row: logprobs (their count),
        an echo, tool calls to read, or embeddings in base64 (the collector reads the request
        again)."""
        return (self.params.logprobs is not None or self.echo or self.tools.parsed or self.model_id != 0
                or (self.embedding is not None and self.embedding.encoding_format != "float"))


def parse_line(raw: bytes, index: int, line: int, served_model: str, calling: ToolCalling = ToolCalling(),
               adapters: Sequence[str] = ()) -> BatchRequest:
    """The request on one line of a scanned batch file (`scan.py` accepted it: its envelope
    is well-formed); what its body asks that this job cannot serve is kept as its error.
    `adapters`: the LoRA adapters' names, in order (`--lora-modules`)."""
    env = envelope(raw)
    try:
        body = msgspec.json.decode(env.body)
    except msgspec.DecodeError:  # valid JSON msgspec does not take (a lone surrogate, a huge number)
        try:
            body = json.loads(bytes(env.body))
        except ValueError:  # Python's own bound on a number's digits
            raise BadInputError(f"the request's body holds a number of more than {sys.get_int_max_str_digits():,} "
                                f"digits, more than any parameter takes") from None
    return request_of(index, line, env.custom_id, env.url, body, served_model, calling, adapters)


def request_of(index: int, line: int, custom_id: str, url: str, body: dict, served_model: str,
               calling: ToolCalling = ToolCalling(), adapters: Sequence[str] = ()) -> BatchRequest:
    """The request of a well-formed line; what it cannot be served with is kept as its error
    (`model_id`: the model it runs on, its adapter's where it names one)."""
    request = _request_of(index, line, custom_id, url, body, served_model, calling, adapters)
    if request.error is None:
        request.model = body["model"]
        if request.model != served_model:
            request.model_id = LORA_FIRST_MODEL + list(adapters).index(request.model)
    return request


def _request_of(index: int, line: int, custom_id: str, url: str, body: dict, served_model: str,
                calling: ToolCalling, adapters: Sequence[str]) -> BatchRequest:
    kind = ENDPOINTS.get(url)
    try:
        if kind is None:
            raise Refused(f"unsupported endpoint {url!r}: this job serves {CHAT_URL}, {COMPLETIONS_URL} and "
                          f"{EMBEDDINGS_URL}", "url")
        given = {key: value for key, value in body.items() if value is not None}  # null: not given
        _check_model(given.get("model"), served_model, adapters)
        if kind == KIND_EMBEDDING:
            _check_embedding_keys(given)
            return BatchRequest(index, line, custom_id, url, kind, None, None, GenerationParams(),
                                embedding=embedding_inputs(given))
        params = _params_of(given, kind)
        if kind == KIND_COMPLETION:
            return BatchRequest(index, line, custom_id, url, kind, None, _prompt(given.get("prompt")), params,
                                echo=given.get("echo", False))
        return _chat_request(BatchRequest(index, line, custom_id, url, kind, _messages(given.get("messages")), None,
                                          params, echo=given.get("echo", False)), given, calling)
    except Refused as refused:
        return BatchRequest(index, line, custom_id, url, kind, None, None, GenerationParams(), str(refused),
                            refused.param)


def _chat_request(request: BatchRequest, given: dict, calling: ToolCalling) -> BatchRequest:
    """A chat request's tools, template arguments and the constraint its tool choice makes."""
    tools = check_tools(given, calling)
    kwargs = given.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise Refused(f"chat_template_kwargs must be an object, got {show(kwargs)}", "chat_template_kwargs")
    constraint = tool_constraint(tools)
    params = request.params
    if constraint is not None:
        structured_outputs = given.get("structured_outputs")
        if tools.named and isinstance(structured_outputs, dict) and any(
                structured_outputs.get(k) is not None for k in ("json", "regex", "choice")):
            raise Refused("You can only either use constraints for structured outputs or tools, not both.",
                          "tool_choice")
        params = _with(params, structured=constraint)  # the tool choice's schema wins, as in vLLM
    if keeps_special_tokens(tools, calling):
        params = _with(params, skip_special_tokens=False)
    request.params, request.tools, request.template_kwargs = params, tools, kwargs
    return request


def _with(params: GenerationParams, **changes: Any) -> GenerationParams:
    try:
        return replace(params, **changes)
    except GenerationParamsError as exc:
        raise Refused(f"the tools' JSON schema: {exc}", "tools") from None


def _check_model(model: object, served_model: str, adapters: Sequence[str]) -> None:
    if model is None:
        raise Refused("you must provide a model parameter", "model")
    if not isinstance(model, str):
        raise Refused(invalid_type("model", "a string", model), "model")
    if model != served_model and model not in adapters:  # vLLM's words, and the names this job serves
        with_adapters = f" and the LoRA adapters {listed(list(adapters))}" if adapters else ""
        raise Refused(f"The model `{snippet(model)}` does not exist (this job serves `{served_model}`"
                      f"{with_adapters}).", "model")


def _params_of(given: dict, kind: str) -> GenerationParams:
    """`given`'s generation parameters, its parameters checked (`_check_params`); Refused
    for one it refuses. Kept for parameter sets of short scalars (the prompt apart): a batch
    file's requests mostly ask the same, and checking them is most of reading a request."""
    key = _params_key(given, kind)
    if key is None:
        _check_params(given, kind)
        return sampling_params(given, kind)
    return _memo_params(key)


def _params_key(given: dict, kind: str) -> tuple | None:
    """`given` without its prompt as a memo key, each value with its type (True == 1 == 1.0
    in Python, not in JSON); None where a value is not a short scalar."""
    prompt = PROMPT_KEYS[kind]
    key: list = [kind]
    for name, value in given.items():
        if name == prompt:
            continue
        kind_of = type(value)
        if kind_of not in MEMO_SCALARS or kind_of is str and len(value) > MEMO_TEXT_CHARS:
            return None
        key.append((name, kind_of, value))
    return tuple(key)


@lru_cache(maxsize=PARAMS_MEMO_ENTRIES)
def _memo_params(key: tuple) -> GenerationParams:
    """`_params_of` of a `_params_key` (a Refused is raised, never kept)."""
    kind, given = key[0], {name: value for name, _kind_of, value in key[1:]}
    _check_params(given, kind)
    return sampling_params(given, kind)


def _check_embedding_keys(given: dict) -> None:
    unknown = sorted(set(given) - EMBEDDING_KEYS - IGNORED_PARAMS)
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise Refused(f"unsupported parameter{plural} {listed(unknown)}: an embeddings request takes "
                      f"{', '.join(sorted(EMBEDDING_KEYS))} (and user, ignored)", unknown[0])


def _check_params(given: dict, kind: str) -> None:
    """Refuse every parameter the engine would drop: vLLM's removed guided-decoding fields,
    unknown ones (all listed), then known ones at a value other than their no-op."""
    removed = sorted(set(given) & set(REMOVED_GUIDED))
    if removed:
        instead = REMOVED_GUIDED[removed[0]]
        raise Refused(f"{removed[0]} was removed from vLLM, which ignores it (the output would not be constrained): "
                      f"give {'structured_outputs: {' + repr(instead) + ': ...}' if instead else 'structured_outputs'}"
                      f" or response_format", removed[0])
    known = KIND_KEYS[kind] | set(CARRIED[kind]) | IGNORED_PARAMS | set(NO_OP_VALUES)
    unknown = sorted(set(given) - known)
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise Refused(f"unsupported parameter{plural} {listed(unknown)}: this job carries vLLM's sampling and output "
                      f"parameters ({', '.join(CARRIED[kind])}), and a parameter it would drop is refused",
                      unknown[0])
    for name, (is_no_op, why) in NO_OP_VALUES.items():
        if name in given and not is_no_op(given[name]):
            raise Refused(f"{name}={json_snippet(given[name])} is not supported: {why}", name)


def _messages(raw: object) -> list[dict[str, Any]]:
    """A chat request's messages as [{"role", "content": text, ["name", "tool_calls",
    "tool_call_id"]}]; an assistant's message with tool calls may have no content (None)."""
    if raw is None:
        raise Refused("Missing required parameter: 'messages'.", "messages")
    if not isinstance(raw, list) or not raw:
        raise Refused(f"messages must be a non-empty array of {{role, content}} objects, got {show(raw)}",
                      "messages")
    out = []
    for k, message in enumerate(raw):
        where = f"messages[{k}]"
        if not isinstance(message, dict):
            raise Refused(f"{where} must be an object with role and content, got {show(message)}", where)
        message = {key: value for key, value in message.items() if value is not None}
        unknown = sorted(set(message) - MESSAGE_KEYS)
        if unknown:
            raise Refused(f"{where} has {listed(unknown)}: a message has role, content, name, tool_calls and "
                          f"tool_call_id only", f"{where}.{unknown[0]}")
        role = message.get("role")
        if role is None:
            raise Refused(f"Missing required parameter: '{where}.role'.", f"{where}.role")
        if not isinstance(role, str):
            raise Refused(invalid_type(f"{where}.role", "a string", role), f"{where}.role")
        if role not in CHAT_ROLES:
            raise Refused(invalid_value(role, CHAT_ROLES), f"{where}.role")
        calls = message.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)
                                  or not all(isinstance(c, dict) for c in calls)):
            raise Refused(f"{where}.tool_calls: an assistant message's array of tool calls, got {show(calls)}",
                          f"{where}.tool_calls")
        bare = calls and "content" not in message  # an assistant's tool calls alone
        normal: dict[str, Any] = {"role": role, "content": None if bare else _content(message.get("content"), where)}
        for key in ("name", "tool_call_id"):
            if key in message:
                if not isinstance(message[key], str):
                    raise Refused(f"{where}.{key} must be a string, got {show(message[key])}", f"{where}.{key}")
                normal[key] = message[key]
        if calls:
            normal["tool_calls"] = calls
        out.append(normal)
    return out


def _content(content: object, where: str) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise Refused(f"{where}.content must be a string or a non-empty array of text parts, got "
                       f"{show(content)}", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" and isinstance(kind, str):
            raise Refused(f"{at} is of type {kind!r}: this job takes text only", at)
        if kind != "text" or set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise Refused(f"{at} must be a text part {{\"type\": \"text\", \"text\": string}}, got {show(part)}",
                           at)
        texts.append(part["text"])
    return TEXT_PART_SEPARATOR.join(texts)


def _prompt(raw: object) -> str | list[int]:
    """A completion's one prompt: non-empty text, or a non-empty list of token ids (a list
    holding one of these is that prompt)."""
    if raw is None:
        raise Refused("Missing required parameter: 'prompt'.", "prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # ["text"] and [[1, 2]] are one prompt
    elif isinstance(raw, list) and len(raw) > 1 and all(isinstance(p, (str, list)) for p in raw):
        raise Refused(f"a list of {len(raw)} prompts: this job takes one prompt per request (split them into "
                       f"several requests)", "prompt")
    if isinstance(raw, str):
        if not raw:
            raise Refused("the prompt is empty", "prompt")
        return raw
    if not isinstance(raw, list) or not raw:
        raise Refused(f"prompt must be a string or a non-empty array of token ids, got {show(raw)}", "prompt")
    for k, token in enumerate(raw):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT32_MAX:
            raise Refused(f"prompt[{k}] is {show(token)}, not a token id (an integer from 0 to {INT32_MAX})",
                           "prompt")
    return list(raw)
