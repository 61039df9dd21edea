"""The records the dispatcher hands out and keeps (`pipeline.broker.dispatch`): a batch for a
consumer, an ingest's report, a frame being stored, a shape's summary, the counters.
Pure data: no I/O, no clock."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import numpy as np

from pipeline.broker.ids import BatchId, ConsumerId, EntryRef, LaneKey, ShapeKey
from pipeline.broker.lanes import LaneCounters, ShapeLanes
from pipeline.storage.base import AppendGroup, Peeked
from pipeline.wire.layouts.frames import Frame


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch for one consumer: entries of one lane (so one shape, or in a lane of the
    solitary pool shapes that share nothing), front first, each padded to `pad_to_tokens`, by column (`entries[i]` makes a PeekedEntry). Not the consumer's
    until `Dispatcher.commit`."""

    batch_id: BatchId
    consumer: ConsumerId
    lane: LaneKey
    pad_to_tokens: int
    entries: Peeked
    switch: str | None = None  # why the consumer changed shape for this batch (None: it did not)

    @property
    def model(self) -> int:
        return self.lane.model

    @property
    def signature(self) -> int:
        return self.lane.signature

    @property
    def refs(self) -> list[EntryRef]:
        return self.entries.refs

    @property
    def real_tokens(self) -> int:
        return int(self.entries.lengths.sum())

    @property
    def padded_tokens(self) -> int:
        return len(self.entries) * self.pad_to_tokens


@dataclass(frozen=True, slots=True)
class IngestReport:
    items: int  # newly stored
    tokens: int
    duplicates: int  # skipped: already stored (StorageTier.already_stored)


@dataclass(slots=True)
class StoringFrame:
    """A frame being stored: its lane groups (lanes already assigned) with their tokens,
    how many groups are stored, and per shape the rows the selector learns of once every
    group is stored. Kept only while a full disk holds part of it back, or while it is
    stored in slices (`ingest(max_groups=...)`)."""

    frame: Frame
    groups: list[tuple[AppendGroup, int]]
    shapes: list[tuple[ShapeKey, np.ndarray]]
    report: IngestReport
    stored: int = 0
    announced: int = 0  # groups the selector was told of one by one (a full disk held the frame)

    def unstored_by_lane(self) -> dict[LaneKey, int]:
        unstored: dict[LaneKey, int] = {}
        for group, _tokens in self.groups[self.stored:]:
            unstored[group.lane] = unstored.get(group.lane, 0) + len(group)
        return unstored

    def unannounced_by_lane(self) -> dict[LaneKey, int]:
        """Items per lane the selector does not know of yet (stored or not): not dispatchable."""
        held: dict[LaneKey, int] = {}
        for group, _tokens in self.groups[self.announced:]:
            held[group.lane] = held.get(group.lane, 0) + len(group)
        return held

    def unannounced_tokens_by_shape(self) -> dict[ShapeKey, int]:
        """Tokens of the groups the selector does not know of yet, per shape."""
        tokens: dict[ShapeKey, int] = {}
        for group, group_tokens in self.groups[self.announced:]:
            tokens[group.lane.shape] = tokens.get(group.lane.shape, 0) + group_tokens
        return tokens


@dataclass(frozen=True, slots=True)
class ShapeSummary:
    """One shape's queue, for status and metrics."""

    model: int
    signature: int
    lanes: int  # in use (active and quiescing)
    queued_items: int
    queued_tokens: int
    pending_items: int  # dispatched, not completed


@dataclass(slots=True)
class DispatchCounters:
    """A snapshot of the dispatcher's totals (see the module docstring for the identities).
    `lanes` sums every shape's LaneCounters, field by field (retired shapes included;
    its max_in_use is the sum of the shapes' maxima); `lanes_in_use` is the current total."""

    items_received: int = 0
    tokens_received: int = 0
    items_routed: int = 0
    tokens_routed: int = 0
    items_returned: int = 0
    tokens_returned: int = 0
    items_completed: int = 0
    tokens_completed: int = 0
    items_recovered: int = 0
    tokens_recovered: int = 0
    duplicate_items: int = 0
    batches: int = 0
    shapes: int = 0
    shapes_seen: int = 0
    lanes_in_use: int = 0
    switches: dict[str, int] = field(default_factory=dict)
    lanes: LaneCounters = field(default_factory=LaneCounters)

    def scalars(self) -> DispatchCounters:
        """A copy of the counts, without `switches` and `lanes` (the caller fills those in)."""
        return DispatchCounters(**{f.name: getattr(self, f.name) for f in fields(DispatchCounters)
                                   if f.name not in ("switches", "lanes")})


LANE_COUNTER_NAMES = tuple(f.name for f in fields(LaneCounters))
lane_counter_values = operator.attrgetter(*LANE_COUNTER_NAMES)


def total_lane_counters(retired: LaneCounters, shapes: Iterable[ShapeLanes]) -> LaneCounters:
    """The lane counters of the retired shapes and of every live one, summed."""
    # Column sums in C: status asks every 0.5 s, and field by field in Python this took
    # 7 ms at demo-chat's 7,829 shapes (py-spy), time the consumers' batches waited.
    rows = [lane_counter_values(retired), *(lane_counter_values(shape_lanes.counters) for shape_lanes in shapes)]
    return LaneCounters(*(sum(column) for column in zip(*rows)))


def add_lane_counters(total: LaneCounters, more: LaneCounters) -> None:
    for name in LANE_COUNTER_NAMES:
        setattr(total, name, getattr(total, name) + getattr(more, name))


def summarize_shapes(shapes: dict[ShapeKey, ShapeLanes]) -> list[ShapeSummary]:
    """Every shape's queue and lanes (status and metrics), largest queued tokens first."""
    # Sorted as plain tuples, made summaries after: a key function and an object per shape
    # before the sort cost 12 ms a status at 7,829 shapes (py-spy).
    rows = []
    for (model, signature), lanes in shapes.items():
        items, tokens, pending = lanes.totals()
        rows.append((-tokens, -pending, model, signature, lanes.lane_count, items))
    rows.sort()
    return [ShapeSummary(model, signature, count, items, -tokens, -pending)
            for tokens, pending, model, signature, count, items in rows]
