"""The pending map: which consumer holds which dispatched entry (SPEC §5, step 3 of a commit).

Pure bookkeeping: no I/O, no clock. A storage tier owns one and calls it from commit,
completion and consumer loss; the entries themselves stay in the tier.

    pending = PendingMap()
    pending.add_batch(BatchId(7), ConsumerId(1), lane_key, refs, lengths)   # commit, step 3
    done = pending.complete(ConsumerId(1), refs[:2])     # NotHeldError if 1 does not hold them
    runs = pending.consumer_lost(ConsumerId(1))          # the rest, grouped by lane, in order

The map is keyed by entry reference (segment id, offset) and holds the entry's batch; the
batch holds its consumer, lane, refs and lengths. It is not persisted (SPEC §5): after a
broker crash every entry that was pending is simply live again in its segment.

Cost: the broker completes whole batches (`complete_batch`), so the map's work per entry is
a few dictionary and set operations done in bulk by C code (dict.update, set.update, map);
only `complete` with arbitrary refs (tests, tools) looks at entries one by one.

Duplicate completions. Delivery is at-least-once and a consumer may resend a report, so a
second completion of an entry must be a counted no-op, while a completion of an entry the
consumer never held must be refused. Once an entry is completed it leaves the map, so each
consumer keeps a window of the refs it completed most recently: a ref in the window is a
duplicate, a ref in neither the map nor the window is not held (NotHeldError).
NOTE: asking the caller to say "this is a resend" was rejected: the consumer that resends
does not know which of its reports arrived. Remembering every completed ref was rejected too:
it grows without bound over a run of billions of items.
Memory bound: at most `recent_per_consumer` refs per connected consumer (default 16,384;
a ref costs about 150 bytes with its set and deque slots, so about 2.5 MB per consumer); a
consumer's window is dropped when it is lost. A resend older than the window raises
NotHeldError, which disconnects the consumer: the safe side (nothing is ever double-counted
as completed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import NamedTuple

from pipeline.broker.ids import BatchId, ConsumerId, EntryRef, LaneKey
from pipeline.wire.errors import NotHeldError

# Completed refs remembered per consumer to recognise a resent completion. A resend covers
# the reports in flight when a consumer retried: a few batches of at most a few hundred items,
# so 16,384 refs is dozens of batches of margin at about 2.5 MB per consumer.
RECENT_COMPLETIONS_PER_CONSUMER = 16_384


class Holding(NamedTuple):
    """Who holds a pending entry: its consumer, its batch, and its position in the batch."""

    consumer: ConsumerId
    batch: BatchId
    index: int


@dataclass(slots=True)
class _Batch:
    consumer: ConsumerId
    lane: LaneKey
    refs: list[EntryRef]
    lengths: list[int]
    open_count: int  # entries of the batch still pending
    positions: dict[EntryRef, int] | None = None  # ref -> index, made when first asked

    def index(self, ref: EntryRef) -> int:
        if self.positions is None:
            self.positions = {r: i for i, r in enumerate(self.refs)}
        return self.positions[ref]


@dataclass(frozen=True, slots=True)
class ReturnedRun:
    """A lost consumer's pending entries of one lane, in their original dispatch order: put
    them back at the FRONT of the lane in this order (refs[0] first)."""

    lane: LaneKey
    refs: tuple[EntryRef, ...]
    lengths: tuple[int, ...]


@dataclass(slots=True)
class Completion:
    """What one `complete` call did: the entries newly completed, grouped by lane in the order
    given, their count and tokens, and how many refs were duplicate completions."""

    by_lane: dict[LaneKey, list[EntryRef]] = field(default_factory=dict)
    items: int = 0
    tokens: int = 0
    duplicates: int = 0


@dataclass(slots=True)
class PendingCounters:
    batches: int = 0
    added: int = 0
    completed: int = 0
    duplicates: int = 0
    returned: int = 0
    refused: int = 0  # complete calls refused with NotHeldError


@dataclass(slots=True)
class _Window:
    """A consumer's most recently completed refs, oldest first, at most `limit`: kept as the
    lists that completions gave (chunks), so remembering a batch costs one set update."""

    limit: int
    chunks: deque[list[EntryRef]] = field(default_factory=deque)
    members: set[EntryRef] = field(default_factory=set)
    size: int = 0

    def extend(self, refs: list[EntryRef]) -> None:
        self.members.update(refs)
        self.chunks.append(refs)
        self.size += len(refs)
        while self.size > self.limit:
            oldest, excess = self.chunks[0], self.size - self.limit
            if len(oldest) <= excess:
                self.chunks.popleft()
            else:
                self.chunks[0], oldest = oldest[excess:], oldest[:excess]
            self.members.difference_update(oldest)
            self.size -= len(oldest)


class PendingMap:
    """Dispatched, not yet completed entries and who holds them.

    Owned by one storage tier, driven by the broker's single dispatch loop. Not thread-safe.
    """

    def __init__(self, recent_per_consumer: int = RECENT_COMPLETIONS_PER_CONSUMER) -> None:
        assert recent_per_consumer >= 0, recent_per_consumer
        self._recent_limit = recent_per_consumer
        self._entries: dict[EntryRef, BatchId] = {}
        self._batches: dict[BatchId, _Batch] = {}
        # Per consumer, its open batches in commit order (a dict as an ordered set).
        self._by_consumer: dict[ConsumerId, dict[BatchId, None]] = {}
        self._recent: dict[ConsumerId, _Window] = {}
        self.counters = PendingCounters()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ref: object) -> bool:
        return ref in self._entries

    def holder(self, ref: EntryRef) -> Holding | None:
        batch_id = self._entries.get(ref)
        if batch_id is None:
            return None
        batch = self._batches[batch_id]
        return Holding(batch.consumer, batch_id, batch.index(ref))

    def held_by(self, consumer: ConsumerId) -> int:
        """Entries the consumer holds now. O(its open batches)."""
        return sum(self._batches[b].open_count for b in self._by_consumer.get(consumer, ()))

    def has_batch(self, batch: BatchId) -> bool:
        return batch in self._batches

    def add_batch(
        self, batch: BatchId, consumer: ConsumerId, lane: LaneKey,
        refs: Sequence[EntryRef], lengths: Sequence[int],
    ) -> None:
        """Step 3 of a commit: the consumer now holds every entry of the batch. The storage
        tier has already checked (step 1) that the entries were dispatchable, hence not
        pending, so a clash here is our bug (assert)."""
        assert refs and len(refs) == len(lengths), (batch, len(refs), len(lengths))
        assert batch not in self._batches, batch
        entries = self._entries
        refs = list(refs)
        assert entries.keys().isdisjoint(refs), [r for r in refs if r in entries]
        before = len(entries)
        entries.update(dict.fromkeys(refs, batch))
        assert len(entries) == before + len(refs), refs  # no ref twice in the batch
        self._batches[batch] = _Batch(consumer, lane, refs, list(lengths), len(refs))
        self._by_consumer.setdefault(consumer, {})[batch] = None
        self.counters.batches += 1
        self.counters.added += len(refs)

    def complete(self, consumer: ConsumerId, refs: Sequence[EntryRef]) -> Completion:
        """The consumer reports `refs` done. All or nothing: every ref is checked first, and a
        ref the consumer neither holds nor recently completed raises NotHeldError with nothing
        applied. A ref it recently completed (or one given twice) is a counted duplicate.

        Example: consumer 1 holds A and B of lane L (lengths 500, 510). complete(1, [A]) ->
        by_lane {L: [A]}, items 1, tokens 500. complete(1, [A, B]) -> by_lane {L: [B]},
        duplicates 1. complete(2, [B]) -> NotHeldError (B was completed by 1, not held by 2).
        """
        entries, batches = self._entries, self._batches
        window = self._recent.get(consumer)
        fresh: list[tuple[EntryRef, BatchId]] = []
        seen: set[EntryRef] = set()
        duplicates = 0
        for ref in refs:
            batch_id = entries.get(ref)
            holder = None if batch_id is None else batches[batch_id].consumer
            if ref in seen or (window is not None and ref in window.members):
                duplicates += 1
            elif holder == consumer:
                fresh.append((ref, batch_id))
                seen.add(ref)
            else:
                self.counters.refused += 1
                where = "pending nowhere" if holder is None else f"held by consumer {holder}"
                raise NotHeldError(
                    f"consumer {consumer} completed entry {tuple(ref)} that it does not hold "
                    f"({where}); none of its {len(refs)} completions were applied"
                )
        return self._apply_completion(consumer, fresh, duplicates)

    def complete_batch(self, consumer: ConsumerId, batch_id: BatchId) -> Completion:
        """The consumer reports every entry of its batch `batch_id` done (the broker's path:
        a consumer completes whole batches). NotHeldError, with nothing applied, if it does
        not hold that batch. Entries of the batch completed before by `complete` are skipped,
        not counted as duplicates. The same as `complete(consumer, refs of the batch)`
        otherwise, in bulk operations."""
        batch = self._batches.get(batch_id)
        if batch is None or batch.consumer != consumer:
            self.counters.refused += 1
            where = "pending nowhere" if batch is None else f"held by consumer {batch.consumer}"
            raise NotHeldError(f"consumer {consumer} completed batch {batch_id}, which it does not hold ({where})")
        refs, lengths = batch.refs, batch.lengths
        if batch.open_count != len(refs):  # some were completed one by one before
            entries = self._entries
            kept = [i for i, ref in enumerate(refs) if entries.get(ref) == batch_id]
            refs, lengths = [refs[i] for i in kept], [lengths[i] for i in kept]
        deque(map(self._entries.__delitem__, refs), maxlen=0)  # a C loop, no bytecode per ref
        del self._batches[batch_id]
        del self._by_consumer[consumer][batch_id]
        self._remember(consumer, refs)
        self.counters.completed += len(refs)
        return Completion({batch.lane: refs}, len(refs), sum(lengths), 0)

    def _apply_completion(
        self, consumer: ConsumerId, fresh: list[tuple[EntryRef, BatchId]], duplicates: int
    ) -> Completion:
        done = Completion(duplicates=duplicates)
        for ref, batch_id in fresh:
            del self._entries[ref]
            batch = self._batches[batch_id]
            done.by_lane.setdefault(batch.lane, []).append(ref)
            done.tokens += batch.lengths[batch.index(ref)]
            batch.open_count -= 1
            if not batch.open_count:
                del self._batches[batch_id]
                del self._by_consumer[consumer][batch_id]
        self._remember(consumer, [ref for ref, _batch in fresh])
        done.items = len(fresh)
        self.counters.completed += done.items
        self.counters.duplicates += duplicates
        return done

    def _remember(self, consumer: ConsumerId, refs: list[EntryRef]) -> None:
        if not self._recent_limit or not refs:
            return
        window = self._recent.get(consumer)
        if window is None:
            window = self._recent[consumer] = _Window(self._recent_limit)
        window.extend(refs)

    def consumer_lost(self, consumer: ConsumerId) -> list[ReturnedRun]:
        """Every entry the consumer still holds leaves the map, grouped by lane (lanes in the
        order their first batch was committed), each run in the original dispatch order:
        batches in commit order, entries in batch order. The caller puts each run back at
        the front of its lane. The consumer's window of completions is dropped.

        Example: consumer 3 holds batch 1 = [a1, a2] of lane L, then batch 2 = [b1] of lane
        M, then batch 4 = [a3, a4] of lane L, and a2 was completed. Returns
        [ReturnedRun(L, (a1, a3, a4)), ReturnedRun(M, (b1,))].
        """
        runs: dict[LaneKey, tuple[list[EntryRef], list[int]]] = {}
        for batch_id in self._by_consumer.pop(consumer, {}):
            batch = self._batches.pop(batch_id)
            refs, lengths = runs.setdefault(batch.lane, ([], []))
            for ref, length in zip(batch.refs, batch.lengths):
                if self._entries.get(ref) == batch_id:
                    del self._entries[ref]
                    refs.append(ref)
                    lengths.append(length)
        self._recent.pop(consumer, None)
        returned = [
            ReturnedRun(lane, tuple(refs), tuple(lengths)) for lane, (refs, lengths) in runs.items()
        ]
        self.counters.returned += sum(len(run.refs) for run in returned)
        return returned

    def check_invariants(self) -> None:
        """Assert every internal invariant. O(pending entries + remembered refs)."""
        open_total = 0
        for batch_id, batch in self._batches.items():
            held = [r for r in batch.refs if self._entries.get(r) == batch_id]
            assert batch.open_count == len(held) >= 1, (batch_id, batch.open_count, held)
            assert len(batch.refs) == len(batch.lengths), batch_id
            assert batch_id in self._by_consumer.get(batch.consumer, {}), (batch_id, batch.consumer)
            open_total += batch.open_count
        assert open_total == len(self._entries), (open_total, len(self._entries))
        for ref, batch_id in self._entries.items():
            assert ref in self._batches[batch_id].refs, ref
        listed = sum(len(batches) for batches in self._by_consumer.values())
        assert listed == len(self._batches), (listed, len(self._batches))
        for consumer, window in self._recent.items():
            assert window.size == len(window.members) <= self._recent_limit, consumer
            assert window.members == set(chain.from_iterable(window.chunks)), consumer
            assert not window.members & self._entries.keys(), consumer
        c = self.counters
        assert c.added == c.completed + c.returned + len(self._entries), c
