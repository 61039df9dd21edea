"""Plots of a progress history: the four PNG files, the shapes they name, and the error
without matplotlib."""

from __future__ import annotations

import sys

import pytest

from pipeline.reporting.plots import MISSING_MATPLOTLIB, top_shapes, write_plots
from pipeline.reporting.progress import ProgressTracker
from tests.support.statuses import status_at

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def history(polls: int = 40):
    """A run whose queue moves from shape a to shapes b..k (more than the chart names)."""
    tracker = ProgressTracker()
    for n in range(polls):
        t = n * 0.5
        shapes = {"a": max(0, 40_000 - 2_000 * n)} | {name: 1_000 * (rank + 1) * n
                                                       for rank, name in enumerate("bcdefghijk")}
        shapes["other"] = 500
        tracker.observe(status_at(t, shapes=shapes), t)
    return tracker.history


def test_write_plots_makes_four_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"  # created by write_plots
    paths = write_plots(history(), str(out))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["lanes.png", "padding.png", "cache_hit_rate.png",
                                                    "queued_tokens.png"]
    for path in paths:
        with open(path, "rb") as file:
            assert file.read(8) == PNG_SIGNATURE, path


def test_a_single_sample_still_plots(tmp_path):
    pytest.importorskip("matplotlib")
    assert len(write_plots(history(polls=1), str(tmp_path))) == 4


def test_no_samples_is_an_error(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="no progress samples"):
        write_plots([], str(tmp_path))


def test_top_shapes_by_peak_queued_tokens():
    # At the last poll (n = 39) b..k hold 39,000..390,000 and a nothing, but a peaked at
    # 40,000 at the start: a ranks above b. The broker's "other" row is never named.
    assert top_shapes(history()) == ["0:k", "0:j", "0:i", "0:h", "0:g", "0:f", "0:e", "0:d"]
    assert top_shapes(history(), count=20) == ["0:k", "0:j", "0:i", "0:h", "0:g", "0:f", "0:e", "0:d", "0:c",
                                               "0:a", "0:b"]


def test_without_matplotlib_the_error_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import fails
    with pytest.raises(RuntimeError) as caught:
        write_plots(history(polls=2), str(tmp_path))
    assert str(caught.value) == MISSING_MATPLOTLIB == "--plots needs matplotlib: pip install 'shape-broker[plots]'"
