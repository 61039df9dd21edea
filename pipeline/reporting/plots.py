"""Charts of a run's progress history (`pipeline launch --plots`), as PNG files.

    paths = write_plots(tracker.history, out_dir)   # pipeline.reporting.progress.ProgressTracker

- lanes.png: lanes in use and shapes over time;
- padding.png: each consumer's padding efficiency per poll interval (real / padded tokens of
  what it ran in that interval, from the cumulative counters);
- cache_hit_rate.png: each consumer's cache hit rate per poll interval (hits inside the
  cacheable prefix / (cacheable - compulsory miss tokens));
- queued_tokens.png: queued tokens of the largest shapes over time, stacked, the rest as "other".

matplotlib is an optional dependency (`shape-broker[plots]`), imported only here and only
when called. Figures are drawn with the object API on the Agg canvas: no pyplot, so no global
figure state and no display backend is touched. Pure but for the files written.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from pipeline.reporting.progress import Sample, consumer_intervals

# Shapes drawn by name in the queued-tokens chart; the rest are summed as "other". Eight
# keeps the legend readable and the colours distinct.
PLOT_TOP_SHAPES = 8
# 10 x 5 inches at 100 dpi: 1000 x 500 pixels, readable on a screen and in a report.
FIGURE_SIZE_IN = (10.0, 5.0)
FIGURE_DPI = 100

MISSING_MATPLOTLIB = "--plots needs matplotlib: pip install 'shape-broker[plots]'"


def write_plots(history: Sequence[Sample], out_dir: str) -> list[str]:
    """Write the four charts of `history` into `out_dir` (created if missing); return their
    paths. Raises RuntimeError when matplotlib is not installed, ValueError on no samples."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError(MISSING_MATPLOTLIB) from exc
    if not history:
        raise ValueError("no progress samples to plot")
    os.makedirs(out_dir, exist_ok=True)
    start_s = history[0].time_s
    times = [s.time_s - start_s for s in history]
    intervals = consumer_intervals(history)
    charts = {
        "lanes.png": lambda ax: _lanes(ax, history, times),
        "padding.png": lambda ax: _per_consumer(ax, intervals, start_s, "padding_efficiency",
                                                "padding efficiency per interval (%)"),
        "cache_hit_rate.png": lambda ax: _per_consumer(ax, intervals, start_s, "cache_hit_rate",
                                                       "cache hit rate per interval (%)"),
        "queued_tokens.png": lambda ax: _queued_tokens(ax, history, times),
    }
    paths = []
    for name, draw in charts.items():
        figure = Figure(figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI, layout="constrained")
        FigureCanvasAgg(figure)
        ax = figure.add_subplot()
        ax.set_xlabel("time since start (s)")
        ax.grid(True, alpha=0.3)
        draw(ax)
        path = os.path.join(out_dir, name)
        figure.savefig(path)
        paths.append(path)
    return paths


def _lanes(ax, history: Sequence[Sample], times: list[float]) -> None:
    ax.set_title("lanes in use")
    ax.plot(times, [s.lanes_in_use for s in history], label="lanes in use", color="tab:blue")
    ax.set_ylabel("lanes in use")
    shapes_ax = ax.twinx()
    shapes_ax.plot(times, [s.shapes for s in history], label="shapes", color="tab:orange", linestyle="--")
    shapes_ax.set_ylabel("shapes")
    for axis in (ax, shapes_ax):
        axis.set_ylim(bottom=0)
        axis.yaxis.get_major_locator().set_params(integer=True)  # counts: no 2.85 shapes
    lines = ax.get_lines() + shapes_ax.get_lines()
    # Outside the axes: two scales leave no corner that is free of lines in every run.
    ax.figure.legend(lines, [line.get_label() for line in lines], loc="outside upper right", ncols=2)


def _per_consumer(ax, intervals: dict, start_s: float, attribute: str, label: str) -> None:
    ax.set_title(label)
    ax.set_ylabel(label)
    ax.set_ylim(0, 105)
    for name in sorted(intervals):
        points = intervals[name]
        # NaN where the consumer ran nothing measurable: matplotlib breaks the line there.
        values = [math.nan if getattr(p, attribute) is None else 100 * getattr(p, attribute) for p in points]
        ax.plot([p.time_s - start_s for p in points], values, label=name, marker=".", markersize=3)
    if intervals:
        ax.legend(loc="lower right")


def top_shapes(history: Sequence[Sample], count: int = PLOT_TOP_SHAPES) -> list[str]:
    """The `count` shapes with the most queued tokens at any sample (the broker's "other"
    row excluded), largest first; ties by name so the choice is deterministic."""
    peaks: dict[str, int] = {}
    for sample in history:
        for shape, tokens in sample.queued_tokens_by_shape.items():
            if shape != "other":
                peaks[shape] = max(peaks.get(shape, 0), tokens)
    return sorted(peaks, key=lambda shape: (-peaks[shape], shape))[:count]


def _queued_tokens(ax, history: Sequence[Sample], times: list[float]) -> None:
    ax.set_title("queued tokens per shape")
    ax.set_ylabel("queued tokens")
    shapes = top_shapes(history)
    series = [[s.queued_tokens_by_shape.get(shape, 0) for s in history] for shape in shapes]
    # A shape outside a poll's top rows is inside that poll's "other" row: other = total - named.
    other = [sum(s.queued_tokens_by_shape.values()) - sum(s.queued_tokens_by_shape.get(x, 0) for x in shapes)
             for s in history]
    ax.stackplot(times, *series, other, labels=[*shapes, "other"])
    ax.legend(loc="upper right", fontsize="small")
