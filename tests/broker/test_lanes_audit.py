"""ShapeLanes' check_invariants reads only; and the audit the production ShapeLanes does not
keep (`AuditedLanes`, tests/support/lanes_audit.py; tests/broker/test_lanes.py drives it)
catches what the lanes cannot check."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from pipeline.broker.ids import LaneId
from pipeline.broker.lanes import ShapeLanes
from tests.support.lanes_audit import AuditedLanes


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
