"""A job's progress in its requests, across every run of it: what the user sees.

    tracker = JobTracker(requests=N)
    tracker.observe(JobCounts(done=..., failed=..., completion_tokens=...), now_s)   # each poll
    view = tracker.view()           # done / failed / to do, requests and tokens per second, ETA
    format_job_line(view)           # "run-batch: 412,003 of 1,000,000 requests (41.2%) ..."

Pure: the caller passes the time. Rates are over the last RATE_WINDOW_S of this run's
observations; counts include what earlier runs answered (the answer log's). The same view,
as JSON, is the job's status file (`DATA_DIR/job/status.json`, written by the job's process)
that `pipeline status` reads, running or stopped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from pipeline.wire.textfiles import counted

# Rates are taken over this much of the latest observations: long enough to smooth batch
# completions, short enough that the ETA follows a change of pace within seconds.
RATE_WINDOW_S = 10.0
# Observations kept in the window whatever the caller's poll rate.
WINDOW_LIMIT_SAMPLES = 1024


@dataclass(slots=True)
class JobCounts:
    """What the answer log holds now."""

    done: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    by_status: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class JobView:
    requests: int
    done: int
    failed: int
    to_do: int
    requests_per_s: float | None
    tokens_per_s: float | None  # completion tokens
    eta_s: float | None
    elapsed_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    alert: str = ""  # what holds the job up (a full disk), said on the line

    def as_json(self) -> dict:
        fields = asdict(self)
        fields["by_status"] = {str(k): v for k, v in self.by_status.items()}
        return fields


class JobTracker:
    """See the module's doc. Owner: the job's process; not thread-safe."""

    def __init__(self, requests: int) -> None:
        self.requests = requests
        self._window: deque[tuple[float, int, int]] = deque()  # (now_s, done, completion tokens)
        self._first_s: float | None = None
        self._last = JobCounts()
        self._last_s = 0.0

    def observe(self, counts: JobCounts, now_s: float) -> None:
        assert counts.done <= self.requests, (counts.done, self.requests)
        if self._first_s is None:
            self._first_s = now_s
        self._last, self._last_s = counts, now_s
        self._window.append((now_s, counts.done, counts.completion_tokens))
        while len(self._window) > 2 and (now_s - self._window[0][0] > RATE_WINDOW_S
                                          or len(self._window) > WINDOW_LIMIT_SAMPLES):
            self._window.popleft()

    def view(self) -> JobView:
        counts = self._last
        rate = tokens = eta = None
        if len(self._window) >= 2 and self._window[-1][0] > self._window[0][0]:
            span = self._window[-1][0] - self._window[0][0]
            rate = (self._window[-1][1] - self._window[0][1]) / span
            tokens = (self._window[-1][2] - self._window[0][2]) / span
            to_do = self.requests - counts.done
            eta = to_do / rate if rate > 0 else None
        return JobView(self.requests, counts.done, counts.failed, self.requests - counts.done, rate, tokens, eta,
                       self._last_s - (self._first_s or self._last_s), counts.prompt_tokens, counts.completion_tokens,
                       counts.cached_tokens, dict(counts.by_status))

    def check_invariants(self) -> None:
        times = [t for t, _d, _c in self._window]
        assert times == sorted(times)
        assert len(self._window) <= WINDOW_LIMIT_SAMPLES + 2
        assert 0 <= self._last.failed <= self._last.done <= self.requests


def format_job_line(view: JobView) -> str:
    """The progress line: done / failed / to do, rates, ETA."""
    share = f"{view.done / view.requests:.1%}" if view.requests else "100%"
    rate = f"{view.requests_per_s:,.0f} requests/s" if view.requests_per_s is not None else "starting"
    tokens = f", {view.tokens_per_s:,.0f} tokens/s" if view.tokens_per_s is not None else ""
    eta = f", ETA {format_duration(view.eta_s)}" if view.eta_s is not None and view.to_do else ""
    alert = f"; {view.alert}" if view.alert else ""
    return (f"run-batch: {view.done:,} of {counted(view.requests, 'request')} answered ({share}), "
            f"{view.failed:,} failed, {view.to_do:,} to do; {rate}{tokens}{eta}{alert}")


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def paced_by(producers: float | None, consumers: float | None) -> str:
    """Which stage paced a run, from the share of it each was busy (None: not measured): the
    producers making prompts, the engines, or neither (the hand-offs, or the start)."""
    if producers is not None and producers >= 0.8 and (consumers is None or producers > consumers):
        return f"making prompts (the producers were busy {producers:.0%} of the run)"
    if consumers is not None and consumers >= 0.8:
        return f"the engines (the consumers were busy {consumers:.0%} of the run)"
    shown = ", ".join(f"{name} busy {share:.0%}" for name, share in (("producers", producers),
                                                                        ("consumers", consumers))
                      if share is not None)
    return f"no stage was busy most of the run ({shown}): the hand-offs between them, or the start"
