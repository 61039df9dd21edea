"""The memory tier: queues per (model, signature, lane) in this process's memory (SPEC §5).

Fast and not durable: a broker crash loses everything it held, so it is for tests, the
simulated demo and workloads that can be replayed. It implements `StorageTier` exactly as the
disk tier does, so the dispatcher and its tests cannot tell them apart.

Layout: each lane gets a queue of entry refs (a deque, front = next to dispatch) and a
"segment" id of its own, fresh each time the LaneKey is (re)created; an entry's offset is its
number within that segment. Entries live in one dict by ref until completed; completing one
deletes it (the memory tier's tombstone).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from pipeline.broker.ids import BatchId, ConsumerId, EntryRef, LaneKey, SegmentId
from pipeline.broker.pending import RECENT_COMPLETIONS_PER_CONSUMER, Completion, PendingMap
from pipeline.broker.storage.base import (
    AppendGroup,
    PeekedEntry,
    Returned,
    StorageCounters,
    StorageTier,
)
from pipeline.errors import StaleBatchError
from pipeline.layouts import ItemId, ProducerId


@dataclass(slots=True)
class _Stored:
    entry: PeekedEntry
    tokens: np.ndarray
    payload: bytes


@dataclass(slots=True)
class _Lane:
    segment: SegmentId
    queue: deque[EntryRef] = field(default_factory=deque)  # dispatchable, front first
    next_offset: int = 0
    pending: int = 0  # entries of this lane held by consumers


class MemoryTier(StorageTier):
    """Queues per lane in memory behind the storage interface.

    Owned by the broker's single dispatch loop (through the Dispatcher). Not thread-safe.
    """

    def __init__(self, recent_per_consumer: int = RECENT_COMPLETIONS_PER_CONSUMER) -> None:
        self._lanes: dict[LaneKey, _Lane] = {}
        self._segment_lane: dict[SegmentId, LaneKey] = {}
        self._entries: dict[EntryRef, _Stored] = {}
        self._pending = PendingMap(recent_per_consumer)
        self._highest: dict[ProducerId, int] = {}
        self._next_segment = 0
        self.counters = StorageCounters()

    # ----------------------------------------------------------------- ingest

    def append(self, group: AppendGroup) -> list[EntryRef]:
        """Copy the group's items (tokens and payloads leave the producer's ring record) and
        queue them at the back of their lane."""
        lane_key = group.lane
        frame, rows = group.frame, group.rows
        items = frame.items[rows]
        assert (items["model"] == lane_key.model).all(), lane_key
        assert (items["signature"] == lane_key.signature).all(), lane_key
        lane = self._lanes.get(lane_key)
        if lane is None:
            lane = self._new_lane(lane_key)
        producer = group.producer_id
        first = lane.next_offset
        refs = [EntryRef(lane.segment, offset) for offset in range(first, first + len(rows))]
        lane.next_offset = first + len(rows)
        starts, pay = frame.token_starts, frame.payload_starts
        for ref, row, item_id, seq, length, prefix_len, submit_ns in zip(
            refs, rows.tolist(), items["item_id"].tolist(), items["seq"].tolist(),
            items["length"].tolist(), items["prefix_len"].tolist(), items["submit_ns"].tolist(),
        ):
            entry = PeekedEntry(ref, lane_key, ItemId(item_id), producer, seq, length,
                                prefix_len, submit_ns)
            tokens = frame.tokens[starts[row]:starts[row + 1]].copy()
            tokens.flags.writeable = False
            payload = frame.payloads[pay[row]:pay[row + 1]].tobytes()
            self._entries[ref] = _Stored(entry, tokens, payload)
        lane.queue.extend(refs)
        if len(rows):
            top = int(items["seq"].max())
            if top > self._highest.get(producer, -1):
                self._highest[producer] = top
        self.counters.appended_items += len(rows)
        self.counters.appended_tokens += int(items["length"].sum())
        return refs

    def _new_lane(self, lane_key: LaneKey) -> _Lane:
        segment = SegmentId(self._next_segment)
        self._next_segment += 1
        lane = self._lanes[lane_key] = _Lane(segment)
        self._segment_lane[segment] = lane_key
        return lane

    def highest_seq(self, producer_id: ProducerId) -> int | None:
        return self._highest.get(producer_id)

    # ----------------------------------------------------------------- dispatch

    def peek(self, lane: LaneKey, max_items: int) -> list[PeekedEntry]:
        queue = self._lanes.get(lane)
        if queue is None:
            return []
        entries = self._entries
        return [entries[ref].entry for ref in islice(queue.queue, max_items)]

    def commit(
        self, lane: LaneKey, refs: Sequence[EntryRef], consumer: ConsumerId, batch: BatchId
    ) -> None:
        """The three steps of SPEC §5. Example: lane queue [r5, r6, r7]; commit(lane,
        [r5, r6], consumer 2, batch 9) leaves [r7] and consumer 2 holding r5, r6 as batch 9;
        commit(lane, [r6], ...) instead raises StaleBatchError and changes nothing."""
        # Step 1: verify everything, touch nothing.
        queue = self._lanes.get(lane)
        count = len(refs)
        if queue is None or not count or count > len(queue.queue) or any(
            want != have for want, have in zip(refs, islice(queue.queue, count))
        ):
            front = [] if queue is None else list(islice(queue.queue, min(count, 4)))
            raise StaleBatchError(
                f"batch {batch} for consumer {consumer}: its {count} entries are no longer the "
                f"front of lane {tuple(lane)} (front now {[tuple(r) for r in front]}); "
                f"nothing was committed"
            )
        assert not self._pending.has_batch(batch), batch
        # Step 2: advance the lane's cursor.
        popleft = queue.queue.popleft
        for _ in range(count):
            popleft()
        queue.pending += count
        # Step 3: the consumer holds them.
        entries = self._entries
        lengths = [entries[ref].entry.length for ref in refs]
        self._pending.add_batch(batch, consumer, lane, refs, lengths)
        self.counters.committed_items += count
        self.counters.committed_tokens += sum(lengths)

    def complete(self, consumer: ConsumerId, refs: Sequence[EntryRef]) -> Completion:
        done = self._pending.complete(consumer, refs)  # NotHeldError before anything changes
        for lane_key, lane_refs in done.by_lane.items():
            self._lanes[lane_key].pending -= len(lane_refs)
            for ref in lane_refs:
                del self._entries[ref]  # the memory tier's tombstone
        self.counters.completed_items += done.items
        self.counters.completed_tokens += done.tokens
        self.counters.duplicate_completions += done.duplicates
        return done

    def return_consumer(self, consumer: ConsumerId) -> list[Returned]:
        returned: list[Returned] = []
        for run in self._pending.consumer_lost(consumer):
            lane = self._lanes[run.lane]
            lane.queue.extendleft(reversed(run.refs))  # ahead of new work, original order
            lane.pending -= len(run.refs)
            returned.append(Returned(run.lane, tuple(self._entries[r].entry for r in run.refs)))
            self.counters.returned_items += len(run.refs)
            self.counters.returned_tokens += sum(run.lengths)
        return returned

    def drop_lane(self, lane: LaneKey) -> None:
        queue = self._lanes.pop(lane, None)
        if queue is not None:
            assert not queue.queue and not queue.pending, (lane, len(queue.queue), queue.pending)
            del self._segment_lane[queue.segment]

    # ----------------------------------------------------------------- reading

    def read_tokens(self, ref: EntryRef) -> np.ndarray:
        return self._entries[ref].tokens

    def read_payload(self, ref: EntryRef) -> bytes:
        return self._entries[ref].payload

    def queued_items(self, lane: LaneKey | None = None) -> int:
        if lane is None:
            return sum(len(queue.queue) for queue in self._lanes.values())
        queue = self._lanes.get(lane)
        return 0 if queue is None else len(queue.queue)

    def pending_items(self, consumer: ConsumerId | None = None) -> int:
        return len(self._pending) if consumer is None else self._pending.held_by(consumer)

    def lane_keys(self) -> list[LaneKey]:
        """Every lane the tier holds a queue for (tests, tools)."""
        return list(self._lanes)

    # ----------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Every stored entry is in exactly one place: queued once in its own lane, or
        pending; counts and totals agree. O(entries)."""
        self._pending.check_invariants()
        queued: set[EntryRef] = set()
        queued_count = 0
        for lane_key, lane in self._lanes.items():
            assert self._segment_lane[lane.segment] == lane_key, lane_key
            for ref in lane.queue:
                assert ref.segment == lane.segment and ref.offset < lane.next_offset, (lane_key, ref)
                assert self._entries[ref].entry.lane == lane_key, ref
            queued.update(lane.queue)
            queued_count += len(lane.queue)
        assert len(queued) == queued_count, "an entry is queued twice"
        pending_by_lane: dict[LaneKey, int] = {}
        for ref in self._entries:
            if ref in self._pending:
                assert ref not in queued, ref
                lane_key = self._segment_lane[ref.segment]
                pending_by_lane[lane_key] = pending_by_lane.get(lane_key, 0) + 1
            else:
                assert ref in queued, f"entry {ref} is neither queued nor pending"
        assert len(self._entries) == queued_count + len(self._pending)
        for lane_key, lane in self._lanes.items():
            assert lane.pending == pending_by_lane.get(lane_key, 0), lane_key
        c = self.counters
        stored_tokens = sum(stored.entry.length for stored in self._entries.values())
        assert c.appended_items == c.completed_items + len(self._entries), c
        assert c.appended_tokens == c.completed_tokens + stored_tokens, c
        assert len(set(self._segment_lane)) == len(self._lanes), "a segment serves two lanes"
