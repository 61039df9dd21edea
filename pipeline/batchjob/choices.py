"""A response's choices from a results row, as vLLM's OpenAI serving code makes them.

    shape = AnswerShape.of(request, calling, decode)           # what the request asked for
    choices = make_choices(row, shape, texts, call_id_prefix)   # [{"index": 0, ...}, ...]

The row holds the engine's outputs (`pipeline/consumer/results.py`: one, or every sample
with its logprobs); the request (read again from the input: `requests.parse_line`) says how
they are answered:
- one choice per sample, index 0..n-1, each with its own finish reason;
- logprobs (chat): {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}]} with top_logprobs the first k of the engine's entries for that
  token (vLLM's order: the sampled token first); completions: {"tokens", "token_logprobs",
  "top_logprobs": [{token: logprob} of the first k + 1 entries], "text_offset"};
- tool calls read from the text (`tools.py`): the message's tool_calls, with finish reason
  "tool_calls" where vLLM gives it (an auto choice that called, or "required" stopped);
- echo: the prompt (completions) or the last message's content where it is the assistant's
  (chat) in front of each choice's text.
A token's text is the engine's where it decoded it (vLLM does), else the tokenizer's text of
that one token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.batchjob.params import KIND_CHAT
from pipeline.batchjob.requests import BatchRequest
from pipeline.batchjob.tools import RequestTools, ToolCalling, answer_tool_calls
from pipeline.wire.errors import BatchOutputError

# The role of a chat answer (vLLM's --response-role default).
RESPONSE_ROLE = "assistant"
FINISH_TOOL_CALLS = "tool_calls"


@dataclass(slots=True, frozen=True)
class Texts:
    """How a row's token ids become text: `decode(ids)` (special tokens skipped, as an
    answer's text) and `token(id)` (one token's text, special tokens kept)."""

    decode: Callable[[list[int]], str]
    token: Callable[[int], str]


@dataclass(slots=True, frozen=True)
class AnswerShape:
    """What a request's answer is made with besides its row."""

    kind: str
    logprobs: int | None = None
    echo: str | None = None
    tools: RequestTools = field(default_factory=lambda: RequestTools(None, "none"))
    calling: ToolCalling = field(default_factory=ToolCalling)

    @classmethod
    def of(cls, request: BatchRequest, calling: ToolCalling, texts: Texts) -> AnswerShape:
        if request.error is not None or request.kind is None:
            raise BatchOutputError(f"request {request.custom_id!r} ran but reads as refused now: {request.error}")
        echo = None
        if request.echo and request.kind == KIND_CHAT:
            last = request.messages[-1] if request.messages else {}
            echo = (last.get("content") or "") if last.get("role") == RESPONSE_ROLE else ""
        elif request.echo:
            echo = request.prompt if isinstance(request.prompt, str) else texts.decode(list(request.prompt or []))
        return cls(request.kind, request.params.logprobs, echo, request.tools, calling)


def make_choices(row: Mapping[str, Any], shape: AnswerShape, texts: Texts, call_id_prefix: str) -> list[dict]:
    """The response's choices for a results row of status ok."""
    samples = row.get("samples")
    if samples is None:
        samples = [{"output": row["output"], "finish_reason": row["finish_reason"], "text": row.get("text")}]
    if not isinstance(samples, list) or not samples:
        raise BatchOutputError(f"results row of item {row.get('item_id')!r}: samples {str(samples)[:60]} is not a "
                               f"list of outputs")
    return [_choice(k, sample, shape, texts, f"{call_id_prefix}_{k}") for k, sample in enumerate(samples)]


def _choice(index: int, sample: Mapping[str, Any], shape: AnswerShape, texts: Texts, call_id: str) -> dict:
    finish = sample.get("finish_reason")
    if not isinstance(finish, str):
        raise BatchOutputError(f"a sample's finish_reason {finish!r} is not an engine's word")
    text = sample["text"] if isinstance(sample.get("text"), str) else texts.decode(sample["output"])
    logprobs = _logprobs(sample, shape, texts) if shape.logprobs is not None else None
    if shape.kind != KIND_CHAT:
        return {"index": index, "text": (shape.echo or "") + text, "logprobs": logprobs, "finish_reason": finish}
    content, calls = answer_tool_calls(text, shape.tools, shape.calling)
    if shape.tools.parsed and shape.calling.parser is not None and (shape.tools.named
                                                                      or shape.tools.choice == "required"):
        content = content or ""
    if shape.echo is not None:
        content = shape.echo + (content or "")
    message: dict[str, Any] = {"role": RESPONSE_ROLE, "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"{call_id}_{j}", "type": "function", "function": call}
                                 for j, call in enumerate(calls)]
        auto = not shape.tools.named and shape.tools.choice == "auto"
        if auto or (shape.tools.choice == "required" and finish == "stop"):
            finish = FINISH_TOOL_CALLS
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def _logprobs(sample: Mapping[str, Any], shape: AnswerShape, texts: Texts) -> dict | None:
    """The logprobs object of one sample (None where the row has none)."""
    found = sample.get("logprobs")
    if found is None:
        return None
    ids = sample["output"]
    if not isinstance(found, list) or len(found) != len(ids):
        raise BatchOutputError(f"a sample of {len(ids)} tokens has logprobs for {len(found)}")
    k = shape.logprobs or 0
    if shape.kind == KIND_CHAT:
        return {"content": [_chat_token(token, entries, k, texts) for token, entries in zip(ids, found)]}
    return _completion_logprobs(ids, found, k, texts)


def _entries(token: int, entries: list, texts: Texts) -> tuple[tuple[str, float], list[tuple[str, float]]]:
    """(the sampled token's (text, logprob), every entry's (text, logprob) in order)."""
    listed = [(texts.token(int(e[0])) if e[2] is None else e[2], float(e[1]), int(e[0])) for e in entries]
    mine = next(((t, lp) for t, lp, tid in listed if tid == token), (texts.token(token), -9999.0))
    return mine, [(t, lp) for t, lp, _tid in listed]


def _chat_token(token: int, entries: list, k: int, texts: Texts) -> dict:
    (text, logprob), listed = _entries(token, entries, texts)
    return {"token": text, "logprob": logprob, "bytes": _bytes(text),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in listed[:k]]}


def _completion_logprobs(ids: list[int], found: list, k: int, texts: Texts) -> dict:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    at = 0
    for token, entries in zip(ids, found):
        (text, logprob), listed = _entries(token, entries, texts)
        tokens.append(text)
        token_logprobs.append(logprob)
        tops.append({t: lp for t, lp in listed[:k + 1]})
        offsets.append(at)
        at += len(text)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": tops}


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
