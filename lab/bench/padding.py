"""`pipeline bench padding`: padding efficiency and batch fill, offline and through the real
processes, on the same workloads.

Offline (lab/bench/offline.py, the lane benchmark's policies, deterministic so run
once): OFFLINE_ITEMS prompt lengths drawn (seeded, with replacement) from each workload's,
shapes ignored, streamed through a queue held at OFFLINE_DEPTH items and
packed by FIFO, power-of-two buckets, fixed 64-token ranges (each batch padded to its own
longest item), the product's lanes (2,048 lanes, queued-min measure, the real packer) and the
offline optimum (the whole stream sorted, the same packer).

Real: `pipeline launch` on the same workload (2 producers, 2 zero-cost sim consumers, the
disk tier), once per dispatch policy (lab/bench/runs.py: the default, sticky +
most-tokens, fifo, round-robin, no-lanes), alternating and repeated; padding efficiency and
mean batch fill from its --json report. Batches there are shape-pure, so a workload of many
shapes packs worse than the shape-blind offline figures: the offline rows bound what lanes
can do, the real rows say what each dispatch policy does with them.

Workloads: the embedded demo (16 shapes), and in full size also the lane benchmark's
log-normal lengths (median 512, sigma 1, one shape: a file written to the scratch
directory) and the Mooncake trace (input lengths; its own contract of 262,144 tokens).
--quick runs the demo alone, small, to stay within the quick test's time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lab.bench import offline, runs
from lab.bench.charts import Panel, cell, grouped_bars
from lab.bench.harness import BenchContext, Outcome, Target, alternate, fmt_spread, spread, spread_of, table
from pipeline.broker.lanes import WasteMeasure
from pipeline.broker.packing import Contract

# Queued items the offline policies are held at: about what a run's backlog is while the
# producers are ahead of the consumers.
OFFLINE_DEPTH = 1000
QUICK_OFFLINE_DEPTH = 200
# Items per workload through the real processes (the demo, the log-normal file); the trace
# has 3,993.
ITEMS = 10_000
QUICK_ITEMS = 300
# Lengths streamed through each offline policy: enough batches at OFFLINE_DEPTH that the
# optimum is judged on a stream, not on a few dozen batches (as tools/bench_lanes.py).
OFFLINE_ITEMS = 100_000
QUICK_OFFLINE_ITEMS = 20_000
OFFLINE_SEED = 20240601
# The lane benchmark's log-normal lengths, clipped to the launch's default longest prompt.
LOGNORMAL_MEDIAN_TOKENS = 512
LOGNORMAL_SIGMA = 1.0
LAUNCH_MAX_INPUT_LEN = 8192
LOGNORMAL_SEED = 20240601
# The Mooncake trace's longest prompt is 125 Ki tokens: its runs get a contract that takes it.
TRACE_MAX_TOKENS = 262_144
# The product's lanes must stay within this much padding efficiency of the offline optimum
# (the lane policy's acceptance target, tools/bench_lanes.py), and the real runs under the
# default policy at or above REAL_EFFICIENCY (the demo's target).
GAP_TO_OPTIMUM = 0.01
REAL_EFFICIENCY = 0.985
OFFLINE_POLICIES: dict[str, Callable[[], offline.BucketPolicy | offline.LanePolicy]] = {
    "FIFO": offline.POLICIES["FIFO, no buckets (own longest)"],
    "power-of-two buckets": offline.POLICIES["power-of-two buckets (own longest)"],
    "64-token ranges": offline.POLICIES["fixed 64-token ranges (own longest)"],
    "lanes (product)": lambda: offline.LanePolicy(2048, WasteMeasure.QUEUED_MIN),
}
LANES = "lanes (product)"
OPTIMUM = "offline optimum"


@dataclass(slots=True)
class PaddingWorkload:
    """One workload: its label, the `pipeline launch` options that run it, and its contract."""

    label: str
    launch: list[str]
    source: str
    items: int | None
    contract: Contract = offline.CONTRACT
    extra: list[str] = field(default_factory=list)


def lognormal_file(path: Path, items: int) -> Path:
    """The log-normal workload as an own-format file: one shape (no components), suffix
    token ids made up, payload "ln-K"."""
    rng = np.random.default_rng(LOGNORMAL_SEED)
    lengths = np.clip(np.rint(rng.lognormal(np.log(LOGNORMAL_MEDIAN_TOKENS), LOGNORMAL_SIGMA, items)),
                      1, LAUNCH_MAX_INPUT_LEN).astype(np.int64)
    with path.open("w") as out:
        for k, n in enumerate(lengths.tolist()):
            out.write(json.dumps({"suffix": rng.integers(0, 32_000, n).tolist(), "payload": f"ln-{k}"}) + "\n")
    return path


def workloads(ctx: BenchContext) -> list[PaddingWorkload]:
    items = ctx.size(ITEMS, QUICK_ITEMS)
    found = [PaddingWorkload("demo (16 shapes)", ["--workload", "demo", "--items", str(items)], "demo", items)]
    if ctx.quick:
        return found
    path = lognormal_file(ctx.work_dir / "lognormal.jsonl", items)
    found.append(PaddingWorkload("log-normal 512 (one shape)", ["--workload", str(path)], str(path), None))
    trace = runs.mooncake_trace()
    if trace is None:
        ctx.log("  no Mooncake trace beside the repository (../shared/workloads): that workload is left out")
    else:
        found.append(PaddingWorkload(
            "Mooncake trace", ["--workload", str(trace), "--max-input-len", str(TRACE_MAX_TOKENS),
                               "--max-batch-tokens", str(TRACE_MAX_TOKENS)], str(trace), None,
            Contract(0, offline.MAX_BATCH_ITEMS, TRACE_MAX_TOKENS, TRACE_MAX_TOKENS)))
    return found


def offline_rows(lengths: np.ndarray, depth: int, contract: Contract) -> dict[str, dict[str, float]]:
    """Efficiency and fill of every offline policy and the optimum on `lengths`."""
    rows = {}
    for name, make in OFFLINE_POLICIES.items():
        result = offline.simulate(make, lengths, min(depth, lengths.size), contract)
        offline.check_invariants(result)
        rows[name] = {"efficiency": result.efficiency, "fill": result.fill}
    best = offline.offline_optimum(lengths, same_packer=True, contract=contract)
    rows[OPTIMUM] = {"efficiency": best.efficiency, "fill": best.fill}
    return rows


def real_side(w: PaddingWorkload, policy: str, ctx: BenchContext, counter: list[int]) -> Callable[[], dict]:
    def run() -> dict:
        counter[0] += 1
        tag = f"padding-{counter[0]}"
        report = runs.launch([*w.launch, *runs.DISPATCH_POLICIES[policy]], ctx.work_dir / f"{tag}.json",
                             ctx.work_dir / tag)
        return {"efficiency": report["padding_efficiency"], "fill": report["mean_batch_fill"],
                "batches": report["batches_routed"], "shape_switches": report["shape_switches"]}
    return run


def measure(ctx: BenchContext) -> dict[str, Any]:
    """Every workload's offline rows and real runs (the JSON figures)."""
    from pipeline.producer.demos import named_workload

    depth = ctx.size(OFFLINE_DEPTH, QUICK_OFFLINE_DEPTH)
    streamed = ctx.size(OFFLINE_ITEMS, QUICK_OFFLINE_ITEMS)
    counter = [0]
    figures: dict[str, Any] = {"offline_depth": depth, "offline_items": streamed, "workloads": {}}
    for w in workloads(ctx):
        lengths = np.array([item.length for item in named_workload(w.source, w.items)], dtype=np.int64)
        ctx.log(f"  {w.label}: {lengths.size:,} items; offline: {streamed:,} lengths at depth {depth:,}")
        off = offline_rows(np.random.default_rng(OFFLINE_SEED).choice(lengths, streamed), depth, w.contract)
        ctx.log(f"  {w.label}: real processes, {len(runs.DISPATCH_POLICIES)} policies x {ctx.repeat}")
        real = alternate([(p, real_side(w, p, ctx, counter)) for p in runs.DISPATCH_POLICIES], ctx.repeat)
        figures["workloads"][w.label] = {
            "items": int(lengths.size), "tokens": int(lengths.sum()), "launch": w.launch,
            "contract": {"max_batch_items": w.contract.max_batch_items, "max_batch_tokens": w.contract.max_batch_tokens},
            "offline": off,
            "real": {p: {k: spread_of(r, k) for k in ("efficiency", "fill", "batches", "shape_switches")}
                     for p, r in real.items()}}
    return figures


def judge(figures: dict[str, Any]) -> list[Target]:
    targets = []
    for label, w in figures["workloads"].items():
        gap = w["offline"][OPTIMUM]["efficiency"] - w["offline"][LANES]["efficiency"]
        targets.append(Target(f"{label}: the product's lanes within {100 * GAP_TO_OPTIMUM:.0f} point of the "
                              "offline optimum (offline)", gap <= GAP_TO_OPTIMUM,
                              f"{100 * w['offline'][LANES]['efficiency']:.2f}% against "
                              f"{100 * w['offline'][OPTIMUM]['efficiency']:.2f}%"))
        eff = w["real"][runs.DEFAULT_POLICY]["efficiency"]["median"]
        targets.append(Target(f"{label}: default policy padding efficiency >= {100 * REAL_EFFICIENCY:.1f}% "
                              "(real processes)", eff >= REAL_EFFICIENCY, f"{100 * eff:.2f}%"))
    return targets


def markdown(figures: dict[str, Any]) -> str:
    depth = figures["offline_depth"]
    head = ["side"] + [f"{label} eff % / fill %" for label in figures["workloads"]]
    rows = []
    for name in [*OFFLINE_POLICIES, OPTIMUM]:
        rows.append([f"offline: {name}"] + [f"{100 * w['offline'][name]['efficiency']:.2f} / "
                                            f"{100 * w['offline'][name]['fill']:.1f}"
                                            for w in figures["workloads"].values()])
    for policy in runs.DISPATCH_POLICIES:
        rows.append([f"real: {policy}"] + [f"{fmt_spread(_pct(w['real'][policy]['efficiency']), '.2f')} / "
                                           f"{fmt_spread(_pct(w['real'][policy]['fill']), '.1f')}"
                                           for w in figures["workloads"].values()])
    sizes = "; ".join(f"{label}: {w['items']:,} items, {w['tokens']:,} tokens, contract "
                      f"{w['contract']['max_batch_items']} items / {w['contract']['max_batch_tokens']:,} tokens"
                      for label, w in figures["workloads"].items())
    return (f"Padding efficiency (real tokens / padded tokens) and batch fill (items per batch / the contract's "
            f"items). Offline: {figures['offline_items']:,} lengths drawn from the workload's, shapes ignored, "
            f"streamed through a queue held at {depth:,} items "
            "(lab/bench/offline.py; FIFO, buckets and ranges pad each batch to its own longest item). "
            "Real: `pipeline launch`, 2 producers, 2 zero-cost sim consumers, per dispatch policy; batches are "
            f"shape-pure there. {sizes}.\n\n" + table(head, rows))


def _pct(s: dict[str, Any]) -> dict[str, Any]:
    return spread([100 * v for v in s["values"]])


def plot(figures: dict[str, Any]) -> Callable[[Path], None]:
    groups = list(figures["workloads"])
    sides = [f"offline: {n}" for n in [*OFFLINE_POLICIES, OPTIMUM]] + [f"real: {p}" for p in runs.DISPATCH_POLICIES]

    def values(key: str) -> list[list]:
        out = []
        for w in figures["workloads"].values():
            row = [(100 * w["offline"][n][key],) * 3 for n in [*OFFLINE_POLICIES, OPTIMUM]]
            row += [cell(w["real"][p][key], 100) for p in runs.DISPATCH_POLICIES]
            out.append(row)
        return out

    def draw(path: Path) -> None:
        grouped_bars(path, "Padding efficiency and batch fill", [
            Panel("padding efficiency", "%", groups, sides, values("efficiency")),
            Panel("batch fill", "% of the contract's items", groups, sides, values("fill"))])
    return draw


class PaddingComparison:
    name = "padding"
    title = "Padding efficiency and batch fill: offline policies and dispatch policies"

    def run(self, ctx: BenchContext) -> Outcome:
        figures = measure(ctx)
        return Outcome(figures, markdown(figures), judge(figures), plot(figures))


COMPARISON = PaddingComparison()
