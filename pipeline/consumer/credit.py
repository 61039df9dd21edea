"""How many batches a consumer lets the broker hand it ahead of the one it runs.

Credit is a window, like TCP's: the broker may hold `window` batches for this consumer (in
its descriptor ring, or running) and sends no more until a completion returns credit. The
window must cover the broker's longest stretch without dispatching (ingesting one producer
frame, a control pass) at this consumer's pace, or the engine waits with nothing to run;
beyond that, every batch ahead is only work a dead consumer must have redelivered, and work
a finishing run cannot give to an idle consumer.

So the window is sized from the consumer's own batch time, the way a bandwidth-delay
product sizes a socket buffer: `window = ceil(ahead_s / mean batch time)`, clamped.

    batch time 1 ms (the sim engine at zero cost), ahead 25 ms   -> 25 batches ahead
    batch time 400 ms (a GPU prefill), ahead 25 ms              -> MIN_CREDIT (2)

NOTE: a fixed credit was rejected: 4 batches left the zero-cost pipeline's consumers idle
while the broker ingested a frame (132 k items/s at 64-item batches; 153 k at credit 32, by
the flood of `pipeline bench e2e`), while 32 would hold half a minute of GPU work per consumer at the
end of a real run, where one consumer finishes it alone and the others sit idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Seconds of work kept queued: the broker's longest stretch without dispatching is one
# producer frame's ingest (4,096 items at about 2 us: 8 ms) plus a control pass; 25 ms
# covers it about three times over. Swept with the flood of `pipeline bench e2e`
# (docs/history/BENCHMARKS-history.md).
DEFAULT_AHEAD_S = 0.025
# One batch running and one waiting: a slow engine needs no more, since its batch time hides
# the broker's turn many times over.
MIN_CREDIT = 2
# Upper bound on batches held: what a dead consumer has redelivered. The consumer also caps
# it by how many of its largest descriptors fit in its descriptor ring.
MAX_CREDIT = 64
# Credit asked for with the first request, before any batch time is known (the window then
# follows the measured batch time from the first completion on).
INITIAL_CREDIT = 4
# Weight of the newest batch time in the running mean: about the last ten batches count.
BATCH_TIME_WEIGHT = 0.2


def window_for(mean_batch_s: float, ahead_s: float, low: int, high: int) -> int:
    """ceil(ahead_s / mean_batch_s) clamped to [low, high]; `high` for batches too quick to
    divide by (zero time, or so small the quotient overflows)."""
    if mean_batch_s * high <= ahead_s:
        return high
    return min(max(math.ceil(ahead_s / mean_batch_s), low), high)


@dataclass(slots=True)
class CreditWindow:
    """The consumer's side of credit: how many batches it granted and has not completed,
    and the window it aims for. Pure (the caller measures batch times).

    Owner: the consumer's main thread, one per broker session. Not thread-safe.

    Example, ahead 25 ms: `start()` -> 4 granted. A completion of a 1 ms batch: the mean
    is 1 ms, the window 25, outstanding 3, so `completed(0.001)` grants 22. Later batches
    of 10 ms move the mean up and the window down; completions then grant 0 until the
    outstanding batches drain below the new window, then 1 per completion again.
    """

    ahead_s: float = DEFAULT_AHEAD_S
    min_credit: int = MIN_CREDIT
    max_credit: int = MAX_CREDIT
    window: int = 0
    outstanding: int = 0
    mean_batch_s: float | None = None
    # Batches the window never goes below (at most max_credit): what a pipelined engine
    # needs to keep its running set full (`Pace`); 0 for none.
    floor: int = 0

    def __post_init__(self) -> None:
        assert 1 <= self.min_credit <= self.max_credit, (self.min_credit, self.max_credit)
        assert self.ahead_s >= 0, self.ahead_s

    @classmethod
    def fixed(cls, credit: int) -> CreditWindow:
        """A window that never moves (`credit` batches ahead, whatever the batch time)."""
        return cls(min_credit=credit, max_credit=credit)

    def start(self) -> int:
        """Credit for a new session's first request; forgets the last session's batches."""
        self.window = min(max(INITIAL_CREDIT, self.min_credit), self.max_credit)
        self.outstanding = self.window
        return self.window

    def completed(self, batch_s: float) -> int:
        """A batch that took `batch_s` seconds completed: the credit to send with it."""
        assert self.outstanding > 0, "a completion nobody granted"
        self.outstanding -= 1
        batch_s = max(batch_s, 0.0)
        if self.mean_batch_s is None:
            self.mean_batch_s = batch_s
        else:
            self.mean_batch_s += BATCH_TIME_WEIGHT * (batch_s - self.mean_batch_s)
        self.window = max(window_for(self.mean_batch_s, self.ahead_s, self.min_credit, self.max_credit),
                          min(self.floor, self.max_credit))
        grant = max(0, self.window - self.outstanding)
        self.outstanding += grant
        return grant

    def check_invariants(self) -> None:
        assert self.min_credit <= self.window <= self.max_credit or self.window == 0, self
        assert 0 <= self.outstanding <= self.max_credit, self
        assert self.mean_batch_s is None or self.mean_batch_s >= 0, self


@dataclass(slots=True)
class Pace:
    """How fast this consumer completes batches, for its credit window. Pure (the caller
    passes the clock). Owner: the consumer's main thread, one per broker session.

    A batch's time is from its start or the last completion, whichever is later: with the
    engine pipelined, batches overlap, and what the window must cover is the time between
    completions. The floor it returns keeps a pipelined engine's running set full (vLLM's
    max_num_seqs prompts, in batches of the mean size seen) with `min_credit` batches
    waiting in the ring beyond it; 0 for an engine that runs one batch at a time."""

    batch_s: float = 0.0
    last_done_s: float = float("-inf")
    mean_items: float = 0.0

    def completed(self, started_s: float, now_s: float, items: int, running_prompts: int, min_credit: int) -> int:
        self.batch_s = max(0.0, now_s - max(started_s, self.last_done_s))
        self.last_done_s = now_s
        self.mean_items = items if self.mean_items == 0 else self.mean_items + BATCH_TIME_WEIGHT * (
            items - self.mean_items)
        if running_prompts == 0:
            return 0
        return math.ceil(running_prompts / max(self.mean_items, 1.0)) + min_credit
