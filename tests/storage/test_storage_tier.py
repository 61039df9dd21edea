"""The storage tier against a reference of plain lists, through the StorageTier interface
only: the disk tier in both durability levels (pipeline/storage/disk.py, on real
files, with small segments so rotation and whole-file deletion happen, and few open files in
`power` so the open-file cache closes and reopens them), held to the same reference.
Deterministic: hypothesis is derandomised, stress runs are seeded."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable

import numpy as np
import pytest
from tests.support.frames import make_frame, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.broker.ids import BatchId, ConsumerId, LaneId, LaneKey, SegmentId
from pipeline.storage import AppendGroup, DiskTier, Durability, Peeked, StorageTier
from pipeline.storage.queues import HOT_ENTRIES_MAX, LaneQueue
from pipeline.wire.errors import NotHeldError, StaleBatchError
from pipeline.wire.layouts.frames import ProducerId

DETERMINISTIC = settings(derandomize=True, database=None, deadline=None, max_examples=150)
LANES = [LaneKey(0, 0xAB, LaneId(0)), LaneKey(0, 0xAB, LaneId(1)), LaneKey(2, 0xCD, LaneId(0))]
# Disk segments this small seal after a few groups: rotation and whole-file deletes happen.
SMALL_SEGMENT_BYTES = 24 << 10
TIERS: dict[str, Callable[[str], StorageTier]] = {
    "disk-process": lambda data_dir: DiskTier.open(
        data_dir, Durability.PROCESS, segment_max_bytes=SMALL_SEGMENT_BYTES),
    "disk-power": lambda data_dir: DiskTier.open(
        data_dir, Durability.POWER, segment_max_bytes=SMALL_SEGMENT_BYTES,
        open_files_max=2),
    # Lanes keep 3 entries' offsets in memory: most of a lane's queue is cold runs, read back
    # from the files as the front reaches them (queues.HOT_ENTRIES_MAX).
    "disk-process-cold": lambda data_dir: DiskTier.open(
        data_dir, Durability.PROCESS, segment_max_bytes=SMALL_SEGMENT_BYTES, hot_entries_max=3),
    "disk-power-cold": lambda data_dir: DiskTier.open(
        data_dir, Durability.POWER, segment_max_bytes=SMALL_SEGMENT_BYTES, open_files_max=2,
        hot_entries_max=3),
}
KINDS = list(TIERS)


@pytest.fixture(params=KINDS)
def make_tier(request, tmp_path):
    """A factory of tiers of one kind, each in its own directory; closed after."""
    made: list[StorageTier] = []

    def make() -> StorageTier:
        made.append(TIERS[request.param](str(tmp_path / f"d{len(made)}")))
        return made[-1]

    yield make
    for tier in made:
        tier.close()


class RefTier:
    """Per lane a list of item ids, front first; pending items in commit order, each with its
    consumer, lane and batch."""

    def __init__(self) -> None:
        self.queues: dict[LaneKey, list[int]] = {lane: [] for lane in LANES}
        self.pending: list[tuple[int, int, LaneKey, int]] = []  # (item id, consumer, lane, batch)

    def lose(self, consumer: int) -> dict[LaneKey, list[int]]:
        runs: dict[LaneKey, list[int]] = {}
        for item, holder, lane, _batch in self.pending:
            if holder == consumer:
                runs.setdefault(lane, []).append(item)
        self.pending = [p for p in self.pending if p[1] != consumer]
        for lane, items in runs.items():
            self.queues[lane] = items + self.queues[lane]
        return runs


class Harness:
    """One tier and the reference, driven by the same operations. The tier lives in a
    temporary directory removed by close()."""

    def __init__(self, kind: str = "disk-process") -> None:
        self.data_dir = tempfile.mkdtemp(prefix="tier-")
        self.tier: StorageTier = TIERS[kind](self.data_dir)
        self.ref = RefTier()
        self.seq = 0
        self.batch = 0
        self.refs: dict[int, object] = {}  # item id -> ref
        self.lengths: dict[int, int] = {}

    def append(self, pick: int, lengths: list[int]) -> None:
        lane = LANES[pick % len(LANES)]
        frame = make_frame(7, self.seq, [(lane.model, lane.signature)] * len(lengths), lengths,
                           submit_ns=self.seq, payloads=[bytes([i % 251]) * (i % 3) for i in range(len(lengths))])
        self.seq += len(lengths)
        refs = self.tier.append(AppendGroup(lane, frame, np.arange(len(lengths))))
        self.tier.flush()  # the loop protocol: once per turn, before anything is dispatched
        items = frame.items["item_id"].tolist()
        self.refs.update(zip(items, refs))
        self.lengths.update(zip(items, lengths))
        self.ref.queues[lane] += items

    def peek(self, pick: int, count: int) -> Peeked:
        lane = LANES[pick % len(LANES)]
        entries = self.tier.peek_many(lane, count)
        got = [entry.item_id for entry in entries]
        assert got == self.ref.queues[lane][:count] and entries.item_ids.tolist() == got
        for entry in entries:
            assert entry.lane == lane and entry.ref == self.refs[entry.item_id]
            assert entry.length == self.lengths[entry.item_id] and entry.prefix_len == entry.length // 2
        return entries

    def commit(self, pick: int, consumer: int, count: int, skew: int) -> None:
        lane = LANES[pick % len(LANES)]
        front = self.peek(pick, count)
        if not len(front):
            return
        if skew:  # a stale batch: not the front any more (or not a prefix)
            stale = front[1:] if len(front) > 1 else Peeked.of(lane, [front[0], front[0]])
            before = self.tier.queued_items(lane)
            with pytest.raises(StaleBatchError):
                self.tier.commit(lane, stale, ConsumerId(consumer), BatchId(self.batch))
            assert self.tier.queued_items(lane) == before
            return
        self.tier.commit(lane, front, ConsumerId(consumer), BatchId(self.batch))
        del self.ref.queues[lane][: len(front)]
        self.ref.pending += [(int(i), consumer, lane, self.batch) for i in front.item_ids.tolist()]
        self.batch += 1

    def complete(self, consumer: int, count: int) -> None:
        """The consumer completes its `count` oldest batches."""
        batches = list(dict.fromkeys(p[3] for p in self.ref.pending if p[1] == consumer))[:count]
        for batch in batches:
            mine = [p[0] for p in self.ref.pending if p[3] == batch]
            done = self.tier.complete_batch(ConsumerId(consumer), BatchId(batch))
            assert done.items == len(mine) and done.tokens == sum(self.lengths[i] for i in mine)
            self.ref.pending = [p for p in self.ref.pending if p[3] != batch]
            for item in mine:
                with pytest.raises(KeyError):
                    self.tier.read_tokens(self.refs[item])

    def lose(self, consumer: int) -> None:
        want = self.ref.lose(consumer)
        got = {run.lane: [e.item_id for e in run.entries] for run in self.tier.return_consumer(ConsumerId(consumer))}
        assert got == want

    def check(self) -> None:
        self.tier.check_invariants()
        for lane in LANES:
            assert self.tier.queued_items(lane) == len(self.ref.queues[lane])
        assert self.tier.pending_items() == len(self.ref.pending)
        for consumer in range(3):
            want = sum(1 for p in self.ref.pending if p[1] == consumer)
            assert self.tier.pending_items(ConsumerId(consumer)) == want

    def run(self, op: tuple) -> None:
        kind, *args = op
        {"append": self.append, "peek": self.peek, "commit": self.commit,
         "complete": self.complete, "lose": self.lose}[kind](*args)
        self.check()

    def close(self) -> None:
        self.tier.close()
        shutil.rmtree(self.data_dir)


picks = st.integers(0, 50)
consumers = st.integers(0, 2)
operations = st.one_of(
    st.tuples(st.just("append"), picks, st.lists(st.integers(1, 3000), min_size=1, max_size=8)),
    st.tuples(st.just("peek"), picks, st.integers(0, 12)),
    st.tuples(st.just("commit"), picks, consumers, st.integers(1, 10), st.sampled_from([0, 0, 0, 1])),
    st.tuples(st.just("complete"), consumers, st.integers(0, 3)),
    st.tuples(st.just("lose"), consumers),
)


@pytest.mark.parametrize("kind", KINDS)
@DETERMINISTIC
@given(ops=st.lists(operations, max_size=50))
def test_matches_reference(kind, ops):
    harness = Harness(kind)
    try:
        for op in ops:
            harness.run(op)
    finally:
        harness.close()


@pytest.mark.campaign
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [1, 2])
def test_seeded_stress(kind, seed):
    rng = np.random.default_rng(seed)
    harness = Harness(kind)
    for _ in range(400):
        roll = rng.random()
        pick, consumer = int(rng.integers(50)), int(rng.integers(3))
        if roll < 0.3:
            harness.run(("append", pick, rng.integers(1, 3000, int(rng.integers(1, 10))).tolist()))
        elif roll < 0.6:
            harness.run(("commit", pick, consumer, int(rng.integers(1, 12)), int(rng.random() < 0.1)))
        elif roll < 0.9:
            harness.run(("complete", consumer, int(rng.integers(1, 3))))
        else:
            harness.run(("lose", consumer))
    harness.close()


@pytest.mark.parametrize("kind", KINDS)
def test_returned_entries_go_first_latest_run_in_front(kind):
    harness = Harness(kind)
    harness.append(0, [10, 20, 30, 40, 50])
    harness.commit(0, consumer=1, count=2, skew=0)  # items 0, 1 to consumer 1
    harness.commit(0, consumer=2, count=2, skew=0)  # items 2, 3 to consumer 2
    harness.append(0, [60])
    harness.lose(1)
    assert harness.tier.peek_many(LANES[0], 10).lengths.tolist() == [10, 20, 50, 60]
    harness.lose(2)
    assert harness.tier.peek_many(LANES[0], 10).lengths.tolist() == [30, 40, 10, 20, 50, 60]
    harness.check()
    harness.close()


def test_tokens_payloads_and_highest_seq(make_tier):
    tier = make_tier()
    assert tier.highest_seq(ProducerId(7)) is None
    frame = make_frame(7, 100, [(0, 1)] * 3, [5, 9, 2], payloads=[b"a", b"", b"xyz"])
    refs = tier.append(AppendGroup(LaneKey(0, 1, LaneId(0)), frame, np.array([0, 2])))
    tier.flush()
    assert tier.highest_seq(ProducerId(7)) == 102 and len(refs) == 2
    entries = tier.peek_many(LaneKey(0, 1, LaneId(0)), 5)
    assert [e.seq for e in entries] == [100, 102] and [e.producer_id for e in entries] == [7, 7]
    for entry, payload in zip(entries, [b"a", b"xyz"]):
        tokens = tier.read_tokens(entry.ref)
        assert np.array_equal(tokens, token_ids(entry.item_id, entry.length))
        assert not tokens.flags.writeable and tier.read_payload(entry.ref) == payload
    tier.check_invariants()


def test_completion_by_a_non_holder_changes_nothing(make_tier):
    tier = make_tier()
    lane = LANES[0]
    tier.append(AppendGroup(lane, make_frame(1, 0, [(lane.model, lane.signature)] * 2, [4, 4]), np.arange(2)))
    tier.flush()
    tier.commit(lane, tier.peek_many(lane, 2), ConsumerId(1), BatchId(0))
    with pytest.raises(NotHeldError):
        tier.complete_batch(ConsumerId(2), BatchId(0))  # another consumer's batch
    with pytest.raises(NotHeldError):
        tier.complete_batch(ConsumerId(1), BatchId(1))  # never committed
    assert tier.pending_items(ConsumerId(1)) == 2 and tier.counters.completed_items == 0
    assert tier.complete_batch(ConsumerId(1), BatchId(0)).items == 2
    with pytest.raises(NotHeldError):
        tier.complete_batch(ConsumerId(1), BatchId(0))  # completed already: nothing is counted twice
    assert tier.counters.completed_items == 2 and tier.pending_items() == 0
    tier.check_invariants()


def test_drop_lane_then_the_same_key_starts_a_new_segment(make_tier):
    tier = make_tier()
    lane = LANES[0]
    tier.append(AppendGroup(lane, make_frame(1, 0, [(lane.model, lane.signature)], [4]), np.arange(1)))
    tier.flush()
    front = tier.peek_many(lane, 1)
    tier.commit(lane, front, ConsumerId(1), BatchId(0))
    tier.complete_batch(ConsumerId(1), BatchId(0))
    tier.drop_lane(lane)
    assert len(tier.peek_many(lane, 1)) == 0 and tier.queued_items(lane) == 0
    tier.append(AppendGroup(lane, make_frame(1, 1, [(lane.model, lane.signature)], [4]), np.arange(1)))
    tier.flush()
    again = tier.peek_many(lane, 1)
    assert again.refs[0].segment != front.refs[0].segment  # refs are never reused
    with pytest.raises(StaleBatchError):
        tier.commit(LANES[1], again, ConsumerId(1), BatchId(1))  # unknown lane
    tier.check_invariants()




@pytest.mark.parametrize("durability", [Durability.PROCESS, Durability.POWER])
def test_offsets_stay_in_memory_up_to_hot_entries_max_and_are_read_back_past_it(tmp_path, durability):
    # At HOT_ENTRIES_MAX queued entries a lane holds every offset in memory; one more is a
    # cold run (its offsets left in the file), read back in order when the front reaches it.
    tier = DiskTier.open(str(tmp_path / "d"), durability)
    lane = LANES[0]
    lengths = [3 + i % 5 for i in range(HOT_ENTRIES_MAX + 1)]
    seq, items = 0, []
    for size in (4096, 4096, 4096, HOT_ENTRIES_MAX - 3 * 4096, 1):
        frame = make_frame(7, seq, [(lane.model, lane.signature)] * size, lengths[seq:seq + size])
        tier.append(AppendGroup(lane, frame, np.arange(size)))
        tier.flush()
        items += frame.items["item_id"].tolist()
        seq += size
        queue = tier._queues[lane]  # the lane's queue: what it keeps in memory
        assert (queue.hot, sum(c.count for c in queue.cold)) == (min(seq, HOT_ENTRIES_MAX), max(0, seq - HOT_ENTRIES_MAX))
    tier.check_invariants()
    batch, got = 0, []
    while tier.queued_items(lane):
        entries = tier.peek_many(lane, 5000)
        got += [entry.item_id for entry in entries]
        tier.commit(lane, entries, ConsumerId(1), BatchId(batch))
        tier.complete_batch(ConsumerId(1), BatchId(batch))
        batch += 1
    assert got == items and not tier._queues[lane].cold
    tier.check_invariants()
    tier.close()


def test_a_deep_lane_keeps_one_cold_record_per_segment(tmp_path):
    # 20 groups past the hot window, 3 to a segment: one cold record per segment, not 20.
    tier = DiskTier.open(str(tmp_path / "d"), Durability.PROCESS, segment_max_bytes=SMALL_SEGMENT_BYTES,
                         hot_entries_max=4)
    lane = LANES[0]
    for group in range(21):
        frame = make_frame(7, group * 4, [(lane.model, lane.signature)] * 4, [400] * 4)
        tier.append(AppendGroup(lane, frame, np.arange(4)))
        tier.flush()
    queue = tier._queues[lane]  # the lane's queue: what it keeps in memory
    assert len(tier.store.segments) == 7
    assert queue.hot == 4 and len(queue.cold) == 7 and sum(c.count for c in queue.cold) == 80
    tier.check_invariants()
    assert queue.hot == 4  # the check read the cold runs back without warming them
    assert len(tier.peek_many(lane, 84)) == 84 and queue.hot == 84 and not queue.cold
    tier.close()


def test_a_reopened_tier_reads_its_recovered_backlog_back_past_the_hot_window(tmp_path):
    # Recovered live entries beyond the hot window are cold runs too, with the entries
    # completed before the restart (tombstoned) skipped when they are read back.
    lane = LANES[0]
    tier = DiskTier.open(str(tmp_path / "d"), Durability.PROCESS, segment_max_bytes=SMALL_SEGMENT_BYTES)
    items = []
    for group in range(12):
        frame = make_frame(7, group * 5, [(lane.model, lane.signature)] * 5, [30 + group] * 5)
        tier.append(AppendGroup(lane, frame, np.arange(5)))
        tier.flush()
        items += frame.items["item_id"].tolist()
    front = tier.peek_many(lane, 60)
    tier.commit(lane, front[:3], ConsumerId(1), BatchId(0))  # still held at the restart: live
    tier.commit(lane, tier.peek_many(lane, 6), ConsumerId(2), BatchId(1))
    tier.complete_batch(ConsumerId(2), BatchId(1))  # tombstones between live entries
    tier.close()
    tier = DiskTier.open(str(tmp_path / "d"), Durability.PROCESS, segment_max_bytes=SMALL_SEGMENT_BYTES,
                         hot_entries_max=2)
    queue = tier._queues[lane]  # the lane's queue: what it keeps in memory
    assert queue.hot <= 2 and queue.cold and tier.queued_items(lane) == 54
    tier.check_invariants()
    assert [e.item_id for e in tier.peek_many(lane, 54)] == items[:3] + items[9:]
    tier.close()


def test_a_cold_run_read_back_in_chunks_skips_the_tombstones_between_them(tmp_path, monkeypatch):
    # Chunks of 2: the second starts where the first ended, on a tombstoned entry.
    monkeypatch.setattr("pipeline.storage.queues.WARM_CHUNK_ENTRIES", 2)
    lane = LANES[0]
    tier = DiskTier.open(str(tmp_path / "d"), Durability.PROCESS)
    frame = make_frame(7, 0, [(lane.model, lane.signature)] * 10, [30] * 10)
    tier.append(AppendGroup(lane, frame, np.arange(10)))
    tier.flush()
    items = frame.items["item_id"].tolist()
    tier.commit(lane, tier.peek_many(lane, 2), ConsumerId(1), BatchId(0))  # held at the restart: live
    tier.commit(lane, tier.peek_many(lane, 3), ConsumerId(2), BatchId(1))
    tier.complete_batch(ConsumerId(2), BatchId(1))  # items 2-4 tombstoned
    tier.close()
    tier = DiskTier.open(str(tmp_path / "d"), Durability.PROCESS, hot_entries_max=1)
    got = []
    for batch in range(7):
        entries = tier.peek_many(lane, 1)
        got += [e.item_id for e in entries]
        tier.commit(lane, entries, ConsumerId(3), BatchId(batch))
    assert got == items[:2] + items[5:] and tier.queued_items(lane) == 0
    tier.check_invariants()
    tier.close()


def test_a_run_that_cannot_be_read_back_keeps_its_offsets_behind_cold_runs():
    # A damaged segment's recovered entries (end -1) behind cold runs: a cold record that
    # holds its offsets, served in order; the loader (a fake file: offsets 16 apart) is
    # asked only for the readable runs.
    asked = []

    def load(segment, start, end, count):
        asked.append((int(segment), start, count))
        offsets = np.arange(start, start + 16 * count, 16, dtype=np.int64)
        assert offsets[-1] < end
        return offsets, start + 16 * count

    queue = LaneQueue(hot_max=2)
    queue.push_back(SegmentId(1), np.array([0, 16], dtype=np.int64), staged=False, end=32)
    queue.push_back(SegmentId(1), np.array([32, 48], dtype=np.int64), staged=False, end=64)
    queue.push_back(SegmentId(2), np.array([5, 500], dtype=np.int64), staged=False, end=-1)
    queue.push_back(SegmentId(3), np.array([0, 16, 32], dtype=np.int64), staged=False, end=48)
    queue.check()
    assert queue.hot == 2 and [c.count for c in queue.cold] == [2, 2, 3] and queue.queued == 9
    queue.warm(9, load)
    segments, offsets = queue.front_keys(9)
    assert segments.tolist() == [1, 1, 1, 1, 2, 2, 3, 3, 3]
    assert offsets.tolist() == [0, 16, 32, 48, 5, 500, 0, 16, 32]
    assert asked == [(1, 32, 2), (3, 0, 3)] and not queue.cold
    queue.pop_front(9)
    queue.check()
    assert queue.queued == 0 and queue.empty
