"""The per-lane queue state of one shape: counts, target, and the min/max windows that give a
lane's queued minimum and maximum in O(1) amortised per event.

A lane's queue is pushed at both ends, so each extreme is kept by two structures:
- new items join the back and leave from the front: monotonic deques of (sequence number,
  key), the key being the length (min-deque: strictly increasing, its front is the main
  part's minimum) or the negated length (a min-deque of -length is a max-deque of length);
  of equal keys only the latest is kept;
- items returned by a lost consumer go to the front, ahead of new work, and are the first to
  leave again: that end is a stack, so they sit in a min/max-stack of (length, minimum and
  maximum of this and every returned item behind it).
The lane's queued minimum is the smaller of the two minima, its queued maximum the larger of
the two maxima.

Example: items 505, 490, 500 join in that order (sequence numbers 0, 1, 2): the min-deque
holds (1, 490), (2, 500), the max-deque (0, -505), (2, -500); dispatching one item moves the
head to 1 and drops (0, -505), so the maximum is 500 and the minimum still 490.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pipeline.broker.ids import LaneId
from pipeline.broker.lanes.config import MAX_LENGTH_TOKENS

# "Nothing queued" for the queued minimum: above every valid length, so min() just works.
NOTHING_QUEUED = MAX_LENGTH_TOKENS + 1
# "Nothing queued" for the queued maximum: below every valid length, so max() just works.
NOTHING_QUEUED_MAX = 0
# fold_all tags each lane's group of keys (lengths or negated lengths, |key| < 2**31) with
# group index << this before one running minimum over the whole call: tagged groups occupy
# disjoint ranges, so the minimum restarts at each group.
_GROUP_SHIFT_BITS = 32
# Below this many lane ids the lane numbers fit int16 keys, which numpy's stable argsort
# sorts by radix (fold_all's grouping sort).
_RADIX_SORT_LANES = 2**15

Window = deque[tuple[int, int]]


def group_suffix_minima(
    keys: np.ndarray, group: np.ndarray, seq_base: np.ndarray
) -> tuple[list[tuple[int, int]], list[int]]:
    """The entries each group of `keys` adds to its lane's monotonic min-deque: the items
    whose key is smaller than every later key of their group, as (sequence number, key),
    found in one numpy pass for all groups. `group[i]` is item i's group (0, 1, ... in
    order); item i's sequence number is i + seq_base[group[i]]. Returns the entries, group
    by group, and where each group's entries begin (one bound per group, plus the end).
    Example: keys [5, 9, 7, 7 | 4, 3], group [0, 0, 0, 0, 1, 1], seq_base [10, 96]
    -> [(10, 5), (13, 7), (101, 3)], bounds [0, 2, 3]: of two equal keys only the later is
    kept (it stays queued longer, so it alone can stand for both), which keeps the deques
    short when many items have one length (fixed-length prompts).
    NOTE: a numpy pass per group (or an item-by-item loop for small groups) was rejected:
    with a few hundred lanes per 4,096-item call, tracking the queued maximum that way as
    well made assign_many about 35% slower; this pass serves both deques of every lane."""
    assert keys.size < 2**31 and group.size == keys.size
    # Reversed, each group (an earlier one, with a lower tag) starts below everything seen so
    # far, so the running minimum restarts there and is the group's own suffix minimum.
    tagged = keys + (group << _GROUP_SHIFT_BITS)
    suffix = np.minimum.accumulate(tagged[::-1])[::-1]
    later = np.empty_like(suffix)  # the minimum strictly after each item (the last: none)
    later[:-1] = suffix[1:]
    later[-1:] = np.iinfo(later.dtype).max
    kept = np.flatnonzero(tagged < later)
    kept_group = group[kept]
    entries = list(zip((kept + seq_base[kept_group]).tolist(), keys[kept].tolist()))
    bounds = np.searchsorted(kept_group, np.arange(seq_base.size + 1)).tolist()
    return entries, bounds


def _push_entries(window: Window, entries: list[tuple[int, int]]) -> None:
    """Append a group's min-deque entries (see group_suffix_minima): the group's smallest key
    (its first entry) pushes out every entry at the back that is not smaller first."""
    lowest = entries[0][1]
    while window and window[-1][1] >= lowest:
        window.pop()
    window.extend(entries)


class LaneTable:
    """Every per-lane field of one shape, indexed by lane id, and the queue events that change
    them. `grow` is the only place a lane id's row is added (every column at once), `release`
    the only place one is cleared. Ids not in use hold target 0 and empty queues.

    Owned by one ShapeLanes (so by the broker's single dispatch loop), which decides lanes and
    calls these events; not thread-safe. The columns are public to that owner and to
    lanes/bulk.py, which read them on every item: a getter would add a call to each read.

    NOTE: one plain list per field, not one record object per lane nor numpy columns.
    Measured by a micro-benchmark of two operations alone (one item's enqueue; one
    fullest_lane scan), one core, 800 lanes, best of 5: lists 459 ns, 11.3 µs; slots
    records 409 ns, 18.9 µs; numpy columns 861 ns, 0.3 µs.
    The broker places items with assign_many, which folds them in per lane, not per item,
    and scans every lane once per dispatched batch (fullest_lane, lanes_by_queued_tokens,
    which numpy builds from a list in C but from records only by walking them in Python),
    so records would slow its path; numpy columns double the per-item cost of `assign` (a
    numpy scalar read or write costs about 50 ns more than a list's, and an item makes
    about ten).
    """

    __slots__ = ("target", "qmin", "queued_items", "queued_tokens", "pending_items",
                 "last_seen_s", "head_seq", "tail_seq", "mins", "maxs", "returned")

    def __init__(self) -> None:
        self.target: list[int] = []  # >= 1 while the id is in use, 0 once released
        # The queued minimum, NOTHING_QUEUED when nothing is queued. Cached because every
        # decision reads it; assign_many keeps it current before the queues are folded in.
        self.qmin: list[int] = []
        self.queued_items: list[int] = []
        self.queued_tokens: list[int] = []
        self.pending_items: list[int] = []
        self.last_seen_s: list[float] = []
        self.head_seq: list[int] = []  # sequence number of the main part's front item
        self.tail_seq: list[int] = []  # sequence number the next new item gets
        self.mins: list[Window] = []  # (sequence number, length)
        # (sequence number, NEGATED length).
        # NOTE: a second, mirrored deque routine was rejected; negation lets one serve both.
        self.maxs: list[Window] = []
        # Returned items, top = front of the queue: (length, running minimum, running maximum).
        self.returned: list[list[tuple[int, int, int]]] = []

    @property
    def size(self) -> int:
        """Lane ids ever handed out: 0 .. size - 1 have a row."""
        return len(self.target)

    def grow(self) -> LaneId:
        """Add the row of the next lane id (free: target 0, nothing queued) and return it."""
        lane = LaneId(len(self.target))
        for column, initial in (
            (self.target, 0), (self.qmin, NOTHING_QUEUED), (self.queued_items, 0),
            (self.queued_tokens, 0), (self.pending_items, 0), (self.last_seen_s, 0.0),
            (self.head_seq, 0), (self.tail_seq, 0),
        ):
            column.append(initial)  # type: ignore[attr-defined]
        self.mins.append(deque())
        self.maxs.append(deque())
        self.returned.append([])
        return lane

    def release(self, lane: LaneId) -> None:
        """The lane's id goes back to the free list: clear its row (nothing is left in it)."""
        assert not self.mins[lane] and not self.maxs[lane] and not self.returned[lane], lane
        self.target[lane] = 0
        self.qmin[lane] = NOTHING_QUEUED
        self.queued_tokens[lane] = 0
        self.head_seq[lane] = self.tail_seq[lane] = 0

    # ----------------------------------------------------------------- queue events

    def enqueue(self, lane: LaneId, length: int, now_s: float) -> None:
        """One new item joins the back of the lane's queue."""
        self.queued_items[lane] += 1
        self.queued_tokens[lane] += length
        self.last_seen_s[lane] = now_s
        seq = self.tail_seq[lane]
        self.tail_seq[lane] = seq + 1
        mins = self.mins[lane]
        while mins and mins[-1][1] >= length:
            mins.pop()
        mins.append((seq, length))
        maxs = self.maxs[lane]
        negated = -length
        while maxs and maxs[-1][1] >= negated:
            maxs.pop()
        maxs.append((seq, negated))
        if length < self.qmin[lane]:
            self.qmin[lane] = length

    def fold_all(
        self, values: np.ndarray, lanes: np.ndarray, now_s: float, qmin_current: bool
    ) -> None:
        """New items join the back of their lanes' queues, each lane's items in arrival order:
        item i of `values` joins lane `lanes[i]`. `qmin_current`: the caller already set each
        lane's cached queued minimum as if the items were queued (checked here)."""
        # Stable sort by lane keeps arrival order within a lane.
        keys = lanes.astype(np.int16) if self.size < _RADIX_SORT_LANES else lanes
        order = np.argsort(keys, kind="stable")
        sorted_lanes = lanes[order]
        sorted_values = values[order]
        starts = np.flatnonzero(np.diff(sorted_lanes)) + 1
        starts = np.concatenate(([0], starts))
        counts = np.diff(np.append(starts, values.size)).tolist()
        tokens = np.add.reduceat(sorted_values, starts).tolist()
        lane_list = sorted_lanes[starts].tolist()
        group = np.zeros(values.size, dtype=np.int64)
        group[starts[1:]] = 1
        np.cumsum(group, out=group)
        tail = self.tail_seq
        seq_base = np.array([tail[lane] for lane in lane_list], dtype=np.int64) - starts
        min_entries, min_bounds = group_suffix_minima(sorted_values, group, seq_base)
        max_entries, max_bounds = group_suffix_minima(-sorted_values, group, seq_base)
        for i, (lane, count, total) in enumerate(zip(lane_list, counts, tokens)):
            self.queued_items[lane] += count
            self.queued_tokens[lane] += total
            self.last_seen_s[lane] = now_s
            tail[lane] += count
            _push_entries(self.mins[lane], min_entries[min_bounds[i] : min_bounds[i + 1]])
            _push_entries(self.maxs[lane], max_entries[max_bounds[i] : max_bounds[i + 1]])
            front = self.front_min(lane)
            assert not qmin_current or front == self.qmin[lane], (lane, front, self.qmin[lane])
            self.qmin[lane] = front

    def dispatch(self, lane: LaneId, values: list[int]) -> None:
        """The lane's front items (`values`, in queue order: returned items first) leave the
        queue and become pending."""
        count = len(values)
        assert count <= self.queued_items[lane], (lane, count, self.queued_items[lane])
        self.queued_items[lane] -= count
        self.queued_tokens[lane] -= sum(values)
        self.pending_items[lane] += count
        stack = self.returned[lane]
        from_stack = min(count, len(stack))
        for value in values[:from_stack]:
            assert stack.pop()[0] == value, (lane, value)
        from_main = count - from_stack
        if from_main:
            head = self.head_seq[lane] + from_main
            self.head_seq[lane] = head
            for window in (self.mins[lane], self.maxs[lane]):
                while window and window[0][0] < head:
                    window.popleft()
        self.qmin[lane] = self.front_min(lane)
        assert self.queued_items[lane] or not self.queued_tokens[lane], lane
        assert self.queued_tokens[lane] >= self.queued_items[lane], lane

    def complete(self, lane: LaneId, count: int) -> None:
        """`count` pending items of the lane are gone."""
        assert 0 <= count <= self.pending_items[lane], (lane, count)
        self.pending_items[lane] -= count

    def give_back(self, lane: LaneId, values: list[int]) -> None:
        """Pending items go back to the FRONT of the queue, `values` front first."""
        count = len(values)
        assert count <= self.pending_items[lane], (lane, count)
        target = self.target[lane]
        stack = self.returned[lane]
        low, high = (stack[-1][1], stack[-1][2]) if stack else (NOTHING_QUEUED, NOTHING_QUEUED_MAX)
        for value in reversed(values):
            assert 0 < value <= target, (lane, value, target)
            low = value if value < low else low
            high = value if value > high else high
            stack.append((value, low, high))
        self.pending_items[lane] -= count
        self.queued_items[lane] += count
        self.queued_tokens[lane] += sum(values)
        self.qmin[lane] = self.front_min(lane)

    # ----------------------------------------------------------------- queries

    def front_min(self, lane: LaneId) -> int:
        """The lane's queued minimum from its windows, NOTHING_QUEUED when nothing is queued."""
        stack = self.returned[lane]
        mins = self.mins[lane]
        best = stack[-1][1] if stack else NOTHING_QUEUED
        if mins and mins[0][1] < best:
            best = mins[0][1]
        return best

    def front_max(self, lane: LaneId) -> int:
        """The lane's queued maximum, NOTHING_QUEUED_MAX when nothing is queued."""
        stack = self.returned[lane]
        maxs = self.maxs[lane]
        best = stack[-1][2] if stack else NOTHING_QUEUED_MAX
        if maxs and -maxs[0][1] > best:
            best = -maxs[0][1]
        return best

    def check_lane(self, lane: LaneId) -> None:
        """Assert the lane's row is consistent; reads only (O(queue windows))."""
        target = self.target[lane]
        items, tokens = self.queued_items[lane], self.queued_tokens[lane]
        assert 0 <= items <= tokens <= items * target and self.pending_items[lane] >= 0, lane
        stack = self.returned[lane]
        head, tail = self.head_seq[lane], self.tail_seq[lane]
        assert items == len(stack) + tail - head, (lane, items, len(stack), head, tail)
        low, high = NOTHING_QUEUED, NOTHING_QUEUED_MAX
        for value, minimum, maximum in stack:
            low, high = min(low, value), max(high, value)
            assert (minimum, maximum) == (low, high) and 0 < value <= target, (lane, stack)
        for window in (self.mins[lane], self.maxs[lane]):
            seqs = [seq for seq, _ in window]
            keys = [key for _, key in window]
            assert all(head <= s < tail for s in seqs) and seqs == sorted(set(seqs)), (lane, window)
            assert all(a < b for a, b in zip(keys, keys[1:])), (lane, window)  # strictly
            assert bool(window) == (tail > head), (lane, window, head, tail)
        low = self.front_min(lane)
        assert self.qmin[lane] == low >= 1, (lane, self.qmin[lane], low)
        assert low == NOTHING_QUEUED or low <= target, lane
        high = self.front_max(lane)
        assert (high == NOTHING_QUEUED_MAX) == (not items) and high <= target, (lane, high)
