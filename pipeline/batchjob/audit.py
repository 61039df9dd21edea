"""`pipeline tools check-job`: a finished batch job's output (and error file) against its
input, in memory that does not depend on the files' lengths.

    files = JobFiles(input_path, output_path, error_path=None, summary_path=None)
    result = audit_job(files, "input", work_dir)     # order: "input" or "completion"
    result.ok, result.line(), result.examples

Each file is read sequentially, in passes:
1. The input, as the job's scan reads it (`scan.read_lines`, `scan.envelope`): each request's
   custom_id digest, byte offset and line go to a spill partitioned by the digest's top bits
   (`scan.DigestSpill`); a line that is not a request is the input's problem.
2. The output, then the error file: each line's custom_id digest, offset and line go to a
   spill of its own.
3. The join, one partition of the three spills at a time, sorted by digest. A digest held by
   one request and one answer is a pair; one held alone is a request without an answer or an
   answer to no request; any other group (a digest two requests, two answers or two
   custom_ids share) is told apart by reading its lines and comparing their custom_ids. Each
   pair goes to a bucket file by its output line (PAIR_BUCKET_LINES lines a bucket).
4. The output and the error file again, a bucket of pairs at a time: every line held to
   `auditrules`, and each paired line's request read back at its offset. Their custom_ids are
   compared, so a pair the digest alone made is confirmed here, or undone into a request
   without an answer and an answer to no request: equal digests never pass for equal
   custom_ids. Then the answer's body against its request and, in input order, each answer
   after the one before it in the input.
5. The job's summary, where there is one, against what the files hold.
Memory: a read block, a line, a partition of records and a bucket of pairs, whatever the
files' lengths; the spills and buckets are files in `work_dir`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import msgspec
import numpy as np

from pipeline.batchjob.auditrules import (
    BODY,
    DUPLICATED,
    ERROR_FILE,
    INPUT,
    INPUT_FILE,
    KINDS,
    MALFORMED,
    MISPLACED,
    MISSING,
    ORDER,
    OUTPUT_FILE,
    SUMMARY,
    SUMMARY_FILE,
    UNEXPECTED,
    Problems,
    Tally,
    body_problem,
    custom_id_of,
    decode_line,
    line_problem,
    status_of,
    summary_problems,
)
from pipeline.batchjob.spec import OUTPUT_ORDERS
from pipeline.batchjob.output import HTTP_OK
from pipeline.batchjob.scan import (
    MAX_BATCH_REQUESTS,
    MAX_REQUEST_LINE_BYTES,
    DigestSpill,
    Envelope,
    custom_id_digest,
    envelope,
    read_lines,
)
from pipeline.wire.errors import AuditFileError, BatchFileError
from pipeline.wire.fileops import errno_text
from pipeline.wire.textfiles import counted, file_kind, read_small_file
from shm.layout import checked_dtype

# The most requests read from an input: a job's (the scan's limit); past it no job ran the
# file, and reading stops.
MAX_REQUESTS = MAX_BATCH_REQUESTS
# The most lines read from an output or error file: a job writes at most one a request.
MAX_ANSWER_LINES = MAX_BATCH_REQUESTS
# The longest output line read: an answer at a job's limits (sampling.MAX_ANSWER_LOGPROBS
# entries of ~80 bytes as chat logprobs, and sampling.MAX_ANSWER_TOKENS tokens of text) is
# ~100 MiB; a line past this is no job's, and is never held whole.
MAX_ANSWER_LINE_BYTES = 256 << 20
# Output lines whose pairs are held at a time in pass 4 (their request's line and offset:
# 16 MiB), and so the lines of one bucket file.
PAIR_BUCKET_LINES = 1 << 20
# A job's summary is a few hundred bytes: past this, not one.
MAX_SUMMARY_BYTES = 1 << 20
ROLES = {INPUT_FILE: "input file", OUTPUT_FILE: "output file", ERROR_FILE: "error file", SUMMARY_FILE: "summary"}
# What an example of a request or an answer named by its custom_id says.
CUSTOM_ID_WORDS = {MISSING: "has no answer", UNEXPECTED: "is the custom_id of no request in the input"}

# A pair of an answer and its request (spilled to a bucket file by output line).
#   off  size  field      meaning
#     0     8  out_line   the answer's line in its file, from 1
#     8     8  in_line    the request's line in the input, from 1
#    16     8  in_offset  the request's byte offset in the input
PAIR_RECORD_DTYPE = checked_dtype(
    [
        ("out_line", 0, "<u8", "answer's line"),
        ("in_line", 8, "<u8", "request's line"),
        ("in_offset", 16, "<u8", "request's byte offset"),
    ],
    itemsize=24,
)


@dataclass(slots=True, frozen=True)
class JobFiles:
    """A job's files as `run-batch` took them: -i, -o, --error-file, --summary-file."""

    input_path: str
    output_path: str
    error_path: str | None = None
    summary_path: str | None = None

    def paths(self) -> dict[int, str | None]:
        return {INPUT_FILE: self.input_path, OUTPUT_FILE: self.output_path, ERROR_FILE: self.error_path,
                SUMMARY_FILE: self.summary_path}


@dataclass(slots=True)
class AuditResult:
    """What the audit found: the counts, and each kind of problem's count and examples
    (`path:line: what`)."""

    files: JobFiles
    order: str
    requests: int
    answered: int
    lines: dict[str, int]
    tally: Tally
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(self.counts.values())

    def line(self) -> str:
        """The verdict in one line."""
        t = self.tally
        if not self.ok:
            kinds = ", ".join(f"{self.counts[k]:,} {k}" for k in KINDS if self.counts.get(k))
            total = sum(self.counts.values())
            return (f"FAILED: {counted(total, 'problem')} ({kinds}); {counted(self.requests, 'request')}, "
                    f"{self.answered:,} answered")
        failed = ", ".join(f"{n:,} with status {code}" for code, n in t.failed_by_status().items())
        cached = f" ({t.cached_tokens / t.prompt_tokens:.1%} cached)" if t.prompt_tokens else ""
        return (f"OK: {counted(self.requests, 'request')}, each answered once: {t.completed:,} completed, "
                f"{t.failed:,} failed{f' ({failed})' if failed else ''}; usage "
                f"{counted(t.prompt_tokens, 'prompt token')}{cached}, "
                f"{t.completion_tokens:,} completion{'; in input order' if self.order == 'input' else ''}"
                f"{'; the summary agrees' if self.files.summary_path else ''}")

    def as_json(self) -> dict:
        return {"ok": self.ok, "order": self.order, "requests": self.requests, "answered": self.answered,
                "lines": self.lines, **self.tally.as_json(),
                "files": {ROLES[k]: v for k, v in self.files.paths().items() if v is not None},
                "problems": {kind: {"count": self.counts[kind], "examples": self.examples.get(kind, [])}
                             for kind in KINDS if self.counts.get(kind)}}


def audit_job(files: JobFiles, order: str, work_dir: str,
              digest: Callable[[str], int] = custom_id_digest) -> AuditResult:
    """The audit of the module's doc. `work_dir` (made if absent) holds its spills while it
    runs; `digest` is the custom_id's (another only where a test makes digests collide).
    AuditFileError for a file that cannot be read."""
    assert order in OUTPUT_ORDERS, order
    audit = _Audit(files, order, work_dir, digest)
    try:
        audit.run()
        return audit.result()
    finally:
        audit.close()


class _Audit:
    """One audit's passes and what they found (the module's doc). Owner: its caller."""

    def __init__(self, files: JobFiles, order: str, work_dir: str, digest: Callable[[str], int]) -> None:
        self.files, self.order, self.digest = files, order, digest
        self.paths = files.paths()
        self.sides = [side for side in (OUTPUT_FILE, ERROR_FILE) if self.paths[side] is not None]
        os.makedirs(work_dir, mode=0o700, exist_ok=True)
        self.spills = {side: DigestSpill(os.path.join(work_dir, f"ids-{side}")) for side in (INPUT_FILE, *self.sides)}
        self.pairs = _PairBuckets(os.path.join(work_dir, "pairs"))
        self.problems = Problems()
        self.tally = Tally()
        self.requests = 0
        self.answered = 0
        self.lines: dict[int, int] = {}
        self.cut_line: dict[int, int] = {}  # the last line, where the file ends without its newline
        self._open: dict[int, BinaryIO] = {}

    def where(self, side: int) -> str:
        return f"{ROLES[side]} {self.paths[side]}"

    def file(self, side: int) -> BinaryIO:
        """The file, open for reading lines back at their offsets."""
        if side not in self._open:
            self._open[side] = _open(self.paths[side], self.where(side))  # type: ignore[arg-type]
        return self._open[side]

    def run(self) -> None:
        self.read_input()
        for side in self.sides:
            self.index_answers(side)
        for parts in zip(*(self.spills[side].parts() for side in (INPUT_FILE, *self.sides))):
            self.join(parts)
        for side in self.sides:
            self.check_answers(side)
        self.check_summary()

    # ------------------------------------------------------------------ passes 1 and 2

    def read_input(self) -> None:
        spill, where = self.spills[INPUT_FILE], self.where(INPUT_FILE)
        with _open(self.files.input_path, where) as f:
            for offset, line, raw in _lines(f, where, MAX_REQUEST_LINE_BYTES):
                if raw is None:
                    self.problems.add(INPUT, INPUT_FILE, line, f"longer than {MAX_REQUEST_LINE_BYTES:,} bytes: no "
                                                               f"job reads it")
                    continue
                if not raw.strip():
                    continue
                try:
                    env = envelope(raw)
                except BatchFileError as exc:
                    self.problems.add(INPUT, INPUT_FILE, line, f"not a request: {exc}")
                    continue
                if self.requests == MAX_REQUESTS:
                    self.problems.add(INPUT, INPUT_FILE, line, f"more than {MAX_REQUESTS:,} requests, more than "
                                                               f"a job runs; reading stopped here")
                    return
                spill.add(self.digest(env.custom_id), offset, line)
                self.requests += 1

    def index_answers(self, side: int) -> None:
        spill, where = self.spills[side], self.where(side)
        count = 0
        with _open(self.paths[side], where) as f:  # type: ignore[arg-type]
            for offset, line, raw in _lines(f, where, MAX_ANSWER_LINE_BYTES):
                if line > MAX_ANSWER_LINES:
                    self.problems.add(MALFORMED, side, line, f"more than {MAX_ANSWER_LINES:,} lines, more than a "
                                                             f"job answers; reading stopped here")
                    break
                count = line
                custom_id = custom_id_of(decode_line(raw)) if raw is not None else None
                if custom_id is not None:
                    spill.add(self.digest(custom_id), offset, line)
            else:
                size = os.fstat(f.fileno()).st_size
                self.cut_line[side] = count if size and os.pread(f.fileno(), 1, size - 1) != b"\n" else 0
        self.lines[side] = count

    # ------------------------------------------------------------------ pass 3

    def join(self, parts: tuple[np.ndarray, ...]) -> None:
        """One partition's records of every file: pairs, lone records, and groups resolved."""
        sides = (INPUT_FILE, *self.sides)
        digest = np.concatenate([part["digest"] for part in parts])
        if not digest.size:
            return
        side = np.concatenate([np.full(part.size, s, dtype=np.uint8) for s, part in zip(sides, parts)])
        line = np.concatenate([part["line"] for part in parts])
        offset = np.concatenate([part["offset"] for part in parts])
        order = np.lexsort((line, side, digest))
        digest, side, line, offset = digest[order], side[order], line[order], offset[order]
        starts = np.flatnonzero(np.r_[True, digest[1:] != digest[:-1]])
        sizes = np.diff(np.r_[starts, digest.size])
        second = np.minimum(starts + 1, digest.size - 1)
        alone = sizes == 1
        pair = (sizes == 2) & (side[starts] == INPUT_FILE) & (side[second] != INPUT_FILE)
        lone = starts[alone & (side[starts] == INPUT_FILE)]
        self.problems.add_many(MISSING, INPUT_FILE, line[lone], offset[lone])
        for s in self.sides:
            lone = starts[alone & (side[starts] == s)]
            self.problems.add_many(UNEXPECTED, s, line[lone], offset[lone])
        at = starts[pair]
        self.pairs.add(side[at + 1], line[at + 1], line[at], offset[at])
        rest = ~(alone | pair)
        for start, size in zip(starts[rest].tolist(), sizes[rest].tolist()):
            self.resolve(side[start:start + size], line[start:start + size], offset[start:start + size])

    def resolve(self, sides: np.ndarray, lines: np.ndarray, offsets: np.ndarray) -> None:
        """The records of one digest, in order (requests first, then answers by file and line),
        told apart by the custom_ids read from their lines. The custom_ids one digest holds
        are a handful at most, so `first` stays small however many lines repeat one of them."""
        first: dict[str, list] = {}  # custom_id: [its request (line, offset), its answer (side, line)]
        found: list[tuple[int, int, int, int]] = []
        for s, line, offset in zip(sides.tolist(), lines.tolist(), offsets.tolist()):
            custom_id = self.custom_id_at(s, offset)
            request, answer = first.setdefault(custom_id, [None, None])
            shown = f"custom_id {custom_id!r:.80}"
            if s == INPUT_FILE and request is None:
                first[custom_id][0] = (line, offset)
            elif s == INPUT_FILE:
                self.problems.add(INPUT, INPUT_FILE, line, f"{shown} is used by line {request[0]} too")
            elif request is None:
                self.problems.add(UNEXPECTED, s, line, None, offset)
            elif answer is None:
                first[custom_id][1] = (s, line)
                found.append((s, line, *request))
            else:
                self.problems.add(DUPLICATED, s, line, f"{shown} is answered again (first at "
                                                       f"{self.paths[answer[0]]}:{answer[1]})")
        for request, answer in first.values():
            if request is not None and answer is None:
                self.problems.add(MISSING, INPUT_FILE, request[0], None, request[1])
        if found:
            columns = np.array(found, dtype=np.uint64).T
            self.pairs.add(*columns)

    def custom_id_at(self, side: int, offset: int) -> str:
        """The custom_id of the line at `offset` of a file, where an earlier pass read one."""
        raw = _line_at(self.file(side), offset, MAX_REQUEST_LINE_BYTES if side == INPUT_FILE else MAX_ANSWER_LINE_BYTES)
        try:
            custom_id = envelope(raw).custom_id if side == INPUT_FILE else custom_id_of(decode_line(raw))
        except BatchFileError:
            custom_id = None
        if custom_id is None:
            raise AuditFileError(f"{self.where(side)}: byte {offset:,} does not start the line read there before: "
                                 f"the file changed while it was audited")
        return custom_id

    # ------------------------------------------------------------------ pass 4

    def check_answers(self, side: int) -> None:
        where = self.where(side)
        previous: tuple[int, int, str] | None = None  # the last answer paired: its request's line, its line, id
        bucket = _Bucket()
        with _open(self.paths[side], where) as f:  # type: ignore[arg-type]
            for offset, line, raw in _lines(f, where, MAX_ANSWER_LINE_BYTES):
                if line > self.lines[side]:
                    break
                found, well_formed = self.check_line(side, line, raw)
                if not bucket.holds(line):
                    bucket = self.pairs.bucket(side, line, self.lines[side])
                in_line, in_offset = bucket.pair(line)
                if in_line:
                    previous = self.check_pair(side, line, offset, found if well_formed else None,
                                               custom_id_of(found), in_line, in_offset, previous)

    def check_line(self, side: int, line: int, raw: bytes | None) -> tuple[object, bool]:
        """A line held to `auditrules`, counted, and placed: (its JSON value, well-formed)."""
        found: object = None
        if raw is None:
            why = f"longer than {MAX_ANSWER_LINE_BYTES:,} bytes: no job writes a line this long"
        else:
            found = decode_line(raw)
            why = line_problem(found)
        if line == self.cut_line.get(side):
            why = f"cut short: the file ends without a newline (a job writes whole lines){f'; {why}' if why else ''}"
        if why:
            self.problems.add(MALFORMED, side, line, why)
            return found, False
        assert isinstance(found, dict)
        self.tally.count(found)
        status = status_of(found)
        if ERROR_FILE in self.sides and (side == OUTPUT_FILE) != (status == HTTP_OK):
            said = f"status {status}" if status is not None else "a failure without a response"
            self.problems.add(MISPLACED, side, line, f"{said} in the {ROLES[side]}: with an error file, failures "
                                                     f"go there and successes to the output (as OpenAI's batches)")
        return found, True

    def check_pair(self, side: int, line: int, offset: int, found: dict | None, custom_id: str | None,
                   in_line: int, in_offset: int, previous: tuple[int, int, str] | None) -> tuple[int, int, str] | None:
        """An answer and the request the join paired it with: the same custom_id (else no
        pair: two custom_ids of one digest), its body, its order; the new `previous`."""
        raw = _line_at(self.file(INPUT_FILE), in_offset, MAX_REQUEST_LINE_BYTES)
        try:
            request = envelope(raw)
        except BatchFileError:
            raise AuditFileError(f"{self.where(INPUT_FILE)}: byte {in_offset:,} does not start the request read "
                                 f"there before: the file changed while it was audited") from None
        if custom_id is None:  # the join read one there
            raise AuditFileError(f"{self.where(side)}: line {line} has no custom_id now: the file changed while it "
                                 f"was audited")
        if custom_id != request.custom_id:
            self.problems.add(MISSING, INPUT_FILE, in_line, None, in_offset)
            self.problems.add(UNEXPECTED, side, line, None, offset)
            return previous
        self.answered += 1
        shown = f"custom_id {custom_id!r:.80}"
        if found is not None and status_of(found) == HTTP_OK:
            why = body_problem(request.url, _body(request), found["response"]["body"])
            if why:
                self.problems.add(BODY, side, line, f"{shown} (input line {in_line}): {why}")
        if self.order == "input" and previous is not None and previous[0] > in_line:
            self.problems.add(ORDER, side, line, f"{shown} (input line {in_line}) comes after custom_id "
                                                 f"{previous[2]!r:.80} (input line {previous[0]}) at line "
                                                 f"{previous[1]}: in input order, answers follow their requests")
        return in_line, line, custom_id

    # ------------------------------------------------------------------ pass 5, the result

    def check_summary(self) -> None:
        path = self.paths[SUMMARY_FILE]
        if path is None:
            return
        try:
            raw = read_small_file(path, MAX_SUMMARY_BYTES)
        except OSError as exc:
            raise AuditFileError(f"summary {path}: cannot read it ({errno_text(exc)})") from exc
        if raw is None:
            raise AuditFileError(f"summary {path}: does not exist")
        try:
            if len(raw) > MAX_SUMMARY_BYTES:
                raise ValueError(f"longer than {MAX_SUMMARY_BYTES:,} bytes")
            document = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            self.problems.add(SUMMARY, SUMMARY_FILE, 0, f"not a job's summary ({str(exc)[:120]})")
            return
        for why in summary_problems(document, self.requests, self.tally):
            self.problems.add(SUMMARY, SUMMARY_FILE, 0, why)

    def result(self) -> AuditResult:
        self.problems.check_invariants()
        self.tally.check_invariants()
        examples = {}
        for kind in KINDS:
            examples[kind] = [self.example(kind, e.file, e.line, e.text, e.offset) for e in self.problems.shown(kind)]
        return AuditResult(self.files, self.order, self.requests, self.answered,
                           {ROLES[side]: self.lines[side] for side in self.sides}, self.tally,
                           {kind: self.problems.count(kind) for kind in KINDS if self.problems.count(kind)},
                           {kind: shown for kind, shown in examples.items() if shown})

    def example(self, kind: str, side: int, line: int, text: str | None, offset: int) -> str:
        if text is None:
            text = f"custom_id {self.custom_id_at(side, offset)!r:.80} {CUSTOM_ID_WORDS[kind]}"
        return f"{self.paths[side]}:{line}: {text}" if line else f"{self.paths[side]}: {text}"

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        for spill in self.spills.values():
            spill.close()
        self.pairs.close()


class _Bucket:
    """The pairs of one bucket's output lines, by line (zero: the line has none)."""

    def __init__(self, first: int = 1, count: int = 0) -> None:
        self.first = first
        self.in_line = np.zeros(count, dtype=np.uint64)
        self.in_offset = np.zeros(count, dtype=np.uint64)

    def holds(self, line: int) -> bool:
        return self.first <= line < self.first + self.in_line.size

    def pair(self, line: int) -> tuple[int, int]:
        return int(self.in_line[line - self.first]), int(self.in_offset[line - self.first])


class _PairBuckets:
    """Pairs spilled to files by their answer's file and line range (PAIR_BUCKET_LINES)."""

    def __init__(self, work_dir: str) -> None:
        self.work_dir = work_dir
        shutil.rmtree(work_dir, ignore_errors=True)  # what a killed audit left there
        os.makedirs(work_dir, mode=0o700)

    def _path(self, side: int, bucket: int) -> str:
        return os.path.join(self.work_dir, f"pairs-{side}-{bucket:06d}.bin")

    def add(self, sides: np.ndarray, out_lines: np.ndarray, in_lines: np.ndarray, in_offsets: np.ndarray) -> None:
        if not sides.size:
            return
        records = np.zeros(sides.size, dtype=PAIR_RECORD_DTYPE)
        records["out_line"], records["in_line"], records["in_offset"] = out_lines, in_lines, in_offsets
        key = sides.astype(np.int64) << 40 | ((out_lines.astype(np.int64) - 1) // PAIR_BUCKET_LINES)
        order = np.argsort(key, kind="stable")
        key, records = key[order], records[order]
        cuts = np.flatnonzero(np.r_[True, key[1:] != key[:-1], True])
        for start, end in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            with open(self._path(int(key[start]) >> 40, int(key[start]) & ((1 << 40) - 1)), "ab") as f:
                f.write(records[start:end].tobytes())

    def bucket(self, side: int, line: int, lines: int) -> _Bucket:
        """The pairs of the bucket holding `line` of `side`'s file of `lines` lines."""
        k = (line - 1) // PAIR_BUCKET_LINES
        first = k * PAIR_BUCKET_LINES + 1
        held = _Bucket(first, min(PAIR_BUCKET_LINES, lines - first + 1))
        path = self._path(side, k)
        if os.path.exists(path):
            records = np.fromfile(path, dtype=PAIR_RECORD_DTYPE)
            at = (records["out_line"] - np.uint64(held.first)).astype(np.intp)
            held.in_line[at], held.in_offset[at] = records["in_line"], records["in_offset"]
        return held

    def close(self) -> None:
        shutil.rmtree(self.work_dir, ignore_errors=True)


def _body(request: Envelope) -> dict:
    """A request's body (a JSON object: the scan's envelope checked it starts as one)."""
    try:
        body = msgspec.json.decode(request.body)
    except msgspec.DecodeError:
        try:
            body = json.loads(bytes(request.body))
        except (ValueError, RecursionError):
            return {}
    return body if isinstance(body, dict) else {}


def _open(path: str, where: str) -> BinaryIO:
    """A regular file, open for reading (a FIFO is refused, never waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AuditFileError(f"{where}: does not exist") from None
    except OSError as exc:
        raise AuditFileError(f"{where}: cannot read it ({errno_text(exc)})") from exc
    kind = file_kind(fd)
    if kind != "file":
        os.close(fd)
        raise AuditFileError(f"{where}: a {kind}, not a regular file (the audit reads each file twice)")
    return open(fd, "rb")


def _lines(f: BinaryIO, where: str, limit_bytes: int) -> Iterator[tuple[int, int, bytes | None]]:
    """`scan.read_lines` of `f`, an OSError reading it as AuditFileError with its offset."""
    at = 0
    try:
        for at, line, raw in read_lines(f, limit_bytes):
            yield at, line, raw
    except OSError as exc:
        raise AuditFileError(f"{where}: reading failed after byte {at:,}: {errno_text(exc)}") from exc


def _line_at(f: BinaryIO, offset: int, limit_bytes: int) -> bytes:
    f.seek(offset)
    return f.readline(limit_bytes + 1).rstrip(b"\n")
