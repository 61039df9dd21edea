"""`pipeline bench scaling`: end-to-end items/s with 1, 2 and 4 producer processes and 1, 2
and 4 zero-cost sim consumers (the full grid, nine cells), each cell a fresh pipeline on the
disk tier at durability `process` with the 256-item contract, flooded with pipelines.py's
256-token items; with each role's CPU over the run (cores used), so a reader sees where this
machine's cores run out: past the point where all roles together keep every core busy, more
processes only share the same cores.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lab.bench.harness import BenchContext, Outcome, alternate, fmt_spread, spread, table
from lab.bench.pipelines import FLOOD_TOKENS, Pipeline, PipelineSpec, flood_targets

COUNTS = (1, 2, 4)
BATCH_ITEMS = 256
# Items per run (shared among the producers): about 1 M (4 to 10 s a run here), and a
# smoke run's worth.
ITEMS, QUICK_ITEMS = 1_000_000, 4000
ROLES = ("broker", "consumer", "producer")


def cell_label(producers: int, consumers: int) -> str:
    return f"{producers}P x {consumers}C"


def _cell(ctx: BenchContext, producers: int, consumers: int, counter: list[int]) -> Any:
    def run() -> dict:
        counter[0] += 1
        items = ctx.size(ITEMS, QUICK_ITEMS)
        spec = PipelineSpec("disk", "process", consumers, BATCH_ITEMS)
        with Pipeline(ctx.work_dir / f"run{counter[0]}", spec) as pipe:
            return pipe.run_producers(flood_targets(pipe.socket_path, producers, items), items).figures()
    return run


def run(ctx: BenchContext) -> Outcome:
    counter = [0]
    cells = [(p, c) for p in COUNTS for c in COUNTS]
    runs = alternate([(cell_label(p, c), _cell(ctx, p, c, counter)) for p, c in cells], ctx.repeat)
    grid = {}
    for p, c in cells:
        done = runs[cell_label(p, c)]
        grid[cell_label(p, c)] = {
            "producers": p, "consumers": c, "items_per_s": spread([r["items_per_s"] for r in done]),
            "cores": {role: spread([r["cores"].get(role, 0.0) for r in done]) for role in (*ROLES, "all")},
            "runs": done}
    figures = {"cores": os.cpu_count(), "items": ctx.size(ITEMS, QUICK_ITEMS), "item_tokens": FLOOD_TOKENS,
               "batch_items": BATCH_ITEMS, "grid": grid}
    return Outcome(figures, _markdown(figures), [], lambda path: _plot(grid, path))


def _markdown(figures: dict) -> str:
    grid = figures["grid"]
    rate_rows = [[f"{p} producer{'s' if p > 1 else ''}"] + [fmt_spread(grid[cell_label(p, c)]["items_per_s"])
                                                            for c in COUNTS] for p in COUNTS]
    core_rows = [[cell_label(g["producers"], g["consumers"])] + [fmt_spread(g["cores"][role], ".2f")
                                                                 for role in (*ROLES, "all")] for g in grid.values()]
    best = max(grid.values(), key=lambda g: g["items_per_s"]["median"])
    return "\n".join([
        f"The full grid: 1, 2 and 4 producer processes against 1, 2 and 4 zero-cost sim consumers, "
        f"{figures['items']:,} items of {figures['item_tokens']} tokens a run (shared among the producers), broker "
        f"on the disk tier at `process`, {figures['batch_items']}-item contract, on a machine of {figures['cores']} "
        "cores. Items/s:", "",
        table(["", *[f"{c} consumer{'s' if c > 1 else ''}" for c in COUNTS]], rate_rows), "",
        "Cores used by role (CPU seconds over wall seconds); where `all` reaches the machine's cores, more "
        "processes only share them:", "",
        table(["cell", "broker", "consumers", "producers", "all"], core_rows), "",
        f"Most items/s: {cell_label(best['producers'], best['consumers'])}, "
        f"{best['items_per_s']['median']:,.0f} items/s (median)."])


def _plot(grid: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12.0, 5.0), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    for p in COUNTS:
        cells = [grid[cell_label(p, c)]["items_per_s"] for c in COUNTS]
        medians = [s["median"] / 1e3 for s in cells]
        left.errorbar(COUNTS, medians, yerr=[[m - s["min"] / 1e3 for m, s in zip(medians, cells)],
                                             [s["max"] / 1e3 - m for m, s in zip(medians, cells)]],
                      marker="o", capsize=3, label=f"{p} producer{'s' if p > 1 else ''}")
    left.set_xticks(list(COUNTS))
    left.set_xlabel("consumers")
    left.set_ylabel("thousand items/s (median, min-max)")
    left.set_title("end-to-end items/s")
    left.legend(fontsize=8)
    labels = list(grid)
    bottom = [0.0] * len(labels)
    for role in ROLES:
        heights = [grid[k]["cores"][role]["median"] for k in labels]
        right.bar(range(len(labels)), heights, bottom=bottom, label=role)
        bottom = [b + h for b, h in zip(bottom, heights)]
    right.axhline(os.cpu_count() or 0, color="k", linestyle="--", linewidth=1, label="machine's cores")
    right.set_xticks(list(range(len(labels))), labels, rotation=30, ha="right", fontsize=8)
    right.set_ylabel("cores used (median of runs)")
    right.set_title("where the cores go")
    right.legend(fontsize=8)
    figure.savefig(path)


class _Scaling:
    name = "scaling"
    title = "Scaling: items/s with 1, 2 and 4 producers and consumers"

    def run(self, ctx: BenchContext) -> Outcome:
        return run(ctx)


COMPARISON = _Scaling()
