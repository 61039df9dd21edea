"""When dispatch starts: once `min_consumers` consumers have registered, or `wait_s` after the
broker started, whichever comes first (BrokerConfig.min_consumers, .min_consumers_wait_s).

Engines start at different times (a vLLM consumer loads its model before it registers: 10-20 s
for the CPU build's tiny model here, minutes for a large one on a GPU). A broker that hands
work to the first consumer up gives it the head of every shape while the others load: on a
short job the first one runs most of it alone, and where a shape then joins a second consumer
its prefix is computed on both. Spark's scheduler has the same setting for the same reason
(`spark.scheduler.minRegisteredResourcesRatio` with `maxRegisteredResourcesWaitingTime`).
Off by default (`min_consumers = 0`): a streaming pipeline starts on its first consumer.

    gate = StartGate(min_consumers=2, wait_s=30.0)
    gate.is_open(now_s=now, registered=0)        # False: the wait starts at the first look
    gate.is_open(now_s=now + 1, registered=1)    # False: one of two, 1 s of 30
    gate.is_open(now_s=now + 2, registered=2)    # True, and from then on whatever the count

The wait starts at the broker loop's first dispatch, after recovery and catch-up (time in
which no consumer can be served must not use it up). Once open it stays open: a consumer
lost later must not stop the others' work. A broker that restarts closes it again: after a
crash, consumers reconnect within their backoff (about 2 s) and the gate opens at the count;
one that does not come back (its results disk full, backing off) holds the backlog for the
wait. Set the wait above the engines' load time (30 s, the default, is short for a large
model on a GPU), and note that a starvation bound (`max_age_s`) below it has every shape
starving when the gate opens: the oldest work first, not the prefix order.

Pure: no I/O, no clock (the caller passes the times). Owner: the broker's ConsumerSide, in
its single loop. Not thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StartGate:
    min_consumers: int
    wait_s: float
    started_s: float | None = None  # the first look (None: not looked at yet)
    opened_s: float | None = None  # when it opened (None: still closed)
    opened_with: int = 0  # consumers registered when it opened

    def __post_init__(self) -> None:
        assert self.min_consumers >= 0 and self.wait_s >= 0, (self.min_consumers, self.wait_s)

    @property
    def gating(self) -> bool:
        """Whether it can still hold dispatch back (closed, and more than one consumer wanted:
        the first consumer to register opens a gate of one anyway)."""
        return self.opened_s is None and self.min_consumers > 1

    def is_open(self, now_s: float, registered: int) -> bool:
        """Whether batches may be dispatched now, with `registered` consumers registered."""
        if self.opened_s is not None:
            return True
        if self.started_s is None:
            self.started_s = now_s
        if self.min_consumers <= 1 or registered >= self.min_consumers or now_s - self.started_s >= self.wait_s:
            self.opened_s, self.opened_with = now_s, registered
        return self.opened_s is not None

    def check_invariants(self) -> None:
        """Side-effect free: an open gate was looked at first, and opened at or after that."""
        assert self.opened_s is None or (self.started_s is not None and self.opened_s >= self.started_s), self
