"""The storage tier's bookkeeping (SPEC §5): lane queues with returned runs at the front,
the three-step commit, completion and consumer loss through the pending map, the counters,
and which (producer, seq) are already stored (idempotent ingest).

`QueuedTier` is the half of the tier that knows nothing of files; `DiskTier` (disk.py)
subclasses it and says only where its entries live:

    _describe(lane, refs, segments, offsets) -> the entries as peeked, by column (peek, return)
    _check_segments(segments)  -> why not, or None: the entries' segments exist (commit step 1)
    _remove(lane, refs)        tombstone completed entries
    _lane_dropped(lane)        the lane's queue is gone (drop_lane)
    _lane_of(segment)          the lane a segment belongs to                (invariants)
    _live_entries()            every stored, not completed entry and its length (invariants)
    _cold_offsets(segment, start, end, count) -> a cold run's next offsets, read back

and calls `_record_append(...)` once it has stored a group.
NOTE: the split is by concern, not for a second tier: the queues are pure bookkeeping,
checked by what they hold, and the files are disk.py's; as one module they would be over
800 lines.

A lane's queue, front first: entries given back by lost consumers (a deque of refs: the
latest run in front, each run in its original order), then runs of appended entries in
arrival order. The appended runs nearest the front are *hot*: one segment's offsets as an
int64 numpy array with a head cursor (8 bytes an entry, plus about 170 bytes per appended
group for the run record and its array header); only returned entries are refs (~100 bytes).
Past HOT_ENTRIES_MAX hot entries a lane's further runs are *cold*: one record per segment
(its first queued byte, its end and how many entries lie between), the entries' offsets
left in the segment file itself. When the front reaches a cold run, `warm` reads the next
offsets back from the file (the subclass's `_cold_offsets`: a walk of the entry headers,
in the page cache) into a hot run. So the broker's memory for a lane is bounded by the hot
window and one record per segment, however deep the backlog (about 128 KiB a lane).
NOTE: offset arrays of every queued entry were rejected: 80 MB at 10,000,000 queued entries.
NOTE: a deque of EntryRef per entry (about 120 bytes each) was rejected: a tier holding
millions of queued entries would spend gigabytes on it.
Runs appended but not yet dispatchable (durability `power` until the group commit) wait in
the lane's `staged` list and join the back of the queue at `flush()`.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import islice

import numpy as np

import pipeline.storage.crashpoints as crashpoints
from pipeline.broker.ids import BatchId, ConsumerId, EntryRef, LaneKey, SegmentId
from pipeline.storage.base import Peeked, Returned, StorageCounters, StorageTier
from pipeline.storage.pending import Completion, EntryColumns, PendingMap, make_refs
from pipeline.wire.errors import StaleBatchError
from pipeline.wire.layouts.frames import ProducerId

# Queued entries of a lane whose offsets stay in memory (8 bytes each): beyond it, a lane's
# further appends are kept as one record per segment and their offsets read back from the
# file when the front reaches them. 16,384 covers many batches of the largest contracts
# (the front is warmed on demand for a bigger one), and 128 KiB a lane keeps the broker flat
# for any backlog (a hundred busy lanes: 12.5 MiB).
HOT_ENTRIES_MAX = 16_384
# Entries read back from a cold run at once, at least: one walk of the headers per this
# many (about 2 ms here), not one per batch.
WARM_CHUNK_ENTRIES = 4096

# Reads offsets back for a cold run: (segment, first byte, end byte, at most how many) ->
# (the offsets of the entries from the first byte on, in file order, and the byte after the
# last one returned).
ColdLoader = Callable[[SegmentId, int, int, int], tuple[np.ndarray, int]]


class RefRun(Sequence[EntryRef]):
    """The refs of entries appended together to one segment, made on demand: an append
    returns one instead of a list (building a list of refs cost a quarter of the disk
    tier's append time, and the dispatcher does not read it)."""

    __slots__ = ("segment", "offsets")

    def __init__(self, segment: SegmentId, offsets: np.ndarray) -> None:
        self.segment = segment
        self.offsets = offsets

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [EntryRef(self.segment, offset) for offset in self.offsets[index].tolist()]
        return EntryRef(self.segment, int(self.offsets[index]))

    def __iter__(self) -> Iterator[EntryRef]:
        segment = self.segment
        return (EntryRef(segment, offset) for offset in self.offsets.tolist())


class _Run:
    """Appended entries of one segment, in file order: `offsets[head:]` are still queued.
    `end`: the byte after the last entry (-1: not to be read back, a damaged segment's)."""

    __slots__ = ("segment", "offsets", "head", "end")

    def __init__(self, segment: SegmentId, offsets: np.ndarray, end: int = -1) -> None:
        self.segment = segment
        self.offsets = offsets
        self.head = 0
        self.end = end

    def __len__(self) -> int:
        return self.offsets.shape[0] - self.head


class _ColdRun:
    """Queued entries of one segment whose offsets are not in memory: `count` live entries
    lie in [start, end) of the file, back to back or (recovered) with tombstoned ones
    between, none dispatched yet."""

    __slots__ = ("segment", "start", "end", "count", "offsets")

    def __init__(self, segment: SegmentId, start: int, end: int, count: int,
                 offsets: np.ndarray | None = None) -> None:
        self.segment = segment
        self.start = start
        self.end = end
        self.count = count
        # A run that cannot be read back (a damaged segment's, recovered behind cold runs)
        # keeps its offsets here: rare, and only ever as many as that segment holds.
        self.offsets = offsets

    def take(self, count: int, load: ColdLoader) -> tuple[np.ndarray, int]:
        """The next `count` offsets and where the rest start (the end when none are left)."""
        if self.offsets is None:
            return load(self.segment, self.start, self.end, count)
        taken, self.offsets = self.offsets[:count], self.offsets[count:]
        return taken, int(self.offsets[0]) if self.offsets.size else self.end


class LaneQueue:
    """One lane's dispatchable entries (returned ones first, then hot appended runs, then
    cold ones) plus its staged runs and how many of its entries are pending.

    Owner: the QueuedTier holding it, in the broker's dispatch loop. Not thread-safe.
    """

    __slots__ = ("returned", "runs", "cold", "staged", "queued", "hot", "hot_max", "staged_count", "pending")

    def __init__(self, hot_max: int = HOT_ENTRIES_MAX) -> None:
        self.returned: deque[EntryRef] = deque()
        self.runs: deque[_Run] = deque()  # hot: offsets in memory
        self.cold: deque[_ColdRun] = deque()  # after every hot run
        self.staged: list[_Run] = []
        self.queued = 0  # dispatchable: len(returned) + hot + the cold runs' counts
        self.hot = 0  # the hot runs' remaining entries
        self.hot_max = hot_max  # appends past this many hot entries are cold
        self.staged_count = 0
        self.pending = 0  # entries of this lane held by consumers

    def warm(self, count: int, load: ColdLoader) -> None:
        """Make the first `count` dispatchable entries hot (fewer if fewer are queued),
        reading offsets back from cold runs, at least WARM_CHUNK_ENTRIES at a time."""
        need = count - len(self.returned)
        while self.hot < need and self.cold:
            cold = self.cold[0]
            take = min(cold.count, max(need - self.hot, WARM_CHUNK_ENTRIES))
            offsets, next_start = cold.take(take, load)
            # `>`: a recovered run's next chunk may start past tombstoned entries
            assert offsets.shape[0] == take and offsets[0] >= cold.start, (cold.segment, cold.start, take)
            self.runs.append(_Run(cold.segment, offsets, next_start))
            self.hot += take
            cold.count -= take
            cold.start = next_start
            if not cold.count:
                assert cold.start == cold.end, (cold.segment, cold.start, cold.end)
                self.cold.popleft()

    def front_keys(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `count` hot entries' segments and offsets (fewer if fewer are hot),
        front first, as int64 columns: no ref is made."""
        out = list(islice(self.returned, count))
        segments = [np.array([ref.segment for ref in out], dtype=np.int64)]
        offsets = [np.array([ref.offset for ref in out], dtype=np.int64)]
        need = count - len(out)
        for run in self.runs:
            if need <= 0:
                break
            taken = run.offsets[run.head:run.head + need]
            segments.append(np.full(taken.shape[0], run.segment, dtype=np.int64))
            offsets.append(taken)
            need -= taken.shape[0]
        if len(segments) == 2 and not segments[0].size:  # nothing returned, one run: the common case
            return segments[1], offsets[1]
        return np.concatenate(segments), np.concatenate(offsets)

    def pop_front(self, count: int) -> None:
        assert count <= len(self.returned) + self.hot, (count, len(self.returned), self.hot)
        self.queued -= count
        from_returned = min(count, len(self.returned))
        for _ in range(from_returned):
            self.returned.popleft()
        count -= from_returned
        self.hot -= count
        while count:
            run = self.runs[0]
            left = len(run)
            if left <= count:
                self.runs.popleft()
                count -= left
            else:
                run.head += count
                count = 0

    def push_front(self, refs: Sequence[EntryRef]) -> None:
        """A returned run goes in front of everything, in its own order."""
        self.returned.extendleft(reversed(refs))
        self.queued += len(refs)

    def push_back(self, segment: SegmentId, offsets: np.ndarray, staged: bool, end: int = -1) -> None:
        """A run of `segment` at `offsets`, its last entry ending at byte `end` (-1: its
        offsets cannot be read back, as a damaged segment's: then it stays hot)."""
        run = _Run(segment, offsets, end)
        if staged:
            self.staged.append(run)
            self.staged_count += len(run)
        else:
            self._enqueue(run)

    def _enqueue(self, run: _Run) -> None:
        count = len(run)
        self.queued += count
        if not (self.cold or self.hot + count > self.hot_max) or (run.end < 0 and not self.cold):
            self.runs.append(run)
            self.hot += count
            return
        start = int(run.offsets[0])
        if run.end < 0:  # behind cold runs, and not to be read back: it keeps its offsets
            self.cold.append(_ColdRun(run.segment, start, int(run.offsets[-1]) + 1, count, run.offsets))
            return
        last = self.cold[-1] if self.cold else None
        if last is not None and last.offsets is None and last.segment == run.segment and last.end == start:
            last.end = run.end  # the lane's next group in the same file: one record
            last.count += count
        else:
            self.cold.append(_ColdRun(run.segment, start, run.end, count))

    def publish(self) -> None:
        """Staged runs become dispatchable, at the back, in the order they were appended."""
        for run in self.staged:
            self._enqueue(run)
        self.staged = []
        self.staged_count = 0

    def all_refs(self, load: ColdLoader) -> Iterator[EntryRef]:
        """Every queued and staged ref, in order (invariants, recovery listings); cold runs
        are read back from their files, not warmed."""
        yield from self.returned
        cold_runs = [_Run(c.segment, load(c.segment, c.start, c.end, c.count)[0] if c.offsets is None
                          else c.offsets) for c in self.cold]
        for run in (*self.runs, *cold_runs, *self.staged):
            segment = run.segment
            for offset in run.offsets[run.head:].tolist():
                yield EntryRef(segment, offset)

    @property
    def empty(self) -> bool:
        return not (self.queued or self.staged_count or self.pending)

    def check(self) -> None:
        assert self.hot == sum(len(run) for run in self.runs), self.hot
        assert self.queued == len(self.returned) + self.hot + sum(c.count for c in self.cold), self.queued
        assert self.staged_count == sum(len(run) for run in self.staged), self.staged_count
        assert all(len(run) > 0 for run in self.runs) and self.pending >= 0
        assert all(c.count > 0 and c.start < c.end for c in self.cold)
        for run in (*self.runs, *self.staged):
            assert run.offsets.dtype == np.int64 and 0 <= run.head < run.offsets.shape[0]
            assert (np.diff(run.offsets) > 0).all(), "a run's offsets are in file order"


class StoredSeqs:
    """Which of a producer's items are already stored: the precise check behind idempotent
    ingest (SPEC §5).

    Protocol invariant it relies on (the broker loop keeps it; the Dispatcher asserts what
    it can): (a) a producer's ring records are ingested in ring order, items in sequence
    order with no gaps; (b) a record is released only after all its items are stored (and,
    in `power`, flushed); (c) an item is dispatched only after its record was released.
    After a crash the ring presents exactly the unreleased records, a suffix of the
    producer's sequence; by (b) and (c) each of their items is either not stored at all or
    stored and still live (never dispatched, so never tombstoned).

    So two facts answer "already stored?" exactly:
    - `highest`: the highest seq this process stored for the producer. By (a), and because
      the Dispatcher ingests nothing new while a frame waits for a retried append, every
      seq at or below it was stored (or found stored) by this process, or released before.
    - `recovered`: the seqs of the producer's live entries found by recovery, sorted, and
      kept when they are completed later (a snapshot). A frame that was partly stored before
      a crash (it spans lanes, written one lane group at a time) is re-presented and exactly
      its stored items are found here, even if they were dispatched and completed first
      (recovered items are dispatchable at once; the loop's catch-up turn, see
      `pipeline.storage.base`, bounds that to one restart).
    NOTE: a high-water mark alone was rejected: after a crash in the middle of a frame, the
    lane group holding its highest seq may be stored while a lower one is not.

    Memory: 8 bytes per recovered live entry (a sorted uint64 array per producer), trimmed
    to the seqs above `highest` as the producer's ingest advances and dropped once it passes
    the highest recovered seq; plus one int per producer.

    Owner: the storage tier. Not thread-safe.
    """

    def __init__(self) -> None:
        self._highest: dict[ProducerId, int] = {}
        self._recovered: dict[ProducerId, np.ndarray] = {}

    def appended(self, producer: ProducerId, top_seq: int) -> None:
        if top_seq <= self._highest.get(producer, -1):
            return
        self._highest[producer] = top_seq
        found = self._recovered.get(producer)
        if found is not None:
            keep = found[np.searchsorted(found, np.uint64(top_seq), side="right"):]
            if keep.size:
                self._recovered[producer] = keep  # a view: no copy per append
            else:
                del self._recovered[producer]

    def add_recovered(self, producer: ProducerId, seqs: np.ndarray) -> None:
        old = self._recovered.get(producer)
        both = seqs if old is None else np.concatenate((old, seqs))
        self._recovered[producer] = np.unique(both.astype(np.uint64))

    def mask(self, producer: ProducerId, seqs: np.ndarray) -> np.ndarray:
        """True where `seqs[i]` is already stored (or was, and was completed)."""
        highest = self._highest.get(producer)
        stored = np.zeros(seqs.shape, dtype=bool) if highest is None else seqs <= np.uint64(highest)
        found = self._recovered.get(producer)
        if found is not None:
            at = np.minimum(np.searchsorted(found, seqs), found.size - 1)
            stored |= found[at] == seqs
        return stored

    def highest(self, producer: ProducerId) -> int | None:
        highest = self._highest.get(producer)
        found = self._recovered.get(producer)
        if found is not None and (highest is None or int(found[-1]) > highest):
            return int(found[-1])
        return highest

    def producers(self) -> set[ProducerId]:
        """Every producer with an item stored (by this process, or found live by recovery)."""
        return set(self._highest) | set(self._recovered)

    def memory_bytes(self) -> int:
        return sum(found.nbytes for found in self._recovered.values())

    def check(self) -> None:
        for producer, found in self._recovered.items():
            assert found.size and (np.diff(found.astype(np.int64)) > 0).all(), producer
            assert int(found[0]) > self._highest.get(producer, -1), producer


class QueuedTier(StorageTier, abc.ABC):
    """The shared half of a storage tier (see the module docstring): queues, commit,
    completion, consumer loss, counters, stored seqs. Subclasses store the entries.

    Owner: the broker's dispatch loop (through the Dispatcher). Not thread-safe.
    """

    def __init__(self, hot_entries_max: int = HOT_ENTRIES_MAX) -> None:
        """`hot_entries_max`: HOT_ENTRIES_MAX but in tests (a few, so cold runs are common)."""
        assert hot_entries_max >= 1, hot_entries_max
        self._hot_entries_max = hot_entries_max
        self._queues: dict[LaneKey, LaneQueue] = {}
        self._pending = PendingMap()
        self._stored = StoredSeqs()
        self._staged_queues: dict[LaneKey, LaneQueue] = {}  # lanes with staged runs
        self.counters = StorageCounters()

    # ----------------------------------------------------------------- for subclasses

    @abc.abstractmethod
    def _describe(self, lane: LaneKey, segments: np.ndarray, offsets: np.ndarray) -> Peeked:
        """The entries at `segments` and `offsets` (int64 columns; all stored in `lane`), in
        order, by column."""

    @abc.abstractmethod
    def _check_segments(self, segments: np.ndarray) -> str | None:
        """Commit step 1, the tier's part: why entries of these segments (int64 ids) cannot
        be committed (a segment is gone), or None. Touches nothing."""

    def _dispatched(self, segments: np.ndarray, offsets: np.ndarray) -> None:
        """Entries at `segments`/`offsets` (file order within each segment) were committed to a
        consumer: a tier may let go of what it holds for them."""

    @abc.abstractmethod
    def _remove(self, lane: LaneKey, entries: EntryColumns) -> None:
        """The entries were completed: they are gone for good."""

    @abc.abstractmethod
    def _lane_dropped(self, lane: LaneKey) -> None:
        """drop_lane: the lane's (empty) queue was removed."""

    @abc.abstractmethod
    def _lane_of(self, segment: SegmentId) -> LaneKey:
        """The lane whose entries `segment` holds."""

    @abc.abstractmethod
    def _live_entries(self) -> dict[EntryRef, int]:
        """Every stored, not completed entry with its length (check_invariants)."""

    @abc.abstractmethod
    def _cold_offsets(self, segment: SegmentId, start: int, end: int, count: int) -> tuple[np.ndarray, int]:
        """The offsets (int64) of the next `count` live entries in `segment` from byte
        `start` on (none past `end`; tombstoned ones skipped), and the byte after the last."""

    def _queue(self, lane: LaneKey) -> LaneQueue:
        queue = self._queues.get(lane)
        if queue is None:
            queue = self._queues[lane] = LaneQueue(self._hot_entries_max)
        return queue

    def _record_append(
        self, lane: LaneKey, segment: SegmentId, offsets: np.ndarray, producer: ProducerId,
        top_seq: int, tokens: int, staged: bool = False, end: int = -1,
    ) -> None:
        """A group of `lane` was stored at `offsets` of `segment` (int64, file order), its
        last entry ending at byte `end` (-1: unknown, it stays hot): queue it (staged:
        dispatchable at the next flush) and count it."""
        queue = self._queue(lane)
        queue.push_back(segment, offsets, staged, end)
        if staged:
            self._staged_queues[lane] = queue
        self._stored.appended(producer, top_seq)
        self.counters.appended_items += int(offsets.shape[0])
        self.counters.appended_tokens += tokens

    def _record_recovered(self, lane: LaneKey, segment: SegmentId, offsets: np.ndarray,
                          tokens: int, end: int = -1) -> None:
        """Recovery found these live entries of `lane` in `segment` (file order), the last
        ending at byte `end` (-1: they stay hot; else tombstoned entries may lie between)."""
        self._queue(lane).push_back(segment, offsets, staged=False, end=end)
        self.counters.recovered_items += int(offsets.shape[0])
        self.counters.recovered_tokens += tokens

    # ----------------------------------------------------------------- StorageTier

    def highest_seq(self, producer_id: ProducerId) -> int | None:
        return self._stored.highest(producer_id)

    def already_stored(self, producer_id: ProducerId, seqs: np.ndarray) -> np.ndarray:
        return self._stored.mask(producer_id, seqs)

    def stored_producers(self) -> set[ProducerId]:
        return self._stored.producers()

    @property
    def needs_flush(self) -> bool:
        return bool(self._staged_queues)

    def flush(self) -> None:
        """Staged entries become dispatchable (a subclass makes them durable first)."""
        for queue in self._staged_queues.values():
            queue.publish()
        self._staged_queues.clear()

    def peek_many(self, lane: LaneKey, max_items: int) -> Peeked:
        queue = self._queues.get(lane)
        if queue is None or not queue.queued or max_items <= 0:
            return Peeked.of(lane, [])
        if queue.cold:
            queue.warm(max_items, self._cold_offsets)
        return self._describe(lane, *queue.front_keys(max_items))

    def commit(self, lane: LaneKey, entries: Peeked, consumer: ConsumerId, batch: BatchId) -> None:
        """The three steps of SPEC §5. Example: lane queue [r5, r6, r7]; committing the peeked
        [r5, r6] for consumer 2 as batch 9 leaves [r7] and consumer 2 holding r5, r6 as batch
        9; committing [r6] instead raises StaleBatchError and changes nothing. Step 1 compares
        the lane's front with the peek's segment and offset columns; the lengths are the
        peek's (the headers were read and checked when it was made)."""
        # Step 1: verify everything (the front of the lane, every segment), touch nothing.
        queue = self._queues.get(lane)
        count = len(entries)
        why: str | None = "they are not the front of the lane"
        if count and queue is not None and self._is_front(queue, entries):
            why = self._check_segments(entries.segments)
        if why is not None:
            front = [] if queue is None else make_refs(*(column.tolist() for column in queue.front_keys(4)))
            raise StaleBatchError(
                f"batch {batch} for consumer {consumer}: its {count} entries cannot be committed "
                f"from lane {tuple(lane)}: {why} (front now {front}); nothing was committed"
            )
        assert queue is not None and not self._pending.has_batch(batch), batch
        if crashpoints.ARMED:
            crashpoints.hit("commit.after_verify")
        # Step 2: advance the lane's cursor.
        queue.pop_front(count)
        queue.pending += count
        self._dispatched(entries.segments, entries.offsets)
        if crashpoints.ARMED:
            crashpoints.hit("commit.after_advance")
        # Step 3: the consumer holds them.
        lengths = entries.lengths.tolist()
        self._pending.add_batch(batch, consumer, lane, entries.columns, lengths)

    @staticmethod
    def _is_front(queue: LaneQueue, entries: Peeked) -> bool:
        # No warming here: a peek warmed its entries, and a commit of more than that is stale.
        segments, offsets = queue.front_keys(len(entries))
        return np.array_equal(segments, entries.segments) and np.array_equal(offsets, entries.offsets)

    def complete_batch(self, consumer: ConsumerId, batch: BatchId) -> Completion:
        done = self._pending.complete_batch(consumer, batch)  # NotHeldError first: nothing applied
        for lane, entries in done.by_lane.items():
            self._queues[lane].pending -= len(entries)
            self._remove(lane, entries)
        self.counters.completed_items += done.items
        self.counters.completed_tokens += done.tokens
        return done

    def return_consumer(self, consumer: ConsumerId) -> list[Returned]:
        returned: list[Returned] = []
        for run in self._pending.consumer_lost(consumer):
            queue = self._queues[run.lane]
            queue.push_front(run.refs)  # ahead of new work, original order
            queue.pending -= len(run.refs)
            entries = EntryColumns.of(run.refs)
            returned.append(Returned(run.lane, self._describe(run.lane, entries.segments, entries.offsets)))
        return returned

    def drop_lane(self, lane: LaneKey) -> None:
        queue = self._queues.pop(lane, None)
        if queue is not None:
            assert queue.empty, (lane, queue.queued, queue.staged_count, queue.pending)
            self._staged_queues.pop(lane, None)
            self._lane_dropped(lane)

    def queued_items(self, lane: LaneKey | None = None) -> int:
        """Stored, not pending entries: dispatchable ones and those waiting for a flush."""
        if lane is None:
            return sum(queue.queued + queue.staged_count for queue in self._queues.values())
        queue = self._queues.get(lane)
        return 0 if queue is None else queue.queued + queue.staged_count

    def pending_items(self, consumer: ConsumerId | None = None) -> int:
        return len(self._pending) if consumer is None else self._pending.held_by(consumer)

    def lane_keys(self) -> list[LaneKey]:
        """Every lane the tier holds a queue for (tests, tools)."""
        return list(self._queues)

    # ----------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Every stored entry is in exactly one place: queued (or staged) once in its own
        lane, or pending; counts and totals agree. O(entries)."""
        self._pending.check_invariants()
        self._stored.check()
        live = self._live_entries()
        pending = self._pending.held_refs()
        queued: set[EntryRef] = set()
        for lane, queue in self._queues.items():
            queue.check()
            assert (queue.staged_count > 0) == (lane in self._staged_queues), lane
            for ref in queue.all_refs(self._cold_offsets):
                assert ref in live and ref not in queued, f"queued entry {ref} is not live or twice"
                assert ref not in pending and self._lane_of(ref.segment) == lane, ref
                queued.add(ref)
        pending_by_lane: dict[LaneKey, int] = {}
        for ref in live:
            if ref in pending:
                lane = self._lane_of(ref.segment)
                pending_by_lane[lane] = pending_by_lane.get(lane, 0) + 1
            else:
                assert ref in queued, f"entry {ref} is neither queued nor pending"
        assert len(live) == len(queued) + len(self._pending), (len(live), len(queued))
        for lane, queue in self._queues.items():
            assert queue.pending == pending_by_lane.get(lane, 0), lane
        c = self.counters
        assert c.appended_items + c.recovered_items == c.completed_items + len(live), c
        assert c.appended_tokens + c.recovered_tokens == c.completed_tokens + sum(live.values()), c
