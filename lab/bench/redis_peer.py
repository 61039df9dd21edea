"""`pipeline bench redis`: the broker against a durable queue users would pick instead,
Redis Streams (redis_streams.py), on the same machine in the same run.

Two parts, every side alternating with the others:
- throughput: the same 256-token flood items (pipelines.py) from 2 producer processes to 2
  consumer processes, batches of up to 256 items (the 256-item contract; XREADGROUP COUNT
  256). The broker on the disk tier at durability `process` and at `power`, Redis with AOF
  `everysec`, its consumers running no engine (the queue alone) and doing the broker's
  consumers' work (redis_streams.ConsumerWork: the end-to-end pairing, where only the queue
  differs; the target is judged on it, and the queue-alone ratio is shown beside it).
  `process` is the fair pairing: neither fsyncs before it acknowledges, both keep
  what was acknowledged through a crash of the process, and a power cut can lose the last
  moments (Redis about a second; `process` what the kernel had not written back). `power`
  (fdatasync before an item counts as stored) is paired with Redis at AOF `always` (the AOF
  fsynced before a round's replies go out), with the same consumer work.
- batches: a workload of several shapes and varied lengths (the embedded demo workload: 16
  shapes, Zipf popularity, log-normal user parts) through the broker (disk, `process`,
  64-item contract) and through Redis (COUNT 64): the padding efficiency (real tokens /
  (batch items x longest item)) and the prefix reuse of the batches each formed. Reuse is the
  sim's PrefixCache replay (pipeline/analysis/reuse.py) of each consumer's batches in the
  order it ran them, one cache per consumer, at the sim's default size and at a small one;
  the broker's sim consumers also report their own cached tokens, which must equal the
  replay at the default size.

Without redis-server or redis-py (with hiredis), the broker's sides still run and the target
is not judged, with the reason.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.analysis.reuse import CacheReplay, PromptBlocks
from pipeline.analysis.workload import HASH_BATCH_PROMPTS, prompt_blocks
from lab.bench.harness import BenchContext, Outcome, Target, alternate, fmt_spread, spread, table
from lab.bench.pipelines import (
    CONTRACT_TOKENS,
    FLOOD_TOKENS,
    Pipeline,
    PipelineSpec,
    feed_share,
    flood_targets,
    padding_efficiency,
    scaled,
)
from pipeline.consumer.engines.sim import DEFAULT_BLOCK_SIZE_TOKENS, DEFAULT_CAPACITY_TOKENS, SimEngine
from pipeline.producer.demos import demo_workload
from pipeline.producer.workload import Workload

PRODUCERS = 2
CONSUMERS = 2
FLOOD_BATCH_ITEMS = 256
MIXED_BATCH_ITEMS = 64
# Items per throughput run: about 1 M for the broker (4 to 8 s here); half that for Redis,
# which takes ~5 times as long per item (the issue measured ~46,000 items/s here).
BROKER_ITEMS, QUICK_BROKER_ITEMS = 1_000_000, 20_000
REDIS_ITEMS, QUICK_REDIS_ITEMS = 500_000, 10_000
# Items of the mixed workload: 30,000 (~19 M tokens); the replays of its batches, not the
# runs, take most of this comparison's time (~10 s a side at the small cache).
MIXED_ITEMS, QUICK_MIXED_ITEMS = 30_000, 2000
# The target: the broker's durable end-to-end items/s at least this many times Redis's.
TARGET_RATIO = 3.0
# Cache sizes of the replay, tokens per consumer: the sim's default (1 Mi, about one 80 GB
# GPU's KV for a 7B model) and 16 Ki, where only a few of the workload's shapes fit.
CACHE_TOKENS = (DEFAULT_CAPACITY_TOKENS, 16_384)
BLOCK_TOKENS = DEFAULT_BLOCK_SIZE_TOKENS
# (storage, durability, sync_interval_s): `process` with the kernel's writeback (a power cut
# loses up to ~35 s, RELIABILITY.md) and with a syncfs every second (about a second, as
# AOF everysec), and `power`.
SYNC_EVERY_S = 1.0
BROKER_SIDES = (("disk", "process", None), ("disk", "process", SYNC_EVERY_S), ("disk", "power", None))
REDIS_LABEL = "Redis Streams, AOF everysec"
# The two Redis consumers of the throughput part: the queue alone (no engine: an upper
# bound), and the broker's consumer's work on each batch (redis_streams.ConsumerWork): the
# end-to-end pairing, where the two sides differ only in the queue.
REDIS_QUEUE_LABEL = f"{REDIS_LABEL}, consumers run no engine"
REDIS_WORK_LABEL = f"{REDIS_LABEL}, consumers do the broker's consumers' work"
# And the peer of durability `power`: AOF `always`, the same consumer work.
REDIS_ALWAYS_LABEL = "Redis Streams, AOF always, consumers do the broker's consumers' work"


def workload_prompts(workload: Workload) -> tuple[np.ndarray, list[PromptBlocks]]:
    """Each item's length and its prompt as the sim's cache sees it (block keys)."""
    hasher = SimEngine(block_size_tokens=BLOCK_TOKENS, capacity_tokens=BLOCK_TOKENS)
    prompts: list[PromptBlocks] = []
    items = workload.items()
    while batch := list(itertools.islice(items, HASH_BATCH_PROMPTS)):
        prompts.extend(prompt_blocks([item.tokens for item in batch], BLOCK_TOKENS, hasher))
    return np.array([p.length for p in prompts], dtype=np.int64), prompts


def batch_figures(batches: Sequence[Sequence[Sequence[int]]], lengths: np.ndarray, prompts: Sequence[PromptBlocks],
                  cache_tokens: Sequence[int], budget_tokens: int) -> dict[str, Any]:
    """What each consumer's batches (workload indices, in the order it ran them) get: batch
    count and mean items, padding efficiency, the share of batches whose padded tokens
    exceed `budget_tokens`, and prefix reuse through one cache per consumer of each size."""
    every = [batch for consumer in batches for batch in consumer if len(batch)]
    padded = [len(batch) * int(lengths[list(batch)].max()) for batch in every]
    out: dict[str, Any] = {
        "batches": len(every), "mean_items": float(np.mean([len(b) for b in every])),
        "padding_efficiency": padding_efficiency([lengths[list(b)].tolist() for b in every]),
        "over_budget_share": float(np.mean([p > budget_tokens for p in padded])), "reuse": {}}
    for size in cache_tokens:
        replay = CacheReplay(BLOCK_TOKENS, [size // BLOCK_TOKENS] * len(batches))
        for cache, consumer in enumerate(batches):
            replay.feed(cache, [prompts[i] for batch in consumer for i in batch])
        replay.check_invariants()
        out["reuse"][str(size)] = replay.reuse
    return out


def broker_batches(results: dict[str, list[dict]]) -> tuple[list[list[list[int]]], int, int]:
    """Each consumer's batches from its results lines (consecutive lines of one batch_id),
    as workload indices read off the demo payload ("demo-K"), and the cached and prompt
    tokens its sim engine reported."""
    out, cached, prompt = [], 0, 0
    for rows in results.values():
        batches = []
        for _, group in itertools.groupby(rows, key=lambda row: row["batch_id"]):
            batches.append([_demo_index(row["payload"]) for row in group])
        out.append(batches)
        cached += sum(row["cached_tokens"] for row in rows)
        prompt += sum(row["prompt_tokens"] for row in rows)
    return out, cached, prompt


def _demo_index(payload: str) -> int:
    text = base64.b64decode(payload).decode()
    assert text.startswith("demo-"), text  # our own workload's payload
    return int(text[5:])


class _Sides:
    """The runs of every side (one object per comparison run, used by one thread)."""

    def __init__(self, ctx: BenchContext, missing: str | None) -> None:
        self.ctx, self.missing = ctx, missing
        self.count = 0
        self.workload = demo_workload(ctx.size(MIXED_ITEMS, QUICK_MIXED_ITEMS), seed=0)
        self.lengths, self.prompts = workload_prompts(self.workload)

    def _root(self) -> Path:
        self.count += 1
        return self.ctx.work_dir / f"run{self.count}"

    def broker_flood(self, storage: str, durability: str, sync_interval_s: float | None = None) -> dict:
        items = self.ctx.size(BROKER_ITEMS, QUICK_BROKER_ITEMS)
        spec = PipelineSpec(storage, durability, CONSUMERS, FLOOD_BATCH_ITEMS, sync_interval_s=sync_interval_s)
        with Pipeline(self._root(), spec) as pipe:
            return pipe.run_producers(flood_targets(pipe.socket_path, PRODUCERS, items), items).figures()

    def redis_flood(self, work: bool, appendfsync: str = "everysec") -> dict:
        from lab.bench.redis_streams import flood_producer, run_redis

        items = self.ctx.size(REDIS_ITEMS, QUICK_REDIS_ITEMS)
        share, extra = divmod(items, PRODUCERS)
        targets = lambda port: [(flood_producer, (port, share + (k < extra), k)) for k in range(PRODUCERS)]  # noqa: E731
        phase, _ = run_redis(self._root(), targets, items, CONSUMERS, FLOOD_BATCH_ITEMS, False,
                             _redis_label(work, appendfsync), work=work, appendfsync=appendfsync)
        return phase.figures()

    def broker_mixed(self) -> dict:
        n = len(self.workload)
        with Pipeline(self._root(), PipelineSpec("disk", "process", CONSUMERS, MIXED_BATCH_ITEMS)) as pipe:
            phase = pipe.run_producers([(feed_share, (pipe.socket_path, self.workload, k, PRODUCERS))
                                        for k in range(PRODUCERS)], n)
            batches, cached, prompt = broker_batches(pipe.results())
        out = {**phase.figures(), **self._batches(batches)}
        out["sim_reported_reuse"] = cached / prompt
        return out

    def redis_mixed(self) -> dict:
        from lab.bench.redis_streams import run_redis, workload_producer

        targets = lambda port: [(workload_producer, (port, self.workload, k, PRODUCERS))  # noqa: E731
                                for k in range(PRODUCERS)]
        phase, batches = run_redis(self._root(), targets, len(self.workload), CONSUMERS, MIXED_BATCH_ITEMS, True,
                                   f"{REDIS_LABEL}, demo workload")
        assert batches is not None
        return {**phase.figures(), **self._batches(batches)}

    def _batches(self, batches: list[list[list[int]]]) -> dict:
        seen = sorted(i for consumer in batches for batch in consumer for i in batch)
        if seen != list(range(len(self.workload))):
            raise RuntimeError(f"the batches hold {len(seen):,} items, not each of the workload's "
                               f"{len(self.workload):,} once")
        return batch_figures(batches, self.lengths, self.prompts, CACHE_TOKENS, CONTRACT_TOKENS)

    def all(self) -> list[tuple[str, Any]]:
        sides: list[tuple[str, Any]] = [(broker_label(s, d, sync), lambda s=s, d=d, sync=sync: self.broker_flood(
            s, d, sync)) for s, d, sync in BROKER_SIDES]
        sides.append(("broker, demo workload", self.broker_mixed))
        if self.missing is None:
            sides += [(REDIS_QUEUE_LABEL, lambda: self.redis_flood(False)),
                      (REDIS_WORK_LABEL, lambda: self.redis_flood(True)),
                      (REDIS_ALWAYS_LABEL, lambda: self.redis_flood(True, "always")),
                      (f"{REDIS_LABEL}, demo workload", self.redis_mixed)]
        return sides


def run(ctx: BenchContext) -> Outcome:
    from lab.bench.redis_streams import redis_missing

    missing = redis_missing()
    if missing is not None:
        ctx.log(f"  the Redis side cannot run: {missing}")
    sides = _Sides(ctx, missing)
    runs = alternate(sides.all(), ctx.repeat)
    figures: dict[str, Any] = {"producers": PRODUCERS, "consumers": CONSUMERS, "item_tokens": FLOOD_TOKENS,
                               "broker_items": ctx.size(BROKER_ITEMS, QUICK_BROKER_ITEMS),
                               "redis_items": ctx.size(REDIS_ITEMS, QUICK_REDIS_ITEMS),
                               "workload": sides.workload.source, "cache_tokens": list(CACHE_TOKENS),
                               "redis_missing": missing, "sides": {}}
    for label, done in runs.items():
        side = {key: spread([r[key] for r in done]) for key in ("items_per_s", "tokens_per_s")}
        side["cores"] = {role: spread([r["cores"][role] for r in done]) for role in done[0]["cores"]}
        if "padding_efficiency" in done[0]:
            for key in ("padding_efficiency", "over_budget_share", "mean_items", "batches"):
                side[key] = spread([r[key] for r in done])
            side["reuse"] = {size: spread([r["reuse"][size] for r in done]) for size in done[0]["reuse"]}
        if "sim_reported_reuse" in done[0]:
            side["sim_reported_reuse"] = spread([r["sim_reported_reuse"] for r in done])
        side["runs"] = done
        figures["sides"][label] = side
    return Outcome(figures, _markdown(figures), _targets(figures, ctx.quick), lambda path: _plot(figures, path))


def broker_label(storage: str, durability: str, sync_interval_s: float | None = None) -> str:
    sync = "" if sync_interval_s is None else f", syncfs every {sync_interval_s:g} s"
    return f"broker {storage}/{durability}{sync}"


def _redis_label(work: bool, appendfsync: str) -> str:
    if appendfsync == "always":
        assert work, "the AOF always side runs the consumer work"
        return REDIS_ALWAYS_LABEL
    return REDIS_WORK_LABEL if work else REDIS_QUEUE_LABEL


def _ratio_target(figures: dict, durability: str, peer_label: str, quick: bool, pairing: str,
                  sync_interval_s: float | None = None) -> Target:
    ours_label = broker_label("disk", durability, sync_interval_s)
    name = f"{ours_label} >= {TARGET_RATIO:g}x {peer_label}, items/s: {pairing}"
    if figures["redis_missing"] is not None:
        return Target(name, None, f"the Redis side did not run: {figures['redis_missing']}")
    ours = figures["sides"][ours_label]["items_per_s"]["median"]
    peer = figures["sides"][peer_label]["items_per_s"]["median"]
    detail = f"{ours:,.0f} against {peer:,.0f} items/s, {ours / peer:.2f}x"
    if quick:
        return Target(name, None, detail + " at --quick size: not judged")
    return Target(name, ours >= TARGET_RATIO * peer, detail)


def _targets(figures: dict, quick: bool) -> list[Target]:
    return [_ratio_target(figures, "process", REDIS_WORK_LABEL, quick,
                          "end to end, the fair pairing (same consumer work, neither fsyncs before it acknowledges)"),
            _ratio_target(figures, "process", REDIS_WORK_LABEL, quick,
                          "end to end, the same loss window on a power cut (about a second)", SYNC_EVERY_S),
            _ratio_target(figures, "power", REDIS_ALWAYS_LABEL, quick,
                          "end to end, both fsync before they acknowledge"),
            _ratio_target(figures, "process", REDIS_QUEUE_LABEL, quick,
                          "against Redis's upper bound (its consumers run no engine, the broker's do)")]


def _markdown(figures: dict) -> str:
    sides = figures["sides"]
    flood = [label for label in sides if "padding_efficiency" not in sides[label]]
    mixed = [label for label in sides if "padding_efficiency" in sides[label]]
    rows = [[label, fmt_spread(sides[label]["items_per_s"]),
             fmt_spread(scaled(sides[label]["tokens_per_s"], 1e-6), ",.1f"), _cores(sides[label]["cores"])] for label in flood]
    small, large = (str(s) for s in sorted(CACHE_TOKENS))
    batch_rows = [[label, fmt_spread(sides[label]["items_per_s"]), fmt_spread(sides[label]["mean_items"], ".1f"),
                   fmt_spread(_pct(sides[label]["padding_efficiency"]), ".1f"),
                   fmt_spread(_pct(sides[label]["over_budget_share"]), ".1f"),
                   fmt_spread(_pct(sides[label]["reuse"][large]), ".1f"),
                   fmt_spread(_pct(sides[label]["reuse"][small]), ".1f")] for label in mixed]
    text = [
        f"Throughput: {figures['producers']} producer processes, {figures['consumers']} consumer processes, items of "
        f"{figures['item_tokens']} tokens over 8 shapes, batches of up to 256 items; {figures['broker_items']:,} items "
        f"a broker run, {figures['redis_items']:,} a Redis run (Redis is the slower side). Redis: redis-server "
        "started by the benchmark on a loopback port, AOF `everysec` (or `always`), no RDB; redis-py with hiredis, producers "
        "pipeline XADD 512 at a time, consumers XREADGROUP (COUNT = batch size) and XACK in one round trip, and "
        "either run no engine (the queue alone: an upper bound for Redis) or do what the broker's consumers do with "
        "a batch (the zero-cost sim engine with its prefix cache, a digest per prompt, the batch's result lines "
        "written to a results file before the ack: the end-to-end pairing, where only the queue differs). The "
        "broker's consumers are zero-cost sim consumers. Durability: "
        "`process` against AOF `everysec` (neither fsyncs before it acknowledges; on a power cut Redis loses "
        "about the last second, the broker what the kernel had not yet written back: up to its writeback delay, "
        "35 s measured with the kernel's defaults, RELIABILITY.md); `process` with `sync_interval_s = 1` (a syncfs "
        "of the data directory's filesystem every second, the store's files and the results: about a second, "
        "as everysec) against the same; `power` (fdatasync before an item counts as stored, and each batch's "
        "results fsynced before it is reported done) against AOF `always` (the AOF fsynced before a round's "
        "replies go out, and each batch's results fsynced before its ack).", "",
        table(["side", "items/s", "M tokens/s", "cores: server or broker / consumers / producers / all"], rows), ""]
    if mixed:
        text += [
            f"Batches on a workload of several shapes and varied lengths ({figures['workload']}; 64-item batches, "
            "65,536-token contract): the broker's batches against Redis's arrival-order batches (the next 64 entries, "
            "whichever shapes). Padding efficiency: real tokens / (batch items x longest item). Prefix reuse: cached "
            "/ input tokens when each consumer's batches, in the order it ran them, replay through its own sim "
            f"PrefixCache ({int(large):,} tokens, the sim's default, and {int(small):,}). Over budget: batches whose "
            "padded tokens exceed the contract's 65,536 (Redis's COUNT cannot bound tokens).", "",
            table(["side", "items/s", "items a batch", "padding efficiency %", "over budget %",
                   f"reuse % at {tokens_label(int(large))}", f"reuse % at {tokens_label(int(small))}"], batch_rows)]
        for label in mixed:
            if "sim_reported_reuse" in sides[label]:
                text += ["", f"Check: the broker's sim consumers reported {fmt_spread(_pct(sides[label]['sim_reported_reuse']), '.2f')}% "
                         f"reuse themselves, the replay of their batches {fmt_spread(_pct(sides[label]['reuse'][large]), '.2f')}%."]
    if figures["redis_missing"] is not None:
        text += ["", f"The Redis side did not run: {figures['redis_missing']}."]
    return "\n".join(text)


def _cores(cores: dict) -> str:
    first = "redis-server" if "redis-server" in cores else "broker"
    return " / ".join(fmt_spread(cores[role], ".2f") for role in (first, "consumer", "producer", "all"))


def tokens_label(tokens: int) -> str:
    """1048576 -> "1 Mi", 16384 -> "16 Ki", 1000 -> "1,000"."""
    for unit, size in (("Mi", 1 << 20), ("Ki", 1 << 10)):
        if tokens % size == 0:
            return f"{tokens // size:,} {unit}"
    return f"{tokens:,}"


def _pct(s: dict) -> dict:
    return scaled(s, 100.0)


def _plot(figures: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sides = figures["sides"]
    figure = Figure(figsize=(12.0, 5.0), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    labels = list(sides)
    medians = [sides[k]["items_per_s"]["median"] / 1e3 for k in labels]
    errors = [[m - sides[k]["items_per_s"]["min"] / 1e3 for m, k in zip(medians, labels)],
              [sides[k]["items_per_s"]["max"] / 1e3 - m for m, k in zip(medians, labels)]]
    left.barh(range(len(labels)), medians, xerr=errors, capsize=3,
              color=["C3" if k.startswith("Redis") else "C0" for k in labels])
    left.set_yticks(list(range(len(labels))), [k.replace(", ", ",\n") for k in labels], fontsize=8)
    left.set_xlabel("thousand items/s (median, min-max)")
    left.set_title("throughput, same machine, same run")
    mixed = [k for k in labels if "padding_efficiency" in sides[k]]
    metrics = [("padding efficiency", lambda s: s["padding_efficiency"]["median"])]
    metrics += [(f"prefix reuse,\n{tokens_label(int(size))}-token cache",
                 lambda s, size=size: s["reuse"][size]["median"]) for size in (str(t) for t in CACHE_TOKENS)]
    width = 0.8 / max(len(mixed), 1)
    for n, label in enumerate(mixed):
        right.bar([m + (n - (len(mixed) - 1) / 2) * width for m in range(len(metrics))],
                  [100 * get(sides[label]) for _, get in metrics], width, label=label)
    right.set_xticks(list(range(len(metrics))), [name for name, _ in metrics])
    right.set_ylabel("% (median of runs)")
    right.set_title("batches on the demo workload: broker vs arrival order")
    right.legend(fontsize=8)
    figure.savefig(path)


class _Redis:
    name = "redis"
    title = "Against a durable queue: Redis Streams (AOF everysec and always) on the same machine"

    def run(self, ctx: BenchContext) -> Outcome:
        return run(ctx)


COMPARISON = _Redis()
