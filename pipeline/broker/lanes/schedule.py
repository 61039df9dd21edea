"""When each shape's lanes next need maintenance: the dispatcher's schedule of ticks.

A ShapeLanes tick changes something only once a lane is due (ShapeLanes.next_tick_s: a
quiescing lane drained, or an active lane with few items idle long enough). The schedule
keeps, per shape, the earliest time it must be ticked, so a tick visits the due shapes
only, not every shape of the broker:

    schedule.offer(shape, lanes.next_tick_s())   # after any event that changed its lanes
    for shape in schedule.pop_due(now_s, 256):   # then tick each, and offer it again
        ...

NOTE: ticking every shape every tick_interval_s (the dispatcher's first version) took 12 ms
a tick on average and up to 100 ms with demo-chat's 7,829 one-item shapes; its consumers,
which hold about 7 ms of one-item batches, idled 1.4-1.5 s of a 40 s run in those ticks
(py-spy, and a turn log set against the results files' idle gaps).

Pure: no I/O, no clock. Owner: the Dispatcher, in the broker's loop. Not thread-safe.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

# The heap is rebuilt when stale entries (a shape offered again earlier) outnumber live ones
# by this factor.
_SLACK_FACTOR = 2


class TickSchedule:
    """A min-heap of (due_s, seq, key) and each scheduled key's earliest due time (heap
    entries that disagree with it are stale and skipped)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hashable]] = []
        self._due_at: dict[Hashable, float] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._due_at)

    def due_at(self, key: Hashable) -> float | None:
        return self._due_at.get(key)

    def offer(self, key: Hashable, due_s: float | None) -> None:
        """`key` must be visited no later than `due_s` (None: no time of its own). An earlier
        entry stays: visiting early is harmless, and the visit offers the key again."""
        if due_s is None:
            return
        scheduled = self._due_at.get(key)
        if scheduled is not None and scheduled <= due_s:
            return
        self._due_at[key] = due_s
        self._seq += 1
        heapq.heappush(self._heap, (due_s, self._seq, key))
        if len(self._heap) > _SLACK_FACTOR * len(self._due_at) + 64:
            self._heap = [(at, n, k) for n, (k, at) in enumerate(self._due_at.items(), start=self._seq + 1)]
            self._seq += len(self._heap)
            heapq.heapify(self._heap)

    def pop_due(self, now_s: float, most: int | None = None) -> list[Hashable]:
        """The keys due by `now_s`, earliest first, at most `most`; they leave the schedule."""
        heap = self._heap
        due: list[Hashable] = []
        while heap and heap[0][0] <= now_s and (most is None or len(due) < most):
            due_s, _seq, key = heapq.heappop(heap)
            if self._due_at.get(key) == due_s:
                del self._due_at[key]
                due.append(key)
        return due

    def any_due(self, now_s: float) -> bool:
        """Whether a key is due by `now_s` (stale entries may make this True once too often)."""
        return bool(self._heap) and self._heap[0][0] <= now_s

    def check_invariants(self) -> None:
        scheduled = {(at, key) for at, _n, key in self._heap}
        assert all((at, key) in scheduled for key, at in self._due_at.items()), "a due key is off the heap"
        assert len({n for _at, n, _key in self._heap}) == len(self._heap), "sequence numbers repeat"
