"""The rolling-lane policy of one shape (SPEC §2): which lane each item joins, when lanes open,
rise, quiesce and are released, and the per-lane counts the dispatcher orders lanes by."""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from pipeline.broker.ids import LaneId
from pipeline.broker.lanes.bulk import LANE_DTYPE, place_all
from pipeline.broker.lanes.config import (
    MAX_LENGTH_TOKENS,
    LaneConfig,
    LaneCounters,
    LaneView,
    TickResult,
    WasteMeasure,
    checked_length,
    checked_lengths,
)
from pipeline.broker.lanes.queues import NOTHING_QUEUED, NOTHING_QUEUED_MAX, LaneTable

_INF = float("inf")


class ShapeLanes:
    """The rolling lanes of one shape: assignment, maintenance and per-lane queue counts.

    Owned by the broker's single dispatch loop, one instance per (model, signature) shape.
    Not thread-safe: nothing here locks, and nothing needs to while one loop owns it.

    Active lanes sit in two parallel lists sorted by target (strictly increasing: a new lane or
    a raise only ever lands strictly between its neighbours), the only per-shape structure
    kept in step by hand: they are inserted, raised and filtered together, in `_open`,
    `_place`, `_open_or_revive`, `restore_lane` and `tick`. Quiescing lanes leave those lists
    at once, so the binary search never sees them and they take no new items; they keep their
    id and counts until nothing of them is queued or pending, then the tick releases the id.
    Released ids sit in a min-heap. Every per-lane field lives in one LaneTable (queues.py).
    NOTE: a SortedList was rejected: a raise changes a key in place, which a SortedList can only
    do by remove + add, and with at most a few thousand lanes a list insert is one memmove.
    """

    def __init__(self, config: LaneConfig | None = None, **overrides: object) -> None:
        """`ShapeLanes()` for the defaults, `ShapeLanes(max_lanes=128, measure="literal")` to
        override some, or `ShapeLanes(LaneConfig(...))`."""
        base = config if config is not None else LaneConfig()
        self._cfg = replace(base, **overrides) if overrides else base  # type: ignore[arg-type]
        self._literal = self._cfg.measure is WasteMeasure.LITERAL
        self.counters = LaneCounters()
        self._active_targets: list[int] = []
        self._active_ids: list[LaneId] = []
        self._quiescing: set[LaneId] = set()
        self._free: list[LaneId] = []  # heap of released ids
        self._in_use = 0
        self._threshold = self._cfg.threshold_base_fraction
        self._table = LaneTable()

    # ----------------------------------------------------------------- read-only state

    @property
    def config(self) -> LaneConfig:
        return self._cfg

    @property
    def lane_count(self) -> int:
        """Lanes in use: active plus quiescing (a quiescing lane holds its id until drained)."""
        return self._in_use

    @property
    def threshold(self) -> float:
        """Current waste-fraction threshold: base + rise * lanes_in_use / max_lanes."""
        return self._threshold

    def totals(self) -> tuple[int, int, int]:
        """(queued items, queued tokens, pending items) over every lane of the shape; ids
        not in use hold zeros. O(lanes ever opened), in C (sum over lists)."""
        table = self._table
        return sum(table.queued_items), sum(table.queued_tokens), sum(table.pending_items)

    def target(self, lane_id: LaneId) -> int:
        """The lane's target length in tokens (only rises while the id is in use)."""
        self._assert_live(lane_id)
        return self._table.target[lane_id]

    def queued_items(self, lane_id: LaneId) -> int:
        self._assert_live(lane_id)
        return self._table.queued_items[lane_id]

    def queued_tokens(self, lane_id: LaneId) -> int:
        self._assert_live(lane_id)
        return self._table.queued_tokens[lane_id]

    def pending_items(self, lane_id: LaneId) -> int:
        self._assert_live(lane_id)
        return self._table.pending_items[lane_id]

    def queued_min(self, lane_id: LaneId) -> int | None:
        """Length of the shortest item queued in the lane, None when nothing is queued."""
        self._assert_live(lane_id)
        value = self._table.qmin[lane_id]
        return None if value == NOTHING_QUEUED else value

    def queued_max(self, lane_id: LaneId) -> int | None:
        """Length of the longest item queued in the lane, None when nothing is queued: the
        "queue's longest item" that packing pads to (SPEC §3). O(1)."""
        self._assert_live(lane_id)
        value = self._table.front_max(lane_id)
        return None if value == NOTHING_QUEUED_MAX else value

    def last_seen_s(self, lane_id: LaneId) -> float:
        """When the lane last took an item (the `now_s` of that assign)."""
        self._assert_live(lane_id)
        return self._table.last_seen_s[lane_id]

    def is_quiescing(self, lane_id: LaneId) -> bool:
        self._assert_live(lane_id)
        return lane_id in self._quiescing

    def lane_ids(self) -> list[LaneId]:
        """Every lane in use: active ones in target order, then quiescing ones by id."""
        return [*self._active_ids, *sorted(self._quiescing)]

    def lanes_by_queued_tokens(self) -> list[LaneId]:
        """Lanes with queued items, most queued tokens first (ties: lower id first), quiescing
        lanes included since they must drain. The order the dispatcher tries lanes in (§4).
        NOTE: sorted on demand (numpy, ~0.1 ms at 2,048 lanes) rather than kept in a heap or
        sorted list: that would cost every assign an update, and the dispatcher asks once per
        batch, not once per item. Free ids hold no tokens, so they never appear."""
        tokens = np.array(self._table.queued_tokens, dtype=np.int64)
        queued = np.flatnonzero(tokens)
        return np.take(queued, np.lexsort((queued, -tokens[queued]))).tolist()

    def fullest_lane(self) -> LaneId | None:
        """The first lane of `lanes_by_queued_tokens()`, None when nothing is queued."""
        if not self._table.queued_tokens:
            return None
        tokens = np.array(self._table.queued_tokens, dtype=np.int64)
        lane = int(tokens.argmax())  # first maximum: the lowest id among ties
        return LaneId(lane) if tokens[lane] else None

    def lanes(self) -> list[LaneView]:
        """A snapshot of every lane in use, in `lane_ids()` order."""
        table = self._table
        return [
            LaneView(
                lane_id=lane,
                target=table.target[lane],
                quiescing=lane in self._quiescing,
                queued_items=table.queued_items[lane],
                queued_tokens=table.queued_tokens[lane],
                pending_items=table.pending_items[lane],
                queued_min=self.queued_min(lane),
                queued_max=self.queued_max(lane),
                last_seen_s=table.last_seen_s[lane],
            )
            for lane in self.lane_ids()
        ]

    # ----------------------------------------------------------------- assignment

    def assign(self, length: int, now_s: float) -> LaneId:
        """Put one item of `length` tokens in a lane and return the lane (SPEC §2).

        Candidates are the first active lane with target >= L (no raise; waste T - L,
        fraction (T - L) / T) and its lower neighbour (raised to L; waste L - ref, fraction
        (L - ref) / L, ref = the shortest item queued in it, or its target when empty; with
        the literal measure ref = its target). The smaller fraction wins; on equal fractions
        the lane that needs no raise. A new lane (target L) opens when the winner's fraction
        is above `threshold` and its waste >= 16 tokens, or its waste > 128 tokens, unless
        every lane id is in use: then the item is force-fitted to the winner.

        Worked example, two lanes with targets 510 and 1000, threshold 0.01 + 0.09 * 2 / 2048
        = 0.010088:
        - L = 990: upper 1000 wastes 10 (1.01%), above the threshold but under 16 tokens:
          joins lane 1000.
        - L = 520, lane 510's shortest queued item 505: upper wastes 480 (48%), raising lane
          510 wastes 520 - 505 = 15 (2.9%); 15 < 16 tokens, so lane 510 is raised to 520.
          Were its shortest item 500, the raise would waste 20 (3.8%) and lane 520 would open;
          the literal measure would see 520 - 510 = 10 tokens and raise the lane.
        """
        value = checked_length(length)
        lane = self._place(value)
        self._table.enqueue(lane, value, now_s)
        return lane

    def assign_many(self, lengths: Sequence[int] | np.ndarray, now_s: float) -> np.ndarray:
        """Assign each length in order, exactly as repeated `assign` would; lane ids as int32.
        How: lanes/bulk.py (numpy judges windows of items; state changes take the scalar path).

        Bad input (non-integer, <= 0, too long) raises BadInputError before anything is
        assigned, where repeated `assign` would have assigned the items before the bad one.
        """
        values = checked_lengths(lengths)
        if values.size < self._cfg.vector_min_call_items:
            return np.fromiter(
                (self.assign(value, now_s) for value in values.tolist()),
                dtype=LANE_DTYPE, count=values.size,
            )
        lanes = place_all(self, values)
        self._table.fold_all(values, lanes, now_s, qmin_current=not self._literal)
        return lanes

    # ----------------------------------------------------------------- what lanes/bulk.py reads

    @property
    def literal(self) -> bool:
        """Raises are measured against the lane's target (WasteMeasure.LITERAL)."""
        return self._literal

    def active_lanes(self) -> tuple[list[int], list[LaneId]]:
        """The active lanes' targets (strictly increasing) and their ids, in that order: the
        lists themselves, which the caller only reads."""
        return self._active_targets, self._active_ids

    def queued_minima(self) -> list[int]:
        """Each lane id's shortest queued length, NOTHING_QUEUED where its queue is empty: the
        list itself, which the caller only reads."""
        return self._table.qmin

    def place_virtual(self, length: int) -> LaneId:
        """`_place`, plus the lane's queued minimum as if the item were already queued:
        assign_many's scalar path, whose queues are folded in after (`LaneTable.fold_all`)."""
        lane = self._place(length)
        qmin = self._table.qmin
        if length < qmin[lane]:
            qmin[lane] = length
        return lane

    def _place(self, length: int) -> LaneId:
        """Decide the lane for `length`, open or raise it as needed; queues untouched."""
        targets = self._active_targets
        count = len(targets)
        if not count:
            return self._open_or_revive(length)
        pos = bisect_left(targets, length)
        up_frac = lo_frac = _INF
        up_waste = lo_waste = 0
        if pos < count:
            up_waste = targets[pos] - length
            up_frac = up_waste / targets[pos]
        if pos:
            ref = targets[pos - 1]
            if not self._literal:
                queued = self._table.qmin[self._active_ids[pos - 1]]
                ref = queued if queued < ref else ref
            lo_waste = length - ref
            lo_frac = lo_waste / length
        raise_lower = not (pos < count and up_frac <= lo_frac)
        frac, waste = (lo_frac, lo_waste) if raise_lower else (up_frac, up_waste)
        counters = self.counters
        if (frac > self._threshold and waste >= self._cfg.waste_floor_tokens) or (
            waste > self._cfg.waste_cap_tokens
        ):
            if self._in_use < self._cfg.max_lanes:
                return self._open(pos, length)
            counters.force_fits += 1
        counters.assigned += 1
        counters.reuses += 1
        if not raise_lower:
            return self._active_ids[pos]
        lane = self._active_ids[pos - 1]
        targets[pos - 1] = length
        self._table.target[lane] = length
        counters.raises += 1
        return lane

    def _open(self, pos: int, length: int) -> LaneId:
        """Open a lane with target `length` at position `pos` of the active lists."""
        lane = self._take_id()
        self._active_targets.insert(pos, length)
        self._active_ids.insert(pos, lane)
        self._table.target[lane] = length
        self.counters.assigned += 1
        self.counters.new_lanes += 1
        return lane

    def _open_or_revive(self, length: int) -> LaneId:
        """No active lane: open one, or, when every id is held by a quiescing lane, take back
        the quiescing lane that fits best (by the same fractions; ties: no raise, lower id).
        NOTE: raising an error was rejected (the broker must never refuse work), and so was a
        lane beyond the cap (the cap bounds open segment files)."""
        if self._in_use < self._cfg.max_lanes:
            return self._open(0, length)
        lane = min(self._quiescing, key=lambda q: self._fit_key(q, length))
        counters = self.counters
        table = self._table
        if table.target[lane] < length:
            table.target[lane] = length
            counters.raises += 1
        self._quiescing.discard(lane)
        self._active_targets.append(table.target[lane])
        self._active_ids.append(lane)
        counters.revived += 1
        counters.force_fits += 1
        counters.assigned += 1
        counters.reuses += 1
        return lane

    def _fit_key(self, lane: LaneId, length: int) -> tuple[float, bool, int]:
        target = self._table.target[lane]
        if target >= length:
            return ((target - length) / target, False, lane)
        ref = target if self._literal else min(self._table.qmin[lane], target)
        return ((length - ref) / length, True, lane)

    def _take_id(self) -> LaneId:
        """The lowest free lane id; the caller has checked the cap."""
        lane = heapq.heappop(self._free) if self._free else self._table.grow()
        self._count_in_use(+1)
        return lane

    def _count_in_use(self, change: int) -> None:
        """A lane id was taken (+1) or released (-1): the threshold and the peak follow."""
        self._in_use += change
        cfg = self._cfg
        self._threshold = (
            cfg.threshold_base_fraction + cfg.threshold_rise_fraction * self._in_use / cfg.max_lanes
        )
        if self._in_use > self.counters.max_in_use:
            self.counters.max_in_use = self._in_use

    # ----------------------------------------------------------------- recovery

    def restore_lane(
        self, lane_id: LaneId, target: int, lengths: Sequence[int] | np.ndarray, now_s: float
    ) -> bool:
        """Recovery: bring back a lane a restarted broker found stored items for, under its
        old id (the disk tier names segment files by it), with `target` and its queued
        items' lengths front first. The id must be free (never handed out, or released),
        `target` at least every length, and a lane id must be left under the cap.

        The lane takes new items again (returns True), unless an active lane already has
        this target (active targets are distinct): then it comes back quiescing (returns
        False), drains, and is released by a later tick as usual. No policy decision placed
        these items, so `assigned` does not count them; `restored` counts the lane.

        Example: on a fresh ShapeLanes, restore_lane(3, 512, [500, 510], 0.0) leaves ids 0,
        1, 2 free (a new lane takes 0 first) and lane 3 active with target 512, two items
        queued, queued minimum 500 and maximum 510.
        """
        values = checked_lengths(lengths)
        cfg = self._cfg
        assert values.size and int(values.max()) <= target <= MAX_LENGTH_TOKENS, (lane_id, target)
        assert 0 <= lane_id < cfg.max_lanes and self._in_use < cfg.max_lanes, lane_id
        while self._table.size <= lane_id:
            heapq.heappush(self._free, self._table.grow())
        assert lane_id in self._free, f"lane {lane_id} is in use"
        self._free.remove(lane_id)
        heapq.heapify(self._free)
        self._count_in_use(+1)
        self.counters.restored += 1
        self._table.target[lane_id] = target
        pos = bisect_left(self._active_targets, target)
        active = pos == len(self._active_targets) or self._active_targets[pos] != target
        if active:
            self._active_targets.insert(pos, target)
            self._active_ids.insert(pos, lane_id)
        else:
            self._quiescing.add(lane_id)
            self.counters.quiesced += 1
        lanes = np.full(values.size, lane_id, dtype=LANE_DTYPE)
        self._table.fold_all(values, lanes, now_s, qmin_current=False)
        return active

    # ----------------------------------------------------------------- queue events

    def on_dispatched(self, lane_id: LaneId, lengths: Sequence[int] | np.ndarray) -> None:
        """The broker committed a batch of the lane's front items: `lengths` in queue order,
        returned items first (they sit at the front). They leave the queue and become
        pending. Call it on commit only, never for a peek or for packing overflow (which
        stays at the front of the queue). Example: queue [returned 700 | 650, 690] and a
        batch of two: lengths [700, 650]; 690 is left and becomes the queued minimum."""
        self._assert_live(lane_id)
        self._table.dispatch(lane_id, [int(v) for v in lengths])

    def on_completed(self, lane_id: LaneId, count: int) -> None:
        """`count` pending items of the lane were completed (tombstoned) and are gone."""
        self._assert_live(lane_id)
        self._table.complete(lane_id, count)

    def on_returned(self, lane_id: LaneId, lengths: Sequence[int] | np.ndarray) -> None:
        """Pending items of a lost consumer go back to the FRONT of the lane's queue, ahead of
        new work, `lengths` in the order they will be dispatched again (front first). They
        go on the lane's min/max-stack; a quiescing lane stays quiescing and drains them.
        Example: queue [650, 690] (minimum 650); on_returned(lane, [700, 640]) makes it
        [700, 640, 650, 690], queued minimum 640, maximum 700, and the next batch starts with
        700."""
        self._assert_live(lane_id)
        self._table.give_back(lane_id, [int(v) for v in lengths])

    # ----------------------------------------------------------------- maintenance

    def tick(self, now_s: float) -> TickResult:
        """Maintenance (SPEC §2): an active lane with fewer than `quiesce_below_items` queued
        items and nothing assigned for `quiesce_idle_s` becomes quiescing (no new items);
        every quiescing lane with nothing queued or pending is released, its id back on the
        free list. The caller reacts to the result (e.g. closes the released lanes' files).
        Example at now_s = 10: lane A (2 queued, last item at 4.0) quiesces; lane B (2
        queued, last item at 6.0) stays; a quiescing lane C with 0 queued, 0 pending is
        released; lane A is released by a later tick, once its items are dispatched and
        completed."""
        cfg = self._cfg
        table = self._table
        keep_targets: list[int] = []
        keep_ids: list[LaneId] = []
        quiesced: list[LaneId] = []
        for target, lane in zip(self._active_targets, self._active_ids):
            idle = now_s - table.last_seen_s[lane] >= cfg.quiesce_idle_s
            if idle and table.queued_items[lane] < cfg.quiesce_below_items:
                quiesced.append(lane)
            else:
                keep_targets.append(target)
                keep_ids.append(lane)
        if quiesced:
            self._active_targets, self._active_ids = keep_targets, keep_ids
            self._quiescing.update(quiesced)
            self.counters.quiesced += len(quiesced)
        released = [
            lane for lane in sorted(self._quiescing)
            if not table.queued_items[lane] and not table.pending_items[lane]
        ]
        for lane in released:
            self._release(lane)
        return TickResult(quiesced=tuple(sorted(quiesced)), released=tuple(released))

    def next_tick_s(self, lane: LaneId | None = None) -> float | None:
        """The earliest time at which `tick` could change anything, were nothing else to
        happen (no assign, dispatch, completion or return): -inf when a quiescing lane is
        drained (the next tick releases it); for an active lane with fewer than
        `quiesce_below_items` queued, the moment it has been idle `quiesce_idle_s`; None when
        only one of those events can give a tick something to do. `lane`: that lane only
        (the one an event changed), else the whole shape. O(lanes) for the shape, O(1) for
        a lane. The dispatcher ticks a shape only once this time has come, so a broker with
        thousands of shapes does not visit each one every tick."""
        table = self._table
        cfg = self._cfg
        due: float | None = None
        if lane is None:
            lanes: Sequence[LaneId] = [*self._active_ids, *self._quiescing]
        elif 0 <= lane < table.size and table.target[lane] > 0:  # in use (release zeroes it)
            lanes = (lane,)
        else:
            return None  # released: nothing left to tick
        for lane_id in lanes:
            if lane_id in self._quiescing:
                if not table.queued_items[lane_id] and not table.pending_items[lane_id]:
                    return -_INF
            elif table.queued_items[lane_id] < cfg.quiesce_below_items:
                at = table.last_seen_s[lane_id] + cfg.quiesce_idle_s
                if due is None or at < due:
                    due = at
        return due

    def _release(self, lane: LaneId) -> None:
        self._quiescing.discard(lane)
        self._table.release(lane)
        heapq.heappush(self._free, lane)
        self._count_in_use(-1)
        self.counters.released += 1

    # ----------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Assert every internal invariant (tests call it after every step). Reads only: the
        object is left exactly as it was. O(lanes + queue windows)."""
        self._check_ids()
        targets, ids = self._active_targets, self._active_ids
        table = self._table
        assert len(targets) == len(ids)
        assert all(a < b for a, b in zip(targets, targets[1:])), targets
        assert all(table.target[lane] == t for lane, t in zip(ids, targets)), (ids, targets)
        for lane in self.lane_ids():
            table.check_lane(lane)
        cfg = self._cfg
        expected = cfg.threshold_base_fraction + cfg.threshold_rise_fraction * self._in_use / cfg.max_lanes
        assert self._threshold == expected, (self._threshold, expected)
        c = self.counters
        assert c.assigned == c.reuses + c.new_lanes, c
        assert c.released <= c.quiesced and c.revived <= c.quiesced, c
        assert self._in_use <= c.max_in_use <= cfg.max_lanes, c

    def _check_ids(self) -> None:
        live = set(self._active_ids)
        assert len(live) == len(self._active_ids), self._active_ids
        assert not live & self._quiescing, (live, self._quiescing)
        live |= self._quiescing
        free = set(self._free)
        assert len(free) == len(self._free) and not free & live, (free, live)
        assert free | live == set(range(self._table.size)), (free, live, self._table.size)
        assert len(live) == self._in_use <= self._cfg.max_lanes, (live, self._in_use)
        for lane in free:
            assert not (self._table.queued_items[lane] or self._table.pending_items[lane]), lane
            assert self._table.target[lane] == 0, lane

    def _assert_live(self, lane_id: LaneId) -> None:
        # A lane in use has a target >= 1; release resets it to 0.
        assert 0 <= lane_id < self._table.size and self._table.target[lane_id] > 0, lane_id
