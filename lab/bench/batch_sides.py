"""The two sides of the run-batch comparison, each a fresh process of the command
as a user runs it, on the same batch file and vLLM settings: `vllm run-batch` (its own
`main`, its `run_batch` coroutine timed) and `pipeline run-batch --engine vllm`; and the
check of an output file. Shared by `pipeline bench run-batch` and `run-batch-mix` and by
tools/bench_engine_process.py.

Both sides get the same vLLM engine flags (`vllm_flags`): the tiny model (tools/tiny_llama.py,
random weights: load_format dummy), enforce_eager, block_size BLOCK, max_model_len
MAX_MODEL_LEN, dtype DTYPE, engine seed ENGINE_SEED, max_num_seqs MAX_NUM_SEQS,
max_num_batched_tokens MAX_NUM_BATCHED_TOKENS, kv_cache_memory_bytes KV_CACHE_MIB MiB per
engine, prefix caching on; OMP_NUM_THREADS and the product's cpu_threads = the threads given
(engine_threads()); VLLM_CACHE_ROOT and TMPDIR in the run's scratch directory; vLLM's
defaults for every other setting (the engine core in its own process, chunked prefill, vLLM's
own thread binding). `python` is an interpreter that imports vllm (this process need not).

Functions only; each call starts one child and waits for it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lab.bench.runs import BenchRunError
from pipeline.runtime.settings import CPU_CORES_KEPT

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".cache" / "tiny-llama"
MODEL_NAME = "tiny-llama"
REQUESTS = 2000
SHAPES = 32
# 3 MiB: 3,072 tokens of the tiny model (bf16, 1 KiB a token): about 6 of the 32 prefixes.
KV_CACHE_MIB = 3
MAX_MODEL_LEN = 2048
BLOCK = 32
# What vLLM picks on the CPU for the tiny model's float32 config anyway, stated on both sides.
DTYPE = "bfloat16"
# vLLM's default engine seed, stated on both sides.
ENGINE_SEED = 0
# vLLM's server defaults on the CPU, what `vllm run-batch` takes untold; `vllm.LLM` (the
# product's engine) has 256 and 4,096 there, so both sides are told.
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 2048
# Settings only the product takes (its engine options of its own), not vLLM flags.
PRODUCT_OPTIONS = ("in_process",)
# A run that takes longer than this is stuck (a full run takes under a minute).
RUN_TIMEOUT_S = 900

# `vllm run-batch`'s own main, with its `run_batch` coroutine (everything after the engine is
# up, until the output file is written) timed; nothing else changed.
VLLM_CHILD = """
import asyncio, json, os, sys, time
import vllm.entrypoints.launchers.run_batch as rb

span = {}
inner = rb.run_batch

async def timed(engine_client, args):
    span["start_ns"] = time.monotonic_ns()
    await inner(engine_client, args)
    span["end_ns"] = time.monotonic_ns()

if __name__ == "__main__":
    rb.run_batch = timed
    asyncio.run(rb.main(rb.parse_args()))
    with open(os.environ["BENCH_SPAN"], "w") as f:
        json.dump(span, f)
"""


def _env(scratch: Path, threads: int) -> dict[str, str]:
    cache, tmp = scratch / "vllm-cache", scratch / "tmp"
    cache.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "VLLM_CACHE_ROOT": str(cache), "TMPDIR": str(tmp), "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": str(ROOT)}


def _timed(cmd: list[str], env: dict[str, str], log: Path) -> float:
    """Run `cmd`, its output to `log`; its wall time.
    NOTE: removing every `sbrk-` object that appears in /dev/shm during the run was rejected:
    it deleted a concurrent benchmark's live doorbell; `pipeline run-batch` removes its
    own objects, and one it left would be a bug for `pipeline tools cleanup` to show."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=RUN_TIMEOUT_S)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise BenchRunError(f"run-batch bench: {' '.join(cmd[:6])} ... exited {proc.returncode}; log {log}:\n{tail}")
    return wall


def engine_threads() -> int:
    """The engine's OMP threads on both sides: the cores less the one kept for the processes
    around the engine. `vllm run-batch` on the CPU build binds its worker to the cores less one
    it reserves for its scheduler process whatever OMP_NUM_THREADS says (VLLM_CPU_OMP_THREADS_BIND
    auto); the product's launch keeps CPU_CORES_KEPT by default.
    NOTE: every core for the product (cpu_threads 2 on 2 cores, against vLLM's 1) made its
    scheduler steps 25x slower on a loaded machine (150 ms against 6 ms), two OMP threads
    spinning at barriers against vLLM's busy engine core; the comparison was then of threads."""
    return max(1, len(os.sched_getaffinity(0)) - CPU_CORES_KEPT)


def engine_settings(kv_cache_mib: int) -> dict[str, Any]:
    return dict(load_format="dummy", enforce_eager=True, block_size=BLOCK, kv_cache_memory_bytes=kv_cache_mib << 20,
                max_model_len=MAX_MODEL_LEN, dtype=DTYPE, seed=ENGINE_SEED, max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)


def vllm_flags(settings: dict[str, Any]) -> list[str]:
    """The settings as vLLM's engine flags, the same list on both sides' command lines (the
    product reads them with vLLM's own parser); a true setting is its flag alone."""
    out = []
    for name, value in settings.items():
        if name in PRODUCT_OPTIONS:
            continue
        assert value is not False, f"setting {name}: false is vLLM's default, leave it out"
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def run_vllm(batch: Path, out_dir: Path, settings: dict, threads: int, python: str = sys.executable) -> dict:
    """`vllm run-batch` on `batch` (VLLM_CHILD) with `python`: wall and span seconds, the output."""
    out_dir.mkdir(parents=True, exist_ok=True)
    output, span_file = out_dir / "out.jsonl", out_dir / "span.json"
    env = _env(out_dir / "scratch", threads) | {"BENCH_SPAN": str(span_file)}
    cmd = [python, "-c", VLLM_CHILD, "-i", str(batch), "-o", str(output), "--model", str(MODEL_DIR),
           "--served-model-name", MODEL_NAME, *vllm_flags(settings), "--enable-prefix-caching",
           "--enable-prompt-tokens-details"]
    wall = _timed(cmd, env, out_dir / "log.txt")
    span = json.loads(span_file.read_text())
    return dict(wall_s=wall, span_s=(span["end_ns"] - span["start_ns"]) / 1e9, output=str(output))


def run_product(batch: Path, out_dir: Path, settings: dict, consumers: int, threads: int,
                python: str = sys.executable) -> dict:
    """`pipeline run-batch --engine vllm` on `batch` with `python`: wall and span seconds, the
    output, vLLM's own prefix-cache counters from the run report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    output, report, data = out_dir / "out.jsonl", out_dir / "report.json", out_dir / "data"
    options = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()
               if k in PRODUCT_OPTIONS]
    options += [f"cpu_threads={threads}", f"cache_dir={out_dir / 'scratch'}"]
    cmd = [python, "-m", "pipeline", "run-batch", "-i", str(batch), "-o", str(output), "--model",
           str(MODEL_DIR), "--served-model-name", MODEL_NAME, "--engine", "vllm", *vllm_flags(settings),
           "--engine-options", ",".join(options), "--consumers", str(consumers), "--data-dir", str(data),
           "--report", str(report)]
    wall = _timed(cmd, _env(out_dir / "scratch", threads), out_dir / "log.txt")
    rows = [json.loads(line) for path in glob.glob(str(data / "results" / "*" / "*.jsonl"))
            for line in Path(path).read_text().splitlines() if line.strip()]
    span = (max(r["done_ns"] for r in rows) - min(r["dispatch_ns"] for r in rows)) / 1e9
    rep = json.loads(report.read_text())
    per = rep["per_consumer"]
    shutil.rmtree(data, ignore_errors=True)
    return dict(wall_s=wall, span_s=span, output=str(output), report_wall_s=rep.get("wall_s"),
                vllm_prefix_cache_hits=sum(c["engine_prefix_cache_hits"] for c in per.values()),
                vllm_prefix_cache_queries=sum(c["engine_prefix_cache_queries"] for c in per.values()),
                engine_counters_agree=rep.get("engine_counters_agree"), batches=sum(c["batches"] for c in per.values()),
                items_per_consumer={n: c["items"] for n, c in per.items()},
                shape_switches=rep.get("shape_switches"), shape_switches_by_reason=rep.get("shape_switches_by_reason"))


def check_output(path: str, custom_ids: list[str]) -> dict:
    """The output's usage sums; raises unless every custom_id is there once with status 200."""
    seen: dict[str, int] = {}
    prompt = cached = completion = 0
    bad = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        seen[row["custom_id"]] = seen.get(row["custom_id"], 0) + 1
        response = row.get("response") or {}
        if response.get("status_code") != 200 or row.get("error"):
            bad.append(row["custom_id"])
            continue
        usage = response["body"]["usage"]
        prompt += usage["prompt_tokens"]
        completion += usage["completion_tokens"]
        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    wanted = set(custom_ids)
    missing = sorted(wanted - set(seen))
    twice = sorted(k for k, n in seen.items() if n > 1)
    extra = sorted(set(seen) - wanted)
    if bad or missing or twice or extra:
        raise BenchRunError(f"run-batch bench: {path}: {len(bad)} not 200 (e.g. {bad[:3]}), {len(missing)} missing, "
                           f"{len(twice)} twice, {len(extra)} unknown")
    return dict(lines=sum(seen.values()), prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
                cached_fraction=cached / prompt if prompt else None)
