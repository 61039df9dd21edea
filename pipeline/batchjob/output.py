"""A batch job's output lines: one OpenAI Batch output line per request.

A request that ran (results row status "ok"), with one plain choice (several, logprobs,
tool calls and an echo: `choices.py`):

    {"id": "batch_req_<hash12>_<index>", "custom_id": "req-17",
     "response": {"status_code": 200, "request_id": "req_<hash12>_<index>", "body": {
         "id": "chatcmpl-<hash12>-<index>", "object": "chat.completion", "created": <unix s>,
         "model": <served>, "choices": [{"index": 0, "message": {"role": "assistant",
         "content": <text>}, "logprobs": null, "finish_reason": "stop" | "length"}],
         "usage": {"prompt_tokens", "completion_tokens", "total_tokens",
                   "prompt_tokens_details": {"cached_tokens"}}}},
     "error": null}

and for /v1/completions a body of "id": "cmpl-...", "object": "text_completion", choices
[{"index": 0, "text": <text>, "logprobs": null, "finish_reason"}], the same usage. For
/v1/embeddings (`embedding_line`), OpenAI's embeddings response, one embedding per input:

    "body": {"id": "embd-<hash12>-<index>", "object": "list", "created": <unix s>,
             "model": <served>, "data": [{"object": "embedding", "index": 0,
             "embedding": [floats] | base64 of little-endian float32}],
             "usage": {"prompt_tokens", "total_tokens"}}

A request that did not (`error_line`):

    {"id": ..., "custom_id": ..., "response": {"status_code": 400, "request_id": ...,
     "body": {"error": {"message", "type", "param", "code"}}}, "error": null}

status 400 ("invalid_request_error") for a request refused when the file was read and for
a prompt longer than the consumers take (results status too_long, code
"context_length_exceeded"); 500 ("server_error") for an item the engine failed (status
error, the engine's message) and for one whose stored entry was damaged (status corrupt).
This is what OpenAI's service writes for a request that failed with an HTTP error (seen
in its error files: openai/openai-openapi issue 302), so a client that reads OpenAI's
output reads ours, status code and message from one place.
NOTE: vLLM's convention (`vllm run-batch`: the message as a string in the top-level
"error", response.body null) was rejected: OpenAI's schema makes that top-level "error" an
object {code, message} kept for failures without an HTTP response (batch_expired,
batch_cancelled), and a client would find no "param" to point at.

A request a batch never ran, because the batch was cancelled or its completion window ended
first (`unrun_line`, the batch service's error file), has that top-level error and no
response, as OpenAI writes it:

    {"id": ..., "custom_id": ..., "response": null,
     "error": {"code": "batch_cancelled" | "batch_expired", "message": ...}}

Ids are deterministic for a job: made of the job's tag (the first hex digits of its input's
digest, `JobManifest.id_tag`) and the request's index, and `created` is the job's start
(its manifest; a results row's done_ns is a monotonic clock, not wall time), so a resumed
job writes the same output however many times it ran.

Lines are JSON with ensure_ascii: a custom_id or a message may hold a lone surrogate (a
valid JSON escape that is not UTF-8), which would otherwise fail the write at the end of a
job; every JSON reader reads the escapes as the same text.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pipeline.batchjob.requests import KIND_CHAT, PROMPT_PARAMS
from pipeline.wire.errors import BatchOutputError

HTTP_OK = 200
HTTP_BAD_REQUEST = 400
HTTP_SERVER_ERROR = 500
# OpenAI's error types by status code.
ERROR_TYPES = {HTTP_BAD_REQUEST: "invalid_request_error", HTTP_SERVER_ERROR: "server_error"}
# OpenAI's code for a prompt over the model's context.
CODE_CONTEXT_LENGTH = "context_length_exceeded"
# A results row's status (pipeline/consumer/results.py's STATUS_*, which this unit may not
# import; tests/batchjob checks they agree).
ROW_OK = "ok"
ROW_TOO_LONG = "too_long"
ROW_CORRUPT = "corrupt"
ROW_CANCELLED = "cancelled"  # the item's batch ended before it ran: no answer (consumer/results.py)
ROW_ERROR = "error"
# A row's counts, as the output's usage names them.
USAGE_KEYS = ("prompt_tokens", "output_tokens", "cached_tokens")


@dataclass(slots=True, frozen=True)
class RequestRef:
    """What an output line says of its request: its custom_id, its kind (KIND_CHAT or
    KIND_COMPLETION; None for an unsupported endpoint) and its index (the ids' suffix)."""

    custom_id: str
    kind: str | None
    index: int


def response_line(request: RequestRef, row: Mapping[str, object], text: str | None, served_model: str, created: int,
                  tag: str, choices: list[dict] | None = None) -> str:
    """The output line of a request that ran (`row`: its results row, status ok; `text`: the
    generated text of its one plain choice, or `choices` made by `choices.make_choices`),
    without a newline. Usage counts every choice's tokens (the row's output_tokens)."""
    if row.get("status") != ROW_OK:
        raise BatchOutputError(f"request {request.custom_id!r} did not run (status {row.get('status')!r}): it "
                               f"takes an error_line")
    if isinstance(created, bool) or not isinstance(created, int) or created < 0:
        raise BatchOutputError(f"created {created!r} must be a Unix time in whole seconds")
    prompt, completion, cached = row_usage(row)
    finish = row.get("finish_reason")
    if not isinstance(finish, str):
        raise BatchOutputError(f"results row of request {request.custom_id!r}: finish_reason {finish!r} is not an "
                               f"engine's word")
    if choices is None and (text is None or type(text) is str):
        return _plain_line(request, text, served_model, created, tag, finish, (prompt, completion, cached))
    return _line(request, tag, HTTP_OK, _response_body(request, text, served_model, created, tag, finish,
                                                       (prompt, completion, cached), choices))


def _response_body(request: RequestRef, text: str | None, served_model: str, created: int, tag: str, finish: str,
                   usage: tuple[int, int, int], choices: list[dict] | None = None) -> dict:
    """A response line's body: one plain choice of `text`, or `choices`."""
    prompt, completion, cached = usage
    if request.kind == KIND_CHAT:
        body_id, kind = f"chatcmpl-{tag}-{request.index}", "chat.completion"
        choice: dict = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        body_id, kind = f"cmpl-{tag}-{request.index}", "text_completion"
        choice = {"index": 0, "text": text}
    choice.update(logprobs=None, finish_reason=finish)
    return {"id": body_id, "object": kind, "created": created, "model": served_model,
            "choices": choices if choices is not None else [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


# `_line` of `_response_body` with one plain choice, its strings written by the encoder's own
# function: the same text (tests/batchjob checks it) at a fifth of json.dumps' cost, which was
# about a third of the job's main process (py-spy, 200,000 requests).
_TEXT = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
_PLAIN = ('{"id":%s,"custom_id":%s,"response":{"status_code":200,"request_id":%s,"body":{"id":%s,"object":%s,'
          '"created":%d,"model":%s,"choices":[{"index":0,%s,"logprobs":null,"finish_reason":%s}],"usage":'
          '{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}'
          '}}},"error":null}')


def _plain_line(request: RequestRef, text: str | None, served_model: str, created: int, tag: str, finish: str,
                usage: tuple[int, int, int]) -> str:
    prompt, completion, cached = usage
    said = "null" if text is None else _TEXT(text)
    if request.kind == KIND_CHAT:
        body_id, kind, choice = f"chatcmpl-{tag}-{request.index}", '"chat.completion"', \
            '"message":{"role":"assistant","content":%s}' % said
    else:
        body_id, kind, choice = f"cmpl-{tag}-{request.index}", '"text_completion"', '"text":%s' % said
    return _PLAIN % (_TEXT(f"batch_req_{tag}_{request.index}"), _TEXT(request.custom_id),
                     _TEXT(f"req_{tag}_{request.index}"), _TEXT(body_id), kind, created, _TEXT(served_model), choice,
                     _TEXT(finish), prompt, completion, prompt + completion, cached)


def embedding_line(request: RequestRef, row: Mapping[str, object], encoding_format: str, served_model: str,
                   created: int, tag: str) -> str:
    """The output line of an embeddings request that ran (`row`: its results row, status ok,
    its "embeddings" the base64 of each input's little-endian float32 vector), each embedding
    as floats (the float32 values, as vLLM writes them) or as that base64."""
    vectors = row.get("embeddings")
    if row.get("status") != ROW_OK or not isinstance(vectors, list) or not vectors \
            or not all(isinstance(v, str) for v in vectors):
        raise BatchOutputError(f"results row of request {request.custom_id!r}: no embeddings (status "
                               f"{row.get('status')!r})")
    if encoding_format == "float":
        made: list = [np.frombuffer(base64.b64decode(v, validate=True), dtype="<f4").tolist() for v in vectors]
    else:
        made = list(vectors)
    prompt = _count(row, "prompt_tokens")
    body = {"id": f"embd-{tag}-{request.index}", "object": "list", "created": created, "model": served_model,
            "data": [{"object": "embedding", "index": k, "embedding": e} for k, e in enumerate(made)],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}
    return _line(request, tag, HTTP_OK, body)


def error_line(request: RequestRef, status_code: int, message: str, param: str | None = None, *, tag: str,
               code: str | None = None) -> str:
    """The output line of a request that failed with HTTP status `status_code` (400 or 500):
    OpenAI's error object in the response body, naming `param` and `code` where given."""
    if status_code not in ERROR_TYPES:
        raise BatchOutputError(f"status code {status_code!r}: an error line takes one of {sorted(ERROR_TYPES)}")
    body = {"error": {"message": message, "type": ERROR_TYPES[status_code], "param": param, "code": code}}
    return _line(request, tag, status_code, body)


# OpenAI's codes and words for a request a batch never ran.
CODE_CANCELLED = "batch_cancelled"
CODE_EXPIRED = "batch_expired"
UNRUN_MESSAGES = {CODE_CANCELLED: "This request was not executed because the batch was cancelled.",
                  CODE_EXPIRED: "This request could not be executed before the completion window expired."}


def unrun_line(custom_id: str, index: int, tag: str, code: str) -> str:
    """The error line of a request its batch never ran (`code`: CODE_CANCELLED or
    CODE_EXPIRED), without a newline; the id as the job would have given its answer."""
    line = {"id": f"batch_req_{tag}_{index}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": UNRUN_MESSAGES[code]}}
    return json.dumps(line, separators=(",", ":"), ensure_ascii=True)


def row_error(request: RequestRef, row: Mapping[str, object], tag: str) -> tuple[str, int]:
    """The output line and status code of a request whose results row is not ok (see the
    module docstring); BatchOutputError for a status that answers nothing (corrupt: the
    request runs again) or that no consumer writes."""
    status = row.get("status")
    prompt = PROMPT_PARAMS.get(request.kind, "prompt")  # type: ignore[arg-type]
    if status == ROW_TOO_LONG:
        return error_line(request, HTTP_BAD_REQUEST, f"the prompt is {row.get('prompt_tokens')} tokens, longer than "
                          f"this job's consumers take: shorten it", prompt, tag=tag,
                          code=CODE_CONTEXT_LENGTH), HTTP_BAD_REQUEST
    if status == ROW_ERROR:
        return error_line(request, HTTP_SERVER_ERROR, f"the engine failed this request: {row.get('error')}",
                          tag=tag), HTTP_SERVER_ERROR
    raise BatchOutputError(f"results row of request {request.custom_id!r}: status {status!r} answers nothing")


def row_usage(row: Mapping[str, object]) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of a results row."""
    return tuple(_count(row, key) for key in USAGE_KEYS)  # type: ignore[return-value]


def _line(request: RequestRef, tag: str, status_code: int, body: dict) -> str:
    line = {"id": f"batch_req_{tag}_{request.index}", "custom_id": request.custom_id,
            "response": {"status_code": status_code, "request_id": f"req_{tag}_{request.index}", "body": body},
            "error": None}
    return json.dumps(line, separators=(",", ":"), ensure_ascii=True)


def _count(row: Mapping[str, object], key: str) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BatchOutputError(f"results row of item {row.get('item_id')!r}: {key} {value!r} is not a count of "
                               f"tokens")
    return value
