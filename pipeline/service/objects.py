"""OpenAI's File and Batch objects, lists and error bodies, from the service's records; and
the checks of what a client sends (a batch's create body, metadata, list parameters). Pure.

    file_object(record)              {"id": "file-...", "object": "file", "bytes", ...}
    batch_object(record)             {"id": "batch_...", "object": "batch", "status", ...}
    list_page(objects, after, limit) {"object": "list", "data", "first_id", "last_id", "has_more"}
    error_body(ApiError)             {"error": {"message", "type", "param", "code"}}

A record is what the store keeps on disk (JSON, a few hundred bytes): everything a listing
shows, so a restart reads no input file. Its `owner` is the tenant's name, never its key.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.service.limits import (
    DEFAULT_PRIORITY,
    PRIORITY_KEY,
    PRIORITY_RANGE,
    COMPLETION_WINDOW,
    COMPLETION_WINDOW_RANGE_S,
    COMPLETION_WINDOW_UNITS_S,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
)
from pipeline.service.states import TERMINAL, Lifecycle
from pipeline.wire.errors import ApiError

PURPOSE_BATCH = "batch"
PURPOSE_OUTPUT = "batch_output"
# What an upload may be for here: batch input only (the service runs batches, nothing else).
UPLOAD_PURPOSES = (PURPOSE_BATCH,)
# The keys of a batch's create body (OpenAI's; output_expires_after is refused: files here
# stay until deleted).
CREATE_KEYS = ("input_file_id", "endpoint", "completion_window", "metadata")
HTTP_BAD_REQUEST = 400
HTTP_UNAUTHORIZED = 401
HTTP_NOT_FOUND = 404
HTTP_CONFLICT = 409
HTTP_TOO_LARGE = 413
HTTP_TOO_MANY = 429
# A file's record version: a record of another version is refused, never misread.
RECORD_VERSION = 1


@dataclass(slots=True)
class FileRecord:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    requests: int = 0  # a batch input's requests (its scan's count)
    urls: list[str] = field(default_factory=list)  # a batch input's endpoints, each line's url
    digest: str = ""  # a batch input's xxh3-128 (its job's id tag)
    batch_id: str | None = None  # an output's batch
    seq: int = 0  # creation order among the server's files (a list's tie within one second)

    def as_json(self) -> dict:
        return {"version": RECORD_VERSION, **asdict(self)}


@dataclass(slots=True)
class BatchRecord:
    id: str
    owner: str
    seq: int  # submission order, across restarts
    input_file_id: str
    endpoint: str
    model: str
    life: Lifecycle
    total: int
    metadata: dict[str, str] | None = None
    completion_window: str = COMPLETION_WINDOW  # as the create said; its deadline is in `life`
    completed: int = 0
    failed: int = 0
    usage: dict[str, int] | None = None  # prompt_tokens, completion_tokens, cached_tokens
    output_file_id: str | None = None
    error_file_id: str | None = None
    reserved_ids: list[str] = field(default_factory=list)  # the output and error file ids, once finalizing
    errors: list[dict] | None = None
    job_failures: int = 0

    def as_json(self) -> dict:
        return {"version": RECORD_VERSION, **asdict(self)}


def file_record(raw: dict) -> FileRecord:
    """A FileRecord from its JSON (ValueError where it is not one: the store names the file)."""
    record = FileRecord(**_fields(raw, FileRecord))
    if type(record.seq) is not int or record.seq < 0:
        raise ValueError(f"seq {record.seq!r:.40} is not a whole number")
    return record


def batch_record(raw: dict) -> BatchRecord:
    fields = _fields(raw, BatchRecord)
    if not isinstance(fields.get("life"), dict):
        raise ValueError("life is not an object")
    fields["life"] = Lifecycle(**fields["life"])
    record = BatchRecord(**fields)
    record.life.check_invariants()
    return record


def _fields(raw: object, kind: type) -> dict:
    if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION:
        raise ValueError(f"not a version {RECORD_VERSION} record")
    return {k: v for k, v in raw.items() if k != "version"}


def file_object(record: FileRecord) -> dict:
    return {"id": record.id, "object": "file", "bytes": record.bytes, "created_at": record.created_at,
            "filename": record.filename, "purpose": record.purpose, "status": "processed",
            "status_details": None, "expires_at": None}


def batch_object(record: BatchRecord) -> dict:
    """The Batch object. Its output and error file ids show once it ended (a file id seen
    is a file whole); usage as OpenAI's (input and output tokens, cached input tokens)."""
    life = record.life
    ended = life.status in TERMINAL
    usage = record.usage
    return {
        "id": record.id, "object": "batch", "endpoint": record.endpoint, "model": record.model,
        "errors": {"object": "list", "data": record.errors} if record.errors else None,
        "input_file_id": record.input_file_id, "completion_window": record.completion_window,
        "status": life.status,
        "output_file_id": record.output_file_id if ended else None,
        "error_file_id": record.error_file_id if ended else None,
        "created_at": life.created_at, "expires_at": life.expires_at, **life.stamps(),
        "request_counts": {"total": record.total, "completed": record.completed, "failed": record.failed},
        "usage": None if usage is None else {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["cached_tokens"]},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
        "metadata": record.metadata,
    }


def error_body(error: ApiError) -> dict:
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def not_found(kind: str, object_id: str, param: str) -> ApiError:
    """The 404 of a missing object, and of another tenant's: the same words either way."""
    return ApiError(HTTP_NOT_FOUND, f"No {kind} found with id '{object_id[:100]}'.", param)


def list_page(objects: Sequence[dict], after: str | None, limit: int) -> dict:
    """A page of `objects` (in the list's order): those after the one whose id is `after`
    (ApiError 400 where it is not in the list), at most `limit`."""
    start = 0
    if after is not None:
        ids = [o["id"] for o in objects]
        if after not in ids:
            raise ApiError(HTTP_BAD_REQUEST, f"after: no object with id '{after[:100]}' in this list", "after")
        start = ids.index(after) + 1
    data = list(objects[start:start + limit])
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(objects)}


def check_limit(value: int | None, default: int, allowed: tuple[int, int]) -> int:
    if value is None:
        return default
    if not allowed[0] <= value <= allowed[1]:
        raise ApiError(HTTP_BAD_REQUEST, f"limit {value}: must be {allowed[0]} to {allowed[1]:,}", "limit")
    return value


@dataclass(slots=True, frozen=True)
class BatchCreate:
    input_file_id: str
    endpoint: str
    metadata: dict[str, str] | None
    completion_window: str = COMPLETION_WINDOW  # checked: `window_seconds` takes it


def parse_batch_create(body: Any, endpoints: Sequence[str]) -> BatchCreate:
    """A batch's create body, checked (ApiError 400 naming the parameter)."""
    if not isinstance(body, dict):
        raise ApiError(HTTP_BAD_REQUEST, "the body must be a JSON object")
    unknown = sorted(set(body) - set(CREATE_KEYS))
    if unknown:
        raise ApiError(HTTP_BAD_REQUEST, f"Unrecognized request argument supplied: {unknown[0][:64]} (this server "
                                         f"takes {', '.join(CREATE_KEYS)})", unknown[0][:64])
    for key in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(key), str):
            raise ApiError(HTTP_BAD_REQUEST, f"{key} is required, a string", key)
    if body["endpoint"] not in endpoints:
        raise ApiError(HTTP_BAD_REQUEST, f"endpoint {body['endpoint'][:100]!r}: this server runs batches of "
                                         f"{', '.join(endpoints)}", "endpoint")
    window = body["completion_window"]
    window_seconds(window)
    return BatchCreate(body["input_file_id"], body["endpoint"], check_metadata(body.get("metadata")), window)


def window_seconds(window: str) -> int:
    """A completion window's seconds: "24h" (OpenAI's), or any number of seconds, minutes or
    hours in COMPLETION_WINDOW_RANGE_S; ApiError 400 otherwise."""
    low, high = COMPLETION_WINDOW_RANGE_S
    match = re.fullmatch(r"([0-9]{1,7})([smh])", window)
    seconds = int(match.group(1)) * COMPLETION_WINDOW_UNITS_S[match.group(2)] if match else None
    if seconds is None or not low <= seconds <= high:
        raise ApiError(HTTP_BAD_REQUEST, f"completion_window {window[:20]!r}: {COMPLETION_WINDOW!r} (OpenAI's), or "
                                         f"seconds, minutes or hours from {low // 60} minute to {high // 3600} hours "
                                         f"(\"90m\", \"2h\")", "completion_window")
    return seconds


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's metadata rules: at most MAX_METADATA_PAIRS string pairs of bounded length."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise ApiError(HTTP_BAD_REQUEST, "metadata must be an object of strings", "metadata")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ApiError(HTTP_BAD_REQUEST, f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS}",
                       "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise ApiError(HTTP_BAD_REQUEST, f"metadata key {key[:MAX_METADATA_KEY_CHARS]!r}: keys are at most "
                                             f"{MAX_METADATA_KEY_CHARS} characters, values at most "
                                             f"{MAX_METADATA_VALUE_CHARS}", "metadata")
    if PRIORITY_KEY in metadata:
        value = metadata[PRIORITY_KEY]
        low, high = PRIORITY_RANGE
        if not re.fullmatch(r"[+-]?[0-9]{1,12}", value.strip()) or not low <= int(value) <= high:
            raise ApiError(HTTP_BAD_REQUEST, f"metadata {PRIORITY_KEY} {value[:20]!r}: an integer from {low:,} to "
                                             f"{high:,} (the lower, the sooner; 0 by default)", "metadata")
    return dict(metadata)


def priority_of(metadata: dict[str, str] | None) -> int:
    """A batch's priority (checked by `check_metadata` when it was created): the lower, the
    sooner, as vLLM's; DEFAULT_PRIORITY without one."""
    if not metadata or PRIORITY_KEY not in metadata:
        return DEFAULT_PRIORITY
    return int(metadata[PRIORITY_KEY])


def check_endpoint_of_lines(urls: Sequence[str], endpoint: str) -> None:
    """Every line of the input is for the batch's endpoint (ApiError 400 naming another)."""
    other = [url for url in urls if url != endpoint]
    if other:
        raise ApiError(HTTP_BAD_REQUEST, f"the input file has requests for {other[0][:100]!r}, and this batch's "
                                         f"endpoint is {endpoint!r}: every line's url must be the batch's endpoint",
                       "endpoint", "mismatched_endpoint")
