"""`pipeline tools analyze FILE --model DIR` in a real process: its memory does not grow
with the file. Two files ten times apart, of the same three shapes, are analyzed by a fresh
interpreter each (the tiny model's tokenizer, as run-batch's producers use it), and the
growth of its peak resident memory over the analysis is compared with a generous ratio (a
benchmark judges the target, this test the shape)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.jobs import SERVED, build_model, chat
from tests.support.repo import ROOT

pytestmark = pytest.mark.integration

SMALL_REQUESTS = 2_000
LARGE_REQUESTS = 20_000
# Each request's system prompt (one of three): long enough that the small file is already
# past the scan's first read blocks, so both analyses hold the same blocks at most. The user
# turns draw on a few hundred words: the tokenizer's own word cache (10,000 words, in Rust)
# then fills in both runs.
SYSTEM_CHARS = 2_400
# Ten times the requests may cost at most this many times the growth (keeping a few hundred
# bytes per request would add several MB to the larger file's).
GENEROUS_RATIO = 2.0
# A hang guard for one analysis (the larger takes about ten seconds here).
ANALYZE_TIMEOUT_S = 240

# The peak is the process's own VmHWM (see tests/batchjob/test_scan_memory.py), taken once
# the model's files are read (a one-off 16 MiB read buffer would otherwise hide the rest).
# The scan reads 256 KiB blocks, not 4 MiB: both files are then many blocks long, as files
# of real jobs are, and the allocator's high-water mark for the blocks is reached in both.
MEASURE = r"""
import gc, json, sys
from pipeline.analysis.batchfile import BatchFileAnalysis
from pipeline.batchjob import scan
from pipeline.batchjob.preview import BatchPreview

scan.READ_BLOCK_BYTES = 256 << 10

def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

preview = BatchPreview(sys.argv[1], sys.argv[2])
preview.maker.model_facts(preview.tokenizer)
analysis = BatchFileAnalysis(16, [4096, 65536])
gc.collect()
before = peak_kib()
counts = preview.run(analysis.add)
figures = analysis.finish()
print(json.dumps({"requests": counts.made, "shapes": figures["shapes"]["count"], "growth_kib": peak_kib() - before}))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / SERVED)


def _write(path: Path, requests: int) -> Path:
    systems = [(f"You are assistant number {k}. " * SYSTEM_CHARS)[:SYSTEM_CHARS] for k in range(3)]
    with open(path, "w") as f:
        for k in range(requests):
            f.write(json.dumps(chat(f"r{k}", f"What is {k % 89} times {k % 83}?", system=systems[k % 3])) + "\n")
    return path


def _growth_kib(path: Path, model_dir: str) -> int:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(path), model_dir], capture_output=True, text=True,
                          cwd=ROOT, timeout=ANALYZE_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["shapes"] == 3
    return found["requests"], found["growth_kib"]


def test_the_analysis_memory_does_not_grow_with_the_file(tmp_path: Path, model_dir: str) -> None:
    small = _write(tmp_path / "small.jsonl", SMALL_REQUESTS)
    requests, small_kib = _growth_kib(small, model_dir)
    assert requests == SMALL_REQUESTS
    small.unlink()
    large = _write(tmp_path / "large.jsonl", LARGE_REQUESTS)
    requests, large_kib = _growth_kib(large, model_dir)
    assert requests == LARGE_REQUESTS
    assert small_kib > 0, (small_kib, large_kib)
    assert large_kib <= GENEROUS_RATIO * small_kib, (small_kib, large_kib)
    assert large_kib < (large.stat().st_size >> 10) / 2, large_kib  # far less than the file (~50 MB)
