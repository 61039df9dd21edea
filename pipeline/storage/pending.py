"""The pending map: which consumer holds which dispatched entry (SPEC §5, step 3 of a commit).

Pure bookkeeping: no I/O, no clock. A storage tier owns one and calls it from commit,
completion and consumer loss; the entries themselves stay in the tier.

    pending = PendingMap()
    pending.add_batch(BatchId(7), ConsumerId(1), lane_key, entries, lengths)  # commit, step 3
    done = pending.complete_batch(ConsumerId(1), BatchId(7))  # NotHeldError if 1 does not hold 7
    runs = pending.consumer_lost(ConsumerId(1))               # what it held, by lane, in order

The map holds batches: each its consumer, lane, entries (EntryColumns) and lengths. It is not persisted
(SPEC §5): after a broker crash every entry that was pending is simply live again in its
segment.

Batches are completed whole: a consumer reports a batch done once it wrote every result of
it, so an entry leaves the map with its batch and a batch is either held or gone. A second
completion of a batch (a resend) finds it gone and raises NotHeldError, which refuses the
consumer: nothing is ever counted completed twice.
NOTE: completions of single entries, with a window of recently completed refs per consumer
to tell a resend from a foreign entry, were rejected: the broker completes nothing but
whole batches, and the window cost a set update per completion and about 2.5 MB per
consumer for a case the batch id already decides.

Cost: nothing per entry; a batch's entries are kept as the columns the commit had.
NOTE: a dict from each ref to its batch was rejected: only invariant checks and tests ask
it, and its update and deletes cost 28 us of a 256-entry batch (0.11 us an item, a fiftieth
of the broker's CPU per item). `holder` and `held_refs` walk the open batches (O(pending));
they are for checks and tools.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import NamedTuple

import numpy as np

from pipeline.broker.ids import BatchId, ConsumerId, EntryRef, LaneKey
from pipeline.wire.errors import NotHeldError


def make_refs(segments: Sequence[int], offsets: Sequence[int]) -> list[EntryRef]:
    """EntryRef(segment, offset) for each pair, built by C code: tuple.__new__ makes the
    named tuples without running their Python constructor (half the cost)."""
    return list(map(tuple.__new__, repeat(EntryRef), zip(segments, offsets)))


@dataclass(frozen=True, slots=True)
class EntryColumns:
    """Entries by column: each one's segment and offset (int64, in batch or queue order).
    NOTE: columns, not a list of EntryRef: a ref per entry made at each peek and read back
    at each completion cost 0.12 us an item of the broker's CPU (make_refs, 256 entries: 32
    us); refs are made only where asked (`refs`: a lost consumer's entries, checks)."""

    segments: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, refs: Sequence[EntryRef]) -> EntryColumns:
        return cls(np.array([r.segment for r in refs], dtype=np.int64), np.array([r.offset for r in refs], dtype=np.int64))

    def __len__(self) -> int:
        return self.offsets.shape[0]

    def refs(self) -> list[EntryRef]:
        return make_refs(self.segments.tolist(), self.offsets.tolist())


class Holding(NamedTuple):
    """Who holds a pending entry: its consumer, its batch, and its position in the batch."""

    consumer: ConsumerId
    batch: BatchId
    index: int


@dataclass(slots=True)
class _Batch:
    consumer: ConsumerId
    lane: LaneKey
    entries: EntryColumns
    lengths: list[int]

    def index(self, ref: EntryRef) -> int | None:
        """Where `ref` is in the batch, or None."""
        at = np.flatnonzero((self.entries.segments == ref.segment) & (self.entries.offsets == ref.offset))
        return int(at[0]) if at.size else None


@dataclass(frozen=True, slots=True)
class ReturnedRun:
    """A lost consumer's pending entries of one lane, in their original dispatch order: put
    them back at the FRONT of the lane in this order (refs[0] first)."""

    lane: LaneKey
    refs: tuple[EntryRef, ...]
    lengths: tuple[int, ...]


@dataclass(slots=True)
class Completion:
    """What one completion did: the entries completed, grouped by lane in batch order, their
    count and tokens."""

    by_lane: dict[LaneKey, EntryColumns] = field(default_factory=dict)
    items: int = 0
    tokens: int = 0


@dataclass(slots=True)
class PendingCounters:
    batches: int = 0
    added: int = 0
    completed: int = 0
    returned: int = 0
    refused: int = 0  # completions refused with NotHeldError


class PendingMap:
    """Dispatched, not yet completed entries and who holds them.

    Owned by one storage tier, driven by the broker's single dispatch loop. Not thread-safe.
    """

    def __init__(self) -> None:
        self._batches: dict[BatchId, _Batch] = {}
        # Per consumer, its open batches in commit order (a dict as an ordered set).
        self._by_consumer: dict[ConsumerId, dict[BatchId, None]] = {}
        self._held = 0  # entries of every open batch
        self.counters = PendingCounters()

    def __len__(self) -> int:
        return self._held

    def held_refs(self) -> set[EntryRef]:
        """Every pending entry's ref. O(pending): for checks."""
        return {ref for batch in self._batches.values() for ref in batch.entries.refs()}

    def holder(self, ref: EntryRef) -> Holding | None:
        """Who holds `ref`, or None. O(pending): for checks and tools."""
        for batch_id, batch in self._batches.items():
            index = batch.index(ref)
            if index is not None:
                return Holding(batch.consumer, batch_id, index)
        return None

    def held_by(self, consumer: ConsumerId) -> int:
        """Entries the consumer holds now. O(its open batches)."""
        return sum(len(self._batches[b].entries) for b in self._by_consumer.get(consumer, ()))

    def has_batch(self, batch: BatchId) -> bool:
        return batch in self._batches

    def add_batch(
        self, batch: BatchId, consumer: ConsumerId, lane: LaneKey,
        entries: EntryColumns, lengths: Sequence[int],
    ) -> None:
        """Step 3 of a commit: the consumer now holds every entry of the batch. The storage
        tier has already checked (step 1) that the entries were dispatchable, hence not
        pending, so a clash here is our bug (assert)."""
        count = len(entries)
        assert count and count == len(lengths), (batch, count, len(lengths))
        assert batch not in self._batches, batch
        self._batches[batch] = _Batch(consumer, lane, entries, list(lengths))
        self._by_consumer.setdefault(consumer, {})[batch] = None
        self._held += count
        self.counters.batches += 1
        self.counters.added += count

    def complete_batch(self, consumer: ConsumerId, batch_id: BatchId) -> Completion:
        """The consumer reports every entry of its batch `batch_id` done. NotHeldError, with
        nothing applied, if it does not hold that batch (never had it, another consumer has
        it, or it was completed already: a resend)."""
        batch = self._batches.get(batch_id)
        if batch is None or batch.consumer != consumer:
            self.counters.refused += 1
            where = "pending nowhere" if batch is None else f"held by consumer {batch.consumer}"
            raise NotHeldError(f"consumer {consumer} completed batch {batch_id}, which it does not hold ({where})")
        del self._batches[batch_id]
        del self._by_consumer[consumer][batch_id]
        count = len(batch.entries)
        self._held -= count
        self.counters.completed += count
        return Completion({batch.lane: batch.entries}, count, sum(batch.lengths))

    def consumer_lost(self, consumer: ConsumerId) -> list[ReturnedRun]:
        """Every entry the consumer still holds leaves the map, grouped by lane (lanes in the
        order their first batch was committed), each run in the original dispatch order:
        batches in commit order, entries in batch order. The caller puts each run back at
        the front of its lane.

        Example: consumer 3 holds batch 1 = [a1, a2] of lane L, then batch 2 = [b1] of lane
        M, then batch 4 = [a3, a4] of lane L. Returns [ReturnedRun(L, (a1, a2, a3, a4)),
        ReturnedRun(M, (b1,))].
        """
        runs: dict[LaneKey, tuple[list[EntryRef], list[int]]] = {}
        for batch_id in self._by_consumer.pop(consumer, {}):
            batch = self._batches.pop(batch_id)
            refs, lengths = runs.setdefault(batch.lane, ([], []))
            self._held -= len(batch.entries)
            refs += batch.entries.refs()
            lengths += batch.lengths
        returned = [
            ReturnedRun(lane, tuple(refs), tuple(lengths)) for lane, (refs, lengths) in runs.items()
        ]
        self.counters.returned += sum(len(run.refs) for run in returned)
        return returned

    def check_invariants(self) -> None:
        """Assert every internal invariant. O(pending entries)."""
        held = 0
        for batch_id, batch in self._batches.items():
            assert len(batch.entries) and len(batch.entries) == len(batch.lengths), batch_id
            assert batch.entries.segments.shape == batch.entries.offsets.shape, batch_id
            assert batch_id in self._by_consumer.get(batch.consumer, {}), (batch_id, batch.consumer)
            held += len(batch.entries)
        assert held == self._held == len(self.held_refs()), (held, self._held)  # no ref held twice
        listed = sum(len(batches) for batches in self._by_consumer.values())
        assert listed == len(self._batches), (listed, len(self._batches))
        c = self.counters
        assert c.added == c.completed + c.returned + self._held, c
