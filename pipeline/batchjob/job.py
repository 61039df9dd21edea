"""A batch job's state on its data directory: which requests have their answer, which wait
in the store, and which are still to be submitted. This is what makes a job resumable.

    DATA_DIR/job/manifest.json     the job: its input file's sha256, the served model, when
                                   it started (every response's `created`); written once
    DATA_DIR/job/rejected/*.jsonl  requests a producer could not make a prompt of (a chat
                                   template that refused the conversation): {"index", "message"}
    DATA_DIR/results/run-*/        the consumers' results files, one directory per run

Every item of a job carries its request's index (0-based, in file order) as its payload,
in ASCII digits (`request_payload`). A rerun on the same data directory reads back:
    answered   a results line of any run (ok, too long, an engine error), or a rejection
    pending    an item still in the store or in a producer ring (the broker delivers it)
    to submit  every other request without a per-request error of its own
so nothing answered runs again and nothing pending is submitted twice. A results line of a
corrupt entry (the store damaged it) is not an answer: the request is submitted again from
its line in the file.

Owner: the process running the job (the launcher's parent); the rejection logs are written
by producer processes, each its own file, one whole line per write.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from pipeline.batchjob.output import write_output
from pipeline.reporting.accounting import ResultsSummary, result_rows
from pipeline.wire.errors import JobMismatchError
from pipeline.wire.textfiles import bounded_lines

JOB_DIR = "job"
MANIFEST_NAME = "manifest.json"
REJECTED_DIR = "rejected"
RESULTS_DIR = "results"
# A results line of these statuses answers its request for good; a corrupt one does not.
ANSWER_STATUSES = frozenset({"ok", "too_long", "error"})
# The manifest and a rejection line are small: anything longer is not ours.
MAX_JOB_LINE_BYTES = 1 << 16
# Longest payload that can be a request index: 20 digits hold any int64.
MAX_INDEX_DIGITS = 20


def request_payload(index: int) -> bytes:
    """The payload of request `index`'s item: its index in ASCII digits."""
    return b"%d" % index


def request_index(payload: bytes) -> int | None:
    """The request index a payload names, or None if it names none (not a job's item)."""
    if not payload or len(payload) > MAX_INDEX_DIGITS or not payload.isdigit():
        return None
    return int(payload)


@dataclass(slots=True, frozen=True)
class JobManifest:
    """What a job's data directory is for. Written at a job's first run; a later run on the
    same directory must be for the same input file (by content) and served model."""

    input_sha256: str
    input_path: str
    served_model: str
    requests: int
    created_s: int  # Unix time of the first run: every response's `created`

    @classmethod
    def load_or_create(cls, data_dir: str, wanted: JobManifest) -> JobManifest:
        """The data directory's manifest (written now from `wanted` if it has none);
        JobMismatchError if it is another job's."""
        path = os.path.join(data_dir, JOB_DIR, MANIFEST_NAME)
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_JOB_LINE_BYTES + 1)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            write_output(path, [json.dumps(asdict(wanted))])  # whole or not at all, as the output
            return wanted
        try:
            have = cls(**json.loads(raw))
        except (ValueError, TypeError) as exc:
            raise JobMismatchError(f"{path}: not a job manifest ({exc}); use another --data-dir") from None
        if (have.input_sha256, have.served_model) != (wanted.input_sha256, wanted.served_model):
            raise JobMismatchError(
                f"{data_dir} holds another job: {have.input_path} (sha256 {have.input_sha256[:12]}..., model "
                f"{have.served_model!r}), not {wanted.input_path} (sha256 {wanted.input_sha256[:12]}..., model "
                f"{wanted.served_model!r}); use another --data-dir, or remove it to start over")
        return have


class RejectionLog:
    """A producer's log of requests it could not make a prompt of. Owner: one producer
    process (its own file); each rejection is one O_APPEND write of one whole line, so a
    kill leaves whole lines (a torn last one is skipped when read, and that request is
    simply made again by the next run). `close()` is explicit."""

    def __init__(self, data_dir: str, name: str) -> None:
        folder = os.path.join(data_dir, JOB_DIR, REJECTED_DIR)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self.path = os.path.join(folder, f"{name}.jsonl")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def reject(self, index: int, message: str) -> None:
        line = json.dumps({"index": index, "message": message[:MAX_JOB_LINE_BYTES // 2]}, ensure_ascii=True)
        os.write(self._fd, line.encode() + b"\n")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(slots=True)
class Answers:
    """Every request answered so far: its results line (an ok one where a request has
    several: a redelivered batch), in the order they were answered, and the rejections."""

    rows: dict[int, dict] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)  # request indices, first answer first
    rejected: dict[int, str] = field(default_factory=dict)
    bad_lines: int = 0  # results lines that are not results (a torn line), skipped

    def answered(self) -> set[int]:
        return set(self.rows) | set(self.rejected)

    def add_row(self, row: dict) -> None:
        index = request_index(base64.b64decode(row.get("payload") or ""))
        if index is None or row.get("status") not in ANSWER_STATUSES:
            return
        have = self.rows.get(index)
        if have is None:
            self.rows[index] = row
            self.order.append(index)
        elif have["status"] != "ok" and row["status"] == "ok":
            self.rows[index] = row  # a redelivered batch answered it properly after all


def read_answers(data_dir: str) -> Answers:
    """What every run of the job on `data_dir` answered (results lines of all runs, in the
    order of their run directories, then of their files and lines) and rejected."""
    answers = Answers()
    seen = ResultsSummary()
    results = os.path.join(data_dir, RESULTS_DIR)
    for run in sorted(os.listdir(results)) if os.path.isdir(results) else []:
        folder = os.path.join(results, run)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if name.endswith(".jsonl"):
                for row in result_rows(os.path.join(folder, name), seen):
                    answers.add_row(row)
    rejected = os.path.join(data_dir, JOB_DIR, REJECTED_DIR)
    for name in sorted(os.listdir(rejected)) if os.path.isdir(rejected) else []:
        for row in _json_lines(os.path.join(rejected, name), answers):
            if isinstance(row.get("index"), int) and row["index"] not in answers.rows:
                answers.rejected.setdefault(row["index"], str(row.get("message", "")))
    answers.bad_lines += seen.bad_lines
    return answers


def _json_lines(path: str, answers: Answers) -> Iterable[dict]:
    """The JSON objects of a rejection log's lines; anything else (a torn last line) is
    counted as a bad line."""
    with open(path, "rb") as file:
        yield from _objects(bounded_lines(file, MAX_JOB_LINE_BYTES), answers)


def _objects(lines: Iterable[tuple[int, bytes | None]], answers: Answers) -> Iterable[dict]:
    for _line, raw in lines:
        if raw is None:
            answers.bad_lines += 1
            continue
        try:
            row = json.loads(raw)
        except ValueError:
            answers.bad_lines += 1
            continue
        if isinstance(row, dict):
            yield row
        else:
            answers.bad_lines += 1


def pending_requests(payloads: Iterable[bytes]) -> set[int]:
    """The request indices of the items a stopped run left in the store and the rings."""
    return {index for index in map(request_index, payloads) if index is not None}
