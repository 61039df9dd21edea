"""The targets of `pipeline bench prefix`, judged the same way on both of its sides (the sim
engine's cost model, lab/bench/prefix.py, and vLLM, lab/bench/prefix_vllm.py): the
product's default dispatch policy ahead of every baseline on prefix reuse, and on makespan
where the runs are bound by the engine (its consumers busy at least BUSY_BOUND of the
makespan, the default's and the baseline's alike).

Pure functions of the comparison's figures: per policy, harness spreads (median, min, max)
of a reuse figure, `makespan_s` and `busy_min` (the least busy consumer's share).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.bench import runs
from lab.bench.charts import Panel, cell, grouped_bars
from lab.bench.harness import Target

# A run whose consumers are busy less than this share of the makespan is not bound by its
# engine: its makespan says more about the broker and the consumer's own loop than about the
# policy, and the makespan target skips it.
BUSY_BOUND = 0.8


def policy_targets(label: str, got: dict[str, dict[str, Any]], bound: float | None, *,
                   reuse_key: str = "prefix_reuse", reuse_name: str = "prefix reuse",
                   bound_name: str = "GPU-bound") -> list[Target]:
    """The reuse target and the makespan target of one workload and cache size (`label`),
    from each policy's spreads in `got`; `bound` (analyze's, None: not known) is shown."""
    mine = got[runs.DEFAULT_POLICY]
    others = {p: v for p, v in got.items() if p != runs.DEFAULT_POLICY}
    assert others, f"{label}: no baseline to judge the default against"
    reuse = mine[reuse_key]["median"]
    behind = [p for p, v in others.items() if v[reuse_key]["median"] >= reuse]
    shown = "" if bound is None else f", bound {100 * bound:.1f}%"
    targets = [Target(
        f"{label}: default ahead of every baseline on {reuse_name}", not behind,
        f"default {100 * reuse:.1f}%, best baseline {100 * max(v[reuse_key]['median'] for v in others.values()):.1f}%"
        + shown + (f"; not behind: {', '.join(behind)}" if behind else ""))]
    bound_runs = {p: v for p, v in others.items() if v["busy_min"]["median"] >= BUSY_BOUND}
    makespan = mine["makespan_s"]["median"]
    if mine["busy_min"]["median"] < BUSY_BOUND or not bound_runs:
        least = min(v["busy_min"]["median"] for v in got.values())
        why = (f"default's least busy consumer {100 * mine['busy_min']['median']:.0f}%"
               if mine["busy_min"]["median"] < BUSY_BOUND
               else f"no baseline is (least busy consumer {100 * least:.0f}%)")
        return targets + [Target(f"{label}: default ahead on makespan ({bound_name})", None,
                                 f"not {bound_name}: {why}")]
    slower = [p for p, v in bound_runs.items() if v["makespan_s"]["median"] <= makespan]
    return targets + [Target(
        f"{label}: default ahead of every {bound_name} baseline on makespan", not slower,
        f"default {makespan:.2f} s, fastest baseline "
        f"{min(v['makespan_s']['median'] for v in bound_runs.values()):.2f} s"
        + (f"; not slower: {', '.join(slower)}" if slower else ""))]


def policy_plot(title: str, reuse_name: str, lines: list[tuple[str, dict[str, Any]]], policies: list[str],
                reuse_key: str = "prefix_reuse") -> Callable[[Path], None]:
    """The plot both sides draw: per line (a group label and its row: `bound` and each
    policy's spreads), the reuse of each policy beside analyze's bound, and the makespan as
    a multiple of the default's."""
    groups, reuse, makespan = [], [], []
    for group, row in lines:
        groups.append(group)
        reuse.append([cell(row["policies"][p][reuse_key], 100) for p in policies] + [(100 * row["bound"],) * 3])
        base = row["policies"][runs.DEFAULT_POLICY]["makespan_s"]["median"]
        makespan.append([cell(row["policies"][p]["makespan_s"], 1 / base) for p in policies])

    def draw(path: Path) -> None:
        grouped_bars(path, title, [Panel(reuse_name, "% of input tokens", groups, [*policies, "analyze bound"], reuse),
                                   Panel("makespan", "x the default's", groups, policies, makespan)])
    return draw
