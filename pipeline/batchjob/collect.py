"""Turning what the consumers and producers wrote into the job's answers, as it is written.

    collector = Collector(data_dir, manifest, input_fd, tokenizer, log)
    collector.collect()          # every poll: new whole lines of every file, to the log

Where answers come from:
    DATA_DIR/results/**/*.jsonl      consumers' results rows (every run's, a staged
                                     consumer's, a Ray node's), `pipeline/consumer/results.py`
    DATA_DIR/job/rejected/*.jsonl    requests a producer answered itself (a body the job
                                     cannot serve, a prompt too long, a template that failed),
                                     `rejections.py`

Each file is read from where the last poll stopped, whole lines only (a line being written
is read at the next poll). A row is this job's when its payload is (`layout.decode_job_payload`:
the job's id and the request's index and line); its request's line is read back from the
input by offset and checked against the payload's digest, so an answer can only ever go to
its own request. A row whose request has its line already (a redelivered batch) is dropped
and counted; a row of a damaged entry (status corrupt) answers nothing: the request is
submitted again by the next run. An answer's text is decoded on a bound (`decoding.py`): a
decoder that fails on it or expands it past the bound answers that request 500.

Where each file was read up to is saved in DATA_DIR/job/collected.json after the log took
what it read, so a resume reads only what is new; a lost or stale one costs a second read,
never an answer (the log drops what it has), but on a node, whose results every job read
are freed (`reclaim.py`): there, answers in what was freed run again.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import msgspec
import xxhash

from pipeline.batchjob.answers import Answer, AnswerLog, records_path
from pipeline.batchjob.choices import AnswerShape, make_choices
from pipeline.batchjob.decoding import AnswerDecoder
from pipeline.batchjob.layout import JOB_FLAG_READS_BODY, LOG_OUTPUT, decode_job_payload, job_payload_flags
from pipeline.batchjob.manifest import JOB_DIR, JobManifest
from pipeline.batchjob.output import (
    HTTP_OK,
    HTTP_SERVER_ERROR,
    ROW_CANCELLED,
    ROW_CORRUPT,
    ROW_OK,
    RequestRef,
    embedding_line,
    error_line,
    response_line,
    row_error,
    row_usage,
)
from pipeline.batchjob.paths import replace_file
from pipeline.batchjob.requests import ENDPOINTS, KIND_EMBEDDING, BatchRequest, parse_line
from pipeline.batchjob.rejections import REJECTED_DIR
from pipeline.batchjob.scan import MAX_REQUEST_LINE_BYTES, envelope
from pipeline.reporting.accounting import ResultsSummary
from pipeline.runtime.madefiles import RESULTS_DIR
from pipeline.wire.errors import (
    AnswerLogWriteError,
    AnswerTextError,
    BatchFileError,
    BatchOutputError,
    JobMismatchError,
)

log = logging.getLogger("pipeline.job")

COLLECTED_NAME = "collected.json"
# Bytes of one file read per poll: a poll takes what a few seconds of a fast job wrote and
# returns, so the launcher's watch loop keeps its pace.
READ_LIMIT_BYTES = 32 << 20
# Bytes read at a time back from a results file's end, for its last whole line: a row is
# rarely longer, and its end is near.
TAIL_READ_BYTES = 1 << 16
# Bytes of output lines gathered before they go to the log: a poll's rows can make lines far
# longer than themselves (a custom_id of a megabyte in every line), and memory stays at this.
APPEND_BYTES = 16 << 20
# A job's own results: its launcher's runs, its Ray driver's.
OWN_RUN_PREFIXES = ("run-", "ray-")
# errno values of a full disk (the answer log's: wait for room).
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# A results or rejection line longer than this is not one of ours (a row holds a request's
# output ids and texts, its samples' and their logprobs within sampling.MAX_ANSWER_TOKENS and
# MAX_ANSWER_LOGPROBS): a row longer than a read is read on to here.
MAX_ROW_BYTES = 64 << 20


@dataclass(slots=True)
class CollectCounts:
    """What collecting found that is not an answer of this job."""

    foreign_rows: int = 0  # rows of items that are not this job's (another run's store)
    bad_lines: int = 0  # lines that are not rows (torn by a kill, damaged)
    corrupt: int = 0  # rows of entries the store damaged: those requests run again
    examples: list[str] = field(default_factory=list)


class Collector:
    """See the module's doc. Owner: the job's process, one per run; not thread-safe."""

    def __init__(self, data_dir: str, manifest: JobManifest, input_fd: int, decode: Callable[[list[int]], str],
                 log: AnswerLog, error_log: int, token_text: Callable[[int], str] | None = None,
                 vocab_size: int = 0, results_root: str | None = None) -> None:
        self.data_dir = data_dir
        # Where the consumers' results are: the job's data directory, or the node it runs on
        # (`pipeline.runtime.attached`), whose results hold every job's rows.
        self.results_root = results_root or data_dir
        self.manifest = manifest
        self.input_fd = input_fd
        # One token's text, special tokens kept (a logprob's token): decode's where not given.
        self.decoder = AnswerDecoder(decode, token_text or (lambda token: decode([token])), vocab_size)
        self.log = log
        self.error_log = error_log  # LOG_ERRORS where failures go to their own file, else LOG_OUTPUT
        self.counts = CollectCounts()
        # The file whose write the last append found without room (answers wait in the
        # results files); None when it found room.
        self.disk_full_path: str | None = None
        self._warned_foreign = False
        # Submit-to-answer latencies of the answers taken since the caller last emptied it.
        self.latencies_s: list[float] = []
        self._path = os.path.join(data_dir, JOB_DIR, COLLECTED_NAME)
        self._offsets: dict[str, int] = _load_offsets(self._path)
        # This run's results, for its report (`tally`, `summary`): the rows are read here once.
        self._tally_dir: str | None = None
        self._tally = ResultsSummary()

    @property
    def disk_full(self) -> bool:
        return self.disk_full_path is not None

    def collect(self) -> int:
        """Read what every answer file gained since the last call; how many new answers
        (0 while the disk of the answer log is full: `disk_full`)."""
        added = 0
        try:
            for relative in self._files():
                added += self._collect_file(relative)
        except _DiskFull:
            return 0
        return added

    def _files(self) -> Iterator[str]:
        """Answer files by their path inside the data directory: the results of the job's own
        runs (its launcher's `run-*`, its Ray driver's `ray-*`), then its producers'
        refusals. A results file of a consumer the job did not start (`pipeline consumer
        start` on its data directory) is not read: that consumer may run another engine, or
        the same with other options, and its answers would not be the job's."""
        results = os.path.join(self.results_root, RESULTS_DIR)
        yield from results_files(self.results_root)
        for entry in sorted(_scandir(os.path.join(self.data_dir, JOB_DIR, REJECTED_DIR)), key=lambda e: e.name):
            if entry.name.endswith(".jsonl"):
                yield os.path.join(JOB_DIR, REJECTED_DIR, entry.name)
        foreign = [e.name for e in _scandir(results) if e.name.endswith(".jsonl")]
        if foreign and not self._warned_foreign and self.results_root == self.data_dir:
            self._warned_foreign = True
            log.warning("results of consumers this job did not start are not its answers: %s", ", ".join(foreign[:5]))

    def _collect_file(self, relative: str) -> int:
        """The new whole lines of one file into the log, APPEND_BYTES of answers at a time;
        the file's read position moves past each part only once the log has it. A full disk
        (AnswerLogWriteError ENOSPC) stops here until the next call (`disk_full`)."""
        path = os.path.join(self.data_dir if relative.startswith(JOB_DIR) else self.results_root, relative)
        start = self._offsets.get(relative, 0)
        try:
            with open(path, "rb") as f:
                start, raw = _read_rows(f, start)
        except OSError:
            return 0
        end = raw.rfind(b"\n") + 1
        if not end:
            return 0
        rejected = relative.startswith(JOB_DIR)
        counted = ResultsSummary() if os.path.dirname(path) == self._tally_dir else None
        consumer = os.path.basename(path)[:-len(".jsonl")]
        answers: list[Answer] = []
        held = added = 0
        at = 0  # bytes of raw read past, whose answers are in `answers` or the log
        for line in raw[:end].split(b"\n")[:-1]:
            at += len(line) + 1
            answer = self._answer(line, rejected, path, counted, consumer)
            if answer is not None:
                answers.append(answer)
                held += len(answer.line)
            if held >= APPEND_BYTES:
                added += self._append(relative, start + at, answers, counted)
                answers, held, counted = [], 0, ResultsSummary() if counted is not None else None
        return added + self._append(relative, start + at, answers, counted)

    def _append(self, relative: str, end: int, answers: list[Answer], counted: ResultsSummary | None) -> int:
        """Answers into the log, then the file's read position to `end`; 0 when the disk is
        full (the same lines are read again next time)."""
        try:
            added = self.log.append(answers)
        except AnswerLogWriteError as exc:
            if exc.errno not in DISK_FULL_ERRNOS:
                raise
            self.disk_full_path = exc.path or self.data_dir
            raise _DiskFull from exc
        self.disk_full_path = None
        self._offsets[relative] = end
        if counted is not None:
            _merge_counts(self._tally, counted)
        return added

    def skip_results_so_far(self) -> None:
        """Read the results files from the end of their last whole line: a new job on a node,
        whose rows cannot be in them yet, does not read every earlier job's."""
        for relative in self._files():
            if not relative.startswith(JOB_DIR):
                with contextlib.suppress(OSError):
                    self._offsets[relative] = whole_lines_end(os.path.join(self.results_root, relative))

    def save(self) -> None:
        """Record where each file was read up to (after the log has what was read)."""
        replace_file(self._path, [json.dumps(self._offsets, sort_keys=True).encode()])

    def tally(self, results_dir: str) -> None:
        """Count the rows of `results_dir` (this run's) for `summary`."""
        self._tally_dir = os.path.abspath(results_dir)
        self._tally = ResultsSummary()

    def summary(self, results_dir: str) -> ResultsSummary:
        """This run's results as `summarize_results` would read them (without item ids:
        the job counts by request; a duplicate is a row whose request had its line)."""
        assert os.path.abspath(results_dir) == self._tally_dir, (results_dir, self._tally_dir)
        self.collect()
        tally = self._tally
        tally.items = tally.lines - self.log.duplicates
        tally.duplicates = self.log.duplicates
        return tally

    def _answer(self, line: bytes, rejected: bool, path: str, tally: ResultsSummary | None = None,
                consumer: str = "") -> Answer | None:
        try:
            row = msgspec.json.decode(line)
        except msgspec.DecodeError:
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                self._bad(path, "not JSON", tally)
                return None
        if not isinstance(row, dict):
            self._bad(path, "not an object", tally)
            return None
        if tally is not None:
            _count_row(tally, row, consumer)
        try:
            return self._rejection(row) if rejected else self._result(row)
        except (BatchOutputError, KeyError, TypeError, ValueError) as exc:
            self._bad(path, str(exc)[:200])
            return None

    def _result(self, row: dict) -> Answer | None:
        payload = base64.b64decode(row.get("payload") or "")
        found = decode_job_payload(payload, self.manifest.job_id)
        if found is None:
            self.counts.foreign_rows += 1
            return None
        index, offset, length, digest, made_ns = found
        if index >= self.manifest.requests or self.log.is_done(index):
            self.log.duplicates += index < self.manifest.requests
            return None
        status = row.get("status")
        if status == ROW_CORRUPT:
            self.counts.corrupt += 1
            return None
        if status == ROW_CANCELLED:  # not run (the batch ended): unanswered, as if never dispatched
            return None
        request = self._request(index, offset, length, digest)
        tag = self.manifest.id_tag
        if status != ROW_OK:
            line, code = row_error(request, row, tag)
            return Answer(index, line.encode() + b"\n", code, self.error_log)
        done_ns = row.get("done_ns")
        if made_ns and type(done_ns) is int and done_ns >= made_ns:
            self.latencies_s.append((done_ns - made_ns) / 1e9)
        texts = self.decoder.texts()
        reads_body = job_payload_flags(payload) & JOB_FLAG_READS_BODY
        asked = self._parsed(index, offset, length) if reads_body or "samples" in row else None
        model = asked.model if asked is not None and asked.model is not None else self.manifest.served_model
        try:
            if request.kind == KIND_EMBEDDING:
                form = asked.embedding.encoding_format if asked is not None and asked.embedding is not None else "float"
                line = embedding_line(request, row, form, model, self.manifest.created_s, tag)
            elif asked is not None:
                shape = AnswerShape.of(asked, self.manifest.tool_calling, texts)
                choices = make_choices(row, shape, texts, f"call_{tag}_{index}")
                line = response_line(request, row, None, model, self.manifest.created_s, tag, choices)
            else:
                text = row["text"] if isinstance(row.get("text"), str) else texts.decode(row["output"])
                line = response_line(request, row, text, self.manifest.served_model, self.manifest.created_s, tag)
        except AnswerTextError as exc:  # the model's decoder on this answer: this request's failure
            line = error_line(request, HTTP_SERVER_ERROR, str(exc), tag=tag)
            return Answer(index, line.encode() + b"\n", HTTP_SERVER_ERROR, self.error_log)
        prompt, completion, cached = row_usage(row)
        return Answer(index, line.encode() + b"\n", HTTP_OK, LOG_OUTPUT, prompt, completion, cached)

    def _rejection(self, row: dict) -> Answer | None:
        index, offset, length, digest = (int(row[k]) for k in ("index", "offset", "length", "line_xxh3"))
        if index >= self.manifest.requests or self.log.is_done(index):
            return None
        request = self._request(index, offset, length, digest)
        status = int(row["status"])
        line = error_line(request, status, str(row["message"]), row.get("param"), tag=self.manifest.id_tag,
                          code=row.get("code"))
        return Answer(index, line.encode() + b"\n", status, self.error_log)

    def _request(self, index: int, offset: int, length: int, digest: int) -> RequestRef:
        """The request's line read back from the input: its custom_id and kind."""
        raw = os.pread(self.input_fd, min(length, MAX_REQUEST_LINE_BYTES), offset)
        if len(raw) != length or xxhash.xxh3_64_intdigest(raw) != digest:
            raise JobMismatchError(f"{self.manifest.input_path}: the line of request {index} at byte {offset} is not "
                                   f"what the job read there: the input file changed while the job ran; restore "
                                   f"it to finish the job")
        try:
            env = envelope(raw)
        except BatchFileError as exc:
            raise JobMismatchError(f"{self.manifest.input_path}: byte {offset}: {exc}") from None
        return RequestRef(env.custom_id, ENDPOINTS.get(env.url), index)

    def _parsed(self, index: int, offset: int, length: int) -> BatchRequest:
        """What the request asked its answer to hold (its model, its choices' shape, its
        embeddings' encoding): its line parsed again (checked against its digest by
        `_request` just before)."""
        raw = os.pread(self.input_fd, length, offset)
        request = parse_line(raw, index, 0, self.manifest.served_model, self.manifest.tool_calling,
                             self.manifest.adapters)
        if request.error is not None:
            raise BatchOutputError(f"request {request.custom_id!r} ran but reads as refused now: {request.error}")
        return request

    def _bad(self, path: str, why: str, tally: ResultsSummary | None = None) -> None:
        self.counts.bad_lines += 1
        if len(self.counts.examples) < 10:
            self.counts.examples.append(f"{path}: {why}")
        if tally is not None:
            tally.bad_lines += 1
            if len(tally.bad_line_examples) < 10:
                tally.bad_line_examples.append(f"{path}: {why}")


def _count_row(tally: ResultsSummary, row: dict, consumer: str) -> None:
    """One results row into a run's summary (what `summarize_results` adds up)."""
    prompt, cached = row.get("prompt_tokens"), row.get("cached_tokens")
    prompt = prompt if type(prompt) is int else 0
    cached = cached if type(cached) is int else 0
    mine = tally.per_consumer.setdefault(consumer, {"lines": 0, "prompt_tokens": 0, "cached_tokens": 0,
                                                    "bad_lines": 0})
    mine["lines"] += 1
    mine["prompt_tokens"] += prompt
    mine["cached_tokens"] += cached
    tally.lines += 1
    tally.prompt_tokens += prompt
    tally.cached_tokens += cached
    status = str(row.get("status"))
    tally.by_status[status] = tally.by_status.get(status, 0) + 1
    dispatch, done = row.get("dispatch_ns"), row.get("done_ns")
    if type(dispatch) is int and (tally.first_dispatch_ns is None or dispatch < tally.first_dispatch_ns):
        tally.first_dispatch_ns = dispatch
    if type(done) is int and (tally.last_done_ns is None or done > tally.last_done_ns):
        tally.last_done_ns = done


class _DiskFull(Exception):
    """Internal: an append found the disk full; `collect` stops reading for this call."""


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        return list(os.scandir(path))
    except OSError:
        return []


def _merge_counts(into: ResultsSummary, part: ResultsSummary) -> None:
    """`part`'s rows (counted by `_count_row`) added to `into`."""
    for consumer, counts in part.per_consumer.items():
        mine = into.per_consumer.setdefault(consumer, dict.fromkeys(counts, 0))
        for key, value in counts.items():
            mine[key] = mine.get(key, 0) + value
    into.lines += part.lines
    into.prompt_tokens += part.prompt_tokens
    into.cached_tokens += part.cached_tokens
    into.bad_lines += part.bad_lines
    into.bad_line_examples.extend(part.bad_line_examples[:max(0, 10 - len(into.bad_line_examples))])
    for status, count in part.by_status.items():
        into.by_status[status] = into.by_status.get(status, 0) + count
    for name, pick in (("first_dispatch_ns", min), ("last_done_ns", max)):
        theirs, mine = getattr(part, name), getattr(into, name)
        if theirs is not None:
            setattr(into, name, theirs if mine is None else pick(mine, theirs))


def forget_answers(data_dir: str) -> None:
    """Drop the job's answer records and where the results files were read up to: every
    answer is collected again from the results files (its logs made anew by the caller)."""
    for path in (records_path(data_dir), os.path.join(data_dir, JOB_DIR, COLLECTED_NAME)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def results_files(results_root: str) -> Iterator[str]:
    """The results files of the runs under `results_root` (a job's data directory, or a
    node's), by their path inside it, in the order they are read."""
    results = os.path.join(results_root, RESULTS_DIR)
    runs = sorted(entry.name for entry in _scandir(results) if entry.is_dir(follow_symlinks=False)
                  and entry.name.startswith(OWN_RUN_PREFIXES))
    for run in runs:
        folder = os.path.join(results, run)
        for entry in sorted(_scandir(folder), key=lambda e: e.name):
            if entry.name.endswith(".jsonl"):
                yield os.path.join(RESULTS_DIR, run, entry.name)


def read_positions(data_dir: str) -> dict[str, int] | None:
    """Where a job's collector had read each results file up to when it last saved (a file
    it does not name, it reads from the start); None where it saved none yet."""
    path = os.path.join(data_dir, JOB_DIR, COLLECTED_NAME)
    return _load_offsets(path) if os.path.exists(path) else None


def _read_rows(f: BinaryIO, start: int) -> tuple[int, bytes]:
    """What `f` holds from `start` on, READ_LIMIT_BYTES of it (to MAX_ROW_BYTES for one long
    row), and where that begins. A row never begins with a NUL byte: one there is a hole a
    node punched in what every job had read (`reclaim.py`), which a job that lost its
    positions since reads on past (the line cut there counts as bad; the requests it
    answered are submitted again), or nothing at all where the hole runs to the end."""
    f.seek(start)
    raw = f.read(READ_LIMIT_BYTES)
    if raw[:1] == b"\0":
        try:
            start = os.lseek(f.fileno(), start, os.SEEK_DATA)
        except OSError:  # ENXIO: a hole to the end; what the writer appends next is data
            return start, b""
        f.seek(start)
        raw = f.read(READ_LIMIT_BYTES)
    if len(raw) == READ_LIMIT_BYTES and b"\n" not in raw:  # one row longer than a read
        raw += f.read(MAX_ROW_BYTES - READ_LIMIT_BYTES)
    return start, raw


def whole_lines_end(path: str) -> int:
    """The offset just past the last newline of the file at `path` (0 without one): where
    the line a writer may be appending begins."""
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        while end > 0:
            start = max(0, end - TAIL_READ_BYTES)
            f.seek(start)
            found = f.read(end - start).rfind(b"\n")
            if found >= 0:
                return start + found + 1
            end = start
    return 0


def _load_offsets(path: str) -> dict[str, int]:
    try:
        with open(path, "rb") as f:
            found = json.loads(f.read(1 << 24))
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, int) and v >= 0}
