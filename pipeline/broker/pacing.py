"""When the broker sends a batch that is not full, and how long ingest may hold its loop:
Nagle's rule for batches, in one place.

A consumer that holds enough batches to keep busy is sent only batches worth sending: full
enough, or from a lane that stopped growing (waiting will not fill it). A consumer running
short takes what there is, and while one is short the broker's fill of new frames yields to
dispatch after a short slice. Three sides of the broker ask this one policy:

    ConsumerSide   partial_allowed(held)  -> may this consumer get a batch that is not full?
                   hungry(consumers)      -> may a consumer run dry within a few batches?
    Dispatcher     worth_sending(...)     -> is this lane's batch full enough, or stalled?
    ProducerSide   fill_slice_s(...)      -> how long a frame stored in slices may take

Pure: no clock (the caller passes how long a lane has been idle), no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# A batch that is not full goes only to a consumer holding fewer batches than this (one
# running, three waiting). A quick consumer's window (consumer/credit.py) reaches 64 batches,
# and filling it with partial batches of shallow lanes takes the demo's mean batch fill from
# 0.25 to 0.14-0.16 while they only wait in its ring.
# NOTE: 2 was rejected: consumers of deep queues starved whenever the current shape's lane ran
# short (the flood of `pipeline bench e2e`: 139 k and 225 k items/s against 165 k and 242 k).
PARTIAL_BATCHES_AHEAD = 4
# A batch for a consumer that holds enough is worth sending if it fills this share (percent,
# compared in integers: no rounding at the boundary) of what its contract lets it hold: a
# lane of 7 long prompts that fill 85% of the token budget is worth sending, 2 are not.
FULL_ENOUGH_PERCENT = 75
# ...or if its lane took no new item for this long: waiting will not fill it then. demo-chat's
# turns are shapes of 1-3 items, all in within the first second; held to PARTIAL_BATCHES_AHEAD
# one-item batches (about 7 ms of work), its consumers idled at every broker hiccup longer
# than that. A lane of the streaming demo takes an item every few ms, so it still waits.
PARTIAL_WAIT_S = 0.25
# How long a fill storing a frame in slices may last while a consumer is hungry: one-item
# batches of 1-2 ms run dry in the ~7 ms a consumer holds, and a whole frame of 200 new
# shapes (50 ms) left both consumers idle 1.6-1.9 s of the first seconds of demo-chat (turn
# log against the results files' idle gaps). 2 ms leaves the turn (dispatch, control) room.
HUNGRY_FILL_SLICE_S = 0.002


@dataclass(frozen=True, slots=True)
class BatchPacing:
    """The rule's four numbers (the module's constants by default; tests vary them)."""

    batches_ahead: int = PARTIAL_BATCHES_AHEAD
    full_enough_percent: int = FULL_ENOUGH_PERCENT
    partial_wait_s: float = PARTIAL_WAIT_S
    hungry_fill_slice_s: float = HUNGRY_FILL_SLICE_S

    def __post_init__(self) -> None:
        self.check_invariants()

    def check_invariants(self) -> None:
        assert self.batches_ahead >= 1, self.batches_ahead  # 0 would starve every consumer
        assert 0 < self.full_enough_percent <= 100, self.full_enough_percent
        assert self.partial_wait_s >= 0.0, self.partial_wait_s
        assert self.hungry_fill_slice_s > 0.0, self.hungry_fill_slice_s

    def partial_allowed(self, held_batches: int) -> bool:
        """Whether a consumer holding `held_batches` (sent, not yet completed) may be sent a
        batch that is not full: it may run dry before a full one comes."""
        assert held_batches >= 0, held_batches
        return held_batches < self.batches_ahead

    def hungry(self, consumers: Iterable[tuple[int, int]]) -> bool:
        """Whether some consumer, given as (credit, held batches), can take a batch and may run
        dry: the loop then keeps its fill short."""
        return any(credit > 0 and self.partial_allowed(held) for credit, held in consumers)

    def worth_sending(self, available: int, fits: int, idle_s: float) -> bool:
        """Whether a lane's batch goes to a consumer that holds enough to run: its `available`
        items fill FULL_ENOUGH_PERCENT of the `fits` a whole batch holds, or the lane took
        no item for `idle_s` >= PARTIAL_WAIT_S (nothing is coming to fill it)."""
        assert available >= 0 and fits >= 1, (available, fits)
        return available * 100 >= self.full_enough_percent * fits or idle_s >= self.partial_wait_s

    def fill_slice_s(self, work_slice_s: float, hungry: bool) -> float:
        """How long a frame stored in slices may hold the loop: the work slice, or
        HUNGRY_FILL_SLICE_S (never longer) while a consumer is hungry."""
        return min(self.hungry_fill_slice_s, work_slice_s) if hungry else work_slice_s


PACING = BatchPacing()
