"""The scan of a batch file in a real process: its memory does not grow with the file. Two
files ten times apart in size are scanned by a fresh interpreter each, and the growth of
its peak resident memory over the scan is compared, with a generous ratio (a
benchmark judges the target, this test the shape)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.batchjob.batchfiles import chat
from tests.support.repo import ROOT

pytestmark = pytest.mark.integration

SMALL_REQUESTS = 20_000
LARGE_REQUESTS = 200_000
# A typical chat request line (the scan's doc measures at 560 bytes): the small file is
# already a few of the scan's read blocks, so both scans hold the same few blocks at most.
CONTENT_CHARS = 500
# Ten times the requests may cost at most this many times the growth (a scan that held the
# file, or a set of its custom_ids, would grow about tenfold).
GENEROUS_RATIO = 2.5
# A hang guard for one scan (each takes a second or two).
SCAN_TIMEOUT_S = 120

# The peak is the process's own VmHWM, which is what ru_maxrss reports of a process that
# never exec'd. NOTE: ru_maxrss itself was rejected: the kernel carries the parent's peak
# into an exec'd child (pytest's, over 100 MB), and both scans measured a growth of 0.
MEASURE = r"""
import gc, json, sys
from pipeline.batchjob.scan import scan_input

def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

gc.collect()
before = peak_kib()
found = scan_input(sys.argv[1], sys.argv[2], sys.argv[2] + ".lines")
print(json.dumps({"requests": found.requests, "growth_kib": peak_kib() - before}))
"""


def _write(path: Path, requests: int) -> Path:
    line = chat("ID", max_completion_tokens=16)
    line["body"]["messages"][0]["content"] = "CONTENT"
    head, middle, tail = (json.dumps(line) + "\n").replace("ID", "\0").replace("CONTENT", "\0").split("\0")
    with open(path, "w") as f:
        for k in range(requests):
            f.write(f"{head}request-{k:09d}{middle}{k} {'x' * CONTENT_CHARS}{tail}")
    return path


def _scan_growth_kib(path: Path, work: Path) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(work)], capture_output=True, text=True,
                          cwd=ROOT, timeout=SCAN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    return found["requests"], found["growth_kib"]


def test_a_scans_memory_does_not_grow_with_the_file(tmp_path: Path) -> None:
    small = _write(tmp_path / "small.jsonl", SMALL_REQUESTS)
    requests, small_kib = _scan_growth_kib(small, tmp_path / "work-small")
    assert requests == SMALL_REQUESTS
    small.unlink()
    large = _write(tmp_path / "large.jsonl", LARGE_REQUESTS)
    requests, large_kib = _scan_growth_kib(large, tmp_path / "work-large")
    assert requests == LARGE_REQUESTS
    file_kib = large.stat().st_size >> 10
    assert small_kib > 0, (small_kib, large_kib)
    assert large_kib <= GENEROUS_RATIO * small_kib, (small_kib, large_kib)
    assert large_kib < file_kib / 2, (large_kib, file_kib)  # far less than the file, which is ~120 MB
