"""Vectorised bulk placement: how `ShapeLanes.assign_many` decides many items' lanes at once,
with exactly the results of repeated `assign`.

Most items change no decision state: they join their upper candidate without a raise, and
are no shorter than its queued minimum (under the queued-minimum measure 1,976 of the
1,000,000 log-normal items of tools/bench_lanes.py part a, 0.2%, open a lane, raise one or
become a new queued minimum). For a window of items, numpy judges every item against the
state as it stands; the prefix that changes nothing is accepted at once, the first item that
would change something (new lane, raise, new queued minimum, force-fit into a lower lane)
goes through the scalar path, and judging resumes after it. Where state changes are dense
(the literal measure raises on about a third of items), a stretch of items goes through the
scalar path before numpy is tried again. Queue bookkeeping is folded in per lane afterwards
(LaneTable.fold_all).

Example: lanes 500 and 1000 (queued minima 495 and 990), lengths [995, 1000, 498, 700, 999]:
the first three are accepted by numpy (lanes 1000, 1000, 500), 700 opens a lane in the
scalar path, 999 is judged again and joins lane 1000.

These functions are assign_many's body, split from lanes/policy.py by concern: they read a
ShapeLanes through its public view (`LanePlacer`) and place state-changing items with its
scalar `place_virtual`, exactly as its own methods would; they keep no state between calls.
Their speed settings are LaneConfig's `vector_*` / `scalar_*` fields (lanes/config.py).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipeline.broker.ids import LaneId
from pipeline.broker.lanes.config import LaneConfig, LaneCounters

# Lane ids in assign_many's result. int32: max_lanes is far below 2**31.
LANE_DTYPE = np.int32


class LanePlacer(Protocol):
    """What place_all reads of one shape's lanes and places through: ShapeLanes' public view."""

    counters: LaneCounters

    @property
    def config(self) -> LaneConfig: ...

    @property
    def threshold(self) -> float: ...

    @property
    def lane_count(self) -> int: ...

    @property
    def literal(self) -> bool: ...

    def active_lanes(self) -> tuple[list[int], list[LaneId]]: ...

    def queued_minima(self) -> list[int]: ...

    def target(self, lane_id: LaneId) -> int: ...

    def place_virtual(self, length: int) -> LaneId: ...


@dataclass(slots=True)
class _VectorView:
    """The decision state as numpy arrays, by position in target order. Built and owned by
    one place_all call; not thread-safe."""

    targets: np.ndarray  # int64, strictly increasing
    ids: np.ndarray  # lane id at each position
    queued_min: np.ndarray  # int64, NOTHING_QUEUED where the lane's queue is empty
    reference: np.ndarray  # int64, what a raise of that lane is measured against
    threshold: float
    at_cap: bool


def place_all(lanes: LanePlacer, values: np.ndarray) -> np.ndarray:
    """Decide every item's lane, in order, opening and raising lanes as repeated `assign`
    would; lane ids as LANE_DTYPE. Queues are untouched (the caller folds the items in), but
    each lane's cached queued minimum is kept current as if each item were queued at once,
    because later decisions read it."""
    cfg = lanes.config
    out = np.empty(values.size, dtype=LANE_DTYPE)
    view: _VectorView | None = None
    window = cfg.vector_first_window_items
    i = 0
    while i < values.size:
        if view is None:
            view = _vector_view(lanes)
        chunk = values[i : i + window]
        run = _accept_run(lanes, view, chunk, out[i:])
        i += run
        if run == chunk.size:
            window = min(2 * window, cfg.vector_max_window_items)
            continue
        # values[i] changes the state: it takes the scalar path.
        window = max(2 * run, cfg.vector_short_run_items, 1)
        if run < cfg.vector_short_run_items:
            i = _place_stretch(lanes, values, out, i, cfg.scalar_stretch_items)
            view = None
        else:
            out[i] = lane = lanes.place_virtual(int(values[i]))
            i += 1
            view = _refresh_view(lanes, view, lane)
    return out


def _place_stretch(
    lanes: LanePlacer, values: np.ndarray, out: np.ndarray, start: int, count: int
) -> int:
    """Scalar path for `count` items from `start`; returns the index after them."""
    stop = min(start + count, values.size)
    out[start:stop] = [lanes.place_virtual(value) for value in values[start:stop].tolist()]
    return stop


def _vector_view(lanes: LanePlacer) -> _VectorView:
    active_targets, active_ids = lanes.active_lanes()
    targets = np.array(active_targets, dtype=np.int64)
    ids = np.array(active_ids, dtype=np.int64)
    qmin = lanes.queued_minima()
    queued_min = np.array([qmin[lane] for lane in active_ids], dtype=np.int64)
    reference = targets if lanes.literal else np.minimum(queued_min, targets)
    return _VectorView(
        targets=targets, ids=ids, queued_min=queued_min, reference=reference,
        threshold=lanes.threshold, at_cap=lanes.lane_count >= lanes.config.max_lanes,
    )


def _refresh_view(lanes: LanePlacer, view: _VectorView, lane: LaneId) -> _VectorView | None:
    """Bring `view` up to date after the scalar path placed an item in `lane`; None when
    the active set changed (a lane opened or came back), so the view must be rebuilt."""
    active_targets, active_ids = lanes.active_lanes()
    if len(active_ids) != view.targets.size:
        return None
    target = lanes.target(lane)
    pos = bisect_left(active_targets, target)
    queued_min = lanes.queued_minima()[lane]
    view.targets[pos] = target
    view.queued_min[pos] = queued_min
    if not lanes.literal:
        view.reference[pos] = min(queued_min, target)
    return view


def _accept_run(lanes: LanePlacer, view: _VectorView, chunk: np.ndarray, out: np.ndarray) -> int:
    """Judge `chunk` against `view` (the state before it) and accept its longest prefix
    of items that change no decision state, writing their lanes to `out`. Returns the
    prefix length. Same formulas as `_place`, so the float fractions are bit-identical."""
    count = view.targets.size
    if not count:
        return 0
    cfg = lanes.config
    pos = np.searchsorted(view.targets, chunk)  # first lane with target >= L
    has_upper = pos < count
    upper = np.minimum(pos, count - 1)
    up_target = view.targets[upper]
    up_waste = up_target - chunk
    up_frac = up_waste / up_target
    lo_frac = (chunk - view.reference[np.maximum(pos - 1, 0)]) / chunk
    ok = has_upper & ((pos == 0) | (up_frac <= lo_frac))
    opens = ((up_frac > view.threshold) & (up_waste >= cfg.waste_floor_tokens)) | (
        up_waste > cfg.waste_cap_tokens
    )
    if not view.at_cap:
        ok &= ~opens
    if not lanes.literal:
        ok &= chunk >= view.queued_min[upper]  # else the item is the lane's new minimum
    run = int(np.argmin(ok)) if not ok.all() else chunk.size
    if run:
        out[:run] = view.ids[upper[:run]]
        counters = lanes.counters
        counters.assigned += run
        counters.reuses += run
        if view.at_cap:
            counters.force_fits += int(np.count_nonzero(opens[:run]))
    return run
