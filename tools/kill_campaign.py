#!/usr/bin/env python3
"""Kill campaigns through the real commands, judged by `pipeline tools
check`: one table (and JSON with --json).

    .venv/bin/python tools/kill_campaign.py                       # a few of each kind
    .venv/bin/python tools/kill_campaign.py --broker-kills 1000 --point-rounds 12 --only broker

Campaigns (lab/reliability/kills.py and runs.py):
    broker      kill -9 of the broker at random moments while `pipeline produce` submits and
                consumers complete, then each named crash point armed in `--point-rounds`
                more starts (PIPELINE_CRASH_POINT, at `power`: the sync points exist there);
                each death followed by `pipeline broker start`
    consumer    SIGKILL (then `pipeline consumer start` again), SIGSTOP then SIGCONT after
                twice the heartbeat timeout (a late completion), the control socket shut
                down under a live consumer; redelivery latency read off the results files
    producer    kill -9 of `pipeline produce`'s producer process while it writes frames, then
                `pipeline produce` of what it says was never submitted
    launch      kill -9 of `pipeline launch` or of its broker once its workload is stored;
                the next launch on the data directory takes over
    run-batch   kill -9 of `pipeline run-batch`, its broker or a consumer; the same command
                finishes the job (output file: one 200 line per request)

Targets judged: lost = unexpected = corrupt = 0 and duplicates within the bound in every
campaign; redelivery within the heartbeat timeout plus 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.storage.crashpoints import POINTS  # noqa: E402
from lab.reliability import kills, runs  # noqa: E402

CAMPAIGNS = ("broker", "consumer", "producer", "launch", "run-batch")
HEARTBEAT_TIMEOUT_S = 1.0  # the consumer campaign's (kills.consumer_faults)


def run(name: str, args: argparse.Namespace, work: str) -> kills.Outcome:
    os.makedirs(work)
    if name == "broker":
        broker = kills.broker_kills(work, args.broker_kills, args.seed, rounds=max(1, args.broker_kills // 3),
                                    items_per_round=args.items)
        if not args.point_rounds:
            return broker
        points = kills.broker_kills(os.path.join(work, "points"), 0, args.seed + 1, rounds=len(POINTS) * args.point_rounds,
                                    items_per_round=args.items, points=POINTS, point_rounds=args.point_rounds,
                                    durability="power")
        return _merge(broker, points)
    if name == "consumer":
        return kills.consumer_faults(work, args.consumer_faults, args.seed, HEARTBEAT_TIMEOUT_S)
    if name == "producer":
        return kills.producer_kills(work, args.producer_kills, args.seed)
    if name == "launch":
        return runs.launch_kills(work, args.launch_kills, args.seed)
    from tools.make_batch_example import requests
    from tools.tiny_llama import build

    model = str(build(os.path.join(work, "tiny-llama")))
    source = os.path.join(work, "requests.jsonl")
    with open(source, "w") as file:
        file.writelines(json.dumps(r) + "\n" for r in requests(args.requests, "tiny-llama", seed=args.seed))
    return runs.run_batch_kills(work, args.batch_kills, args.seed, source, model)


def _merge(first: kills.Outcome, second: kills.Outcome) -> kills.Outcome:
    """Two data directories' outcomes as one row: both verdicts must pass."""
    merged = kills.Outcome(second.campaign, restart_s=first.restart_s + second.restart_s,
                           process_start_to_serving_s=first.process_start_to_serving_s
                           + second.process_start_to_serving_s,
                           crash_points=second.crash_points, notes=first.notes + second.notes,
                           resubmits=first.resubmits + second.resubmits, wall_s=first.wall_s + second.wall_s)
    for outcome in (first, second):
        for kind, count in outcome.faults.items():
            merged.faults[kind] = merged.faults.get(kind, 0) + count
    numbers = ("attempted", "acknowledged", "completed", "held", "lost", "unexpected", "corrupt", "detected",
               "duplicated", "duplicate_bound")
    merged.verdict = {key: first.verdict.get(key, 0) + second.verdict.get(key, 0) for key in numbers}
    merged.verdict["passed"] = first.passed and second.passed
    return merged


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def table(outcomes: list[kills.Outcome]) -> str:
    rows = ["| campaign | faults by kind | items | lost | unexpected | corrupt | duplicated (bound) | "
            "restart-to-serving ms p50 / p99 (n) | of it, the new broker process ms p50 / p99 | redelivery ms p50 / p99 / max (n) | verdict |",
            "|---|---|---:|---:|---:|---:|---:|---|---|---|---|"]
    for out in outcomes:
        f = out.figures()
        kinds = ", ".join(f"{kind} {count:,}" for kind, count in sorted(out.faults.items()))
        restart, redelivery, own = f["restart_s"], f["redelivery_s"], f["broker_process_start_to_serving_s"]
        rows.append(f"| {out.campaign} | {kinds} | {f['attempted'] or 0:,} | {f['lost']} | {f['unexpected']} | "
                    f"{f['corrupt']} | {f['duplicated']:,} ({f['duplicate_bound']:,}) | "
                    f"{_ms(restart['p50'])} / {_ms(restart['p99'])} ({restart['n']}) | "
                    f"{_ms(own['p50'])} / {_ms(own['p99'])} | "
                    f"{_ms(redelivery['p50'])} / {_ms(redelivery['p99'])} / {_ms(redelivery['max'])} "
                    f"({redelivery['n']}) | {'PASS' if out.passed else 'FAIL'} |")
    return "\n".join(rows)


def redelivery_target_met(outcomes: list[kills.Outcome]) -> bool:
    latencies = [r["latency_s"] for out in outcomes for r in out.redelivery if r["latency_s"] is not None]
    return all(latency <= HEARTBEAT_TIMEOUT_S + 1.0 for latency in latencies)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=CAMPAIGNS, default=list(CAMPAIGNS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--broker-kills", type=int, default=20)
    parser.add_argument("--point-rounds", type=int, default=1, help="Starts armed at each crash point.")
    parser.add_argument("--items", type=int, default=2000, help="Items per workload of the broker campaign.")
    parser.add_argument("--consumer-faults", type=int, default=3, help="Faults of each consumer kind.")
    parser.add_argument("--producer-kills", type=int, default=3)
    parser.add_argument("--launch-kills", type=int, default=3)
    parser.add_argument("--batch-kills", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000, help="Requests of the run-batch job.")
    parser.add_argument("--json", help="Also write every outcome (each fault's figures) to this file.")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="sbrk-kills-")
    outcomes = []
    finished = False
    try:
        for name in args.only:
            outcomes.append(run(name, args, os.path.join(work, name)))
            print(json.dumps(outcomes[-1].figures()), file=sys.stderr, flush=True)
        finished = True
    finally:
        # A failed campaign's data directories are the evidence to reproduce it from: kept.
        if finished and all(out.passed for out in outcomes):
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept the data directories of a failed or stopped campaign: {work}", file=sys.stderr, flush=True)
    print(table(outcomes))
    met = redelivery_target_met(outcomes)
    print(f"\nredelivery within the heartbeat timeout ({HEARTBEAT_TIMEOUT_S:g} s) plus 1 s: {'met' if met else 'NOT met'}")
    for out in outcomes:
        for note in out.notes:
            print(f"note ({out.campaign}): {note}")
        for point, counts in out.crash_points.items():
            print(f"crash point {point}: {counts}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump([out.to_json() for out in outcomes], file, indent=1)
    return 0 if all(out.passed for out in outcomes) and met else 1


if __name__ == "__main__":
    sys.exit(main())
