"""pipeline.batchjob.answers: one line per request across any number of runs, each line whole
and matching its record, and the counts of a reopened log those of the records it kept:
after a redelivered answer, a torn or zero-filled record, a log cut short or zero-filled at
its end, at any byte."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.batchjob import answers as answers_module
from pipeline.batchjob.answers import Answer, AnswerLog, Usage, record_chunks, records_path
from pipeline.batchjob.layout import (
    ANSWER_RECORD_SIZE_BYTES,
    LOG_ERRORS,
    LOG_OUTPUT,
    MAX_RECORD_COUNT,
    valid_records,
)
from pipeline.wire.errors import AnswerLogWriteError, JobPathError

STATUSES = (200, 400, 500)


def line(index: int, status: int = 200, usage: tuple[int, int, int] = (0, 0, 0), pad: int = 0) -> bytes:
    """An answer's line: JSON naming what its record says, and some padding."""
    prompt, completion, cached = usage
    return json.dumps({"i": index, "s": status, "p": prompt, "c": completion, "k": cached, "x": "x" * pad},
                      separators=(",", ":")).encode() + b"\n"


def answer(index: int, status: int = 200, usage: tuple[int, int, int] = (0, 0, 0), pad: int = 0,
           two_logs: bool = False) -> Answer:
    log = LOG_OUTPUT if status == 200 or not two_logs else LOG_ERRORS
    return Answer(index, line(index, status, usage, pad), status, log, *(usage if status == 200 else (0, 0, 0)))


def logs_in(directory: Path, two_logs: bool) -> dict[int, str]:
    logs = {LOG_OUTPUT: str(directory / "out.jsonl")}
    if two_logs:
        logs[LOG_ERRORS] = str(directory / "errors.jsonl")
    return logs


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path


def test_answers_are_appended_once_each_and_counted(data: Path) -> None:
    log = AnswerLog.open(str(data), 10, logs_in(data, True))
    assert log.append([answer(3, 200, (20, 5, 16), two_logs=True), answer(1, 400, two_logs=True),
                       answer(3, 500, two_logs=True)]) == 2
    assert log.append([answer(1, 200, (9, 9, 9)), answer(0, 200, (1, 2, 0))]) == 1
    assert log.append([]) == 0
    log.check_invariants()
    assert (log.done, log.failed, log.duplicates) == (3, 1, 2)
    assert log.by_status == {200: 2, 400: 1}
    assert log.usage == Usage(21, 7, 16) and log.usage.total_tokens == 28
    assert [log.is_done(k) for k in range(10)] == [k in (0, 1, 3) for k in range(10)]
    assert (data / "out.jsonl").read_bytes() == line(3, 200, (20, 5, 16)) + line(0, 200, (1, 2, 0))
    assert (data / "errors.jsonl").read_bytes() == line(1, 400)
    log.close()
    log.close()  # idempotent


def test_each_record_says_where_its_line_is(data: Path) -> None:
    log = AnswerLog.open(str(data), 5, logs_in(data, True))
    log.append([answer(4, 200, (3, 2, 1), pad=7, two_logs=True), answer(2, 500, two_logs=True)])
    log.append([answer(0, 200, pad=30)])
    log.sync()
    log.close()
    records = valid_records(Path(records_path(str(data))).read_bytes())
    assert records["index"].tolist() == [4, 2, 0]
    for record in records:
        path = data / ("out.jsonl" if int(record["log"]) == LOG_OUTPUT else "errors.jsonl")
        start = int(record["log_offset"])
        text = path.read_bytes()[start:start + int(record["line_bytes"])]
        assert json.loads(text)["i"] == int(record["index"]) and text.endswith(b"\n")
    assert [int(r["status_code"]) for r in records] == [200, 500, 200]
    assert (int(records[0]["prompt_tokens"]), int(records[0]["completion_tokens"]),
            int(records[0]["cached_tokens"])) == (3, 2, 1)


def test_a_reopened_log_has_the_answers_of_every_run(data: Path) -> None:
    logs = logs_in(data, False)
    log = AnswerLog.open(str(data), 9, logs)
    log.append([answer(k, STATUSES[k % 3], (k, 1, 0)) for k in range(0, 9, 2)])
    log.close()
    again = AnswerLog.open(str(data), 9, logs)
    again.check_invariants()
    assert again.recovered.records_cut == 0 and again.recovered.log_bytes_cut == {}
    assert (again.done, again.by_status, again.usage) == (5, {200: 2, 400: 1, 500: 2}, Usage(6, 2, 0))
    assert again.done_bits().tolist() == [0b0101_0101, 0b1]
    assert again.append([answer(k) for k in range(9)]) == 4 and again.duplicates == 5
    again.check_invariants()
    again.close()


def test_a_torn_last_record_is_cut_with_its_line(data: Path) -> None:
    logs = logs_in(data, True)
    log = AnswerLog.open(str(data), 4, logs)
    log.append([answer(0, 200, (5, 5, 5))])
    log.append([answer(1, 400, two_logs=True), answer(2, 200, (7, 7, 7), two_logs=True)])
    log.close()
    path = Path(records_path(str(data)))
    path.write_bytes(path.read_bytes()[:-1])
    again = AnswerLog.open(str(data), 4, logs)
    again.check_invariants()
    assert again.recovered.records_cut == 1  # the output's records come first: the error's is the last
    assert again.recovered.log_bytes_cut == {LOG_ERRORS: len(line(1, 400))}
    assert (again.done, again.usage) == (2, Usage(12, 12, 12)) and not again.is_done(1)
    assert (data / "errors.jsonl").read_bytes() == b""
    again.close()


@pytest.mark.parametrize("size", [1, ANSWER_RECORD_SIZE_BYTES - 1])
def test_a_records_file_torn_inside_its_first_record_opens_empty(data: Path, size: int) -> None:
    logs = logs_in(data, False)
    log = AnswerLog.open(str(data), 2, logs)
    log.append([answer(1)])
    log.close()
    path = Path(records_path(str(data)))
    path.write_bytes(path.read_bytes()[:size])
    again = AnswerLog.open(str(data), 2, logs)
    again.check_invariants()
    assert again.done == 0 and again.recovered.records_cut == 1 and path.stat().st_size == 0
    assert (data / "out.jsonl").read_bytes() == b""
    again.close()


def test_a_log_zero_filled_at_its_end_loses_the_lines_there(data: Path) -> None:
    logs = logs_in(data, False)
    log = AnswerLog.open(str(data), 3, logs)
    log.append([answer(0, pad=10), answer(1, pad=10), answer(2, pad=10)])
    log.close()
    out = data / "out.jsonl"
    raw = out.read_bytes()
    keep = len(line(0, pad=10)) + 5  # a power cut zero-fills from inside the second line
    out.write_bytes(raw[:keep] + bytes(len(raw) - keep))
    again = AnswerLog.open(str(data), 3, logs)
    again.check_invariants()
    assert again.done == 1 and again.is_done(0) and out.read_bytes() == line(0, pad=10)
    again.close()


def test_a_count_at_the_records_limit_is_kept_and_one_past_is_our_bug(data: Path) -> None:
    log = AnswerLog.open(str(data), 2, logs_in(data, False))
    log.append([Answer(0, line(0), 200, LOG_OUTPUT, MAX_RECORD_COUNT, MAX_RECORD_COUNT, MAX_RECORD_COUNT)])
    assert log.usage == Usage(MAX_RECORD_COUNT, MAX_RECORD_COUNT, MAX_RECORD_COUNT)
    with pytest.raises(AssertionError):
        log.append([Answer(1, line(1), 200, LOG_OUTPUT, MAX_RECORD_COUNT + 1, 0, 0)])
    log.close()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "device", "directory"])
def test_a_log_that_is_not_a_regular_file_is_refused(data: Path, kind: str) -> None:
    target = data / "out.jsonl"
    if kind == "symlink":
        (data / "victim").write_bytes(b"mine\n")
        target.symlink_to(data / "victim")
    elif kind == "fifo":
        os.mkfifo(target)  # no reader: refused, not waited on
    elif kind == "directory":
        target.mkdir()
    else:
        target = Path("/dev/null")
    with pytest.raises(JobPathError, match=f"{target}: "):
        AnswerLog.open(str(data), 2, {LOG_OUTPUT: str(target)})
    if kind == "symlink":
        assert (data / "victim").read_bytes() == b"mine\n"


def test_the_records_are_read_back_in_chunks(data: Path) -> None:
    log = AnswerLog.open(str(data), 50, logs_in(data, False))
    log.append([answer(k) for k in range(50)])
    log.close()
    with mock.patch.object(answers_module, "RECOVERY_CHUNK_RECORDS", 7):
        chunks = list(record_chunks(str(data)))
    assert [len(c) for c in chunks] == [7] * 7 + [1]
    assert [int(k) for c in chunks for k in c["index"]] == list(range(50))


# --- a property: any crash, at any byte, of any file ------------------------------------------

REQUESTS = 24


@dataclass
class Damage:
    """What a crash did to one file: cut at a fraction of its size, then zero-filled from a
    fraction of what is left (either may be absent)."""

    cut: float | None
    zero_from: float | None

    def apply(self, path: Path) -> None:
        raw = path.read_bytes()
        if self.cut is not None:
            raw = raw[:int(len(raw) * self.cut)]
        if self.zero_from is not None:
            start = int(len(raw) * self.zero_from)
            raw = raw[:start] + bytes(len(raw) - start)
        path.write_bytes(raw)


fractions = st.floats(0, 1, allow_nan=False)
damages = st.one_of(st.none(), st.builds(Damage, st.one_of(st.none(), fractions), st.one_of(st.none(), fractions)))
answers_st = st.lists(st.tuples(st.integers(0, REQUESTS - 1), st.sampled_from(STATUSES),
                                st.tuples(st.integers(0, 1 << 20), st.integers(0, 300), st.integers(0, 1 << 20)),
                                st.integers(0, 40)), max_size=12)
steps = st.lists(st.one_of(st.tuples(st.just("append"), answers_st),
                           st.tuples(st.just("crash"), st.tuples(damages, damages, damages))), max_size=14)


def _expected_kept(data: Path, logs: dict[int, str], before: dict[str, bytes]) -> int:
    """How many leading records a recovery must keep: those whose own bytes and line survived."""
    records = valid_records(before["records"])
    now = Path(records_path(str(data))).read_bytes()
    for r, record in enumerate(records):
        span = slice(r * ANSWER_RECORD_SIZE_BYTES, (r + 1) * ANSWER_RECORD_SIZE_BYTES)
        if now[span] != before["records"][span]:
            return r
        path = logs[int(record["log"])]
        start = int(record["log_offset"])
        span = slice(start, start + int(record["line_bytes"]))
        if Path(path).read_bytes()[span] != before[path][span]:
            return r
    return len(records)


def _check(log: AnswerLog, data: Path, logs: dict[int, str], offered: dict[int, set[bytes]]) -> None:
    """The log against a model made of the records it kept."""
    log.check_invariants()
    raw = Path(records_path(str(data))).read_bytes()
    records = valid_records(raw)
    assert len(records) * ANSWER_RECORD_SIZE_BYTES == len(raw) == log.done * ANSWER_RECORD_SIZE_BYTES
    indices = records["index"].tolist()
    assert len(set(indices)) == len(indices)  # at most one line per request
    assert [log.is_done(k) for k in range(REQUESTS)] == [k in indices for k in range(REQUESTS)]
    contents = {number: Path(path).read_bytes() for number, path in logs.items()}
    ends = dict.fromkeys(logs, 0)
    usage, by_status = Usage(), Counter()
    for record in records:
        number, start, size = int(record["log"]), int(record["log_offset"]), int(record["line_bytes"])
        assert start == ends[number]  # each log is its records' lines, back to back
        ends[number] = start + size
        text = contents[number][start:start + size]
        assert text.endswith(b"\n") and text.count(b"\n") == 1 and text in offered[int(record["index"])]
        fields = json.loads(text)
        status = int(record["status_code"])
        assert (fields["i"], fields["s"]) == (int(record["index"]), status)
        by_status[status] += 1
        if status == 200:
            counts = (int(record["prompt_tokens"]), int(record["completion_tokens"]), int(record["cached_tokens"]))
            assert counts == (fields["p"], fields["c"], fields["k"])
            usage.prompt_tokens += counts[0]
            usage.completion_tokens += counts[1]
            usage.cached_tokens += counts[2]
    assert ends == {number: len(content) for number, content in contents.items()}
    assert (log.done, log.by_status, log.usage) == (len(records), dict(by_status), usage)
    assert log.failed == len(records) - by_status[200]


@settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(two_logs=st.booleans(), chunk=st.sampled_from([1, 3, answers_module.RECOVERY_CHUNK_RECORDS]), plan=steps)
def test_any_crash_leaves_one_whole_line_per_answered_request_and_its_counts(two_logs: bool, chunk: int,
                                                                             plan: list) -> None:
    with tempfile.TemporaryDirectory() as scratch, mock.patch.object(answers_module, "RECOVERY_CHUNK_RECORDS", chunk):
        data = Path(scratch)
        logs = logs_in(data, two_logs)
        offered: dict[int, set[bytes]] = {k: set() for k in range(REQUESTS)}
        log = AnswerLog.open(str(data), REQUESTS, logs)
        try:
            for kind, step in plan:
                if kind == "append":
                    batch = [answer(index, status, usage, pad, two_logs) for index, status, usage, pad in step]
                    for one in batch:
                        offered[one.index].add(one.line)
                    fresh = sum(1 for k, one in enumerate(batch) if not log.is_done(one.index)
                                and all(other.index != one.index for other in batch[:k]))
                    assert log.append(batch) == fresh
                else:
                    log.close()
                    before = {"records": Path(records_path(str(data))).read_bytes(),
                              **{path: Path(path).read_bytes() for path in logs.values()}}
                    for damage, path in zip(step, [records_path(str(data)), *logs.values()]):
                        if damage is not None:
                            damage.apply(Path(path))
                    kept = _expected_kept(data, logs, before)
                    log = AnswerLog.open(str(data), REQUESTS, logs)
                    assert log.done == kept
                    assert log.recovered.records_cut <= len(before["records"]) // ANSWER_RECORD_SIZE_BYTES - kept
                _check(log, data, logs, offered)
        finally:
            log.close()


@pytest.mark.integration
def test_an_append_that_finds_the_disk_full_keeps_nothing_and_a_later_one_lands_where_it_should(tmp_path):
    from tests.consumer.tmpfs import fill, small_tmpfs

    with small_tmpfs(str(tmp_path / "disk"), size_bytes=1 << 20) as disk:
        out = os.path.join(disk, "out.jsonl")
        log = AnswerLog.open(disk, 4000, {LOG_OUTPUT: out})
        log.append([Answer(k, line(k), 200, LOG_OUTPUT, 3, 1, 0) for k in range(10)])
        filler = fill(disk, leave_bytes=8192)  # room for part of the next append only
        with pytest.raises(AnswerLogWriteError) as caught:
            log.append([Answer(k, line(k, pad=200), 200, LOG_OUTPUT, 3, 1, 0) for k in range(10, 200)])
        assert caught.value.errno == errno.ENOSPC
        assert log.done == 10 and not log.is_done(10)
        log.check_invariants()  # every file cut back to what it held
        os.unlink(filler)
        assert log.append([Answer(k, line(k), 200, LOG_OUTPUT, 3, 1, 0) for k in range(10, 200)]) == 190
        log.close()
        log = AnswerLog.open(disk, 4000, {LOG_OUTPUT: out})
        log.check_invariants()
        raw = open(out, "rb").read()
        records = valid_records(open(records_path(disk), "rb").read())
        for record in records:  # every record points at its own line
            start = int(record["log_offset"])
            assert raw[start:start + int(record["line_bytes"])] == line(int(record["index"]))
        log.close()
