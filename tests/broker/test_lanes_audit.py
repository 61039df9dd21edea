"""The audit trail the production ShapeLanes does not keep, kept here: `AuditedLanes` records
every queued length of every lane and checks the lanes' windows against it by brute force
(tests/broker/test_lanes.py drives it). Also: check_invariants reads only."""

from __future__ import annotations

import pickle
from collections import defaultdict, deque
from collections.abc import Sequence

import numpy as np
import pytest
from test_lane_queues import check_windows

from pipeline.broker.ids import LaneId
from pipeline.broker.lanes import LaneConfig, ShapeLanes, TickResult


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


# ------------------------------------------------------------------------- tests


def busy_lanes() -> AuditedLanes:
    """Lanes in every state: restored, active, raised, quiescing, released and reused, with
    returned and pending items; the audit checked after every step."""
    rng = np.random.default_rng(7)
    lanes = AuditedLanes(max_lanes=6, vector_min_call_items=1, vector_first_window_items=2)
    lanes.restore_lane(LaneId(4), 900, [880, 890], 0.0)
    for step in range(60):
        now_s = float(step)
        lanes.assign_many(np.maximum(1, rng.lognormal(np.log(500), 0.6, 8)).astype(np.int64), now_s)
        for lane in lanes.lane_ids()[step % 3 :: 3]:
            front = (lanes.returned[lane] + list(lanes.main[lane]))[:3]
            if not front:
                continue
            lanes.on_dispatched(lane, front)
            lanes.on_returned(lane, front[1:])
            lanes.on_completed(lane, 1)
        lanes.tick(now_s * 2)
        lanes.check_invariants()
    c = lanes.counters
    assert c.released and c.raises and c.restored and c.quiesced, c  # every state was reached
    return lanes


def observable(lanes: ShapeLanes) -> tuple[object, ...]:
    return (lanes.lanes(), lanes.lane_ids(), lanes.lanes_by_queued_tokens(), lanes.totals(),
            lanes.fullest_lane(), lanes.threshold, lanes.lane_count, repr(lanes.counters))


def test_check_invariants_changes_nothing():
    """Byte for byte: the whole object pickled, and everything it shows, before and after."""
    lanes = busy_lanes().inner
    before = pickle.dumps(lanes), observable(lanes)
    lanes.check_invariants()
    lanes.check_invariants()
    assert (pickle.dumps(lanes), observable(lanes)) == before


def test_audit_catches_lengths_the_lanes_cannot_check():
    """The production object keeps no lengths of the main part, so a dispatch naming the
    wrong ones passes there; the audit refuses it."""
    lanes = AuditedLanes()
    lane = lanes.assign(500, 0.0)
    lanes.assign(495, 0.0)
    with pytest.raises(AssertionError):
        lanes.on_dispatched(lane, [495])  # the front item is 500
