"""Brute-force audits of the lanes, kept here because production keeps no such trail:
`check_windows` checks a LaneTable row's min/max windows against plain lists, and
`AuditedLanes` records every queued length of every lane of a ShapeLanes and checks its
windows that way after every event."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence

import numpy as np

from pipeline.broker.ids import LaneId
from pipeline.broker.lanes import LaneConfig, ShapeLanes, TickResult
from pipeline.broker.lanes.queues import NOTHING_QUEUED, LaneTable


def window_entries(keys: list[int], head: int) -> list[tuple[int, int]]:
    """What a monotonic min-deque must hold for `keys` (the main part, front first, the first
    key at sequence number `head`): every key smaller than all later ones, with its number."""
    expected: list[tuple[int, int]] = []
    lowest = NOTHING_QUEUED
    for seq in reversed(range(len(keys))):
        if keys[seq] < lowest:
            lowest = keys[seq]
            expected.append((head + seq, lowest))
    expected.reverse()
    return expected


def check_windows(table: LaneTable, lane: LaneId, main: list[int], returned: list[int]) -> None:
    """The lane's row matches its queue by brute force: `returned` (front first) ahead of
    `main` (arrival order)."""
    whole = returned + main
    assert [value for value, _, _ in reversed(table.returned[lane])] == returned
    assert table.queued_items[lane] == len(whole) and table.queued_tokens[lane] == sum(whole)
    assert table.qmin[lane] == min(whole, default=NOTHING_QUEUED), (lane, whole)
    assert table.front_max(lane) == max(whole, default=0), (lane, whole)
    head = table.head_seq[lane]
    assert list(table.mins[lane]) == window_entries(main, head), (lane, main)
    assert list(table.maxs[lane]) == window_entries([-v for v in main], head), (lane, main)


class AuditedLanes:
    """A ShapeLanes plus an audit: the lengths queued in every lane (returned items and the
    main part, in queue order), the target each lane had when last checked, the releases
    seen. The event methods check the lengths they are given against it; check_invariants
    adds the brute force to the ShapeLanes' own checks. Everything else is the ShapeLanes'.
    Owned by one test; not thread-safe."""

    def __init__(self, config: LaneConfig | None = None, **overrides: object) -> None:
        self.inner = ShapeLanes(config, **overrides)
        self.main: defaultdict[int, deque[int]] = defaultdict(deque)  # arrival order
        self.returned: defaultdict[int, list[int]] = defaultdict(list)  # front first
        self.checked_targets: dict[int, int] = {}
        self.released = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def assign(self, length: int, now_s: float) -> LaneId:
        lane = self.inner.assign(length, now_s)
        self.main[lane].append(int(length))
        return lane

    def assign_many(self, lengths: Sequence[int] | np.ndarray, now_s: float) -> np.ndarray:
        lanes = self.inner.assign_many(lengths, now_s)
        for lane, length in zip(lanes.tolist(), np.asarray(lengths).tolist()):
            self.main[lane].append(length)
        return lanes

    def restore_lane(self, lane_id: LaneId, target: int, lengths: Sequence[int] | np.ndarray,
                     now_s: float) -> bool:
        active = self.inner.restore_lane(lane_id, target, lengths, now_s)
        assert not self.main[lane_id] and not self.returned[lane_id], lane_id
        self.main[lane_id].extend(int(v) for v in lengths)
        return active

    def on_dispatched(self, lane_id: LaneId, lengths: Sequence[int] | np.ndarray) -> None:
        self.inner.on_dispatched(lane_id, lengths)
        values = [int(v) for v in lengths]
        returned, main = self.returned[lane_id], self.main[lane_id]
        taken = returned[: len(values)]
        del returned[: len(values)]
        taken += [main.popleft() for _ in range(len(values) - len(taken))]
        assert taken == values, (lane_id, taken, values)

    def on_returned(self, lane_id: LaneId, lengths: Sequence[int] | np.ndarray) -> None:
        self.inner.on_returned(lane_id, lengths)
        self.returned[lane_id][:0] = [int(v) for v in lengths]

    def tick(self, now_s: float) -> TickResult:
        result = self.inner.tick(now_s)
        for lane in result.released:
            assert not self.main[lane] and not self.returned[lane], lane
            self.checked_targets.pop(lane, None)  # the id starts a new life
        self.released += len(result.released)
        return result

    def check_invariants(self) -> None:
        """The ShapeLanes' own checks, then: targets only rise while an id is in use, every
        release was reported by a tick, and every lane's counts, extremes and windows are
        those of the lengths recorded here."""
        lanes = self.inner
        lanes.check_invariants()
        assert lanes.counters.released == self.released, (lanes.counters, self.released)
        in_use = set(lanes.lane_ids())
        for lane in in_use:
            target = lanes.target(lane)
            assert target >= self.checked_targets.get(lane, 0), (lane, target)
            self.checked_targets[lane] = target
            check_windows(lanes._table, lane, list(self.main[lane]), self.returned[lane])
        for lane in set(self.main) | set(self.returned):
            assert lane in in_use or not (self.main[lane] or self.returned[lane]), lane
