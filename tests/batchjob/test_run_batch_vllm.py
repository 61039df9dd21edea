"""`pipeline run-batch --engine vllm` on the tiny model (marked `vllm`): real completions,
and every response's cached_tokens are vLLM's own, summing to vLLM's prefix_cache_hits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.batchjob.test_run_batch import ROOT, check_output, write_requests
from tests.consumer.test_vllm_engine import MODEL_DIR
from tools.make_batch_example import requests as example_requests

# Two engines' first start on 2 cores, then the job.
RUN_TIMEOUT_S = 300


@pytest.mark.vllm
def test_real_completions_whose_cached_tokens_are_vllms_own(tmp_path):
    from tools.tiny_llama import build

    build(MODEL_DIR)
    records = example_requests(60, MODEL_DIR.name)
    source = write_requests(tmp_path / "requests.jsonl", records)
    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pipeline", "run-batch", "-i", str(source), "-o", str(out),
                           "--model", str(MODEL_DIR), "--engine", "vllm", "--report", str(report),
                           "--engine-options", "load_format=dummy,max_model_len=2048,kv_cache_memory_bytes=8388608"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = check_output(out, records)
    assert {row["response"]["status_code"] for row in rows} == {200}
    bodies = [row["response"]["body"] for row in rows]
    texts = [b["choices"][0].get("message", {}).get("content", b["choices"][0].get("text")) for b in bodies]
    assert all(isinstance(t, str) for t in texts) and any(texts)
    cached = sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies)
    figures = json.loads(report.read_text())
    per_consumer = figures["per_consumer"].values()
    assert figures["engine_counters_agree"] is True
    assert cached == sum(c["engine_prefix_cache_hits"] for c in per_consumer) > 0
    assert prompt == sum(c["engine_prefix_cache_queries"] for c in per_consumer)
