#!/usr/bin/env python3
"""End-to-end throughput and latency: producers -> broker (disk tier) -> consumers.

    .venv/bin/python tools/bench_pipeline.py            # about two minutes (1 M items a run)
    .venv/bin/python tools/bench_pipeline.py --quick    # a smoke run

Throughput: 2 producer processes submit 256-token items (8 shapes, `submit_many` in calls of
4,096) to a broker process with the disk tier (durability `process`), and 2 consumer
processes run them on the sim engine at zero cost. Two consumer contracts, both with 65,536
tokens and an 8,192-token input limit: 64 items a batch, and 256 (vLLM's default
max_num_seqs; 256 items of 256 tokens fill the token budget exactly). Each is run with the
consumer's credit window (the default) and with a fixed credit of 4 batches (the baseline:
the default before the window), alternating, and the best of `--repeat` runs is reported.
Elapsed time runs from the producers' start to the broker counting every item completed.

CPU per item: each process's CPU time (user + system, psutil) over the items of the run:
where the time goes when all five share two cores.

Against another commit: `--against REV` checks REV out in a temporary git worktree and
alternates runs of this tree's code and REV's, each with its own default credit, through
this script's own benchmark functions (in a child process whose PYTHONPATH picks the tree;
REV must have `pipeline.runtime.local`'s start_broker/start_consumer, as from 2026-11-29 on,
and either this tree's module layout (issue 12 on: pipeline.broker.config's BrokerConfig,
pipeline.wire.client's broker_status returning a BrokerStatus) or the one before it (as at
49f50fc: pipeline.broker.service's BrokerConfig, pipeline.runtime.local's broker_status
returning a dict): the imports below try the new path and fall back to the old one, and
`_counter` reads a status figure by attribute or by key; nothing else differs).

Latency at low load: one producer submits one item at a time, 400 items a second, to the
same pipeline; latency is a result line's `done_ns - submit_ns` (the producer's submit to
the consumer's result written and flushed, one monotonic clock), p50 and p99.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil

from pipeline.consumer.process import ConsumerConfig
from pipeline.producer.client import BrokerProducer
from pipeline.producer.signature import signature
from pipeline.runtime.local import CTX, start_broker, start_consumer
from pipeline.runtime.local import stop_process as stop

try:  # the module layout from issue 12 on
    from pipeline.broker.config import BrokerConfig
    from pipeline.wire.client import broker_status as status
    from pipeline.wire.status import BrokerStatus
except ModuleNotFoundError as missing:  # the one before it (a --against child of e.g. 49f50fc)
    if missing.name not in ("pipeline.broker.config", "pipeline.wire"):
        raise
    from pipeline.broker.service import BrokerConfig
    from pipeline.runtime.local import broker_status as status
    BrokerStatus = dict  # its status was a plain dict of counters


def _counter(counters: BrokerStatus, name: str) -> int:
    """One status figure: an attribute of a BrokerStatus, a key of an older tree's dict."""
    return counters[name] if isinstance(counters, dict) else getattr(counters, name)

TOKENS = 256
SHAPES = 8
CALL_ITEMS = 4096
CONTRACT = dict(max_batch_tokens=65_536, max_input_len=8192)
BATCH_ITEMS = (64, 256)
# The fixed credit the window is compared with: the consumer's default before it.
BASELINE_CREDIT = 4
# `credit` for a consumer that keeps its code's own default (a run of another commit's code).
CODE_DEFAULT = "code default"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flood(socket_path: str, items: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    prefixes = [np.random.default_rng(k).integers(0, 50_000, size=128, dtype=np.int32) for k in range(SHAPES)]
    signatures = np.array([signature([p]) for p in prefixes], dtype=np.uint64)
    shapes = rng.integers(0, SHAPES, size=CALL_ITEMS)
    tokens = np.concatenate([np.concatenate([prefixes[s], rng.integers(0, 50_000, size=TOKENS - 128, dtype=np.int32)])
                             for s in shapes])
    producer = BrokerProducer(socket_path, timeout_s=120)
    sent = 0
    while sent < items:
        n = min(CALL_ITEMS, items - sent)
        producer.submit_many(0, signatures[shapes[:n]], tokens[: n * TOKENS], np.full(n, TOKENS), 128)
        sent += n
    producer.close(timeout_s=300)


def _trickle(socket_path: str, items: int, rate_per_s: float) -> None:
    prefix = np.random.default_rng(0).integers(0, 50_000, size=128, dtype=np.int32)
    sig = signature([prefix])
    rng = np.random.default_rng(1)
    producer = BrokerProducer(socket_path, timeout_s=60)
    start = time.monotonic()
    for k in range(items):
        tokens = np.concatenate([prefix, rng.integers(0, 50_000, size=TOKENS - 128, dtype=np.int32)])
        producer.submit(0, sig, tokens, 128)
        delay = start + (k + 1) / rate_per_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    producer.close(timeout_s=60)


def _pipeline(root: str, consumers: int, batch_items: int = 64, credit: int | None | str = None):
    config = BrokerConfig(os.path.join(root, "data"))
    broker = start_broker(config)
    socket_path = config.socket_path
    results = os.path.join(root, "results")
    chosen = {} if credit == CODE_DEFAULT else {"credit": credit}
    workers = [start_consumer(ConsumerConfig(socket_path, results, f"c{k}", max_batch_items=batch_items,
                                             **chosen, **CONTRACT)) for k in range(consumers)]
    return broker, socket_path, workers, results


def _wait_completed(socket_path: str, total: int, timeout_s: float) -> BrokerStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        counters = status(socket_path)
        if _counter(counters, "items_completed") >= total:
            return counters
        time.sleep(0.02)
    raise TimeoutError(f"only {_counter(status(socket_path), 'items_completed')} of {total} completed")


def _cpu_seconds(processes: dict[str, psutil.Process], into: dict[str, float]) -> None:
    """Record each live process's CPU time (user + system); the last reading before it
    exits stays."""
    for name, process in processes.items():
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        into[name] = times.user + times.system


def throughput(items_per_producer: int, batch_items: int, credit: int | None | str) -> dict:
    root = tempfile.mkdtemp(prefix="bench-pipeline-")
    broker, socket_path, workers, _results = _pipeline(root, 2, batch_items, credit)
    try:
        started = time.monotonic()
        producers = [CTX.Process(target=_flood, args=(socket_path, items_per_producer, p)) for p in range(2)]
        for p in producers:
            p.start()
        watched = {"broker": broker, **{f"consumer {k}": w for k, w in enumerate(workers)},
                   **{f"producer {k}": p for k, p in enumerate(producers)}}
        processes = {name: psutil.Process(p.pid) for name, p in watched.items()}
        total = 2 * items_per_producer
        cpu: dict[str, float] = {}
        while _counter(counters := status(socket_path), "items_completed") < total:
            _cpu_seconds(processes, cpu)
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        _cpu_seconds(processes, cpu)
        for p in producers:
            p.join(60)
    finally:
        for w in workers:
            stop(w)
        stop(broker)
        shutil.rmtree(root, ignore_errors=True)
    return {"items": total, "seconds": elapsed, "items_per_s": total / elapsed,
            "tokens_per_s": total * TOKENS / elapsed, "tokens_completed": _counter(counters, "tokens_completed"),
            "cpu_us_per_item": {name: 1e6 * seconds / total for name, seconds in cpu.items()}}


def latency(items: int, rate_per_s: float, credit: int | None | str = None) -> dict:
    root = tempfile.mkdtemp(prefix="bench-latency-")
    broker, socket_path, workers, results = _pipeline(root, 2, credit=credit)
    try:
        producer = CTX.Process(target=_trickle, args=(socket_path, items, rate_per_s))
        producer.start()
        _wait_completed(socket_path, items, timeout_s=120)
        producer.join(60)
    finally:
        for w in workers:
            stop(w)
        stop(broker)
    waits = []
    for name in os.listdir(results):
        with open(os.path.join(results, name)) as file:
            waits.extend((row["done_ns"] - row["submit_ns"]) / 1e6 for row in map(json.loads, file))
    shutil.rmtree(root, ignore_errors=True)
    waits_ms = np.array(waits)
    return {"items": len(waits), "p50_ms": float(np.percentile(waits_ms, 50)),
            "p99_ms": float(np.percentile(waits_ms, 99)), "max_ms": float(waits_ms.max())}


def _report(label: str, best: dict) -> None:
    shares = ", ".join(f"{name} {us:.1f}" for name, us in best["cpu_us_per_item"].items())
    print(f"  {label}: {best['items_per_s']:,.0f} items/s, {best['tokens_per_s'] / 1e6:,.1f} M tokens/s "
          f"({best['seconds']:.2f} s; tokens completed {best['tokens_completed']:,} of {best['items'] * TOKENS:,}); "
          f"CPU us per item: {shares}, total {sum(best['cpu_us_per_item'].values()):.1f}")


def _child(root: str, *args: str) -> dict:
    """One run in a child process whose `pipeline` comes from `root`; its JSON line."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *args],
                          env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"run {args} of {root} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def against(rev: str, items: int, batch_items_list: list[int], repeat: int) -> None:
    """Alternating runs of this tree's code and `rev`'s (see the module docstring); which
    goes first alternates too, so a warm-up or a drift does not always favour one side."""
    tree = tempfile.mkdtemp(prefix="bench-against-")
    subprocess.run(["git", "worktree", "add", "--detach", tree, rev], cwd=REPO, check=True, capture_output=True)
    sides = [("this tree", REPO), (rev, tree)]
    try:
        for batch_items in batch_items_list:
            runs: dict[str, list[dict]] = {label: [] for label, _root in sides}
            for k in range(repeat):
                for label, root in sides[::-1] if k % 2 else sides:
                    runs[label].append(_child(root, "--one", str(items), str(batch_items)))
            every = "; ".join(f"{label} " + " / ".join(f"{r['items_per_s']:,.0f}" for r in results)
                              for label, results in runs.items())
            print(f"contract {batch_items} items, each code's default credit (every run, items/s: {every})")
            for label, results in runs.items():
                _report(label, max(results, key=lambda r: r["items_per_s"]))
        lows: dict[str, list[dict]] = {label: [] for label, _root in sides}
        for k in range(repeat):
            for label, root in sides[::-1] if k % 2 else sides:
                lows[label].append(_child(root, "--one-latency", str(min(items, 2000))))
        for label, results in lows.items():
            print(f"latency at 400 items/s, {label}: " + "; ".join(
                f"p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms" for r in results))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO, check=False, capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--items", type=int, default=500_000, help="items per producer")
    parser.add_argument("--batch-items", type=int, nargs="+", default=list(BATCH_ITEMS))
    parser.add_argument("--against", metavar="REV", help="compare with another commit's code instead")
    parser.add_argument("--one", type=int, nargs=2, metavar=("ITEMS", "BATCH_ITEMS"), help=argparse.SUPPRESS)
    parser.add_argument("--one-latency", type=int, metavar="ITEMS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    items = 20_000 if args.quick else args.items
    repeat = 1 if args.quick else args.repeat
    if args.one:  # a child of --against: one run of whatever `pipeline` is on the path, as JSON
        print(json.dumps(throughput(args.one[0], args.one[1], CODE_DEFAULT)))
        return 0
    if args.one_latency:
        print(json.dumps(latency(args.one_latency, 400, CODE_DEFAULT)))
        return 0
    if args.against:
        print(f"machine: {os.cpu_count()} cpus; {2 * items:,} items of {TOKENS} tokens per run; this tree "
              f"against {args.against}")
        against(args.against, items, args.batch_items, repeat)
        return 0
    print(f"machine: {os.cpu_count()} cpus; 2 producers, broker (disk, process), 2 consumers (sim, zero cost); "
          f"{2 * items:,} items of {TOKENS} tokens per run; CPU per item is over all items (each consumer "
          f"runs half of them)")
    for batch_items in args.batch_items:
        runs: dict[str, list[dict]] = {"window": [], f"credit {BASELINE_CREDIT}": []}
        for _ in range(repeat):  # alternating, so drift on the machine hits both alike
            runs["window"].append(throughput(items, batch_items, None))
            runs[f"credit {BASELINE_CREDIT}"].append(throughput(items, batch_items, BASELINE_CREDIT))
        every = "; ".join(f"{label} " + " / ".join(f"{r['items_per_s']:,.0f}" for r in results)
                          for label, results in runs.items())
        print(f"contract {batch_items} items / {CONTRACT['max_batch_tokens']:,} tokens (every run, items/s: {every})")
        for label, results in runs.items():
            _report(label, max(results, key=lambda r: r["items_per_s"]))
    low = latency(400 if args.quick else 2000, rate_per_s=400)
    print(f"latency at 400 items/s, one item per submit, {low['items']} items: p50 {low['p50_ms']:.2f} ms, "
          f"p99 {low['p99_ms']:.2f} ms, max {low['max_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
