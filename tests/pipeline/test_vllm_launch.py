"""`pipeline launch --engine vllm` as the README runs it on a CPU machine (marked `vllm`): two
consumers, each with its own vLLM on the tiny model, on the demo workload, through the real
command in its own process. The launcher fills in the CPU options (enforce_eager, block
size, KV cache size, threads, cache directory) and draws the demo's token ids below the
model's vocabulary (its config.json): every item completes, none is an engine error, and
the shared prefixes hit vLLM's cache. Asserts on counts, never on time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.repo import ROOT
from tests.support.tiny_vllm import MODEL_DIR

ITEMS = 200
# The tiny model's context is 2,048 tokens; vLLM wants room for one output token, and
# longer demo prompts come back as too_long (counted, not an engine error).
MAX_MODEL_LEN = 2048
MAX_INPUT_LEN = MAX_MODEL_LEN - 8
# The run takes ~30 s on 2 cores (two engines starting at once); this only stops a hang.
RUN_TIMEOUT_S = 300


@pytest.mark.vllm
def test_a_vllm_launch_on_the_cpu_completes_every_item_with_cache_hits(tmp_path):
    from tools.tiny_llama import build

    build(MODEL_DIR)
    report_path = tmp_path / "report.json"
    options = f"model={MODEL_DIR},load_format=dummy,max_model_len={MAX_MODEL_LEN},max_tokens=2,seed=0"
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "launch", "--engine", "vllm", "--engine-options", options,
         "--items", str(ITEMS), "--consumers", "2", "--max-input-len", str(MAX_INPUT_LEN),
         "--report", str(report_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=RUN_TIMEOUT_S,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))  # the CPU path, even where a GPU is
    assert done.returncode == 0, done.stderr[-4000:]
    launch_line = next(line for line in done.stderr.splitlines() if line.startswith("launch: "))
    assert "no GPU found: filled in enforce_eager=True, block_size=32" in launch_line, launch_line
    assert "token ids below 4,096" in launch_line, launch_line
    report = json.loads(report_path.read_text())
    print(f"\n{launch_line}\n" + json.dumps({k: report[k] for k in (
        "items_completed", "items_with_results", "items_error", "items_empty", "cache_hit_tokens", "lost")}))
    assert report["items_completed"] == report["items_with_results"] == ITEMS
    assert report["items_error"] == 0 and report["lost"] == 0 and report["accounting_ok"]
    assert report["cache_hit_tokens"] > 0
