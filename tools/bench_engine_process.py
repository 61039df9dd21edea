#!/usr/bin/env python3
"""vLLM's engine core in the consumer's process against in a process of its own (vLLM's
default), on a decode-heavy job, in the same invocation.

    PYTHONPATH=. .venv-vllm/bin/python tools/bench_engine_process.py                # 128 requests, 2 rounds
    PYTHONPATH=. .venv-vllm/bin/python tools/bench_engine_process.py --requests 32 --rounds 1

The job: the run-batch comparison's chat batch file (lab/bench/chat_batch.py: 8 shapes
here) with every request's max_completion_tokens raised to --new-tokens (96: decode-heavy,
~8 new tokens for each prompt token of a request's own turn), through `pipeline run-batch
--engine vllm --consumers 1` with the same engine settings as the run-batch comparison
(lab/bench/batch_sides.py: the tiny model, random weights, enforce_eager, block 32)
and cpu_threads 1, once with `--engine-options in_process=true` (the engine core stepped in
the consumer's process) and once with in_process=false (vLLM's own process), alternating
which runs first in each round.

Per row:
- span: the results' first dispatch to last done (the engine's processing of the job);
- in step: the consumer's time inside vLLM's step (the run report's busy_s: in process, the
  scheduling and the model's execution; own process, the wait for the next outputs);
- own per request: (span - in step) / requests, the consumer's own time outside vLLM's step
  (reading segments, writing results, talking to the broker);
- wall: the command's whole wall time (vLLM's start included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lab.bench.batch_sides import KV_CACHE_MIB, MODEL_DIR, MODEL_NAME, check_output, engine_settings, run_product  # noqa: E402
from lab.bench.chat_batch import requests as batch_requests  # noqa: E402

MODES = {"in process": True, "own process": False}


def row(batch: Path, out_dir: Path, settings: dict, in_process: bool, ids: list[str]) -> dict:
    result = run_product(batch, out_dir, {**settings, "in_process": in_process}, consumers=1, threads=1)
    result.update(check_output(result["output"], ids))
    report = json.loads((out_dir / "report.json").read_text())
    busy = sum(c["busy_s"] for c in report["per_consumer"].values())
    result.update(in_step_s=busy, own_ms_per_request=1000 * (result["span_s"] - busy) / len(ids))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--shapes", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", metavar="PATH", help="write the raw figures here")
    args = parser.parse_args()
    from tools.tiny_llama import build

    build(MODEL_DIR)
    work = Path(tempfile.mkdtemp(prefix="bench-engine-process-"))
    reqs = batch_requests(args.requests, args.shapes, MODEL_NAME, seed=0)
    for request in reqs:
        request["body"]["max_completion_tokens"] = args.new_tokens
    batch = work / "batch.jsonl"
    batch.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    ids = [r["custom_id"] for r in reqs]
    settings = engine_settings(KV_CACHE_MIB)
    rounds = []
    try:
        for k in range(args.rounds):
            order = list(MODES) if k % 2 == 0 else list(reversed(MODES))
            rows = {}
            for name in order:
                print(f"round {k + 1}: {name} ...", file=sys.stderr, flush=True)
                rows[name] = row(batch, work / f"r{k}-{name.replace(' ', '-')}", settings, MODES[name], ids)
            rounds.append(dict(order=order, load_avg=os.getloadavg(), rows=rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| round | engine core | span s | in step s | own ms / request | completion tokens | wall s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for k, rnd in enumerate(rounds):
        for name in rnd["order"]:
            r = rnd["rows"][name]
            print(f"| {k + 1} | {name} | {r['span_s']:.2f} | {r['in_step_s']:.2f} | {r['own_ms_per_request']:.2f} "
                  f"| {r['completion_tokens']:,} | {r['wall_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(settings=vars(args), rounds=rounds), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
