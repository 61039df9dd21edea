"""`pipeline run-batch --engine vllm` on the tiny model (marked `vllm`): real completions,
and every response's cached_tokens are vLLM's own, summing to vLLM's prefix_cache_hits;
vLLM's engine flags as vLLM reads them, what vLLM would refuse refused before anything
starts, and an engine over two workers (tensor parallel 2 on the CPU build)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.jobs import check_output, write_requests
from tests.support.repo import ROOT
from tests.support.tiny_vllm import MODEL_DIR
from tools.make_batch_example import requests as example_requests

# Two engines' first start on 2 cores (each an engine core and a worker process of its own,
# 1 to 3 minutes on this loaded machine), then the job.
RUN_TIMEOUT_S = 600


@pytest.mark.vllm
def test_real_completions_whose_cached_tokens_are_vllms_own(tmp_path):
    from tools.tiny_llama import build

    build(MODEL_DIR)
    records = example_requests(60, MODEL_DIR.name)
    source = write_requests(tmp_path / "requests.jsonl", records)
    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    had = _vllms_shared_memory()
    done = subprocess.run([sys.executable, "-m", "pipeline", "run-batch", "-i", str(source), "-o", str(out),
                           "--model", str(MODEL_DIR), "--engine", "vllm", "--report", str(report),
                           "--load-format", "dummy", "--max-model-len", "2K", "--kv-cache-memory-bytes", "8M",
                           "--max-num-seqs", "16"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _vllms_shared_memory() <= had  # the engine is killed at its end: what it made is unlinked all the same
    assert "leaked" not in done.stderr
    rows = check_output(out, records)
    assert {row["response"]["status_code"] for row in rows} == {200}
    bodies = [row["response"]["body"] for row in rows]
    texts = [b["choices"][0].get("message", {}).get("content", b["choices"][0].get("text")) for b in bodies]
    assert all(isinstance(t, str) for t in texts) and any(texts)
    cached = sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies)
    figures = json.loads(report.read_text())
    options = figures["settings"]["engine"]["options"]  # each flag the engine option of its name, as vLLM read it
    assert (options["load_format"], options["max_model_len"], options["kv_cache_memory_bytes"]) == ("dummy", 2048,
                                                                                                   8 << 20)
    assert options["llm_kwargs"] == {"max_num_seqs": 16}
    per_consumer = figures["per_consumer"].values()
    assert figures["engine_counters_agree"] is True
    assert cached == sum(c["engine_prefix_cache_hits"] for c in per_consumer) > 0
    assert prompt == sum(c["engine_prefix_cache_queries"] for c in per_consumer)


def _vllms_shared_memory() -> set[str]:
    """The names in /dev/shm that vLLM's engine core and workers make: Python's for shared
    memory and (spawn context) semaphores, vLLM's for a tensor-parallel CPU engine's."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(("psm_", "sem.mp-", "vllm"))}


def _run_batch(tmp_path, *flags: str, requests: int = 8) -> tuple[subprocess.CompletedProcess, list[dict]]:
    from tools.tiny_llama import build

    build(MODEL_DIR)
    records = example_requests(requests, MODEL_DIR.name)
    source = write_requests(tmp_path / "requests.jsonl", records)
    done = subprocess.run([sys.executable, "-m", "pipeline", "run-batch", "-i", str(source), "-o",
                           str(tmp_path / "out.jsonl"), "--model", str(MODEL_DIR), "--engine", "vllm",
                           "--data-dir", str(tmp_path / "data"), "--load-format", "dummy", *flags],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    return done, records


@pytest.mark.vllm
@pytest.mark.parametrize("flags, words", [
    (["--dtype", "float33"], "vLLM: argument --dtype: invalid choice: 'float33'"),
    (["--max-model-len", "4096"], "max_model_len (4096) is greater than the derived max_model_len"),
    (["--no-enable-prefix-caching"], "--enable-prefix-caching: prefix caching stays on"),
])
def test_what_vllm_would_refuse_is_refused_in_one_line_before_anything_starts(tmp_path, flags, words):
    done, _records = _run_batch(tmp_path, *flags)
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert done.returncode == 1 and len(errors) == 1 and words in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "data").exists()


@pytest.mark.vllm
def test_tensor_parallel_2_runs_on_the_cpu_build(tmp_path):
    """One engine of two workers (vLLM's multiprocessing executor; each worker's threads
    unbound, as vLLM's CPU binding needs a NUMA node per worker)."""
    had = _vllms_shared_memory()
    done, records = _run_batch(tmp_path, "-tp", "2", "--consumers", "1", "--report", str(tmp_path / "report.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert _vllms_shared_memory() <= had
    rows = check_output(tmp_path / "out.jsonl", records)
    assert {row["response"]["status_code"] for row in rows} == {200}
    figures = json.loads((tmp_path / "report.json").read_text())
    assert figures["settings"]["engine"]["options"]["tensor_parallel_size"] == 2
    assert figures["engine_counters_agree"] is True


@pytest.mark.vllm
def test_a_consumer_killed_leaves_nothing_of_its_engine_behind(tmp_path):
    """kill -9 of a consumer while its engine runs: the run stops saying so, and the engine
    core it started is killed and what only it mapped in /dev/shm (vLLM's message queues,
    hundreds of MiB) removed, though the consumer never got to its own end."""
    import time

    import psutil

    from tools.tiny_llama import build

    build(MODEL_DIR)
    records = example_requests(200, MODEL_DIR.name)
    source = write_requests(tmp_path / "requests.jsonl", records)
    had = _vllms_shared_memory()
    job = subprocess.Popen([sys.executable, "-m", "pipeline", "run-batch", "-i", str(source), "-o",
                            str(tmp_path / "out.jsonl"), "--model", str(MODEL_DIR), "--engine", "vllm",
                            "--data-dir", str(tmp_path / "data"), "--load-format", "dummy", "--consumers", "1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        consumer, made = None, set()
        while not (consumer and made) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            consumer, made = _consumer_with_an_engine(psutil.Process(job.pid)), _vllms_shared_memory() - had
        assert consumer is not None and made, "no consumer's engine core started"  # made: its message queues
        engine = consumer.children(recursive=True)
        consumer.kill()
        _out, err = job.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0 and "exited with status -9" in err, err[-3000:]
    assert psutil.wait_procs(engine, timeout=30)[1] == []
    assert not (_vllms_shared_memory() & made)


def _consumer_with_an_engine(job):
    """The consumer process of `job` whose vLLM engine core has started, if one has."""
    import psutil

    try:
        for process in job.children(recursive=True):
            if any("EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline())
                   for child in process.children()):
                return process
    except psutil.Error:
        return None
    return None
