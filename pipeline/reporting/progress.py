"""Live progress of a run (SPEC §7): a pure tracker of the broker's status snapshots, and
the display that shows what it derives.

The launcher's polling thread owns both objects; neither is thread-safe, and neither reads a
clock (the caller passes `now_s`, any monotonic seconds):

    tracker = ProgressTracker(expected_items=40_000)
    with LiveProgress() as live:                       # stderr: a live table on a terminal,
        while running:                                 # else a log line every 5 s
            now_s = time.monotonic()
            tracker.observe(broker_status(socket_path), now_s)
            live.update(tracker.snapshot(), now_s)
    write_plots(tracker.history, out_dir)              # pipeline.reporting.plots

Figures follow the status record's and the report's definitions (pipeline.wire.status,
pipeline.reporting.report): received includes the recovered items (BrokerStatus.items_received_all); padding efficiency = the consumers' real / padded tokens; cache hit rate =
hits inside the cacheable prefix / (cacheable - compulsory miss tokens). Rates are taken
over the last `RATE_WINDOW_S`; a broker restart (a new `generation`) starts the window again,
since its counters start again from zero.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TextIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pipeline.reporting.report import format_compact, format_count, format_percent, format_rate
from pipeline.wire.status import BrokerStatus, cache_hit_rate, padding_efficiency

# Samples kept for plots. 2,048 polls at the launcher's 2 a second cover 17 minutes at full
# resolution; past that the history keeps every other sample (and then every 4th, ...), so a
# run of any length is covered end to end in at most ~2,048 x ~2 KB = 4 MB. Even, so the
# sample that triggers a decimation is itself on the new stride.
HISTORY_LIMIT_SAMPLES = 2048
# Rates (and the recent padding and hit rate) are taken over this much of the latest history:
# long enough to smooth the half-second polls and the batch granularity of completions (a
# consumer completes up to max_batch_items at once), short enough that the ETA follows a
# change of pace within seconds.
RATE_WINDOW_S = 10.0
# Bound on the samples in the rate window whatever the caller's poll rate (at 2 polls a second
# the window holds ~21); a faster poller gets a shorter window rather than unbounded memory.
RATE_WINDOW_LIMIT_SAMPLES = 1024
# A plain log line this often when the output is not a terminal: a log file of an hour-long
# run stays ~700 lines, and a hung run still shows within seconds.
LOG_INTERVAL_S = 5.0
# Shown while the broker's disk is full: nothing is lost, but nothing new is stored either.
DISK_FULL_ALERT = ("DISK FULL: the broker stores nothing new until space comes back; submitted items wait "
                   "in the producer rings (nothing is lost)")

@dataclass(slots=True)
class TokenTotals:
    """Engine tokens summed over consumers, cumulative or the growth over an interval."""

    prompt_tokens: int = 0
    padded_tokens: int = 0
    cacheable_tokens: int = 0
    cache_hit_tokens: int = 0  # inside the cacheable prefix
    compulsory_miss_tokens: int = 0

    def add(self, after: TokenTotals, before: TokenTotals | None = None) -> bool:
        """Add `after` (less `before`); False, adding nothing, if a counter went down (the
        consumer's totals restarted: that interval is not measured)."""
        deltas = [getattr(after, f) - (getattr(before, f) if before is not None else 0) for f in _TOKEN_FIELDS]
        if min(deltas) < 0:
            return False
        for name, delta in zip(_TOKEN_FIELDS, deltas):
            setattr(self, name, getattr(self, name) + delta)
        return True

    @property
    def padding_efficiency(self) -> float | None:
        return padding_efficiency(self.prompt_tokens, self.padded_tokens)

    @property
    def cache_hit_rate(self) -> float | None:
        return cache_hit_rate(self.cache_hit_tokens, self.cacheable_tokens, self.compulsory_miss_tokens)


_TOKEN_FIELDS = tuple(f.name for f in fields(TokenTotals))


@dataclass(slots=True)
class ConsumerSample(TokenTotals):
    """One consumer's cumulative engine counters at a poll (the broker keeps them by name
    across reconnects, so they only grow within one broker generation)."""

    connected: bool = False


@dataclass(slots=True)
class FlowCounters:
    """Items and tokens received (+ recovered), routed and completed: cumulative counters."""

    items_received: int
    tokens_received: int
    items_routed: int
    tokens_routed: int
    items_completed: int
    tokens_completed: int


_FLOW_FIELDS = tuple(f.name for f in fields(FlowCounters))


@dataclass(slots=True)
class Sample(FlowCounters):
    """One status poll: cumulative counters, levels, and queued tokens of the top shapes."""

    index: int  # observation number, from 0; the history keeps multiples of its stride
    time_s: float
    generation: int
    backlog_items: int
    backlog_tokens: int
    pending_items: int
    lanes_in_use: int
    shapes: int
    switches: int
    consumers: dict[str, ConsumerSample]
    queued_tokens_by_shape: dict[str, int]  # "model:signature" of the top shapes, and "other"
    disk_full: bool = False  # the broker's disk is full: ingest paused (backpressure)


def sample_from_status(status: BrokerStatus, index: int, now_s: float) -> Sample:
    """The figures of a `Broker.status()` that progress and plots use."""
    consumers = {}
    for name, row in status.per_consumer.items():
        work = row.work
        consumers[name] = ConsumerSample(
            connected=row.connected, prompt_tokens=work.prompt_tokens, padded_tokens=work.padded_tokens,
            cacheable_tokens=work.cacheable_tokens, cache_hit_tokens=work.cacheable_hit_tokens,
            compulsory_miss_tokens=work.compulsory_miss_tokens)
    shapes = {(row.signature if row.is_other else f"{row.model}:{row.signature}"): row.queued_tokens
              for row in status.top_shapes}
    return Sample(
        index=index, time_s=now_s, generation=status.generation,
        items_received=status.items_received_all, tokens_received=status.tokens_received_all,
        items_routed=status.items_routed, tokens_routed=status.tokens_routed,
        items_completed=status.items_completed, tokens_completed=status.tokens_completed,
        backlog_items=status.backlog_items, backlog_tokens=status.backlog_tokens,
        pending_items=status.pending_items, lanes_in_use=status.lanes_in_use,
        shapes=status.shapes, switches=status.shape_switches,
        consumers=consumers, queued_tokens_by_shape=shapes, disk_full=status.disk_full)


def interval_totals(before: Sample, after: Sample) -> TokenTotals:
    """What every consumer's engine did between two samples (consumers in both; none across
    a broker restart, whose totals start again)."""
    totals = TokenTotals()
    if before.generation == after.generation:
        for name, row in after.consumers.items():
            if name in before.consumers:
                totals.add(row, before.consumers[name])
    return totals


@dataclass(slots=True)
class IntervalPoint:
    """One consumer's padding efficiency and cache hit rate between two samples."""

    time_s: float  # the end of the interval
    padding_efficiency: float | None
    cache_hit_rate: float | None


def consumer_intervals(history: Sequence[Sample]) -> dict[str, list[IntervalPoint]]:
    """Per consumer, per interval between consecutive samples, the padding efficiency and
    cache hit rate of what it ran in that interval (None where it ran nothing measurable).
    Intervals across a broker restart or a counter going down are left out."""
    points: dict[str, list[IntervalPoint]] = {}
    for before, after in zip(history, history[1:]):
        if before.generation != after.generation:
            continue
        for name, row in after.consumers.items():
            totals = TokenTotals()
            # A consumer first seen in `after` started from zero during the interval.
            if totals.add(row, before.consumers.get(name)):
                points.setdefault(name, []).append(
                    IntervalPoint(after.time_s, totals.padding_efficiency, totals.cache_hit_rate))
    return points


@dataclass(slots=True)
class ProgressView(FlowCounters):
    """What the display shows at one moment. Rates are per second over the rate window
    (None until two samples span some time); ratios are None until something is measured."""

    time_s: float
    elapsed_s: float
    items_received_per_s: float | None
    tokens_received_per_s: float | None
    items_routed_per_s: float | None
    tokens_routed_per_s: float | None
    items_completed_per_s: float | None
    tokens_completed_per_s: float | None
    expected_items: int | None
    fraction_done: float | None  # completed / expected
    eta_s: float | None  # until expected_items are completed, at the current completion rate
    backlog_items: int
    backlog_tokens: int
    pending_items: int
    shapes: int
    lanes_in_use: int
    shape_switches: int
    padding_efficiency: float | None  # since the start
    cache_hit_rate: float | None  # since the start
    padding_efficiency_recent: float | None  # over the rate window
    cache_hit_rate_recent: float | None  # over the rate window
    consumers_connected: int
    consumers_known: int
    alert: str = ""  # what the user must know now (a full disk), "" when all is well


class ProgressTracker:
    """Derives rates, ETA and efficiency from status snapshots, and keeps a bounded history
    for plots. Pure (no clock, no I/O); owned by one thread, not thread-safe."""

    def __init__(self, expected_items: int | None = None, *, history_limit_samples: int = HISTORY_LIMIT_SAMPLES,
                 rate_window_s: float = RATE_WINDOW_S) -> None:
        if history_limit_samples < 2 or history_limit_samples % 2:
            raise ValueError(f"history_limit_samples must be even and >= 2, not {history_limit_samples}")
        if rate_window_s <= 0:
            raise ValueError(f"rate_window_s must be positive, not {rate_window_s}")
        if expected_items is not None and expected_items < 0:
            raise ValueError(f"expected_items must not be negative, not {expected_items}")
        self.expected_items = expected_items
        self.history_limit_samples = history_limit_samples
        self.rate_window_s = rate_window_s
        self.stride = 1  # the history keeps observations whose index is a multiple of this
        self.observations = 0
        self._history: list[Sample] = []
        self._window: deque[Sample] = deque(maxlen=RATE_WINDOW_LIMIT_SAMPLES)
        self._first_time_s: float | None = None
        self._latest: Sample | None = None

    def observe(self, status: BrokerStatus, now_s: float) -> None:
        """Take one `Broker.status()` snapshot polled at `now_s` (seconds, never decreasing)."""
        if self._latest is not None and now_s < self._latest.time_s:
            raise ValueError(f"time went backwards: {now_s} after {self._latest.time_s}")
        sample = sample_from_status(status, self.observations, now_s)
        self.observations += 1
        if self._first_time_s is None:
            self._first_time_s = now_s
        if self._latest is not None and sample.generation != self._latest.generation:
            self._window.clear()  # a restarted broker counts from zero: no rate across it
        self._latest = sample
        self._window.append(sample)
        # Keep the newest sample at or before the window's start, so rates span the window.
        while len(self._window) >= 2 and self._window[1].time_s <= now_s - self.rate_window_s:
            self._window.popleft()
        self._record(sample)

    def _record(self, sample: Sample) -> None:
        if sample.index % self.stride:
            return
        if len(self._history) == self.history_limit_samples:
            # NOTE: halving the history and doubling the stride keeps samples evenly spaced
            # over the whole run; dropping the oldest would lose the run's start, and halving
            # without the stride would mix spacings.
            self._history = self._history[::2]
            self.stride *= 2
            if sample.index % self.stride:
                return
        self._history.append(sample)

    @property
    def history(self) -> list[Sample]:
        """The kept samples, oldest first, plus the newest observation when the stride skipped
        it (so plots end where the run ended): at most history_limit_samples + 1."""
        samples = list(self._history)
        if self._latest is not None and (not samples or samples[-1] is not self._latest):
            samples.append(self._latest)
        return samples

    def _rate(self, counter: str) -> float | None:
        first, last = self._window[0], self._window[-1]
        span_s = last.time_s - first.time_s
        return (getattr(last, counter) - getattr(first, counter)) / span_s if span_s > 0 else None

    def snapshot(self) -> ProgressView:
        """The current view. Raises ValueError before the first observation."""
        last = self._latest
        if last is None or self._first_time_s is None:
            raise ValueError("no status observed yet")
        rates = {counter: self._rate(counter) for counter in _FLOW_FIELDS}
        cumulative = TokenTotals()
        for row in last.consumers.values():
            cumulative.add(row)
        recent = interval_totals(self._window[0], last)
        expected = self.expected_items
        return ProgressView(
            time_s=last.time_s, elapsed_s=last.time_s - self._first_time_s,
            **{counter: getattr(last, counter) for counter in _FLOW_FIELDS},
            **{f"{counter}_per_s": rate for counter, rate in rates.items()},
            expected_items=expected,
            fraction_done=None if not expected else last.items_completed / expected,
            eta_s=_eta_s(expected, last.items_completed, rates["items_completed"]),
            backlog_items=last.backlog_items, backlog_tokens=last.backlog_tokens, pending_items=last.pending_items,
            shapes=last.shapes, lanes_in_use=last.lanes_in_use, shape_switches=last.switches,
            padding_efficiency=cumulative.padding_efficiency, cache_hit_rate=cumulative.cache_hit_rate,
            padding_efficiency_recent=recent.padding_efficiency, cache_hit_rate_recent=recent.cache_hit_rate,
            consumers_connected=sum(row.connected for row in last.consumers.values()),
            consumers_known=len(last.consumers), alert=DISK_FULL_ALERT if last.disk_full else "")

    def check_invariants(self) -> None:
        """Assert the history's bound and spacing and the window's span. O(history)."""
        history = self._history
        assert len(history) <= self.history_limit_samples, (len(history), self.history_limit_samples)
        assert self.stride >= 1 and self.stride & (self.stride - 1) == 0, self.stride
        indexes = [s.index for s in history]
        assert indexes == sorted(set(indexes)), "history out of order"
        assert all(i % self.stride == 0 for i in indexes), (self.stride, indexes[:8])
        if history:
            assert indexes[0] == 0, indexes[0]
            # Evenly spaced: every multiple of the stride up to the last kept index is there.
            assert indexes == list(range(0, indexes[-1] + 1, self.stride)), (self.stride, len(indexes))
        assert all(a.time_s <= b.time_s for a, b in zip(history, history[1:]))
        window = self._window
        assert (self._latest is None) == (not window) == (self.observations == 0)
        if window:
            assert window[-1] is self._latest
            assert len({s.generation for s in window}) == 1, "rate window spans a broker restart"
            assert all(a.index < b.index and a.time_s <= b.time_s for a, b in zip(window, list(window)[1:]))
            if len(window) >= 2:
                assert window[1].time_s > window[-1].time_s - self.rate_window_s, "window keeps a stale sample"


def _eta_s(expected: int | None, completed: int, rate_per_s: float | None) -> float | None:
    if expected is None:
        return None
    remaining = expected - completed
    if remaining <= 0:
        return 0.0
    return remaining / rate_per_s if rate_per_s else None


def format_duration(seconds: float | None) -> str:
    """"1h02m", "3m05s", "42s"; "-" for None."""
    if seconds is None:
        return "-"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _progress_text(view: ProgressView) -> str:
    if view.expected_items:
        return (f"{format_count(view.items_completed)}/{format_count(view.expected_items)} items "
                f"({format_percent(view.fraction_done)}), ETA {format_duration(view.eta_s)}")
    return f"{format_count(view.items_completed)} items"


def format_view_line(view: ProgressView) -> str:
    """The one-line form of a view, for logs."""
    return (
        f"[{format_duration(view.elapsed_s)}] done {_progress_text(view)} | "
        f"items in {format_count(view.items_received)} ({format_rate(view.items_received_per_s)}) "
        f"routed {format_count(view.items_routed)} done {format_count(view.items_completed)} "
        f"({format_rate(view.items_completed_per_s)}) | "
        f"tokens in {format_compact(view.tokens_received)} routed {format_compact(view.tokens_routed)} "
        f"done {format_compact(view.tokens_completed)} ({format_rate(view.tokens_completed_per_s)}) | "
        f"backlog {format_count(view.backlog_items)} items {format_compact(view.backlog_tokens)} tokens | "
        f"shapes {view.shapes} lanes {view.lanes_in_use} switches {view.shape_switches} | "
        f"cache hit {format_percent(view.cache_hit_rate)} padding {format_percent(view.padding_efficiency)} | "
        f"consumers {view.consumers_connected}/{view.consumers_known}"
        + (f" | {view.alert}" if view.alert else "")
    )


def progress_table(view: ProgressView) -> RenderableType:
    """The live display of a view: a flow table (items and tokens in / routed / completed
    with rates) over a compact grid of the rest."""
    flow = Table(box=box.SIMPLE, title=f"pipeline: {_progress_text(view)}", title_justify="left")
    for name in ("", "items", "items/s", "tokens", "tokens/s"):
        flow.add_column(name, justify="left" if not name else "right")
    for stage in ("received", "routed", "completed"):
        flow.add_row(stage, format_count(getattr(view, f"items_{stage}")),
                     format_rate(getattr(view, f"items_{stage}_per_s")), format_count(getattr(view, f"tokens_{stage}")),
                     format_rate(getattr(view, f"tokens_{stage}_per_s")))
    grid = Table.grid(padding=(0, 2))
    for _ in range(4):
        grid.add_column()
    grid.add_row("backlog", f"{format_count(view.backlog_items)} items / {format_count(view.backlog_tokens)} tokens",
                 "elapsed", format_duration(view.elapsed_s))
    grid.add_row("shapes", format_count(view.shapes), "lanes in use", format_count(view.lanes_in_use))
    grid.add_row("cache hit rate", f"{format_percent(view.cache_hit_rate)} (recent "
                 f"{format_percent(view.cache_hit_rate_recent)})", "shape switches", format_count(view.shape_switches))
    grid.add_row("padding efficiency", f"{format_percent(view.padding_efficiency)} (recent "
                 f"{format_percent(view.padding_efficiency_recent)})", "consumers",
                 f"{view.consumers_connected} connected / {view.consumers_known}")
    if view.alert:
        return Group(flow, grid, Text(view.alert, style="bold red"))
    return Group(flow, grid)


class LiveProgress:
    """Shows ProgressViews: a rich Live table redrawn at every update when the console is a
    terminal, otherwise a plain line at most every `log_interval_s` (and the last view on
    exit). Time comes from the caller. Owned by the launcher's polling thread; not
    thread-safe. Use as a context manager."""

    def __init__(self, stream: TextIO | None = None, *, console: Console | None = None,
                 log_interval_s: float = LOG_INTERVAL_S) -> None:
        # stderr by default: stdout stays free for the report (and for `--json` output).
        self.console = console or Console(file=stream if stream is not None else sys.stderr)
        self.log_interval_s = log_interval_s
        self.terminal = self.console.is_terminal
        self._live: Live | None = None
        self._logged_s: float | None = None
        self._unlogged: ProgressView | None = None

    def __enter__(self) -> LiveProgress:
        if self.terminal:
            # NOTE: auto_refresh off: rich's refresh thread would redraw on the wall clock;
            # the launcher's polls (2 a second) already pace the redraws.
            self._live = Live(console=self.console, auto_refresh=False, redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        return self

    def update(self, view: ProgressView, now_s: float) -> None:
        if self._live is not None:
            self._live.update(progress_table(view), refresh=True)
            return
        if self._logged_s is None or now_s - self._logged_s >= self.log_interval_s:
            self._write(view)
            self._logged_s = now_s
        else:
            self._unlogged = view

    def _write(self, view: ProgressView) -> None:
        self.console.file.write(format_view_line(view) + "\n")
        self.console.file.flush()
        self._unlogged = None

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        elif self._unlogged is not None:
            self._write(self._unlogged)  # the log ends with the run's last figures
