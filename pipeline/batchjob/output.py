"""A batch job's output file: one OpenAI Batch output line per request, written whole (issue 14).

A request that ran (results row status "ok"):

    {"id": "batch_req_<hash12>_<index>", "custom_id": "req-17",
     "response": {"status_code": 200, "request_id": "req_<hash12>_<index>", "body": {
         "id": "chatcmpl-<hash12>-<index>", "object": "chat.completion", "created": <unix s>,
         "model": <served>, "choices": [{"index": 0, "message": {"role": "assistant",
         "content": <text>}, "logprobs": null, "finish_reason": "stop" | "length"}],
         "usage": {"prompt_tokens", "completion_tokens", "total_tokens",
                   "prompt_tokens_details": {"cached_tokens"}}}},
     "error": null}

and for /v1/completions a body of "id": "cmpl-...", "object": "text_completion", choices
[{"index": 0, "text": <text>, "logprobs": null, "finish_reason"}], the same usage.

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
batch_cancelled), which this job does not have, and a client would find no "param" to
point at.

Ids are deterministic for a job: made of the first ID_HASH_CHARS hex digits of the input
file's sha256 and the request's index, and `created` is the job's start (the integrator
records it in the job manifest; a results row's done_ns is a monotonic clock, not wall
time), so a resumed job writes the same output however many times it ran.

Lines are JSON with ensure_ascii: a custom_id or a message may hold a lone surrogate (a
valid JSON escape that is not UTF-8), which would otherwise fail the write at the end of a
job; every JSON reader reads the escapes as the same text.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pipeline.batchjob.requests import KIND_CHAT, BatchRequest
from pipeline.wire import fileops
from pipeline.wire.errors import BatchOutputError
from pipeline.wire.fileops import errno_text

HTTP_OK = 200
HTTP_BAD_REQUEST = 400
HTTP_SERVER_ERROR = 500
# OpenAI's error types by status code.
ERROR_TYPES = {HTTP_BAD_REQUEST: "invalid_request_error", HTTP_SERVER_ERROR: "server_error"}
# OpenAI's code for a prompt over the model's context.
CODE_CONTEXT_LENGTH = "context_length_exceeded"
# Hex digits of the file's sha256 in every id: 48 bits tell jobs apart in a user's folder of
# outputs, and keep ids short (the index makes them unique within a job).
ID_HASH_CHARS = 12
# A results row's status (pipeline/consumer/results.py's STATUS_*, which this unit may not
# import; tests/batchjob checks they agree).
ROW_OK = "ok"
ROW_TOO_LONG = "too_long"
ROW_CORRUPT = "corrupt"
ROW_ERROR = "error"
# The output is the user's results: owner-only, like the results files (SPEC §7, §12).
OUTPUT_FILE_MODE = 0o600


@dataclass(slots=True)
class Usage:
    """Tokens of a job's requests that ran, as their output lines' usage adds up."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0


def response_line(request: BatchRequest, row: Mapping[str, object], text: str, served_model: str, created: int,
                  job_hash: str) -> str:
    """The output line of a request that ran (`row`: its results row, status ok; `text`: the
    generated text), without a newline."""
    if request.error is not None or row.get("status") != ROW_OK:
        raise BatchOutputError(f"request {request.custom_id!r} (line {request.line}) did not run (status "
                               f"{row.get('status')!r}, error {request.error!r}): it takes an error_line")
    if isinstance(created, bool) or not isinstance(created, int) or created < 0:
        raise BatchOutputError(f"created {created!r} must be a Unix time in whole seconds")
    usage = _usage(request, row)
    finish = row.get("finish_reason")
    if not isinstance(finish, str):
        raise BatchOutputError(f"results row of request {request.custom_id!r}: finish_reason {finish!r} is not an "
                               f"engine's word")
    tag = _tag(job_hash, request.index)
    if request.kind == KIND_CHAT:
        body_id, kind = f"chatcmpl-{tag}", "chat.completion"
        choice: dict = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        body_id, kind = f"cmpl-{tag}", "text_completion"
        choice = {"index": 0, "text": text}
    choice.update(logprobs=None, finish_reason=finish)
    body = {"id": body_id, "object": kind, "created": created, "model": served_model, "choices": [choice],
            "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                      "total_tokens": usage.total_tokens,
                      "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}}
    return _line(request, job_hash, HTTP_OK, body)


def error_line(request: BatchRequest, status_code: int, message: str, param: str | None = None, *, job_hash: str,
               code: str | None = None) -> str:
    """The output line of a request that failed with HTTP status `status_code` (400 or 500):
    OpenAI's error object in the response body, naming `param` and `code` where given."""
    if status_code not in ERROR_TYPES:
        raise BatchOutputError(f"status code {status_code!r}: an error line takes one of {sorted(ERROR_TYPES)}")
    body = {"error": {"message": message, "type": ERROR_TYPES[status_code], "param": param, "code": code}}
    return _line(request, job_hash, status_code, body)


def row_line(request: BatchRequest, row: Mapping[str, object] | None, text: str | None, *, served_model: str,
             created: int, job_hash: str) -> str:
    """The output line of any request: its own error (refused when the file was read: `row`
    None, it never ran), else by its results row's status (see the module docstring)."""
    if request.error is not None:
        return error_line(request, HTTP_BAD_REQUEST, request.error, request.error_param, job_hash=job_hash)
    if row is None:
        raise BatchOutputError(f"request {request.custom_id!r} (line {request.line}) has no results row")
    status = row.get("status")
    if status == ROW_OK:
        return response_line(request, row, text or "", served_model, created, job_hash)
    prompt = "messages" if request.kind == KIND_CHAT else "prompt"
    if status == ROW_TOO_LONG:
        return error_line(request, HTTP_BAD_REQUEST, f"the prompt is {row.get('prompt_tokens')} tokens, longer than "
                          f"this job's consumers take: shorten it", prompt, job_hash=job_hash,
                          code=CODE_CONTEXT_LENGTH)
    if status == ROW_ERROR:
        return error_line(request, HTTP_SERVER_ERROR, f"the engine failed this request: {row.get('error')}",
                          job_hash=job_hash)
    if status == ROW_CORRUPT:
        return error_line(request, HTTP_SERVER_ERROR, "the stored request was damaged (it failed its checksum) and "
                          "did not run: submit it again", job_hash=job_hash)
    raise BatchOutputError(f"results row of request {request.custom_id!r}: unknown status {status!r}")


def usage_totals(rows: Iterable[Mapping[str, object]]) -> Usage:
    """The tokens of the rows that ran (status ok), summed as their output lines show them:
    for the job's summary."""
    total = Usage()
    for row in rows:
        if row.get("status") == ROW_OK:
            prompt, completion, cached = (_count(row, key) for key in ("prompt_tokens", "output_tokens",
                                                                       "cached_tokens"))
            total.prompt_tokens += prompt
            total.completion_tokens += completion
            total.total_tokens += prompt + completion
            total.cached_tokens += cached
    return total


# Bytes of output lines gathered into one write: few system calls, bounded memory.
OUTPUT_CHUNK_BYTES = 1 << 20


def write_output(path: str | os.PathLike[str], lines: Iterable[str]) -> None:
    """Write `lines` (each without its newline) as the file `path`, whole or not at all: into
    a temporary file beside it, flushed and fsynced, renamed over `path`, then the directory
    fsynced. Any failure (the disk, or `lines` itself raising) removes the temporary file and
    leaves an older `path` as it was; an OSError is raised as BatchOutputError.
    NOTE: writing `path` in place was rejected: a crash in the middle would leave a torn
    output, or an older complete one cut to a prefix of the new."""
    name = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(name))
    try:
        fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(name)}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise BatchOutputError(f"{name}: cannot create the output file's temporary file in {directory}: "
                               f"{errno_text(exc)}") from exc
    try:
        try:
            os.fchmod(fd, OUTPUT_FILE_MODE)
            chunk: list[str] = []
            size = 0
            for line in lines:
                chunk.append(line)
                size += len(line) + 1
                if size >= OUTPUT_CHUNK_BYTES:
                    fileops.write_all(fd, ("\n".join(chunk) + "\n").encode("utf-8"))
                    chunk, size = [], 0
            if chunk:
                fileops.write_all(fd, ("\n".join(chunk) + "\n").encode("utf-8"))
            fileops.fsync(fd)
        finally:
            os.close(fd)
        fileops.rename(temp, name)
    except BaseException as exc:
        _remove_quietly(temp)
        if isinstance(exc, OSError):
            raise BatchOutputError(f"{name}: writing the output failed: {errno_text(exc)}; the temporary file "
                                   f"was removed and an older output left as it was") from exc
        raise
    try:
        fileops.fsync_directory(directory)
    except OSError as exc:
        raise BatchOutputError(f"{name}: the output was written, but fsync of its directory {directory} failed: "
                               f"{errno_text(exc)}; after a power cut the older output may be back") from exc


def _tag(job_hash: str, index: int) -> str:
    """What makes a request's ids: the job's hash prefix and the request's index."""
    tag = job_hash[:ID_HASH_CHARS]
    if len(tag) != ID_HASH_CHARS or not all(c in "0123456789abcdef" for c in tag):
        raise BatchOutputError(f"job hash {job_hash!r}: expected the input file's sha256 in lowercase hex")
    return f"{tag}-{index}"


def _line(request: BatchRequest, job_hash: str, status_code: int, body: dict) -> str:
    tag = _tag(job_hash, request.index).replace("-", "_")
    line = {"id": f"batch_req_{tag}", "custom_id": request.custom_id,
            "response": {"status_code": status_code, "request_id": f"req_{tag}", "body": body}, "error": None}
    return json.dumps(line, separators=(",", ":"), ensure_ascii=True)


def _usage(request: BatchRequest, row: Mapping[str, object]) -> Usage:
    prompt, completion, cached = (_count(row, key) for key in ("prompt_tokens", "output_tokens", "cached_tokens"))
    return Usage(prompt, completion, prompt + completion, cached)


def _count(row: Mapping[str, object], key: str) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BatchOutputError(f"results row of item {row.get('item_id')!r}: {key} {value!r} is not a count of "
                               f"tokens")
    return value


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # already gone; the error being raised says what went wrong
