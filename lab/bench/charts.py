"""Grouped bar charts of the evaluation suite's comparisons (`padding`, `prefix`, `run-batch`):
one panel per measure, one group of bars per workload (or setting), one bar per side, the
min-max over repeats as an error bar.

matplotlib is optional and imported only inside `grouped_bars` (ImportError tells the
harness to skip the plot); the object API on the Agg canvas, as pipeline/reporting/plots.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class Panel:
    """One panel: `values[group][side]` = (median, min, max), None where a side did not run."""

    title: str
    ylabel: str
    groups: Sequence[str]
    sides: Sequence[str]
    values: Sequence[Sequence[tuple[float, float, float] | None]]


# Bars of one group fill this share of the space between groups; the rest is the gap.
GROUP_WIDTH = 0.8
# Inches per panel: wide enough for a handful of groups with their labels.
PANEL_SIZE_IN = (11.0, 3.6)


def grouped_bars(path: Path, title: str, panels: Sequence[Panel]) -> None:
    """Draw `panels` one above the other into the PNG at `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(PANEL_SIZE_IN[0], PANEL_SIZE_IN[1] * len(panels)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        width = GROUP_WIDTH / max(1, len(panel.sides))
        for s, side in enumerate(panel.sides):
            xs, heights, low, high = [], [], [], []
            for g, row in enumerate(panel.values):
                cell = row[s]
                if cell is None:
                    continue
                median, least, most = cell
                xs.append(g - GROUP_WIDTH / 2 + (s + 0.5) * width)
                heights.append(median)
                low.append(median - least)
                high.append(most - median)
            ax.bar(xs, heights, width, yerr=[low, high], label=side, capsize=2)
        ax.set_xticks(range(len(panel.groups)), list(panel.groups))
        ax.set_title(panel.title)
        ax.set_ylabel(panel.ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize="small", ncols=min(4, max(1, len(panels[0].sides))))
    figure.suptitle(title)
    figure.savefig(path, dpi=110)


def cell(spread: dict | None, scale: float = 1.0) -> tuple[float, float, float] | None:
    """A harness spread (median, min, max) as a bar's (median, min, max), times `scale`."""
    if spread is None:
        return None
    return spread["median"] * scale, spread["min"] * scale, spread["max"] * scale
