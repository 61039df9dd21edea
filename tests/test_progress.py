"""Live progress: rates, ETA, the bounded history, per-interval efficiency, and both displays,
on synthetic status series whose rates are known exactly (no wall clock)."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
from rich.console import Console

from pipeline.reporting.progress import (
    LiveProgress,
    ProgressTracker,
    consumer_intervals,
    format_duration,
    format_view_line,
)
from tests.support.statuses import (
    C1_CHANGE_S,
    COMPLETED_ITEMS_PER_S,
    RECEIVED_ITEMS_PER_S,
    ROUTED_ITEMS_PER_S,
    TOKENS_PER_ITEM,
    consumer_row,
    status_at,
)


def poll_times(count: int, seed: int = 7) -> list[float]:
    """Poll times about half a second apart, with jitter (the launcher's loop is not exact)."""
    rng = np.random.default_rng(seed)
    return [float(t) for t in np.cumsum(rng.uniform(0.4, 0.6, size=count)) - 0.5]


def feed(tracker: ProgressTracker, times: list[float], **status_args) -> None:
    for t in times:
        tracker.observe(status_at(t, **status_args), t)
        tracker.check_invariants()


def test_rates_and_eta_over_the_window():
    tracker = ProgressTracker(expected_items=10_000, rate_window_s=5.0)
    times = poll_times(60)
    feed(tracker, times)
    view = tracker.snapshot()
    now = times[-1]
    assert view.time_s == now and view.elapsed_s == pytest.approx(now - times[0])
    # Counters are whole items, so a rate over >= 5 s is within 1 item / 5 s of the true one.
    assert view.items_received_per_s == pytest.approx(RECEIVED_ITEMS_PER_S, abs=0.2)
    assert view.items_routed_per_s == pytest.approx(ROUTED_ITEMS_PER_S, abs=0.2)
    assert view.items_completed_per_s == pytest.approx(COMPLETED_ITEMS_PER_S, abs=0.2)
    assert view.tokens_completed_per_s == pytest.approx(COMPLETED_ITEMS_PER_S * TOKENS_PER_ITEM, abs=0.2 * 400)
    completed = int(COMPLETED_ITEMS_PER_S * now)
    assert view.items_completed == completed
    assert view.fraction_done == pytest.approx(completed / 10_000)
    assert view.eta_s == pytest.approx((10_000 - completed) / view.items_completed_per_s)
    assert view.eta_s == pytest.approx((10_000 - completed) / COMPLETED_ITEMS_PER_S, rel=0.01)
    assert view.backlog_items == int(RECEIVED_ITEMS_PER_S * now) - int(ROUTED_ITEMS_PER_S * now)
    assert view.shape_switches == 1 + int(now // 5)
    assert view.lanes_in_use == 10 + int(now)
    assert now > 20  # c1 disconnected at 20 s; the broker keeps its totals
    assert (view.consumers_connected, view.consumers_known) == (1, 2)


def test_rate_window_follows_a_change_of_pace():
    """Completions stop at t = 20: the rate over the 5 s window reaches zero 5 s later."""
    tracker = ProgressTracker(rate_window_s=5.0)
    for t in [i * 0.5 for i in range(61)]:
        status = status_at(t)
        if t > 20:
            status = replace(status, items_completed=COMPLETED_ITEMS_PER_S * 20,
                             tokens_completed=COMPLETED_ITEMS_PER_S * 20 * 400)
        tracker.observe(status, t)
        tracker.check_invariants()
        view = tracker.snapshot()
        if t == 20:
            assert view.items_completed_per_s == pytest.approx(COMPLETED_ITEMS_PER_S)
        elif t == 22.5:
            assert view.items_completed_per_s == pytest.approx(COMPLETED_ITEMS_PER_S / 2)
        elif t >= 25:
            assert view.items_completed_per_s == 0.0
    assert tracker.snapshot().eta_s is None  # no expected total


def test_first_sample_has_no_rate_and_eta_is_zero_when_done():
    tracker = ProgressTracker(expected_items=800)
    tracker.observe(status_at(10.0), 100.0)
    tracker.check_invariants()
    view = tracker.snapshot()
    assert view.items_completed_per_s is None and view.elapsed_s == 0.0
    assert view.eta_s == 0.0 and view.fraction_done == 1.0
    unknown = ProgressTracker(expected_items=10_000)
    unknown.observe(status_at(1.0), 1.0)
    assert unknown.snapshot().eta_s is None  # remaining work, but no rate yet


def test_a_broker_restart_starts_the_rate_window_again():
    tracker = ProgressTracker(rate_window_s=5.0)
    feed(tracker, [i * 0.5 for i in range(20)])
    # The new broker counts from zero; without the reset the rates would come out negative.
    tracker.observe(status_at(0.5, generation=2), 10.0)
    tracker.check_invariants()
    view = tracker.snapshot()
    assert view.items_completed_per_s is None
    assert view.padding_efficiency_recent is None
    tracker.observe(status_at(1.5, generation=2), 11.0)
    tracker.check_invariants()
    assert tracker.snapshot().items_completed_per_s == pytest.approx(COMPLETED_ITEMS_PER_S)


def test_history_is_bounded_and_evenly_decimated():
    tracker = ProgressTracker(history_limit_samples=8)
    times = [i * 0.5 for i in range(40)]
    for n, t in enumerate(times):
        tracker.observe(status_at(t), t)
        tracker.check_invariants()
        assert len(tracker.history) <= 8 + 1
        assert tracker.history[-1].index == n  # plots always end at the newest poll
    # Halved at observations 8, 16 and 32: stride 8, then the newest (39) appended.
    assert tracker.stride == 8
    assert [s.index for s in tracker.history] == [0, 8, 16, 24, 32, 39]
    assert [s.time_s for s in tracker.history] == [0.0, 4.0, 8.0, 12.0, 16.0, 19.5]


def test_default_history_bound_holds_over_a_long_run():
    tracker = ProgressTracker()
    for n in range(5000):
        tracker.observe(status_at(n * 0.5), n * 0.5)
    tracker.check_invariants()
    assert tracker.stride == 4 and len(tracker.history) <= tracker.history_limit_samples + 1


def test_per_consumer_interval_efficiency():
    tracker = ProgressTracker()
    times = [i * 0.5 for i in range(41)]
    feed(tracker, times)
    intervals = consumer_intervals(tracker.history)
    assert sorted(intervals) == ["c0", "c1"]
    assert [p.time_s for p in intervals["c0"]] == times[1:]
    for point in intervals["c0"][1:]:  # the first interval holds c0's compulsory misses
        assert point.padding_efficiency == pytest.approx(0.9)
        assert point.cache_hit_rate == pytest.approx(0.6)
    assert intervals["c0"][0].cache_hit_rate == pytest.approx(150 / (250 - 100))
    for point in intervals["c1"][1:]:
        expected = (0.5, 0.4) if point.time_s <= C1_CHANGE_S else (0.8, 1.0)
        assert (point.padding_efficiency, point.cache_hit_rate) == pytest.approx(expected)
    # The tracker's view: cumulative, and over the rate window (all after the change).
    view = tracker.snapshot()
    prompt = 900 * 20 + 500 * 10 + 800 * 10
    assert view.padding_efficiency == pytest.approx(prompt / (2 * 1000 * 20))
    hits = 300 * 20 + 200 * 10 + 500 * 10
    assert view.cache_hit_rate == pytest.approx(hits / (2 * 500 * 20 - 200))
    assert view.padding_efficiency_recent == pytest.approx((900 + 800) / 2000)
    assert view.cache_hit_rate_recent == pytest.approx((300 + 500) / 1000)


def test_intervals_skip_counter_resets_and_restarts():
    tracker = ProgressTracker()
    feed(tracker, [0.0, 1.0, 2.0])
    tracker.observe(status_at(0.5, generation=2), 3.0)  # broker restarted: totals from zero
    tracker.observe(status_at(1.5, generation=2), 4.0)
    reset = status_at(2.5, generation=2)
    reset = replace(reset, per_consumer={**reset.per_consumer,
                                         "c1": consumer_row(10, 10, 0, 0, 0)})  # c1's totals went down
    tracker.observe(reset, 5.0)
    tracker.check_invariants()
    intervals = consumer_intervals(tracker.history)
    assert [p.time_s for p in intervals["c0"]] == [1.0, 2.0, 4.0, 5.0]
    assert [p.time_s for p in intervals["c1"]] == [1.0, 2.0, 4.0]


def test_bad_input_is_refused():
    tracker = ProgressTracker()
    with pytest.raises(ValueError, match="no status"):
        tracker.snapshot()
    tracker.observe(status_at(1.0), 5.0)
    with pytest.raises(ValueError, match="backwards"):
        tracker.observe(status_at(1.5), 4.0)
    with pytest.raises(ValueError, match="even"):
        ProgressTracker(history_limit_samples=7)


def views(times: list[float], expected_items: int | None = 4000):
    tracker = ProgressTracker(expected_items=expected_items)
    for t in times:
        tracker.observe(status_at(t), t)
        yield t, tracker.snapshot()


def test_plain_log_writes_one_line_per_interval():
    out = io.StringIO()
    with LiveProgress(out, log_interval_s=5.0) as live:
        assert not live.terminal
        for t, view in views([i * 0.5 for i in range(25)]):
            live.update(view, t)
        lines = out.getvalue().splitlines()
        assert len(lines) == 3  # at 0, 5 and 10 s
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # and the last view (12 s) on exit
    assert lines[0].startswith("[0s] done 0/4,000 items (0.0%)")
    assert lines[1].startswith("[5s] done 400/4,000 items (10.0%)")
    assert "in 1,200 (100/s)" in lines[3] and "done 960 (80/s)" in lines[3]
    assert "tokens in 480k" in lines[3] and "(32k/s)" in lines[3]
    assert "ETA 38s" in lines[3]  # (4000 - 960) / 80
    assert "\x1b" not in out.getvalue()


def test_plain_log_without_a_final_line_when_the_last_view_was_logged():
    out = io.StringIO()
    with LiveProgress(out, log_interval_s=5.0) as live:
        for t, view in views([0.0, 5.0, 10.0]):
            live.update(view, t)
    assert len(out.getvalue().splitlines()) == 3


def test_terminal_mode_renders_a_live_table():
    out = io.StringIO()
    console = Console(force_terminal=True, file=out, width=120)
    with LiveProgress(console=console) as live:
        assert live.terminal
        for t, view in views([i * 0.5 for i in range(25)]):
            live.update(view, t)
    text = out.getvalue()
    for figure in ("1,200", "1,080", "960", "480,000", "100/s", "80/s", "32k/s", "960/4,000 items", "ETA 38s",
                   "72.5%", "lanes in use", "22", "consumers", "2 connected / 2"):
        assert figure in text, figure


def test_view_line_without_expected_items():
    _, view = list(views([0.0, 1.0], expected_items=None))[-1]
    line = format_view_line(view)
    assert line.startswith("[1s] done 80 items |") and "ETA" not in line


def test_format_duration():
    assert [format_duration(s) for s in (None, 0.4, 42, 185, 3720)] == ["-", "0s", "42s", "3m05s", "1h02m"]
