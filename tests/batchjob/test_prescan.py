"""pipeline.batchjob.prescan: a scan kept beforehand is adopted only whole (the same scan and
line digests a fresh scan makes), and anything else leaves the job to scan its input."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from pipeline.batchjob import prescan
from pipeline.batchjob.prescan import adopt_scan, keep_scan, kept_paths, scan_or_adopt
from pipeline.batchjob.scan import parse_index, scan_input, write_index


def write_batch(path, count: int, tag: str = "a") -> str:
    with open(path, "w") as f:
        for k in range(count):
            f.write(json.dumps({"custom_id": f"{tag}{k}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": "x" * (k % 7)}}) + "\n")
    return str(path)


@pytest.fixture
def kept(tmp_path):
    """A 5,000-request input (past one index stride) and its scan, kept as the service keeps it."""
    source = write_batch(tmp_path / "in.jsonl", 5000)
    work = tmp_path / "work"
    os.makedirs(work)
    scan = scan_input(source, str(work / "scan"), str(work / "lines.bin"))
    os.makedirs(tmp_path / "files")
    prefix = str(tmp_path / "files" / "file-1")
    keep_scan(scan, str(work / "lines.bin"), prefix)
    return source, prefix, scan


def fresh(source: str, where) -> tuple:
    os.makedirs(where)
    scan = scan_input(source, str(where / "scan"), str(where / "lines.bin"))
    with open(where / "lines.bin", "rb") as f:
        return scan, f.read()


def test_an_adopted_scan_is_the_scan_a_fresh_one_makes(tmp_path, kept):
    source, prefix, _scan = kept
    os.makedirs(tmp_path / "job")
    adopted = adopt_scan(prefix, source, str(tmp_path / "job" / "lines.bin"))
    want, want_lines = fresh(source, tmp_path / "again")
    assert adopted is not None
    assert (adopted.path, adopted.input_bytes, adopted.input_xxh3, adopted.requests) == \
        (source, want.input_bytes, want.input_xxh3, want.requests)
    assert np.array_equal(adopted.index, want.index) and len(adopted.index) > 1
    with open(tmp_path / "job" / "lines.bin", "rb") as f:
        assert f.read() == want_lines


def damage_index(prefix: str) -> None:
    index, _lines = kept_paths(prefix)
    with open(index, "r+b") as f:
        f.seek(20)
        f.write(b"\xff")


def cut_lines(prefix: str) -> None:
    _index, lines = kept_paths(prefix)
    os.truncate(lines, os.path.getsize(lines) - 8)


def remove_index(prefix: str) -> None:
    os.unlink(kept_paths(prefix)[0])


@pytest.mark.parametrize("spoil", [damage_index, cut_lines, remove_index])
def test_a_kept_scan_that_is_not_whole_is_not_adopted_and_the_input_is_scanned(tmp_path, kept, spoil):
    source, prefix, scan = kept
    spoil(prefix)
    job = tmp_path / "job"
    os.makedirs(job)
    assert adopt_scan(prefix, source, str(job / "lines.bin")) is None
    again, adopted = scan_or_adopt(source, str(job), prefix)
    assert not adopted and (again.requests, again.input_xxh3) == (scan.requests, scan.input_xxh3)


def test_the_scan_of_another_file_is_not_adopted(tmp_path, kept):
    _source, prefix, _scan = kept
    other = write_batch(tmp_path / "other.jsonl", 4999)
    assert adopt_scan(prefix, other, str(tmp_path / "lines.bin")) is None


def test_an_index_at_the_size_limit_is_read_and_one_past_it_is_not(tmp_path, kept, monkeypatch):
    source, prefix, _scan = kept
    size = os.path.getsize(kept_paths(prefix)[0])
    monkeypatch.setattr(prescan, "MAX_INDEX_BYTES", size)
    assert adopt_scan(prefix, source, str(tmp_path / "a.bin")) is not None
    monkeypatch.setattr(prescan, "MAX_INDEX_BYTES", size - 1)
    assert adopt_scan(prefix, source, str(tmp_path / "b.bin")) is None


def test_without_a_kept_scan_the_job_scans(tmp_path, kept):
    source, _prefix, scan = kept
    os.makedirs(tmp_path / "job")
    again, adopted = scan_or_adopt(source, str(tmp_path / "job"), None)
    assert not adopted and again.input_xxh3 == scan.input_xxh3


def test_an_index_parses_whole_and_not_cut_short(tmp_path, kept):
    _source, _prefix, scan = kept
    write_index(str(tmp_path / "idx"), scan)
    with open(tmp_path / "idx", "rb") as f:
        raw = f.read()
    parsed = parse_index(raw)
    assert parsed is not None and np.array_equal(parsed.index, scan.index)
    assert parse_index(raw[:-1]) is None and parse_index(raw[:10]) is None and parse_index(b"") is None


@pytest.mark.parametrize("digest", ["ab" * 14 + "0000", "00" * 16, "00" + "cd" * 15])
def test_an_index_keeps_every_byte_of_the_inputs_digest(tmp_path, kept, digest):
    _source, _prefix, scan = kept
    write_index(str(tmp_path / "idx"), dataclasses.replace(scan, input_xxh3=digest))
    with open(tmp_path / "idx", "rb") as f:
        parsed = parse_index(f.read())
    assert parsed is not None and parsed.input_xxh3 == digest  # a trailing zero byte is a byte
