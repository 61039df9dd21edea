"""Vectorised bulk placement: how `ShapeLanes.assign_many` decides many items' lanes at once,
with exactly the results of repeated `assign`, and the settings that tune its speed.

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

These functions are assign_many's body, split from lanes/policy.py by concern: they read the
ShapeLanes' active lanes and LaneTable and place state-changing items with its scalar
`_place`, exactly as its own methods would; they keep no state between calls.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pipeline.broker.ids import LaneId

if TYPE_CHECKING:
    from pipeline.broker.lanes.policy import ShapeLanes

# assign_many calls shorter than this just loop `assign`: building the numpy view of the lane
# state (tens of microseconds) costs more than it saves on a handful of items.
VECTOR_MIN_CALL_ITEMS = 64
# First window of items judged at once by assign_many; it then doubles after a window without
# a state change and shrinks to about twice the observed run after one.
VECTOR_FIRST_WINDOW_ITEMS = 256
# Largest window: bounds the numpy work thrown away when a state change cuts a window short.
VECTOR_MAX_WINDOW_ITEMS = 16384
# A vectorised run shorter than this means state changes are dense (e.g. the literal measure
# raises on about a third of items); one numpy pass then costs more than the scalar path...
# (0: never fall back; tests use it to send every state change through the view refresh.)
VECTOR_SHORT_RUN_ITEMS = 8
# ...so this many items go through the scalar path before numpy is tried again.
SCALAR_STRETCH_ITEMS = 512

# Lane ids in assign_many's result. int32: max_lanes is far below 2**31.
LANE_DTYPE = np.int32


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


def place_all(lanes: ShapeLanes, values: np.ndarray) -> np.ndarray:
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
            out[i] = lane = _place_virtual(lanes, int(values[i]))
            i += 1
            view = _refresh_view(lanes, view, lane)
    return out


def _place_virtual(lanes: ShapeLanes, length: int) -> LaneId:
    """ShapeLanes._place, plus the queued minimum as if the item were already queued."""
    lane = lanes._place(length)
    qmin = lanes._table.qmin
    if length < qmin[lane]:
        qmin[lane] = length
    return lane


def _place_stretch(
    lanes: ShapeLanes, values: np.ndarray, out: np.ndarray, start: int, count: int
) -> int:
    """Scalar path for `count` items from `start`; returns the index after them."""
    stop = min(start + count, values.size)
    out[start:stop] = [_place_virtual(lanes, value) for value in values[start:stop].tolist()]
    return stop


def _vector_view(lanes: ShapeLanes) -> _VectorView:
    active_ids = lanes._active_ids
    targets = np.array(lanes._active_targets, dtype=np.int64)
    ids = np.array(active_ids, dtype=np.int64)
    qmin = lanes._table.qmin
    queued_min = np.array([qmin[lane] for lane in active_ids], dtype=np.int64)
    reference = targets if lanes._literal else np.minimum(queued_min, targets)
    return _VectorView(
        targets=targets, ids=ids, queued_min=queued_min, reference=reference,
        threshold=lanes.threshold, at_cap=lanes.lane_count >= lanes.config.max_lanes,
    )


def _refresh_view(lanes: ShapeLanes, view: _VectorView, lane: LaneId) -> _VectorView | None:
    """Bring `view` up to date after the scalar path placed an item in `lane`; None when
    the active set changed (a lane opened or came back), so the view must be rebuilt."""
    if len(lanes._active_ids) != view.targets.size:
        return None
    table = lanes._table
    target = table.target[lane]
    pos = bisect_left(lanes._active_targets, target)
    view.targets[pos] = target
    view.queued_min[pos] = table.qmin[lane]
    if not lanes._literal:
        view.reference[pos] = min(table.qmin[lane], target)
    return view


def _accept_run(lanes: ShapeLanes, view: _VectorView, chunk: np.ndarray, out: np.ndarray) -> int:
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
    if not lanes._literal:
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
