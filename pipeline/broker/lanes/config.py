"""The lane policy's settings, counters and read-only records, and the length checks every
entry point shares (SPEC §2, §8). Values only: nothing here holds lane state."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.broker.ids import LaneId
from pipeline.wire.errors import BadInputError
from pipeline.wire.layouts.names import LANE_ID_LIMIT

# The lane budget per shape. 128 saturated under sustained load (every shape at full pressure,
# waste climbing without limit), so the design note SPEC.md comes from raised it to 2,048;
# see SPEC §2.
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
# The speed settings of assign_many's vectorised placement (lanes/bulk.py; never its results).
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

# Lengths are int32 in the segment entry layout (SPEC §5); anything longer is bad input. The
# bound also keeps every length and waste exactly representable in float64.
MAX_LENGTH_TOKENS = 2**31 - 1


class WasteMeasure(enum.Enum):
    """What a raise of the lower neighbour's target is measured against."""

    # The padding the queue would really pay: L minus the shortest item still queued in the
    # lane (the lane's target when nothing is queued). Default: on log-normal lengths it
    # holds padding efficiency at 98.6-99.0% at every queue depth, where LITERAL falls to 77%
    # with 100,000 items queued (tools/bench_lanes.py part b, BENCHMARKS.md).
    QUEUED_MIN = "queued_min"
    # SPEC §2 read literally: L minus the lane's current target. Kept for comparison.
    LITERAL = "literal"


@dataclass(frozen=True, slots=True)
class LaneConfig:
    """Every constant of the lane policy; defaults are the module constants above, and the
    `vector_*` / `scalar_*` tuning of assign_many's placement (lanes/bulk.py: they change its
    speed, never its results)."""

    max_lanes: int = MAX_LANES
    threshold_base_fraction: float = THRESHOLD_BASE_FRACTION
    threshold_rise_fraction: float = THRESHOLD_RISE_FRACTION
    waste_floor_tokens: int = WASTE_FLOOR_TOKENS
    waste_cap_tokens: int = WASTE_CAP_TOKENS
    quiesce_idle_s: float = QUIESCE_IDLE_S
    quiesce_below_items: int = QUIESCE_BELOW_ITEMS
    measure: WasteMeasure = WasteMeasure.QUEUED_MIN
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
    in `quiesced`). Owned by its ShapeLanes, which alone writes it; not thread-safe."""

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


def checked_length(length: object) -> int:
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


def checked_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
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
