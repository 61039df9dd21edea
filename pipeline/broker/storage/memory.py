"""The memory tier: queues per (model, signature, lane) in this process's memory (SPEC §5).

Fast and not durable: a broker crash loses everything it held, so it is for tests, the
simulated demo and workloads that can be replayed. It implements `StorageTier` exactly as the
disk tier does, so the dispatcher and its tests cannot tell them apart.

Layout: each lane gets a "segment" id of its own, fresh each time the LaneKey is
(re)created; an entry's offset is its number within that segment. The lane queues are
`QueuedTier`'s (shared with the disk tier); the entries live in one dict by ref until
completed, and completing one deletes it (the memory tier's tombstone).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.broker.ids import EntryRef, LaneKey, SegmentId
from pipeline.broker.pending import RECENT_COMPLETIONS_PER_CONSUMER
from pipeline.broker.storage.base import AppendGroup, PeekedEntry
from pipeline.broker.storage.queues import QueuedTier
from pipeline.layouts import ItemId


@dataclass(slots=True)
class _Stored:
    entry: PeekedEntry
    tokens: np.ndarray
    payload: bytes


@dataclass(slots=True)
class _LaneSegment:
    segment: SegmentId
    next_offset: int = 0


class MemoryTier(QueuedTier):
    """Queues per lane in memory behind the storage interface (queues, commit, completion
    and redelivery are `QueuedTier`'s; this class holds the entries).

    Owned by the broker's single dispatch loop (through the Dispatcher). Not thread-safe.
    """

    def __init__(self, recent_per_consumer: int = RECENT_COMPLETIONS_PER_CONSUMER) -> None:
        super().__init__(recent_per_consumer)
        self._segments: dict[LaneKey, _LaneSegment] = {}
        self._segment_lane: dict[SegmentId, LaneKey] = {}
        self._entries: dict[EntryRef, _Stored] = {}
        self._next_segment = 0

    # ----------------------------------------------------------------- ingest

    def append(self, group: AppendGroup) -> list[EntryRef]:
        """Copy the group's items (tokens and payloads leave the producer's ring record) and
        queue them at the back of their lane."""
        lane_key = group.lane
        frame, rows = group.frame, group.rows
        items = frame.items[rows]
        assert (items["model"] == lane_key.model).all(), lane_key
        assert (items["signature"] == lane_key.signature).all(), lane_key
        lane = self._segments.get(lane_key)
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
        if len(rows):
            self._record_append(
                lane_key, lane.segment, np.arange(first, first + len(rows), dtype=np.int64),
                producer, int(items["seq"].max()), int(items["length"].sum()),
            )
        return refs

    def _new_lane(self, lane_key: LaneKey) -> _LaneSegment:
        segment = SegmentId(self._next_segment)
        self._next_segment += 1
        lane = self._segments[lane_key] = _LaneSegment(segment)
        self._segment_lane[segment] = lane_key
        return lane

    # ----------------------------------------------------------------- QueuedTier hooks

    def _describe(self, lane: LaneKey, refs: list[EntryRef]) -> list[PeekedEntry]:
        entries = self._entries
        return [entries[ref].entry for ref in refs]

    def _check_stored(self, lane: LaneKey, refs: list[EntryRef]) -> list[int] | str:
        entries = self._entries
        if any(ref not in entries for ref in refs):
            return "an entry is not stored"
        return [entries[ref].entry.length for ref in refs]

    def _remove(self, lane: LaneKey, refs: list[EntryRef]) -> None:
        for ref in refs:
            del self._entries[ref]  # the memory tier's tombstone

    def _lane_dropped(self, lane: LaneKey) -> None:
        dropped = self._segments.pop(lane, None)
        if dropped is not None:
            del self._segment_lane[dropped.segment]

    def _lane_of(self, segment: SegmentId) -> LaneKey:
        return self._segment_lane[segment]

    def _live_entries(self) -> dict[EntryRef, int]:
        return {ref: stored.entry.length for ref, stored in self._entries.items()}

    # ----------------------------------------------------------------- reading

    def read_tokens(self, ref: EntryRef) -> np.ndarray:
        return self._entries[ref].tokens

    def read_payload(self, ref: EntryRef) -> bytes:
        return self._entries[ref].payload

    def check_invariants(self) -> None:
        """QueuedTier's checks, and every entry sits in its own lane's segment. O(entries)."""
        super().check_invariants()
        for ref, stored in self._entries.items():
            assert stored.entry.lane == self._segment_lane[ref.segment], ref
            assert ref.offset < self._segments[stored.entry.lane].next_offset, ref
        assert len(self._segment_lane) == len(self._segments), "a segment serves two lanes"
