"""The storage interface (SPEC §5): what the dispatcher asks of the store.

There is one tier, `DiskTier` (disk.py): segment files under a data directory. It lives in
one of two places, chosen by the broker's `--storage`: on disk (`disk`, durable) or on tmpfs
(`memory`: the same files in RAM, gone when the broker stops). Consumers map those files and
read token ids zero-copy, so every tier the broker runs on must keep its items in segment
files: this interface is that one tier's, written apart from its implementation so that the
dispatcher, which depends on it, reads it in one place.
NOTE: an in-process heap tier (MemoryTier) was dropped: it could not say where a consumer
finds an entry (no file to map), so the broker could not run on it, and it kept a second
implementation of every operation alive for tests alone.

The tier holds the items themselves, queued per (model, signature, lane) in arrival order,
and the pending map of dispatched entries. It knows nothing of lane policy, packing or shape
selection (the dispatcher drives those) and nothing of processes or sockets. Every operation
takes and returns entries by column (`Peeked`), as dispatch uses them:

    refs = tier.append(AppendGroup(lane_key, frame, rows))   # items of ONE lane, in order
    front = tier.peek_many(lane_key, 64)                      # first 64 dispatchable; no advance
    tier.commit(lane_key, front[:n], consumer, batch_id)      # after the channel took them
    done = tier.complete_batch(consumer, batch_id)            # tombstones; NotHeldError if not held
    back = tier.return_consumer(consumer)                     # lost: pending -> front of lanes
    skip = tier.already_stored(producer_id, seqs)             # idempotent ingest (a bool mask)
    tier.flush()                                              # once per loop turn, see below
    lanes = tier.take_recovered_lanes()                       # after a restart: reseed the lanes
    lanes, seqs, offsets = tier.entry_locations(front)        # where a consumer finds them

Entries are addressed by `EntryRef(segment, offset)`: the segment id and byte offset. Refs
are never reused while the store lives, which is what lets the pending map recognise a
completion of something a consumer does not hold.

Dispatch order within a lane: entries returned by a lost consumer first (each return run in
its original order, the latest run in front), then the rest in arrival order.

The commit is the three steps of SPEC §5, in this order, so that it is failure-atomic without
a log: (1) verify that the peeked entries are still the front of their lane and every segment
exists, touching nothing (StaleBatchError if not); (2) advance the lane's cursor past them;
(3) add them to the pending map with the consumer that holds them.

Loop protocol (what makes ingest idempotent and the durability level mean something): in
each turn the broker loop (1) ingests the frames it read from the producer rings (append),
(2) calls `flush()` once, (3) only then releases those ring records, and (4) only then
serves consumers. So a record is released only once its items are stored as durably as the
durability level says, and an item is dispatched only after its record was released: after
a crash, a re-presented record's items are either not stored or stored and still live, and
`already_stored` finds exactly the latter (see `queues.StoredSeqs`). (5) After a restart,
before serving anyone, the loop does one catch-up turn: it ingests, flushes and releases
every record the rings still hold. Recovered items of records that were never released
are dispatchable at once; the catch-up releases those records before any of their items
can be dispatched, so a second crash cannot re-present a record whose items were already
completed (and stored again). The kill -9 tests fail without it.

Ownership: a tier is owned by the broker's single dispatch loop (through the Dispatcher).
Not thread-safe.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.broker.ids import BatchId, ConsumerId, EntryRef, LaneKey
from pipeline.storage.pending import Completion, EntryColumns, make_refs
from pipeline.wire.layouts.frames import Frame, ItemId, ProducerId


@dataclass(frozen=True, slots=True)
class AppendGroup:
    """Items of one (model, signature, lane) to store, in arrival order: `rows` of a parsed
    frame (indices into frame.items). Every row's model and signature are the lane's."""

    lane: LaneKey
    frame: Frame
    rows: np.ndarray

    def __len__(self) -> int:
        return int(self.rows.size)

    @property
    def producer_id(self) -> ProducerId:
        return ProducerId(self.frame.producer_id)


@dataclass(frozen=True, slots=True)
class PeekedEntry:
    """One stored entry as dispatch sees it: where it lives, the routing keys it was stored
    under (the disk tier reads them from the segment header), and the item's fields. The
    token ids stay in the store (`read_tokens`; a consumer maps them from the segment)."""

    ref: EntryRef
    lane: LaneKey
    item_id: ItemId
    producer_id: ProducerId
    seq: int
    length: int
    prefix_len: int
    submit_ns: int
    signature: int  # the item's own shape: the lane's, but in a pool lane (the entry header's)


class Peeked(Sequence[PeekedEntry]):
    """A lane's front entries in dispatch order, by column: what dispatch reads (`peek_many`)
    without an object per entry. Indexing makes PeekedEntry objects on demand (tests,
    tools, the rare paths); a slice is a Peeked of the same columns' slices.
    NOTE: a list of PeekedEntry cost about a microsecond per entry to
    build, a tenth of the broker's CPU per item."""

    __slots__ = ("lane", "_refs", "segments", "offsets", "lengths", "item_ids", "producer_ids", "seqs",
                 "prefix_lens", "submit_ns", "signatures")

    def __init__(self, lane: LaneKey, refs: list[EntryRef] | None, segments: np.ndarray, offsets: np.ndarray,
                 lengths: np.ndarray, item_ids: np.ndarray, producer_ids: np.ndarray, seqs: np.ndarray,
                 prefix_lens: np.ndarray, submit_ns: np.ndarray, signatures: np.ndarray) -> None:
        self.lane = lane
        self._refs = refs  # EntryRef per entry, made from the columns when first asked (None)
        self.segments = segments  # int64: each entry's segment and offset, as columns
        self.offsets = offsets
        self.lengths = lengths  # int64
        self.item_ids = item_ids  # uint64
        self.producer_ids = producer_ids
        self.seqs = seqs
        self.prefix_lens = prefix_lens
        self.submit_ns = submit_ns  # uint64
        self.signatures = signatures  # uint64: each entry's own shape (the entry header's)

    @classmethod
    def of(cls, lane: LaneKey, entries: Sequence[PeekedEntry]) -> Peeked:
        """Columns of a list of entries (an empty front, or one a test builds), under the lane
        the entries say they were stored in (`lane` when there are none)."""
        def column(name: str, dtype: type) -> np.ndarray:
            return np.array([getattr(e, name) for e in entries], dtype=dtype)
        stored = {e.lane for e in entries} or {lane}
        assert len(stored) == 1, f"entries of lanes {sorted(stored)} peeked from one lane"
        refs = [e.ref for e in entries]
        return cls(stored.pop(), refs, np.array([r.segment for r in refs], dtype=np.int64),
                   np.array([r.offset for r in refs], dtype=np.int64), column("length", np.int64),
                   column("item_id", np.uint64), column("producer_id", np.int64), column("seq", np.uint64),
                   column("prefix_len", np.int64), column("submit_ns", np.uint64), column("signature", np.uint64))

    @property
    def refs(self) -> list[EntryRef]:
        if self._refs is None:
            self._refs = make_refs(self.segments.tolist(), self.offsets.tolist())
        return self._refs

    @property
    def columns(self) -> EntryColumns:
        return EntryColumns(self.segments, self.offsets)

    def __len__(self) -> int:
        return self.offsets.shape[0]

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            refs = None if self._refs is None else self._refs[index]
            return Peeked(self.lane, refs, *(getattr(self, name)[index] for name in self.__slots__[2:]))
        return PeekedEntry(self.refs[index], self.lane, ItemId(int(self.item_ids[index])),
                           ProducerId(int(self.producer_ids[index])), int(self.seqs[index]),
                           int(self.lengths[index]), int(self.prefix_lens[index]), int(self.submit_ns[index]),
                           int(self.signatures[index]))

    def __iter__(self):
        return map(self.__getitem__, range(len(self)))


@dataclass(frozen=True, slots=True)
class RecoveredLane:
    """A lane that recovery found live entries for: its key and its queued entries' lengths
    and submit times in dispatch order (segment sequence order, file order within a
    segment), for the dispatcher to reseed its lanes with the same lane id."""

    lane: LaneKey
    lengths: np.ndarray  # int64
    submit_ns: np.ndarray  # uint64
    signatures: np.ndarray  # uint64: each entry's own shape (a pool lane's are many)


@dataclass(frozen=True, slots=True)
class Returned:
    """A lost consumer's pending entries of one lane, now dispatchable again at the front of
    the lane, front first."""

    lane: LaneKey
    entries: Peeked

    @property
    def lengths(self) -> list[int]:
        return self.entries.lengths.tolist()


@dataclass(slots=True)
class StorageCounters:
    """Running totals of a tier. Accounting identity (check_invariants asserts it):
    appended + recovered = completed + queued + pending, in items and in tokens. (What was
    dispatched and given back is the Dispatcher's to count: routed, returned.)"""

    appended_items: int = 0
    appended_tokens: int = 0
    completed_items: int = 0
    completed_tokens: int = 0
    # Live entries a disk tier found at start (the accounting identity counts them with the
    # appended ones: appended + recovered = completed + queued + pending).
    recovered_items: int = 0
    recovered_tokens: int = 0


class StorageTier(abc.ABC):
    """The interface of the storage tier (see the module docstring for the protocol).

    Owned by the broker's single dispatch loop (through the Dispatcher); the implementation
    need not be thread-safe."""

    counters: StorageCounters

    @abc.abstractmethod
    def append(self, group: AppendGroup) -> Sequence[EntryRef]:
        """Store the group's items at the back of their lane, in order; return their refs.
        Once this returns (and, with durability `power`, once `flush()` has run), the items
        are dispatchable and as durable as the durability level says, so the producer's
        ring record may be released."""

    @abc.abstractmethod
    def peek_many(self, lane: LaneKey, max_items: int) -> Peeked:
        """The lane's first `max_items` dispatchable entries in dispatch order (returned
        entries first, then arrival order), by column, without advancing anything. Empty
        for an unknown or empty lane."""

    @abc.abstractmethod
    def commit(self, lane: LaneKey, entries: Peeked, consumer: ConsumerId, batch: BatchId) -> None:
        """`entries` (a prefix of the lane's dispatchable entries, as peeked in this loop
        turn) now belong to `consumer` as batch `batch`: the three steps of SPEC §5.
        StaleBatchError, with nothing changed, when they are no longer the front of the lane
        or a segment of theirs is gone. Their lengths are the peek's: no header is read again."""

    @abc.abstractmethod
    def complete_batch(self, consumer: ConsumerId, batch: BatchId) -> Completion:
        """The consumer finished every entry of batch `batch`: tombstone them (they are gone
        for good). All or nothing: NotHeldError, with nothing applied, if the consumer does
        not hold that batch (never committed, held by another, or completed already)."""

    @abc.abstractmethod
    def return_consumer(self, consumer: ConsumerId) -> list[Returned]:
        """The consumer is lost (disconnected, missed heartbeats): every entry it holds is
        dispatchable again, at the front of its lane ahead of new work, in its original
        order. Returns what went back, per lane."""

    @abc.abstractmethod
    def highest_seq(self, producer_id: ProducerId) -> int | None:
        """The highest sequence number stored for the producer (None if none). For reports:
        ingest asks `already_stored`, which is exact where a high-water mark is not (a
        frame spans lanes, and a crash can leave it partly stored)."""

    @abc.abstractmethod
    def already_stored(self, producer_id: ProducerId, seqs: np.ndarray) -> np.ndarray:
        """A bool mask over `seqs` (one producer's sequence numbers, uint64): True where
        the item is already stored, or was stored and completed, so ingest must skip it
        (SPEC §5). Exact under the loop protocol of the module docstring."""

    @abc.abstractmethod
    def stored_producers(self) -> set[ProducerId]:
        """Every producer id with an item in the store (found by recovery or stored since):
        an id the broker must never hand out again, even if its own record of the ids it
        handed out is lost (a new producer numbering from seq 0 under an old id would have
        its items taken for the stored ones and skipped)."""

    @abc.abstractmethod
    def flush(self) -> None:
        """The broker loop calls this once per turn after ingesting, BEFORE releasing the
        producer ring records it ingested: it makes what was appended as durable as the
        durability level promises (`power`: fdatasync, group commit) and then dispatchable."""

    @property
    @abc.abstractmethod
    def needs_flush(self) -> bool:
        """Appended entries wait for `flush()` to become dispatchable."""

    @abc.abstractmethod
    def take_recovered_lanes(self) -> list[RecoveredLane]:
        """Lanes with live entries found when the tier opened, once: later calls return []
        (the lists cost 16 bytes per entry, kept only until the dispatcher reseeds its
        lanes)."""

    @abc.abstractmethod
    def take_recovered_chains(self) -> list[tuple[int, tuple[int, ...]]]:
        """The chains of the shapes recovered, as (model, chain) from the store log, once
        (later calls return []): the dispatcher declares them before it seeds the lanes."""

    @abc.abstractmethod
    def record_chains(self, chains: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Producers declared these (model, chain) pairs: keep their new levels durable, as
        durable as the items `flush()` makes durable at the same group commit (a chain
        declared again, by a reconnecting producer, writes nothing). Never fails for want of
        room: a chain that cannot be kept is counted (`chains_unrecorded`) and only its
        order is lost."""

    @property
    @abc.abstractmethod
    def chains_unrecorded(self) -> int:
        """Chains `record_chains` could not keep (past the file's limit, or a full disk)."""

    @abc.abstractmethod
    def drop_lane(self, lane: LaneKey) -> None:
        """The lane's id was released (nothing of it is queued or pending): forget it. The
        same LaneKey may come back later as a new lane, starting empty."""

    @abc.abstractmethod
    def entry_locations(self, peeked: Peeked) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where a consumer finds each peeked entry, as int64 columns: (lane ids, segment
        sequences, byte offsets) of their segment files (the segment's model and signature
        are the batch's)."""

    @abc.abstractmethod
    def read_tokens(self, ref: EntryRef) -> np.ndarray:
        """The entry's token ids (int32), read-only, for tools and tests (consumers read the
        segment files themselves). KeyError for an entry that is not stored (completed or
        never written)."""

    @abc.abstractmethod
    def read_payload(self, ref: EntryRef) -> bytes:
        """The entry's opaque payload (b"" when it has none)."""

    @abc.abstractmethod
    def queued_items(self, lane: LaneKey | None = None) -> int:
        """Stored, not pending entries of one lane, or of every lane: the dispatchable ones
        and those waiting for `flush()`."""

    @abc.abstractmethod
    def pending_items(self, consumer: ConsumerId | None = None) -> int:
        """Dispatched, not completed entries held by one consumer, or by all."""

    @abc.abstractmethod
    def check_invariants(self) -> None:
        """Assert every internal invariant (tests call it after every step)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release files and mappings (the files, the store, stay)."""
