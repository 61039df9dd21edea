"""What `pipeline tools check-job` holds a finished job's output to, line by line, and what it
counts: the pure half of the audit (`audit.py` reads the files and pairs their lines).

    found = decode_line(raw)                      # the line's JSON value, or why it is none
    why = line_problem(found)                     # None for a well-formed output line
    why = body_problem(url, request_body, body)   # None where a 200 answer fits its request
    tally.count(found)                            # lines by status, usage sums
    problems.add(MISSING, INPUT_FILE, line, None, offset)   # all counted, the first few kept

A line is OpenAI's batch output line (BatchRequestOutput in OpenAI's API reference, as
`output.py` writes it): an object of exactly id and custom_id (non-empty strings), response
and error; response null or {status_code (an HTTP status), request_id (a string), body (an
object)}; error null or {code, message} (strings: a failure without an HTTP response, as
OpenAI's batch_expired); exactly one of the two not null. A body of status 200 is its
endpoint's answer; of any other status, OpenAI's error object {"error": {message, type,
param, code}}.

What a 200 answer owes its request, checked without the engine: the model the request named;
its endpoint's object (chat.completion, text_completion, a list of embeddings); as many
choices as the request's n (one without it), indexed in order, or one embedding per input;
usage of counts whose total is the prompt and completion tokens, the cached within the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from pipeline.batchjob.embeddings import KIND_EMBEDDING, embedding_inputs
from pipeline.batchjob.output import HTTP_OK
from pipeline.batchjob.params import KIND_CHAT, KIND_COMPLETION, Refused, whole_number
from pipeline.batchjob.requests import ENDPOINTS
from pipeline.batchjob.scan import show
from pipeline.wire.textfiles import counted, listed

# The files an audit reads, as examples name them.
INPUT_FILE, OUTPUT_FILE, ERROR_FILE, SUMMARY_FILE = range(4)
# The kinds of problem, in the order they are reported.
INPUT = "input"            # a line of the input that is not a request, or a custom_id used twice
MISSING = "missing"        # a request without an answer
DUPLICATED = "duplicated"  # a request answered more than once (each extra line)
UNEXPECTED = "unexpected"  # an answer whose custom_id no request has
MALFORMED = "malformed"    # a line that is not an OpenAI batch output line
MISPLACED = "misplaced"    # with an error file: a failure in the output, a success in the error file
ORDER = "order"            # in input order: an answer before one whose request comes earlier
BODY = "body"              # a 200 answer that does not fit its request
SUMMARY = "summary"        # the job's summary disagrees with the files
KINDS = (INPUT, MISSING, DUPLICATED, UNEXPECTED, MALFORMED, MISPLACED, ORDER, BODY, SUMMARY)
TITLES = {INPUT: "input lines that are not requests, or custom_ids used twice",
          MISSING: "requests without an answer",
          DUPLICATED: "answers to a request answered before",
          UNEXPECTED: "answers to no request of the input",
          MALFORMED: "lines that are not OpenAI batch output lines",
          MISPLACED: "answers in the other file than their status puts them",
          ORDER: "answers out of the input's order",
          BODY: "answers that do not fit their request",
          SUMMARY: "figures of the job's summary that the files do not hold"}
# Examples kept of each kind, the first by file and line: enough to see the pattern, few
# enough that a file of nothing but problems stays readable.
MAX_EXAMPLES = 5
# What a line's keys are (OpenAI's BatchRequestOutput), its response's, its error's.
LINE_KEYS = ("id", "custom_id", "response", "error")
RESPONSE_KEYS = ("status_code", "request_id", "body")
ERROR_KEYS = ("code", "message")
# An HTTP status code: three digits.
HTTP_STATUS_RANGE = (100, 599)
# Each endpoint's answer object (OpenAI's).
OBJECTS = {KIND_CHAT: "chat.completion", KIND_COMPLETION: "text_completion", KIND_EMBEDDING: "list"}
EMBEDDING_OBJECT = "embedding"
# Characters of a value from a file that a message shows.
SAID_CHARS = 60
# The count of lines without an HTTP response, in `Tally.as_json`.
NO_RESPONSE = "no response"


def said(value: object) -> str:
    """A value from a file for a message: its JSON, cut to SAID_CHARS."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= SAID_CHARS else text[:SAID_CHARS - 3] + "..."


def decode_line(raw: bytes) -> object:
    """The JSON value of an output line, or the reason it is none (a str: a line's JSON
    value is never a bare string that `line_problem` would take)."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        try:  # valid JSON msgspec does not take (a lone surrogate escape), or the words why not
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:
            return f"not JSON ({str(exc)[:120]})"


def line_problem(found: object) -> str | None:
    """Why `found` (decode_line's) is not an OpenAI batch output line; None where it is one."""
    if isinstance(found, str):
        return found
    if not isinstance(found, dict):
        return f"not a JSON object: {show(found)}"
    why = _keys_problem(found, LINE_KEYS, "a line")
    if why:
        return why
    for key in ("id", "custom_id"):
        if not isinstance(found[key], str) or not found[key]:
            return f"{key} must be a non-empty string, got {show(found[key])}"
    response, error = found["response"], found["error"]
    if (response is None) == (error is None):
        return (f"response and error are both {'null' if response is None else 'given'}: a line answers its "
                f"request with exactly one of them")
    if error is not None:
        if not isinstance(error, dict):
            return f"error must be an object or null, got {show(error)}"
        return _keys_problem(error, ERROR_KEYS, "error") or _strings_problem(error, ERROR_KEYS, "error")
    return _response_problem(response)


def _keys_problem(found: dict, keys: tuple[str, ...], what: str) -> str | None:
    missing = [key for key in keys if key not in found]
    unknown = sorted(set(found) - set(keys))
    if not missing and not unknown:
        return None
    said = [f"no {listed(missing)}" if missing else "", f"unknown {listed(unknown)}" if unknown else ""]
    return f"{'; '.join(s for s in said if s)}: {what} has {', '.join(keys)}"


def _strings_problem(found: dict, keys: tuple[str, ...], what: str) -> str | None:
    for key in keys:
        if not isinstance(found[key], str):
            return f"{what}.{key} must be a string, got {show(found[key])}"
    return None


def _response_problem(response: object) -> str | None:
    if not isinstance(response, dict):
        return f"response must be an object or null, got {show(response)}"
    why = _keys_problem(response, RESPONSE_KEYS, "response")
    if why:
        return why
    status = response["status_code"]
    if type(status) is not int or not HTTP_STATUS_RANGE[0] <= status <= HTTP_STATUS_RANGE[1]:
        return f"response.status_code must be an HTTP status, got {show(status)}"
    if not isinstance(response["request_id"], str):
        return f"response.request_id must be a string, got {show(response['request_id'])}"
    body = response["body"]
    if not isinstance(body, dict):
        return f"response.body must be an object, got {show(body)}"
    if status == HTTP_OK:
        return None  # a success's body is held to its request (`body_problem`)
    error = body.get("error")
    if set(body) != {"error"} or not isinstance(error, dict):
        return f"a status {status} body is OpenAI's error object {{\"error\": {{message, type, param, code}}}}, " \
               f"got {show(body)}"
    for key in ("message", "type"):
        if not isinstance(error.get(key), str):
            return f"response.body.error.{key} must be a string, got {show(error.get(key))}"
    for key in ("param", "code"):
        if error.get(key) is not None and not isinstance(error[key], str):
            return f"response.body.error.{key} must be a string or null, got {show(error[key])}"
    return None


def status_of(found: dict) -> int | None:
    """A well-formed line's HTTP status; None for a failure without a response."""
    response = found["response"]
    return None if response is None else response["status_code"]


def custom_id_of(found: object) -> str | None:
    """The custom_id of a decoded line, where it has a string one."""
    if isinstance(found, dict) and isinstance(found.get("custom_id"), str):
        return found["custom_id"]
    return None


def body_problem(url: str, request: dict[str, Any], body: dict[str, Any]) -> str | None:
    """Why the body of a 200 answer does not fit the request (its url and body) that asked for
    it; None where it does, as far as that is known without the engine."""
    asked = request.get("model")
    if body.get("model") != asked:
        return f"model {said(body.get('model'))}, the request asked for {said(asked)}"
    kind = ENDPOINTS.get(url)
    if kind is None:  # an endpoint no job serves: only the model and usage are known
        return _usage_problem(body.get("usage"), kind)
    if body.get("object") != OBJECTS[kind]:
        return f"object {show(body.get('object'))}: the answer of {url} is {OBJECTS[kind]!r}"
    why = _embeddings_problem(request, body.get("data")) if kind == KIND_EMBEDDING else \
        _choices_problem(kind, request, body.get("choices"))
    return why or _usage_problem(body.get("usage"), kind)


def _choices_problem(kind: str, request: dict[str, Any], choices: object) -> str | None:
    n = whole_number(request.get("n"))
    wanted = n if n is not None else 1
    if not isinstance(choices, list):
        return f"choices must be an array, got {show(choices)}"
    if len(choices) != wanted:
        asked = f"n={n}" if n is not None else "one (no n)"
        return f"{counted(len(choices), 'choice')}, the request asked for {asked}"
    for k, choice in enumerate(choices):
        if not isinstance(choice, dict) or choice.get("index") != k:
            return f"choices[{k}] must be an object of index {k}, got {show(choice)}"
        if not isinstance(choice.get("finish_reason"), str):
            return f"choices[{k}].finish_reason must be a string, got {show(choice.get('finish_reason'))}"
        message = choice.get("message")
        if kind == KIND_CHAT and (not isinstance(message, dict) or not isinstance(message.get("role"), str)):
            return f"choices[{k}].message must be an object with a role, got {show(message)}"
        if kind != KIND_CHAT and not isinstance(choice.get("text"), str):
            return f"choices[{k}].text must be a string, got {show(choice.get('text'))}"
    return None


def _embeddings_problem(request: dict[str, Any], data: object) -> str | None:
    try:
        inputs = embedding_inputs({key: value for key, value in request.items() if value is not None}).inputs
    except Refused as refused:
        return f"answered 200, but the request is one a job refuses: {refused}"
    if not isinstance(data, list) or len(data) != len(inputs):
        got = counted(len(data), "embedding") if isinstance(data, list) else f"data {show(data)}"
        return f"{got}, the request gave {counted(len(inputs), 'input')}"
    for k, item in enumerate(data):
        if not isinstance(item, dict) or item.get("object") != EMBEDDING_OBJECT or item.get("index") != k:
            return f"data[{k}] must be an {EMBEDDING_OBJECT} object of index {k}, got {show(item)}"
    return None


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _usage_problem(usage: object, kind: str | None) -> str | None:
    if not isinstance(usage, dict):
        return f"usage must be an object, got {show(usage)}"
    required = ("prompt_tokens", "total_tokens") if kind in (KIND_EMBEDDING, None) else \
        ("prompt_tokens", "completion_tokens", "total_tokens")
    for key in (*required, *(["completion_tokens"] if "completion_tokens" in usage else [])):
        if not _is_count(usage.get(key)):
            return f"usage.{key} must be a count of tokens, got {show(usage.get(key))}"
    prompt, completion, total = usage["prompt_tokens"], usage.get("completion_tokens", 0), usage["total_tokens"]
    if total != prompt + completion:
        return f"usage.total_tokens {total} is not prompt_tokens {prompt} + completion_tokens {completion}"
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if details is not None and not (isinstance(details, dict) and (cached is None or _is_count(cached))):
        return f"usage.prompt_tokens_details must be an object of cached_tokens, got {show(details)}"
    if cached is not None and cached > prompt:
        return f"usage: {cached} cached tokens of a prompt of {prompt}"
    return None


def _tokens(usage: dict, key: str) -> int:
    value = usage.get(key)
    return value if _is_count(value) else 0


@dataclass(slots=True)
class Tally:
    """Well-formed lines by HTTP status (and those without a response), and the usage of the
    200 answers summed as a job's summary sums it."""

    by_status: dict[int, int] = field(default_factory=dict)
    no_response: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0

    def count(self, found: dict) -> None:
        """One line `line_problem` found well-formed."""
        status = status_of(found)
        if status is None:
            self.no_response += 1
            return
        self.by_status[status] = self.by_status.get(status, 0) + 1
        usage = found["response"]["body"].get("usage") if status == HTTP_OK else None
        if isinstance(usage, dict):
            self.prompt_tokens += _tokens(usage, "prompt_tokens")
            self.completion_tokens += _tokens(usage, "completion_tokens")
            self.total_tokens += _tokens(usage, "total_tokens")
            details = usage.get("prompt_tokens_details")
            self.cached_tokens += _tokens(details, "cached_tokens") if isinstance(details, dict) else 0

    @property
    def completed(self) -> int:
        return self.by_status.get(HTTP_OK, 0)

    @property
    def failed(self) -> int:
        return sum(self.by_status.values()) - self.completed + self.no_response

    @property
    def lines(self) -> int:
        return self.completed + self.failed

    def failed_by_status(self) -> dict[int, int]:
        return {status: n for status, n in sorted(self.by_status.items()) if status != HTTP_OK}

    def as_json(self) -> dict:
        return {"completed": self.completed, "failed": self.failed,
                "by_status": {str(k): v for k, v in sorted(self.by_status.items())}
                | ({NO_RESPONSE: self.no_response} if self.no_response else {}),
                "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                          "total_tokens": self.total_tokens, "cached_tokens": self.cached_tokens}}

    def check_invariants(self) -> None:
        assert all(HTTP_STATUS_RANGE[0] <= k <= HTTP_STATUS_RANGE[1] and n > 0 for k, n in self.by_status.items())
        assert min(self.no_response, self.prompt_tokens, self.completion_tokens, self.total_tokens,
                   self.cached_tokens) >= 0


def summary_problems(document: object, requests: int, tally: Tally) -> list[str]:
    """What a job's summary (`--summary-file`, JSON: {"job": {request_counts, failed_by_status,
    usage, output_written}}) says that the files do not: each figure that differs."""
    job = document.get("job") if isinstance(document, dict) else None
    if not isinstance(job, dict):
        return [f"not a job's summary (no \"job\" object): {show(document)}"]
    holds = {"request_counts.total": (requests, "the input holds"),
             "request_counts.completed": (tally.completed, "the files hold"),
             "request_counts.failed": (tally.failed, "the files hold"),
             "usage.prompt_tokens": (tally.prompt_tokens, "the 200 answers sum to"),
             "usage.completion_tokens": (tally.completion_tokens, "the 200 answers sum to"),
             "usage.total_tokens": (tally.total_tokens, "the 200 answers sum to"),
             "usage.cached_tokens": (tally.cached_tokens, "the 200 answers sum to")}
    found = []
    for path, (value, where) in holds.items():
        outer, key = path.split(".")
        figure = job[outer].get(key) if isinstance(job.get(outer), dict) else None
        if figure != value or type(figure) is not int:
            found.append(f"{path} is {said(figure)}, {where} {value:,}")
    failed = {str(k): v for k, v in tally.failed_by_status().items()}
    if job.get("failed_by_status") != failed:
        found.append(f"failed_by_status is {said(job.get('failed_by_status'))}, the files hold {said(failed)}")
    if job.get("output_written") is not True:
        found.append(f"output_written is {said(job.get('output_written'))}: the job did not finish its output")
    return found


@dataclass(slots=True, frozen=True)
class Example:
    """Where a problem is (`file`: INPUT_FILE...; `line` from 1, 0 for the file as a whole)
    and what it is; `text` None: the kind's words about the custom_id of the line at byte
    `offset`, read when it is shown."""

    file: int
    line: int
    text: str | None
    offset: int = 0


class Problems:
    """Every problem counted by kind, the first `limit` of each (by file and line) kept."""

    def __init__(self, limit: int = MAX_EXAMPLES) -> None:
        self.limit = limit
        self.counts: dict[str, int] = {}
        self._kept: dict[str, list[Example]] = {}

    def add(self, kind: str, file: int, line: int, text: str | None, offset: int = 0) -> None:
        assert kind in KINDS, kind
        self.counts[kind] = self.counts.get(kind, 0) + 1
        kept = self._kept.setdefault(kind, [])
        kept.append(Example(file, line, text, offset))
        if len(kept) > 4 * self.limit:  # the earliest kept, bounded
            self._kept[kind] = self._first(kept)

    def add_many(self, kind: str, file: int, lines: np.ndarray, offsets: np.ndarray) -> None:
        """Many of one kind in one file (their lines and byte offsets), each named by the
        custom_id of its line; only the first `limit` of them are looked at one by one."""
        first = np.argsort(lines, kind="stable")[:self.limit] if lines.size > self.limit else np.arange(lines.size)
        for k in first.tolist():
            self.add(kind, file, int(lines[k]), None, int(offsets[k]))
        self.counts[kind] = self.counts.get(kind, 0) + int(lines.size) - len(first)

    def _first(self, kept: list[Example]) -> list[Example]:
        return sorted(kept, key=lambda e: (e.file, e.line))[:self.limit]

    def count(self, kind: str) -> int:
        return self.counts.get(kind, 0)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def shown(self, kind: str) -> list[Example]:
        return self._first(self._kept.get(kind, []))

    def check_invariants(self) -> None:
        assert set(self.counts) <= set(KINDS) and set(self._kept) <= set(self.counts)
        for kind, kept in self._kept.items():
            assert 0 < len(kept) <= 4 * self.limit and len(kept) <= self.counts[kind], (kind, len(kept))
