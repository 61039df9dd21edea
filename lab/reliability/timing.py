"""The figures of a kill campaign: percentiles, and which items a lost consumer's loss sent
back to dispatch, read off the results files alone.

Redelivery is found without asking the broker: in a campaign whose items all sit in one
lane (one shape, one length) the broker hands each producer's items out in its order (item
sequence), and a lost consumer's entries go back to
the front of their lane, ahead of new work (`Dispatcher.consumer_lost`). So an item whose
results line was dispatched after the loss although an item later in the sequence had been
dispatched before it was dispatched twice: it is one of those the loss sent back. Its
redelivery latency is from the loss (the kill, the SIGSTOP, the socket's shutdown) to the
last such item's completion by a consumer (`done_ns`). The campaign checks the count
against the broker's own `items_returned`, so a broken premise shows, not a figure.

Pure: no I/O, no clock. Times are `time.monotonic_ns()`: one clock for every process of the
machine (results lines carry it too).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipeline.wire.layouts.frames import ITEM_ID_SEQ_BITS, MAX_SEQ


@dataclass(frozen=True, slots=True)
class Line:
    """What the redelivery figure needs of one results line."""

    item_id: int
    consumer: str  # the results file's name
    dispatch_ns: int
    done_ns: int

    @property
    def seq(self) -> int:
        return self.item_id & MAX_SEQ

    @property
    def producer(self) -> int:
        return self.item_id >> ITEM_ID_SEQ_BITS


@dataclass(frozen=True, slots=True)
class Loss:
    """One consumer lost at `at_ns`; the next fault of the campaign is at `until_ns`. The
    broker cannot have handed its batches out again before `returned_ns` (the loss itself
    for a kill or a closed socket; nearly the heartbeat timeout later for a paused consumer,
    which may still be handed a batch while its silence is not yet judged)."""

    consumer: str
    kind: str
    at_ns: int
    until_ns: int
    returned_ns: int = -1

    def __post_init__(self) -> None:
        if self.returned_ns < 0:
            object.__setattr__(self, "returned_ns", self.at_ns)


@dataclass(frozen=True, slots=True)
class Redelivery:
    loss: Loss
    items: int  # items found dispatched again after the loss
    latency_s: float | None  # loss to the last of them completed; None when it held none


def percentiles(values: Iterable[float]) -> dict[str, float | int | None]:
    """n, p50, p99 and max (nearest rank: the value a share of the runs stayed at or under)."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "p50": None, "p99": None, "max": None}

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {"n": len(ordered), "p50": rank(0.50), "p99": rank(0.99), "max": ordered[-1]}


def redeliveries(lines: Sequence[Line], losses: Sequence[Loss]) -> list[Redelivery]:
    """For each loss, the items dispatched again after it (see the module docstring): lines
    dispatched in [returned_ns, until_ns) whose sequence is below the highest sequence of
    their producer dispatched before returned_ns (a producer's items keep its order in the
    lane, whoever else's items come between)."""
    by_dispatch = sorted(lines, key=lambda line: line.dispatch_ns)
    found = []
    for loss in losses:
        high: dict[int, int] = {}
        for line in by_dispatch:
            if line.dispatch_ns >= loss.returned_ns:
                break
            high[line.producer] = max(high.get(line.producer, -1), line.seq)
        again = [line for line in by_dispatch if loss.returned_ns <= line.dispatch_ns < loss.until_ns
                 and line.seq < high.get(line.producer, -1)]
        items = {line.item_id for line in again}
        latency = (max(line.done_ns for line in again) - loss.at_ns) / 1e9 if again else None
        found.append(Redelivery(loss, len(items), latency))
    return found
