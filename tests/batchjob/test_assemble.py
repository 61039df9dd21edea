"""pipeline.batchjob.assemble: the answer log's lines in input order, whatever order they came
in and however small the buckets, failures in the error file where there is one; the work
directory removed; a failure in the middle leaves no output and no temporary file."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.batchjob import assemble
from pipeline.batchjob.answers import Answer, AnswerLog
from pipeline.batchjob.assemble import bucket_bounds, read_parts, write_in_input_order
from pipeline.batchjob.layout import ANSWER_RECORD_DTYPE, LOG_OUTPUT
from pipeline.wire import fileops
from pipeline.batchjob.paths import ReplacingFile
from tests.batchjob.batchfiles import without_tmpfile


def sink(path):
    """A maker of the sink the merge writes `path` through."""
    return lambda: ReplacingFile(str(path))


class _NoSync(fileops.FileIO):
    """What the property's examples skip: durability is not what they test."""

    def fsync(self, fd: int) -> None:
        pass

    def fsync_directory(self, directory: str) -> None:
        pass


def _line(index: int, status: int, pad: int) -> bytes:
    return json.dumps({"i": index, "s": status, "x": "x" * pad}).encode() + b"\n"


def _answered(data: Path, requests: int, answers: list[tuple[int, int, int]]) -> Path:
    """A job's answer log holding `answers` (index, status, padding), in that order; its path."""
    log_path = data / "job" / "answers.jsonl"
    log = AnswerLog.open(str(data), requests, {LOG_OUTPUT: str(log_path)})
    log.append([Answer(index, _line(index, status, pad), status, LOG_OUTPUT) for index, status, pad in answers])
    log.close()
    return log_path


def _expected(answers: list[tuple[int, int, int]], split: bool) -> tuple[bytes, bytes]:
    """(output, error file) by the plain method: the first answer of each request, by index."""
    first: dict[int, tuple[int, int]] = {}
    for index, status, pad in answers:
        first.setdefault(index, (status, pad))
    ordered = [(index, *first[index]) for index in sorted(first)]
    output = b"".join(_line(*a) for a in ordered if a[1] == 200 or not split)
    errors = b"".join(_line(*a) for a in ordered if a[1] != 200) if split else b""
    return output, errors


@st.composite
def jobs(draw) -> tuple[int, list[tuple[int, int, int]]]:
    """A finished job's answers: every request's, in any order, some offered twice."""
    requests = draw(st.integers(1, 80))
    indices = draw(st.permutations(range(requests)))
    for again in draw(st.lists(st.integers(0, requests - 1), max_size=requests)):
        indices.insert(draw(st.integers(0, len(indices))), again)
    answers = [(index, draw(st.sampled_from((200, 200, 400, 500))), draw(st.integers(0, 300))) for index in indices]
    return requests, answers


@settings(max_examples=100, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=jobs(), bucket_bytes=st.one_of(st.integers(1, 600), st.just(assemble.BUCKET_BYTES)),
       ranges=st.sampled_from([3, 7, assemble.HISTOGRAM_RANGES]), buckets=st.sampled_from([4, assemble.MAX_BUCKETS]),
       split=st.booleans(), tmpfile=st.booleans(), read_bytes=st.sampled_from([1, 700, assemble.DISTRIBUTE_READ_BYTES]),
       write_lines=st.sampled_from([1, 3, assemble.WRITE_LINES]))
def test_the_merge_is_the_lines_sorted_by_request(job, bucket_bytes: int, ranges: int, buckets: int, split: bool,
                                                  tmpfile: bool, read_bytes: int, write_lines: int) -> None:
    requests, answers = job
    previous = fileops.install(_NoSync())
    try:
        with mock.patch.object(assemble, "DISTRIBUTE_READ_BYTES", read_bytes), \
                mock.patch.object(assemble, "WRITE_LINES", write_lines):
            _merge_and_check(requests, answers, bucket_bytes, ranges, buckets, split, tmpfile)
    finally:
        fileops.install(previous)


@given(sizes=st.lists(st.integers(1, 5000), max_size=60), read_bytes=st.integers(1, 20_000))
def test_the_log_is_read_in_parts_of_at_most_the_read_size_or_one_line(sizes: list[int], read_bytes: int) -> None:
    records = np.zeros(len(sizes), dtype=ANSWER_RECORD_DTYPE)
    records["line_bytes"] = sizes
    records["log_offset"] = np.cumsum([0] + sizes[:-1])
    parts = list(read_parts(records, read_bytes))
    assert np.array_equal(np.concatenate(parts) if parts else records[:0], records)
    for part in parts:
        assert part.size == 1 or int(part["line_bytes"].sum()) <= read_bytes
    for part, after in zip(parts, parts[1:]):  # each part as long as it may be
        assert int(part["line_bytes"].sum()) + int(after["line_bytes"][0]) > read_bytes


def _merge_and_check(requests: int, answers: list[tuple[int, int, int]], bucket_bytes: int, ranges: int,
                     buckets: int, split: bool, tmpfile: bool) -> None:
    with tempfile.TemporaryDirectory() as scratch, mock.patch.object(assemble, "HISTOGRAM_RANGES", ranges), \
            mock.patch.object(assemble, "MAX_BUCKETS", buckets):
        data = out = Path(scratch)  # few directories: removing one costs milliseconds here
        log_path = _answered(data, requests, answers)
        bounds = bucket_bounds(str(data), requests, bucket_bytes).tolist()
        assert bounds[0] == 0 and bounds[-1] == requests and bounds == sorted(bounds), bounds
        work = data / "job" / "merge"
        error_file = out / "errors.jsonl" if split else None
        with nullcontext() if tmpfile else without_tmpfile():
            write_in_input_order(str(data), str(log_path), requests, sink(out / "output.jsonl"),
                                 sink(error_file) if split else None, str(work), bucket_bytes)
        expected_output, expected_errors = _expected(answers, split)
        assert (out / "output.jsonl").read_bytes() == expected_output
        written = ["errors.jsonl", "output.jsonl"] if split else ["output.jsonl"]
        assert sorted(os.listdir(out)) == sorted(["job", *written])
        if split:
            assert error_file.read_bytes() == expected_errors
        assert all(os.stat(out / name).st_mode & 0o777 == 0o600 for name in written)
        assert not work.exists()


def test_the_buckets_cut_where_the_lines_reach_the_bucket_size(tmp_path: Path) -> None:
    _answered(tmp_path, 10, [(k, 200, 100 - len(_line(k, 200, 0)) + 1) for k in range(10)])  # 101 bytes each
    assert bucket_bounds(str(tmp_path), 10, 300).tolist() == [0, 2, 4, 6, 8, 10]
    assert bucket_bounds(str(tmp_path), 10, 303).tolist() == [0, 3, 6, 9, 10]
    assert bucket_bounds(str(tmp_path), 10, 10_000).tolist() == [0, 10]
    assert bucket_bounds(str(tmp_path), 10, 1).tolist() == list(range(11))  # a line larger than a bucket: its own


@pytest.mark.parametrize("ranges", [4, 7])
def test_no_bucket_starts_past_the_last_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranges: int) -> None:
    """Index ranges of the histogram wider than one request: the last ones hold none."""
    monkeypatch.setattr(assemble, "HISTOGRAM_RANGES", ranges)
    _answered(tmp_path, 9, [(k, 200, 10) for k in range(9)])
    bounds = bucket_bounds(str(tmp_path), 9, 1).tolist()
    assert bounds[0] == 0 and bounds[-1] == 9 and bounds == sorted(bounds), bounds


def test_the_buckets_are_at_most_max_buckets_whatever_the_bucket_size(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assemble, "MAX_BUCKETS", 4)
    _answered(tmp_path, 40, [(k, 200, 50) for k in range(40)])
    assert len(bucket_bounds(str(tmp_path), 40, 1)) - 1 <= 4 + 1


@pytest.mark.parametrize("older", [False, True], ids=["no older output", "an older output"])
@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "a named temporary file"])
def test_a_failure_in_the_middle_leaves_no_output_and_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        older: bool, tmpfile: bool) -> None:
    data, out = tmp_path / "data", tmp_path / "out"
    out.mkdir()
    log_path = _answered(data, 30, [(k, 200 if k % 3 else 400, 5000) for k in range(30)])
    if older:
        (out / "output.jsonl").write_bytes(b"the older output\n")
    real = assemble._write_bucket
    calls = []

    def failing(path: str, output, failed) -> None:
        calls.append(path)
        if len(calls) == 3:
            raise OSError(5, "Input/output error", path)
        real(path, output, failed)

    monkeypatch.setattr(assemble, "_write_bucket", failing)
    work = data / "job" / "merge"
    with nullcontext() if tmpfile else without_tmpfile(), pytest.raises(OSError, match="Input/output error"):
        write_in_input_order(str(data), str(log_path), 30, sink(out / "output.jsonl"), sink(out / "errors.jsonl"),
                             str(work), bucket_bytes=20_000)
    assert len(calls) == 3
    assert os.listdir(out) == (["output.jsonl"] if older else [])
    if older:
        assert (out / "output.jsonl").read_bytes() == b"the older output\n"
    assert not work.exists()
    monkeypatch.setattr(assemble, "_write_bucket", real)
    write_in_input_order(str(data), str(log_path), 30, sink(out / "output.jsonl"), sink(out / "errors.jsonl"),
                         str(work))
    assert len((out / "output.jsonl").read_bytes().splitlines()) == 20
    assert len((out / "errors.jsonl").read_bytes().splitlines()) == 10
