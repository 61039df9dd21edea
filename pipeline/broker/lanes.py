"""Rolling lanes for one shape: which lane (padding class) each item joins (SPEC §2, issue 3).

A lane is a queue of items of similar length with a target length; the broker pads a lane's
batches to (about) its target. `ShapeLanes` decides, for every item of one (model, signature)
shape, which lane it joins, opens and retires lanes, and keeps the per-lane counts the
dispatcher orders lanes by. It is pure policy: no I/O, no clock (callers pass `now_s`), no
processes; the storage tier holds the items themselves.

Who calls what, in one broker loop:

    lanes = ShapeLanes()                       # one per shape
    lane = lanes.assign(length, now_s)         # or lanes.assign_many(lengths, now_s)
    lanes.on_dispatched(lane, batch_lengths)   # a batch of the lane's front items was committed
    lanes.on_completed(lane, count)            # its items were completed (tombstoned)
    lanes.on_returned(lane, lengths)           # a lost consumer's pending items came back
    changed = lanes.tick(now_s)                # maintenance, e.g. once per loop turn
"""

from __future__ import annotations

import enum
import heapq
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NewType

import numpy as np

from pipeline.errors import BadInputError
from pipeline.layouts import LANE_ID_LIMIT

LaneId = NewType("LaneId", int)
"""A lane's id within its shape. Ids are reused after release (lowest free id first)."""

# The lane budget per shape. 128 saturated under sustained load (every shape at full pressure,
# waste climbing without limit), so the design note raised it to 2,048; see SPEC §2.
MAX_LANES = 2048
# Tolerated waste fraction with no lane in use: be strict while lanes are cheap (SPEC §2).
THRESHOLD_BASE_FRACTION = 0.01
# Added linearly as the budget fills, reaching 1% + 9% = 10% at the cap: as lanes run out,
# tolerate waste rather than run out of lanes (SPEC §2).
THRESHOLD_RISE_FRACTION = 0.09
# Below this waste no new lane opens, whatever the fraction: stops lanes being opened for
# trivial waste on short prompts (SPEC §2).
WASTE_FLOOR_TOKENS = 16
# Above this waste a new lane always opens: a long prompt must never absorb large padding just
# because its percentage looks small (SPEC §2).
WASTE_CAP_TOKENS = 128
# A lane idle this long (no item assigned) may quiesce: it has stopped receiving work (SPEC §2).
QUIESCE_IDLE_S = 5.0
# ...if it also holds fewer queued items than this: a lane with real backlog keeps its identity
# (and its on-disk segments) instead of being drained and reopened (SPEC §2).
QUIESCE_BELOW_ITEMS = 4
# Lengths are int32 in the segment entry layout (SPEC §5); anything longer is bad input. The
# bound also keeps every length and waste exactly representable in float64.
MAX_LENGTH_TOKENS = 2**31 - 1
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

# assign_many tags each lane's group of keys (lengths or negated lengths, |key| < 2**31) with
# group index << this before one running minimum over the whole call: tagged groups occupy
# disjoint ranges, so the minimum restarts at each group.
_GROUP_SHIFT_BITS = 32

# Lane ids in assign_many's result. int32: max_lanes is far below 2**31.
LANE_DTYPE = np.int32
# "Nothing queued" in the queued-minimum slots: above every valid length, so min() just works.
_NOTHING_QUEUED = MAX_LENGTH_TOKENS + 1
# "Nothing queued" for the queued maximum: below every valid length, so max() just works.
_NOTHING_QUEUED_MAX = 0
_INF = float("inf")


class WasteMeasure(enum.Enum):
    """What a raise of the lower neighbour's target is measured against (issue 3 item 2)."""

    # The padding the queue would really pay: L minus the shortest item still queued in the
    # lane (the lane's target when nothing is queued). Default: it holds padding efficiency
    # near 98.7% at every queue depth, where LITERAL falls to 73% with 100,000 items queued.
    QUEUED_MIN = "queued_min"
    # SPEC §2 read literally: L minus the lane's current target. Kept for comparison.
    LITERAL = "literal"


@dataclass(frozen=True, slots=True)
class LaneConfig:
    """Every constant of the lane policy; defaults are the module constants above."""

    max_lanes: int = MAX_LANES
    threshold_base_fraction: float = THRESHOLD_BASE_FRACTION
    threshold_rise_fraction: float = THRESHOLD_RISE_FRACTION
    waste_floor_tokens: int = WASTE_FLOOR_TOKENS
    waste_cap_tokens: int = WASTE_CAP_TOKENS
    quiesce_idle_s: float = QUIESCE_IDLE_S
    quiesce_below_items: int = QUIESCE_BELOW_ITEMS
    measure: WasteMeasure = WasteMeasure.QUEUED_MIN
    # Keep every queued length so check_invariants can brute-force the queued minimum and the
    # event methods can check the lengths they are given. For tests and debugging: in
    # production it would duplicate the lengths the storage tier already holds.
    audit: bool = False
    vector_min_call_items: int = VECTOR_MIN_CALL_ITEMS
    vector_first_window_items: int = VECTOR_FIRST_WINDOW_ITEMS
    vector_max_window_items: int = VECTOR_MAX_WINDOW_ITEMS
    vector_short_run_items: int = VECTOR_SHORT_RUN_ITEMS
    scalar_stretch_items: int = SCALAR_STRETCH_ITEMS

    def __post_init__(self) -> None:
        if isinstance(self.measure, str):
            object.__setattr__(self, "measure", _parse_measure(self.measure))
        if not isinstance(self.measure, WasteMeasure):
            raise BadInputError(f"lane config: measure must be a WasteMeasure, got {self.measure!r}")
        _require_at_least(self, 1, int, "max_lanes", "vector_min_call_items",
                          "vector_first_window_items", "vector_max_window_items",
                          "scalar_stretch_items")
        _require_at_least(self, 0, int, "waste_floor_tokens", "waste_cap_tokens",
                          "quiesce_below_items", "vector_short_run_items")
        _require_at_least(self, 0, float, "threshold_base_fraction", "threshold_rise_fraction",
                          "quiesce_idle_s")
        if self.max_lanes > LANE_ID_LIMIT:  # lane ids name segment files: l0000 .. l9999
            raise BadInputError(
                f"lane config: max_lanes must be <= {LANE_ID_LIMIT} (a lane id is four digits of its "
                f"segment file names), got {self.max_lanes!r}"
            )


def _parse_measure(name: str) -> WasteMeasure:
    try:
        return WasteMeasure(name)
    except ValueError:
        choices = ", ".join(m.value for m in WasteMeasure)
        raise BadInputError(f"lane config: measure must be one of {choices}, got {name!r}") from None


def _require_at_least(config: LaneConfig, floor: int, kind: type, *names: str) -> None:
    """Each named field is a `kind` (an int also passes as a float) and >= floor (not NaN)."""
    kinds = (int, float) if kind is float else (int,)
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, kinds) or not value >= floor:
            raise BadInputError(
                f"lane config: {name} must be {kind.__name__} >= {floor}, got {value!r}"
            )


@dataclass(slots=True)
class LaneCounters:
    """Running totals for one shape (SPEC §2 "Count"). `reuses` counts items that joined an
    existing lane (so assigned == reuses + new_lanes); `revived` counts quiescing lanes taken
    back into service because every lane id was held by a quiescing lane; `restored` lanes
    brought back by `restore_lane` after a restart (a lane restored quiescing also counts
    in `quiesced`)."""

    assigned: int = 0
    reuses: int = 0
    new_lanes: int = 0
    force_fits: int = 0
    raises: int = 0
    quiesced: int = 0
    released: int = 0
    revived: int = 0
    max_in_use: int = 0
    restored: int = 0


@dataclass(frozen=True, slots=True)
class TickResult:
    """What one maintenance tick changed, ids in ascending order."""

    quiesced: tuple[LaneId, ...]
    released: tuple[LaneId, ...]


@dataclass(frozen=True, slots=True)
class LaneView:
    """A read-only snapshot of one lane (metrics, debugging, tests)."""

    lane_id: LaneId
    target: int
    quiescing: bool
    queued_items: int
    queued_tokens: int
    pending_items: int
    queued_min: int | None
    queued_max: int | None
    last_seen_s: float


@dataclass(slots=True)
class _VectorView:
    """The decision state as numpy arrays, by position in target order, for assign_many."""

    targets: np.ndarray  # int64, strictly increasing
    ids: np.ndarray  # lane id at each position
    queued_min: np.ndarray  # int64, _NOTHING_QUEUED where the lane's queue is empty
    reference: np.ndarray  # int64, what a raise of that lane is measured against
    threshold: float
    at_cap: bool


def _checked_length(length: object) -> int:
    """The length as an int, or BadInputError (SPEC §8: zero, negative, non-integer)."""
    if type(length) is int:
        if 0 < length <= MAX_LENGTH_TOKENS:
            return length
    elif isinstance(length, (int, np.integer)) and not isinstance(length, (bool, np.bool_)):
        if 0 < length <= MAX_LENGTH_TOKENS:
            return int(length)
    else:
        raise BadInputError(f"item length must be an integer, got {type(length).__name__}")
    raise BadInputError(f"item length must be in [1, {MAX_LENGTH_TOKENS}] tokens, got {length}")


def _checked_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """The lengths as a 1-D int64 array, or BadInputError naming the first bad one."""
    array = np.asarray(lengths)
    if array.ndim != 1:
        raise BadInputError(f"lengths must be one-dimensional, got shape {array.shape}")
    if not array.size:  # np.asarray([]) is float64: an empty batch has no dtype to judge
        return np.empty(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise BadInputError(f"lengths must be integers, got dtype {array.dtype}")
    bad = np.flatnonzero((array < 1) | (array > MAX_LENGTH_TOKENS))
    if bad.size:
        index = int(bad[0])
        raise BadInputError(
            f"item length must be in [1, {MAX_LENGTH_TOKENS}] tokens, got {array[index]} "
            f"at index {index}"
        )
    return array.astype(np.int64, copy=False)


def _group_suffix_minima(
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


def _push_entries(window: deque[tuple[int, int]], entries: list[tuple[int, int]]) -> None:
    """Append a group's min-deque entries (see _group_suffix_minima): the group's smallest key
    (its first entry) pushes out every entry at the back that is not smaller first."""
    lowest = entries[0][1]
    while window and window[-1][1] >= lowest:
        window.pop()
    window.extend(entries)


class ShapeLanes:
    """The rolling lanes of one shape: assignment, maintenance and per-lane queue counts.

    Owned by the broker's single dispatch loop, one instance per (model, signature) shape.
    Not thread-safe: nothing here locks, and nothing needs to while one loop owns it.

    Active lanes sit in two parallel lists sorted by target (strictly increasing: a new lane or
    a raise only ever lands strictly between its neighbours). Quiescing lanes leave those lists
    at once, so the binary search never sees them and they take no new items; they keep their
    id and counts until nothing of them is queued or pending, then the tick releases the id.
    NOTE: a SortedList was rejected: a raise changes a key in place, which a SortedList can only
    do by remove + add, and with at most a few thousand lanes a list insert is one memmove.

    The queued minimum of a lane (the raise reference of WasteMeasure.QUEUED_MIN) and its
    queued maximum (the pad-to of SPEC §3 packing) are kept in O(1) amortised per event by two
    structures each, because the queue is pushed at both ends:
    - new items join the back and leave from the front: monotonic deques of
      (sequence number, length), one strictly increasing in length (its front is the main
      part's minimum), one strictly decreasing (its front is the main part's maximum); of
      equal lengths only the latest is kept;
    - items returned by a lost consumer go to the front, ahead of new work, and are the first
      to leave again: that end is a stack, so they sit in a min/max-stack of (length, minimum
      and maximum of this and every returned item behind it).
    The lane's queued minimum is the smaller of the two minima, its queued maximum the larger
    of the two maxima. Released ids sit in a min-heap.
    """

    def __init__(self, config: LaneConfig | None = None, **overrides: object) -> None:
        """`ShapeLanes()` for the defaults, `ShapeLanes(max_lanes=128, measure="literal")` to
        override some, or `ShapeLanes(LaneConfig(...))`."""
        base = config if config is not None else LaneConfig()
        self._cfg = replace(base, **overrides) if overrides else base  # type: ignore[arg-type]
        self._literal = self._cfg.measure is WasteMeasure.LITERAL
        self.counters = LaneCounters()
        # Active lanes in target order.
        self._pos_targets: list[int] = []
        self._pos_ids: list[LaneId] = []
        self._quiescing: set[LaneId] = set()
        self._free: list[LaneId] = []  # heap of released ids
        self._fresh = 0  # ids below this have been handed out at least once
        self._in_use = 0
        self._threshold = self._cfg.threshold_base_fraction
        # Per lane id, grown as ids are first handed out.
        self._target: list[int] = []
        self._qmin: list[int] = []
        self._queued_items: list[int] = []
        self._queued_tokens: list[int] = []
        self._pending_items: list[int] = []
        self._last_seen_s: list[float] = []
        self._head_seq: list[int] = []  # sequence number of the main part's front item
        self._tail_seq: list[int] = []  # sequence number the next new item gets
        self._mins: list[deque[tuple[int, int]]] = []
        # (sequence number, NEGATED length): a min-deque of -length is a max-deque of length.
        # NOTE: a second, mirrored deque routine was rejected; negation lets one serve both.
        self._maxs: list[deque[tuple[int, int]]] = []
        # Returned items, top = front of the queue: (length, running minimum, running maximum).
        self._returned: list[list[tuple[int, int, int]]] = []
        self._audit: list[deque[int]] = []
        # check_invariants' memory of targets, to check they only rise: lane -> (life, target).
        self._life: list[int] = []
        self._seen_targets: dict[int, tuple[int, int]] = {}

    # ----------------------------------------------------------------- read-only state

    @property
    def config(self) -> LaneConfig:
        return self._cfg

    @property
    def lane_count(self) -> int:
        """Lanes in use: active plus quiescing (a quiescing lane holds its id until drained)."""
        return self._in_use

    @property
    def active_lane_count(self) -> int:
        """Lanes that take new items."""
        return len(self._pos_ids)

    @property
    def threshold(self) -> float:
        """Current waste-fraction threshold: base + rise * lanes_in_use / max_lanes."""
        return self._threshold

    def totals(self) -> tuple[int, int, int]:
        """(queued items, queued tokens, pending items) over every lane of the shape; ids
        not in use hold zeros. O(lanes ever opened), in C (sum over lists)."""
        return sum(self._queued_items), sum(self._queued_tokens), sum(self._pending_items)

    def target(self, lane_id: LaneId) -> int:
        """The lane's target length in tokens (only rises while the id is in use)."""
        self._assert_live(lane_id)
        return self._target[lane_id]

    def queued_items(self, lane_id: LaneId) -> int:
        self._assert_live(lane_id)
        return self._queued_items[lane_id]

    def queued_tokens(self, lane_id: LaneId) -> int:
        self._assert_live(lane_id)
        return self._queued_tokens[lane_id]

    def pending_items(self, lane_id: LaneId) -> int:
        self._assert_live(lane_id)
        return self._pending_items[lane_id]

    def queued_min(self, lane_id: LaneId) -> int | None:
        """Length of the shortest item queued in the lane, None when nothing is queued."""
        self._assert_live(lane_id)
        value = self._qmin[lane_id]
        return None if value == _NOTHING_QUEUED else value

    def queued_max(self, lane_id: LaneId) -> int | None:
        """Length of the longest item queued in the lane, None when nothing is queued: the
        "queue's longest item" that packing pads to (SPEC §3). O(1)."""
        self._assert_live(lane_id)
        value = self._front_max(lane_id)
        return None if value == _NOTHING_QUEUED_MAX else value

    def is_quiescing(self, lane_id: LaneId) -> bool:
        self._assert_live(lane_id)
        return lane_id in self._quiescing

    def lane_ids(self) -> list[LaneId]:
        """Every lane in use: active ones in target order, then quiescing ones by id."""
        return [*self._pos_ids, *sorted(self._quiescing)]

    def lanes_by_queued_tokens(self) -> list[LaneId]:
        """Lanes with queued items, most queued tokens first (ties: lower id first), quiescing
        lanes included since they must drain. The order the dispatcher tries lanes in (§4).
        NOTE: sorted on demand (numpy, ~0.1 ms at 2,048 lanes) rather than kept in a heap or
        sorted list: that would cost every assign an update, and the dispatcher asks once per
        batch, not once per item. Free ids hold no tokens, so they never appear."""
        tokens = np.array(self._queued_tokens, dtype=np.int64)
        queued = np.flatnonzero(tokens)
        return np.take(queued, np.lexsort((queued, -tokens[queued]))).tolist()

    def fullest_lane(self) -> LaneId | None:
        """The first lane of `lanes_by_queued_tokens()`, None when nothing is queued."""
        if not self._queued_tokens:
            return None
        tokens = np.array(self._queued_tokens, dtype=np.int64)
        lane = int(tokens.argmax())  # first maximum: the lowest id among ties
        return LaneId(lane) if tokens[lane] else None

    def lanes(self) -> list[LaneView]:
        """A snapshot of every lane in use, in `lane_ids()` order."""
        return [
            LaneView(
                lane_id=lane,
                target=self._target[lane],
                quiescing=lane in self._quiescing,
                queued_items=self._queued_items[lane],
                queued_tokens=self._queued_tokens[lane],
                pending_items=self._pending_items[lane],
                queued_min=self.queued_min(lane),
                queued_max=self.queued_max(lane),
                last_seen_s=self._last_seen_s[lane],
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
        value = _checked_length(length)
        lane = self._place(value)
        self._enqueue(lane, value, now_s)
        return lane

    def assign_many(self, lengths: Sequence[int] | np.ndarray, now_s: float) -> np.ndarray:
        """Assign each length in order, exactly as repeated `assign` would; lane ids as int32.

        Bad input (non-integer, <= 0, too long) raises BadInputError before anything is
        assigned, where repeated `assign` would have assigned the items before the bad one.

        How: most items change no decision state: they join their upper candidate without a
        raise, and are no shorter than its queued minimum (issue 3 measured that only about
        0.19% of log-normal items change lane state under the queued-minimum measure). For a window of items, numpy
        judges every item against the state as it stands; the prefix that changes nothing is
        accepted at once, the first item that would change something (new lane, raise, new
        queued minimum, force-fit into a lower lane) goes through the scalar path, and judging
        resumes after it. Queue bookkeeping (counts, min-deques) is folded in per lane at the
        end. Example: lanes 500 and 1000 (queued minima 495 and 990), lengths
        [995, 1000, 498, 700, 999]: the first three are accepted by numpy (lanes 1000, 1000,
        500), 700 opens a lane in the scalar path, 999 is judged again and joins lane 1000.
        """
        values = _checked_lengths(lengths)
        if values.size < self._cfg.vector_min_call_items:
            return np.fromiter(
                (self.assign(value, now_s) for value in values.tolist()),
                dtype=LANE_DTYPE, count=values.size,
            )
        lanes = self._place_all(values)
        self._enqueue_all(values, lanes, now_s)
        return lanes

    def _place(self, length: int) -> LaneId:
        """Decide the lane for `length`, open or raise it as needed; queues untouched."""
        targets = self._pos_targets
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
                queued = self._qmin[self._pos_ids[pos - 1]]
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
            return self._pos_ids[pos]
        lane = self._pos_ids[pos - 1]
        targets[pos - 1] = length
        self._target[lane] = length
        counters.raises += 1
        return lane

    def _enqueue(self, lane: LaneId, length: int, now_s: float) -> None:
        """One new item joins the back of the lane's queue."""
        self._queued_items[lane] += 1
        self._queued_tokens[lane] += length
        self._last_seen_s[lane] = now_s
        seq = self._tail_seq[lane]
        self._tail_seq[lane] = seq + 1
        mins = self._mins[lane]
        while mins and mins[-1][1] >= length:
            mins.pop()
        mins.append((seq, length))
        maxs = self._maxs[lane]
        negated = -length
        while maxs and maxs[-1][1] >= negated:
            maxs.pop()
        maxs.append((seq, negated))
        if length < self._qmin[lane]:
            self._qmin[lane] = length
        if self._cfg.audit:
            self._audit[lane].append(length)

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
        values = _checked_lengths(lengths)
        cfg = self._cfg
        assert values.size and int(values.max()) <= target <= MAX_LENGTH_TOKENS, (lane_id, target)
        assert 0 <= lane_id < cfg.max_lanes and self._in_use < cfg.max_lanes, lane_id
        while self._fresh <= lane_id:
            self._grow_one()
            heapq.heappush(self._free, LaneId(self._fresh))
            self._fresh += 1
        assert lane_id in self._free, f"lane {lane_id} is in use"
        self._free.remove(lane_id)
        heapq.heapify(self._free)
        self._in_use += 1
        self._update_threshold()
        self.counters.max_in_use = max(self.counters.max_in_use, self._in_use)
        self.counters.restored += 1
        self._target[lane_id] = target
        pos = bisect_left(self._pos_targets, target)
        active = pos == len(self._pos_targets) or self._pos_targets[pos] != target
        if active:
            self._pos_targets.insert(pos, target)
            self._pos_ids.insert(pos, lane_id)
        else:
            self._quiescing.add(lane_id)
            self.counters.quiesced += 1
        self._qmin[lane_id] = int(values.min())  # as _place_all leaves it before the fold
        self._enqueue_all(values, np.full(values.size, lane_id, dtype=LANE_DTYPE), now_s)
        return active

    def _open(self, pos: int, length: int) -> LaneId:
        """Open a lane with target `length` at position `pos` of the active lists."""
        lane = self._take_id()
        self._pos_targets.insert(pos, length)
        self._pos_ids.insert(pos, lane)
        self._target[lane] = length
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
        if self._target[lane] < length:
            self._target[lane] = length
            counters.raises += 1
        self._quiescing.discard(lane)
        self._pos_targets.append(self._target[lane])
        self._pos_ids.append(lane)
        counters.revived += 1
        counters.force_fits += 1
        counters.assigned += 1
        counters.reuses += 1
        return lane

    def _fit_key(self, lane: LaneId, length: int) -> tuple[float, bool, int]:
        target = self._target[lane]
        if target >= length:
            return ((target - length) / target, False, lane)
        ref = target if self._literal else min(self._qmin[lane], target)
        return ((length - ref) / length, True, lane)

    def _take_id(self) -> LaneId:
        """The lowest free lane id; the caller has checked the cap."""
        if self._free:
            lane = heapq.heappop(self._free)
        else:
            lane = LaneId(self._fresh)
            self._fresh += 1
            self._grow_one()
        self._in_use += 1
        self._update_threshold()
        if self._in_use > self.counters.max_in_use:
            self.counters.max_in_use = self._in_use
        return lane

    def _grow_one(self) -> None:
        for column, initial in (
            (self._target, 0), (self._qmin, _NOTHING_QUEUED), (self._queued_items, 0),
            (self._queued_tokens, 0), (self._pending_items, 0), (self._last_seen_s, 0.0),
            (self._head_seq, 0), (self._tail_seq, 0), (self._life, 0),
        ):
            column.append(initial)  # type: ignore[attr-defined]
        self._mins.append(deque())
        self._maxs.append(deque())
        self._returned.append([])
        self._audit.append(deque())

    def _update_threshold(self) -> None:
        cfg = self._cfg
        self._threshold = (
            cfg.threshold_base_fraction + cfg.threshold_rise_fraction * self._in_use / cfg.max_lanes
        )

    # ----------------------------------------------------------------- assign_many internals

    def _place_all(self, values: np.ndarray) -> np.ndarray:
        """Decide every item's lane (see assign_many); queues are folded in afterwards, while
        `_qmin` is kept current as if each item were queued at once (decisions read it)."""
        cfg = self._cfg
        out = np.empty(values.size, dtype=LANE_DTYPE)
        view: _VectorView | None = None
        window = cfg.vector_first_window_items
        i = 0
        while i < values.size:
            if view is None:
                view = self._vector_view()
            chunk = values[i : i + window]
            run = self._accept_run(view, chunk, out[i:])
            i += run
            if run == chunk.size:
                window = min(2 * window, cfg.vector_max_window_items)
                continue
            # values[i] changes the state: it takes the scalar path.
            window = max(2 * run, cfg.vector_short_run_items, 1)
            if run < cfg.vector_short_run_items:
                i = self._place_stretch(values, out, i, cfg.scalar_stretch_items)
                view = None
            else:
                out[i] = lane = self._place_virtual(int(values[i]))
                i += 1
                view = self._refresh_view(view, lane)
        return out

    def _place_virtual(self, length: int) -> LaneId:
        """_place, plus the queued minimum as if the item were already queued."""
        lane = self._place(length)
        if length < self._qmin[lane]:
            self._qmin[lane] = length
        return lane

    def _place_stretch(self, values: np.ndarray, out: np.ndarray, start: int, count: int) -> int:
        """Scalar path for `count` items from `start`; returns the index after them."""
        stop = min(start + count, values.size)
        place = self._place_virtual
        out[start:stop] = [place(value) for value in values[start:stop].tolist()]
        return stop

    def _vector_view(self) -> _VectorView:
        targets = np.array(self._pos_targets, dtype=np.int64)
        ids = np.array(self._pos_ids, dtype=np.int64)
        qmin = self._qmin
        queued_min = np.array([qmin[lane] for lane in self._pos_ids], dtype=np.int64)
        reference = targets if self._literal else np.minimum(queued_min, targets)
        return _VectorView(
            targets=targets, ids=ids, queued_min=queued_min, reference=reference,
            threshold=self._threshold, at_cap=self._in_use >= self._cfg.max_lanes,
        )

    def _refresh_view(self, view: _VectorView, lane: LaneId) -> _VectorView | None:
        """Bring `view` up to date after the scalar path placed an item in `lane`; None when
        the active set changed (a lane opened or came back), so the view must be rebuilt."""
        if len(self._pos_ids) != view.targets.size:
            return None
        target = self._target[lane]
        pos = bisect_left(self._pos_targets, target)
        view.targets[pos] = target
        view.queued_min[pos] = self._qmin[lane]
        if not self._literal:
            view.reference[pos] = min(self._qmin[lane], target)
        return view

    def _accept_run(self, view: _VectorView, chunk: np.ndarray, out: np.ndarray) -> int:
        """Judge `chunk` against `view` (the state before it) and accept its longest prefix
        of items that change no decision state, writing their lanes to `out`. Returns the
        prefix length. Same formulas as `_place`, so the float fractions are bit-identical."""
        count = view.targets.size
        if not count:
            return 0
        cfg = self._cfg
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
        if not self._literal:
            ok &= chunk >= view.queued_min[upper]  # else the item is the lane's new minimum
        run = int(np.argmin(ok)) if not ok.all() else chunk.size
        if run:
            out[:run] = view.ids[upper[:run]]
            counters = self.counters
            counters.assigned += run
            counters.reuses += run
            if view.at_cap:
                counters.force_fits += int(np.count_nonzero(opens[:run]))
        return run

    def _enqueue_all(self, values: np.ndarray, lanes: np.ndarray, now_s: float) -> None:
        """Fold placed items into their lanes' queues, each lane's items in arrival order."""
        # Stable sort by lane keeps arrival order within a lane; int16 keys get radix sort.
        keys = lanes.astype(np.int16) if self._fresh < 2**15 else lanes
        order = np.argsort(keys, kind="stable")
        sorted_lanes = lanes[order]
        sorted_values = values[order]
        starts = np.flatnonzero(np.diff(sorted_lanes)) + 1
        starts = np.concatenate(([0], starts))
        ends = np.append(starts[1:], values.size)
        tokens = np.add.reduceat(sorted_values, starts)
        lane_list = sorted_lanes[starts].tolist()
        group = np.zeros(values.size, dtype=np.int64)
        group[starts[1:]] = 1
        np.cumsum(group, out=group)
        tail = self._tail_seq
        seq_base = np.array([tail[lane] for lane in lane_list], dtype=np.int64) - starts
        min_entries, min_bounds = _group_suffix_minima(sorted_values, group, seq_base)
        max_entries, max_bounds = _group_suffix_minima(-sorted_values, group, seq_base)
        for i, (lane, start, end, total) in enumerate(
            zip(lane_list, starts.tolist(), ends.tolist(), tokens.tolist())
        ):
            self._fold(lane, sorted_values[start:end], total, now_s)
            _push_entries(self._mins[lane], min_entries[min_bounds[i] : min_bounds[i + 1]])
            _push_entries(self._maxs[lane], max_entries[max_bounds[i] : max_bounds[i + 1]])
            front = self._front_min(lane)
            assert self._literal or front == self._qmin[lane], (lane, front, self._qmin[lane])
            self._qmin[lane] = front

    def _fold(self, lane: LaneId, group: np.ndarray, tokens: int, now_s: float) -> None:
        """Count `group` (one lane's new items, in order) into the lane's queue; the caller
        pushes their min- and max-deque entries (found for every lane of the call at once)."""
        count = group.size
        self._queued_items[lane] += count
        self._queued_tokens[lane] += tokens
        self._last_seen_s[lane] = now_s
        self._tail_seq[lane] += count
        if self._cfg.audit:
            self._audit[lane].extend(group.tolist())

    # ----------------------------------------------------------------- queue events

    def on_dispatched(self, lane_id: LaneId, lengths: Sequence[int] | np.ndarray) -> None:
        """The broker committed a batch of the lane's front items: `lengths` in queue order,
        returned items first (they sit at the front). They leave the queue and become
        pending. Call it on commit only, never for a peek or for packing overflow (which
        stays at the front of the queue). Example: queue [returned 700 | 650, 690] and a
        batch of two: lengths [700, 650]; 690 is left and becomes the queued minimum."""
        self._assert_live(lane_id)
        values = [int(v) for v in lengths]
        count = len(values)
        assert count <= self._queued_items[lane_id], (lane_id, count, self._queued_items[lane_id])
        total = sum(values)
        self._queued_items[lane_id] -= count
        self._queued_tokens[lane_id] -= total
        self._pending_items[lane_id] += count
        stack = self._returned[lane_id]
        from_stack = min(count, len(stack))
        for value in values[:from_stack]:
            assert stack.pop()[0] == value, (lane_id, value)
        from_main = count - from_stack
        if from_main:
            head = self._head_seq[lane_id] + from_main
            self._head_seq[lane_id] = head
            for window in (self._mins[lane_id], self._maxs[lane_id]):
                while window and window[0][0] < head:
                    window.popleft()
            if self._cfg.audit:
                audit = self._audit[lane_id]
                left = [audit.popleft() for _ in range(from_main)]
                assert left == values[from_stack:], (lane_id, left, values[from_stack:])
        self._qmin[lane_id] = self._front_min(lane_id)
        assert self._queued_items[lane_id] or not self._queued_tokens[lane_id], lane_id
        assert self._queued_tokens[lane_id] >= self._queued_items[lane_id], lane_id

    def on_completed(self, lane_id: LaneId, count: int) -> None:
        """`count` pending items of the lane were completed (tombstoned) and are gone."""
        self._assert_live(lane_id)
        assert 0 <= count <= self._pending_items[lane_id], (lane_id, count)
        self._pending_items[lane_id] -= count

    def on_returned(self, lane_id: LaneId, lengths: Sequence[int] | np.ndarray) -> None:
        """Pending items of a lost consumer go back to the FRONT of the lane's queue, ahead of
        new work, `lengths` in the order they will be dispatched again (front first). They
        go on the lane's min/max-stack; a quiescing lane stays quiescing and drains them.
        Example: queue [650, 690] (minimum 650); on_returned(lane, [700, 640]) makes it
        [700, 640, 650, 690], queued minimum 640, maximum 700, and the next batch starts with
        700."""
        self._assert_live(lane_id)
        values = [int(v) for v in lengths]
        count = len(values)
        assert count <= self._pending_items[lane_id], (lane_id, count)
        target = self._target[lane_id]
        stack = self._returned[lane_id]
        low, high = (stack[-1][1], stack[-1][2]) if stack else (_NOTHING_QUEUED, _NOTHING_QUEUED_MAX)
        for value in reversed(values):
            assert 0 < value <= target, (lane_id, value, target)
            low = value if value < low else low
            high = value if value > high else high
            stack.append((value, low, high))
        self._pending_items[lane_id] -= count
        self._queued_items[lane_id] += count
        self._queued_tokens[lane_id] += sum(values)
        self._qmin[lane_id] = self._front_min(lane_id)

    def _front_min(self, lane: LaneId) -> int:
        stack = self._returned[lane]
        mins = self._mins[lane]
        best = stack[-1][1] if stack else _NOTHING_QUEUED
        if mins and mins[0][1] < best:
            best = mins[0][1]
        return best

    def _front_max(self, lane: LaneId) -> int:
        stack = self._returned[lane]
        maxs = self._maxs[lane]
        best = stack[-1][2] if stack else _NOTHING_QUEUED_MAX
        if maxs and -maxs[0][1] > best:
            best = -maxs[0][1]
        return best

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
        keep_targets: list[int] = []
        keep_ids: list[LaneId] = []
        quiesced: list[LaneId] = []
        for target, lane in zip(self._pos_targets, self._pos_ids):
            idle = now_s - self._last_seen_s[lane] >= cfg.quiesce_idle_s
            if idle and self._queued_items[lane] < cfg.quiesce_below_items:
                quiesced.append(lane)
            else:
                keep_targets.append(target)
                keep_ids.append(lane)
        if quiesced:
            self._pos_targets, self._pos_ids = keep_targets, keep_ids
            self._quiescing.update(quiesced)
            self.counters.quiesced += len(quiesced)
        released = [
            lane for lane in sorted(self._quiescing)
            if not self._queued_items[lane] and not self._pending_items[lane]
        ]
        for lane in released:
            self._release(lane)
        return TickResult(quiesced=tuple(sorted(quiesced)), released=tuple(released))

    def _release(self, lane: LaneId) -> None:
        self._quiescing.discard(lane)
        assert not self._mins[lane] and not self._maxs[lane] and not self._returned[lane], lane
        assert not self._audit[lane], lane
        self._target[lane] = 0
        self._qmin[lane] = _NOTHING_QUEUED
        self._queued_tokens[lane] = 0
        self._head_seq[lane] = self._tail_seq[lane] = 0
        self._life[lane] += 1
        heapq.heappush(self._free, lane)
        self._in_use -= 1
        self._update_threshold()
        self.counters.released += 1

    # ----------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Assert every internal invariant (tests call it after every step). O(lanes + queued
        items with audit on)."""
        self._check_ids()
        targets, ids = self._pos_targets, self._pos_ids
        assert len(targets) == len(ids)
        assert all(a < b for a, b in zip(targets, targets[1:])), targets
        assert all(self._target[lane] == t for lane, t in zip(ids, targets)), (ids, targets)
        for lane in self.lane_ids():
            self._check_lane(lane)
        cfg = self._cfg
        expected = cfg.threshold_base_fraction + cfg.threshold_rise_fraction * self._in_use / cfg.max_lanes
        assert self._threshold == expected, (self._threshold, expected)
        c = self.counters
        assert c.assigned == c.reuses + c.new_lanes, c
        assert c.released <= c.quiesced and c.revived <= c.quiesced, c
        assert self._in_use <= c.max_in_use <= cfg.max_lanes, c
        assert c.released == sum(self._life), (c.released, self._life)

    def _check_ids(self) -> None:
        live = set(self._pos_ids)
        assert len(live) == len(self._pos_ids), self._pos_ids
        assert not live & self._quiescing, (live, self._quiescing)
        live |= self._quiescing
        free = set(self._free)
        assert len(free) == len(self._free) and not free & live, (free, live)
        assert free | live == set(range(self._fresh)), (free, live, self._fresh)
        assert len(live) == self._in_use <= self._cfg.max_lanes, (live, self._in_use)
        for lane in free:
            assert not (self._queued_items[lane] or self._pending_items[lane]), lane

    def _check_lane(self, lane: LaneId) -> None:
        target = self._target[lane]
        life, previous = self._seen_targets.get(lane, (self._life[lane], 0))
        assert life != self._life[lane] or target >= previous, (lane, previous, target)
        self._seen_targets[lane] = (self._life[lane], target)
        items, tokens = self._queued_items[lane], self._queued_tokens[lane]
        assert 0 <= items <= tokens <= items * target and self._pending_items[lane] >= 0, lane
        stack = self._returned[lane]
        head, tail = self._head_seq[lane], self._tail_seq[lane]
        assert items == len(stack) + tail - head, (lane, items, len(stack), head, tail)
        low, high = _NOTHING_QUEUED, _NOTHING_QUEUED_MAX
        for value, minimum, maximum in stack:
            low, high = min(low, value), max(high, value)
            assert (minimum, maximum) == (low, high) and 0 < value <= target, (lane, stack)
        for window in (self._mins[lane], self._maxs[lane]):
            seqs = [seq for seq, _ in window]
            keys = [key for _, key in window]
            assert all(head <= s < tail for s in seqs) and seqs == sorted(set(seqs)), (lane, window)
            assert all(a < b for a, b in zip(keys, keys[1:])), (lane, window)  # strictly
            assert bool(window) == (tail > head), (lane, window, head, tail)
        assert self._qmin[lane] == self._front_min(lane) and self._front_min(lane) >= 1, lane
        assert self._qmin[lane] == _NOTHING_QUEUED or self._qmin[lane] <= target, lane
        high = self._front_max(lane)
        assert (high == _NOTHING_QUEUED_MAX) == (not items) and high <= target, (lane, high)
        if self._cfg.audit:
            self._check_audit(lane)

    def _check_audit(self, lane: LaneId) -> None:
        """Brute force: the min- and max-deques are exactly the suffix minima and maxima of
        the main part."""
        main = list(self._audit[lane])
        whole = [value for value, _, _ in reversed(self._returned[lane])] + main
        assert len(whole) == self._queued_items[lane] and sum(whole) == self._queued_tokens[lane]
        assert self._qmin[lane] == min(whole, default=_NOTHING_QUEUED), (lane, whole)
        assert self._front_max(lane) == max(whole, default=_NOTHING_QUEUED_MAX), (lane, whole)
        head = self._head_seq[lane]
        for window, keys in ((self._mins[lane], main), (self._maxs[lane], [-v for v in main])):
            expected: list[tuple[int, int]] = []
            lowest = _NOTHING_QUEUED
            for seq in reversed(range(len(keys))):
                if keys[seq] < lowest:
                    lowest = keys[seq]
                    expected.append((head + seq, lowest))
            expected.reverse()
            assert list(window) == expected, (lane, list(window), expected)

    def _assert_live(self, lane_id: LaneId) -> None:
        # A lane in use has a target >= 1; release resets it to 0.
        assert 0 <= lane_id < self._fresh and self._target[lane_id] > 0, lane_id
