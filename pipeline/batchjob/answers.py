"""The job's answers: one output line per request, appended as each answer is known, and a
record per answer that says which request it is for (`layout.ANSWER_RECORD_DTYPE`).

    log = AnswerLog.open(data_dir, requests=N, logs={LOG_OUTPUT: path, LOG_ERRORS: path})
    log.is_done(17)                          # has request 17 its line?
    log.append([Answer(17, line, 200, LOG_OUTPUT, 12, 16, 8)])
    log.done, log.by_status, log.usage       # across every run of the job

Owner: the process running the job; one writer (the data directory's job lock says who).
Each append writes the lines (one write per log), then their records (one write): a line is
an answer once its record is written. Opening recovers from any stop: records past the first
one whose check fails (torn, zero-filled by a power cut) or whose line is not whole in its
log are cut off, and so is every byte of a log past its last recorded line, so each request
has at most one line, whole, in every log, across any number of resumes. What was cut is
answered again from the results files, which outlive the answer log (`collect.py`).

Memory: one bit per request (which are answered) and a few counters; the records stay on
disk and are read in RECOVERY_CHUNK_RECORDS at a time.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.batchjob.layout import (
    ANSWER_RECORD_DTYPE,
    ANSWER_RECORD_SIZE_BYTES,
    make_records,
    valid_records,
)
from pipeline.batchjob.manifest import JOB_DIR
from pipeline.wire import fileops
from pipeline.wire.errors import AnswerLogWriteError, JobPathError
from pipeline.wire.fileops import errno_text

RECORDS_NAME = "answers.bin"
# The answer log of an input-order job (merged into the output at the end).
LOG_NAME = "answers.jsonl"
# Records read at a time on recovery and by the merge (which reads their lines with them:
# ~10 MiB of typical lines): 640 KiB.
RECOVERY_CHUNK_RECORDS = 1 << 14
# Records at the end of the log checked against a completion-order output's lines when a
# run opens it (`log_fits_records`): an edit anywhere before them moves their lines.
LOG_CHECK_RECORDS = 1024
FILE_MODE = 0o600
# A record's fields in the order `append` gathers them (all but the check).
_COLUMNS = ("index", "log_offset", "line_bytes", "status_code", "log", "prompt_tokens", "completion_tokens",
            "cached_tokens")
# Bytes of a log's end read at a time on recovery, looking for where its data ends.
TAIL_READ_BYTES = 1 << 16
# Read too: recovery looks at a log's last bytes. O_NONBLOCK: a FIFO is refused, not waited on.
_APPEND = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


@dataclass(slots=True)
class Answer:
    """One request's output line (its newline included) and what its record says."""

    index: int
    line: bytes
    status_code: int
    log: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class Usage:
    """Tokens of the completed requests, as their output lines' usage adds up."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Recovered:
    """What opening the log cut off: records (and their lines) that were not whole."""

    records_cut: int = 0
    log_bytes_cut: dict[int, int] = field(default_factory=dict)


def records_path(data_dir: str) -> str:
    return os.path.join(data_dir, JOB_DIR, RECORDS_NAME)


def answer_records(data_dir: str) -> int:
    """Answer records in a job's data directory by the size of their file, unchecked (0 when
    there is none): what a resume may find answered, before it reads them."""
    try:
        return os.stat(records_path(data_dir)).st_size // ANSWER_RECORD_SIZE_BYTES
    except FileNotFoundError:
        return 0


class AnswerLog:
    """See the module's doc. `close()` is explicit and idempotent."""

    def __init__(self, data_dir: str, requests: int, logs: Mapping[int, str]) -> None:
        self.requests = requests
        self.paths = dict(logs)
        self._done = bytearray((requests + 7) // 8)
        self.done = 0
        self.by_status: dict[int, int] = {}
        self.usage = Usage()
        self.duplicates = 0  # answers offered for requests that had theirs (redelivered batches)
        self._ends: dict[int, int] = {log: 0 for log in logs}
        self._records_path = records_path(data_dir)
        self._fds: dict[int, int] = {}
        self._records_fd = -1
        self.recovered = Recovered()

    @classmethod
    def open(cls, data_dir: str, requests: int, logs: Mapping[int, str],
             opened: Mapping[int, int] | None = None) -> AnswerLog:
        """The job's answers so far, recovered (the module's doc), open for appending.
        `opened`: logs the caller opened (for appending) itself, by log; the log owns them."""
        log = cls(data_dir, requests, logs)
        log._fds.update(opened or {})
        try:
            log._open_files()
            log._recover()
        except BaseException:
            log.close()
            raise
        return log

    def _open_files(self) -> None:
        os.makedirs(os.path.dirname(self._records_path), mode=0o700, exist_ok=True)
        self._records_fd = _open_append(self._records_path)
        for log, path in self.paths.items():
            if log not in self._fds:
                self._fds[log] = _open_append(path)

    def _recover(self) -> None:
        sizes = {log: _data_end(fd) for log, fd in self._fds.items()}
        kept = 0
        size = os.fstat(self._records_fd).st_size
        with open(self._records_path, "rb") as f:
            while kept * ANSWER_RECORD_SIZE_BYTES < size:
                raw = f.read(RECOVERY_CHUNK_RECORDS * ANSWER_RECORD_SIZE_BYTES)
                records = valid_records(raw)
                records = records[:_whole_lines(records, sizes)]
                self._count(records)
                kept += records.size
                if records.size < RECOVERY_CHUNK_RECORDS:
                    break
        if kept * ANSWER_RECORD_SIZE_BYTES < size:
            self.recovered.records_cut = -(-(size - kept * ANSWER_RECORD_SIZE_BYTES) // ANSWER_RECORD_SIZE_BYTES)
            fileops.ftruncate(self._records_fd, kept * ANSWER_RECORD_SIZE_BYTES)
        for log, fd in self._fds.items():
            size = os.fstat(fd).st_size
            if size > self._ends[log]:
                self.recovered.log_bytes_cut[log] = size - self._ends[log]
                fileops.ftruncate(fd, self._ends[log])

    def _count(self, records: np.ndarray) -> None:
        """Take recovered records into the bit set, the counts and the logs' ends."""
        if not records.size:
            return
        index = records["index"].astype(np.int64)
        bits = np.frombuffer(self._done, dtype=np.uint8)
        np.bitwise_or.at(bits, index >> 3, (1 << (index & 7)).astype(np.uint8))
        self.done += int(records.size)
        status = records["status_code"]
        counts = np.bincount(status)  # NOTE: not np.unique: its hash path cost 4x as much
        for code in np.flatnonzero(counts).tolist():
            self.by_status[code] = self.by_status.get(code, 0) + int(counts[code])
        ok = status == 200
        self.usage.prompt_tokens += int(records["prompt_tokens"][ok].sum())
        self.usage.completion_tokens += int(records["completion_tokens"][ok].sum())
        self.usage.cached_tokens += int(records["cached_tokens"][ok].sum())
        logs = records["log"]
        for log in self._ends:
            mine = np.flatnonzero(logs == log)  # the last record of each log: not a copy of all
            if mine.size:
                last = records[int(mine[-1])]
                self._ends[log] = int(last["log_offset"]) + int(last["line_bytes"])

    def is_done(self, index: int) -> bool:
        return bool(self._done[index >> 3] >> (index & 7) & 1)

    def done_bits(self) -> np.ndarray:
        """A copy of the answered set, one bit per request (bit k of byte k // 8)."""
        return np.frombuffer(bytes(self._done), dtype=np.uint8)

    def append(self, answers: Sequence[Answer]) -> int:
        """Append the answers of requests that have none yet (a second answer of a request
        is counted in `duplicates` and dropped); how many were new. All or nothing: a write
        that fails (ENOSPC) is cut back from every file it touched and AnswerLogWriteError
        raised (its errno kept), with nothing counted, so the same answers can be offered
        again once there is room."""
        fresh, taken = [], set()
        for answer in answers:
            assert 0 <= answer.index < self.requests, (answer.index, self.requests)
            if self.is_done(answer.index) or answer.index in taken:
                self.duplicates += 1
                continue
            taken.add(answer.index)
            fresh.append(answer)
        if not fresh:
            return 0
        columns: dict[str, list[int]] = {name: [] for name in _COLUMNS}
        ends = dict(self._ends)
        chunks: dict[int, bytes] = {}
        for log in sorted({a.log for a in fresh}):
            lines = [a for a in fresh if a.log == log]
            for answer in lines:
                for name, value in zip(_COLUMNS, (answer.index, ends[log], len(answer.line), answer.status_code,
                                                  answer.log, answer.prompt_tokens, answer.completion_tokens,
                                                  answer.cached_tokens)):
                    columns[name].append(value)
                ends[log] += len(answer.line)
            chunks[log] = b"".join(a.line for a in lines)
        self._write_whole(chunks, make_records(columns))
        self._ends = ends
        self._count_fresh(fresh)
        return len(fresh)

    def _write_whole(self, chunks: dict[int, bytes], records: bytes) -> None:
        """Every log's lines, then the records; on failure every file cut back to its size
        before the call (the logs end at `_ends`, the records at done x record size)."""
        written: list[int] = []
        where = self._records_path
        try:
            for log, data in chunks.items():
                written.append(self._fds[log])
                where = self.paths[log]
                fileops.write_all(self._fds[log], data)
            written.append(self._records_fd)
            where = self._records_path
            fileops.write_all(self._records_fd, records)
        except OSError as exc:
            sizes = {self._records_fd: self.done * ANSWER_RECORD_SIZE_BYTES,
                     **{self._fds[log]: self._ends[log] for log in self._fds}}
            for fd in written:
                try:
                    fileops.ftruncate(fd, sizes[fd])
                except OSError as cut:
                    raise AnswerLogWriteError(f"appending answers to {where} failed ({errno_text(exc)}) and "
                                              f"cutting the partial write back failed too ({errno_text(cut)}): the "
                                              f"next run recovers the log", exc.errno, where) from exc
            raise AnswerLogWriteError(f"appending answers to {where} failed: {errno_text(exc)}; nothing of it was "
                                      f"kept", exc.errno, where) from exc

    def _count_fresh(self, fresh: Sequence[Answer]) -> None:
        for answer in fresh:
            self._done[answer.index >> 3] |= 1 << (answer.index & 7)
            self.done += 1
            self.by_status[answer.status_code] = self.by_status.get(answer.status_code, 0) + 1
            if answer.status_code == 200:
                self.usage.prompt_tokens += answer.prompt_tokens
                self.usage.completion_tokens += answer.completion_tokens
                self.usage.cached_tokens += answer.cached_tokens

    def fds(self) -> dict[int, int]:
        """The logs' descriptors, by log (the caller checks they are still its files)."""
        return dict(self._fds)

    @property
    def failed(self) -> int:
        return self.done - self.by_status.get(200, 0)

    def sync(self) -> None:
        """Every line and record written so far on disk (the end of a job)."""
        for fd in (*self._fds.values(), self._records_fd):
            fileops.fsync(fd)

    def check_invariants(self) -> None:
        bits = np.unpackbits(np.frombuffer(self._done, dtype=np.uint8), bitorder="little")
        assert int(bits.sum()) == self.done == sum(self.by_status.values()), (bits.sum(), self.done)
        assert not bits[self.requests:].any()
        assert os.fstat(self._records_fd).st_size == self.done * ANSWER_RECORD_SIZE_BYTES
        for log, fd in self._fds.items():
            assert os.fstat(fd).st_size == self._ends[log], (log, self._ends[log])

    def close(self) -> None:
        for fd in (*self._fds.values(), self._records_fd):
            if fd >= 0:
                os.close(fd)
        self._fds, self._records_fd = {}, -1


def _whole_lines(records: np.ndarray, sizes: Mapping[int, int]) -> int:
    """How many leading records have their line whole in a log of ours."""
    ends = records["log_offset"] + records["line_bytes"]
    by_log = np.zeros(256, dtype=np.uint64)  # a log's size by its number (a u1 field)
    ours = np.zeros(256, dtype=bool)
    for log, size in sizes.items():
        by_log[log], ours[log] = size, True
    logs = records["log"]
    bad = np.flatnonzero(~ours[logs] | (ends > by_log[logs]))
    return int(bad[0]) if bad.size else int(records.size)


def _data_end(fd: int) -> int:
    """Where a log's lines end: its size, less a tail of zero bytes (a power cut may leave a
    file's last blocks zero-filled, and a line never holds a zero byte)."""
    end = os.fstat(fd).st_size
    while end:
        start = max(0, end - TAIL_READ_BYTES)
        data = os.pread(fd, end - start, start).rstrip(b"\0")
        if data:
            return start + len(data)
        end = start
    return 0


def _open_append(path: str) -> int:
    try:
        fd = os.open(path, _APPEND, FILE_MODE)
    except OSError as exc:
        raise JobPathError(f"{path}: cannot open it to append answers: {exc.strerror}") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise JobPathError(f"{path}: not a regular file: the job appends its answers only to regular files")
    return fd


def record_chunks(data_dir: str):
    """The job's answer records, RECOVERY_CHUNK_RECORDS at a time (for the merge: the log
    was opened, so every record is valid)."""
    with open(records_path(data_dir), "rb") as f:
        while raw := f.read(RECOVERY_CHUNK_RECORDS * ANSWER_RECORD_SIZE_BYTES):
            yield np.frombuffer(raw, dtype=ANSWER_RECORD_DTYPE)


def log_fits_records(data_dir: str, log: int, fd: int) -> bool:
    """Whether the log open at `fd` still holds, where the last LOG_CHECK_RECORDS records of
    `log` say, whole lines: a line of it deleted or changed in length in place (an editor's
    save) moves every later line, so the tail's lines no longer start and end where their
    records say. (The records' own checks are `valid_records`'.)"""
    try:
        with open(records_path(data_dir), "rb") as f:
            size = os.fstat(f.fileno()).st_size // ANSWER_RECORD_SIZE_BYTES * ANSWER_RECORD_SIZE_BYTES
            f.seek(max(0, size - LOG_CHECK_RECORDS * ANSWER_RECORD_SIZE_BYTES))
            records = valid_records(f.read(LOG_CHECK_RECORDS * ANSWER_RECORD_SIZE_BYTES))
    except FileNotFoundError:
        return True
    end = os.fstat(fd).st_size
    for offset, length in zip(records["log_offset"][records["log"] == log].tolist(),
                              records["line_bytes"][records["log"] == log].tolist()):
        if offset + length > end or os.pread(fd, 1, offset + length - 1) != b"\n":
            return False
        if offset and os.pread(fd, 1, offset - 1) != b"\n":
            return False
    return True
