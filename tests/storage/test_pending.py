"""The pending map (pipeline/storage/pending.py) against a plain reference written here.
Deterministic: hypothesis is derandomised, stress runs are seeded."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.broker.ids import BatchId, ConsumerId, EntryRef, LaneId, LaneKey, SegmentId
from pipeline.storage.pending import EntryColumns, PendingMap, ReturnedRun
from pipeline.wire.errors import BadInputError, NotHeldError

DETERMINISTIC = settings(derandomize=True, database=None, deadline=None, max_examples=200)
LANES = [LaneKey(0, 11, LaneId(0)), LaneKey(0, 11, LaneId(1)), LaneKey(1, 22, LaneId(0))]


class RefPending:
    """Every pending entry in one list in commit order, each with its batch."""

    def __init__(self) -> None:
        self.pending: list[tuple[EntryRef, int, int, LaneKey, int]] = []  # ref, consumer, batch, lane, length

    def add(self, batch: int, consumer: int, lane: LaneKey, refs: list[EntryRef], lengths: list[int]) -> None:
        self.pending += [(r, consumer, batch, lane, n) for r, n in zip(refs, lengths)]

    def complete_batch(self, consumer: int, batch: int) -> tuple[dict, int, int] | None:
        """(by_lane, items, tokens), or None where NotHeldError is due."""
        rows = [p for p in self.pending if p[2] == batch]
        if not rows or rows[0][1] != consumer:
            return None
        self.pending = [p for p in self.pending if p[2] != batch]
        return {rows[0][3]: [r[0] for r in rows]}, len(rows), sum(r[4] for r in rows)

    def lose(self, consumer: int) -> list[ReturnedRun]:
        runs: dict[LaneKey, tuple[list, list]] = {}
        for ref, c, _, lane, n in self.pending:  # already in commit order, batch order
            if c == consumer:
                runs.setdefault(lane, ([], []))[0].append(ref)
                runs[lane][1].append(n)
        self.pending = [p for p in self.pending if p[1] != consumer]
        return [ReturnedRun(lane, tuple(refs), tuple(ns)) for lane, (refs, ns) in runs.items()]


class Harness:
    def __init__(self) -> None:
        self.sut = PendingMap()
        self.ref = RefPending()
        self.next_offset = 0
        self.next_batch = 0

    def add(self, consumer: int, lane_pick: int, size: int) -> None:
        lane = LANES[lane_pick % len(LANES)]
        refs = [EntryRef(SegmentId(lane_pick % len(LANES)), self.next_offset + i) for i in range(size)]
        lengths = [100 + (self.next_offset + i) % 37 for i in range(size)]
        self.next_offset += size
        self.sut.add_batch(BatchId(self.next_batch), ConsumerId(consumer), lane, EntryColumns.of(refs), lengths)
        self.ref.add(self.next_batch, consumer, lane, refs, lengths)
        self.next_batch += 1

    def complete(self, consumer: int, batch_pick: int) -> None:
        """Complete a batch id ever handed out (held, another's, or done: a resend)."""
        batch = batch_pick % max(1, self.next_batch)
        want = self.ref.complete_batch(consumer, batch)
        before = self.sut.counters.completed
        if want is None:
            with pytest.raises(NotHeldError):
                self.sut.complete_batch(ConsumerId(consumer), BatchId(batch))
            assert self.sut.counters.completed == before  # nothing applied
            return
        done = self.sut.complete_batch(ConsumerId(consumer), BatchId(batch))
        by_lane = {lane: entries.refs() for lane, entries in done.by_lane.items()}
        assert (by_lane, done.items, done.tokens) == want

    def lose(self, consumer: int) -> None:
        assert self.sut.consumer_lost(ConsumerId(consumer)) == self.ref.lose(consumer)

    def check(self) -> None:
        self.sut.check_invariants()
        assert len(self.sut) == len(self.ref.pending)
        for ref, consumer, batch, _, _ in self.ref.pending:
            holding = self.sut.holder(ref)
            assert holding is not None and (holding.consumer, holding.batch) == (consumer, batch)
        for consumer in range(3):
            want = sum(1 for p in self.ref.pending if p[1] == consumer)
            assert self.sut.held_by(ConsumerId(consumer)) == want


consumers = st.integers(0, 2)
operations = st.one_of(
    st.tuples(st.just("add"), consumers, st.integers(0, 5), st.integers(1, 6)),
    st.tuples(st.just("complete"), consumers, st.integers(0, 10_000)),
    st.tuples(st.just("lose"), consumers),
)


def run(harness: Harness, op: tuple) -> None:
    kind, *args = op
    {"add": harness.add, "complete": harness.complete, "lose": harness.lose}[kind](*args)
    harness.check()


@DETERMINISTIC
@given(ops=st.lists(operations, max_size=50))
def test_matches_reference(ops):
    harness = Harness()
    for op in ops:
        run(harness, op)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_stress(seed):
    """Mostly completions of batches the consumer holds (sometimes resent, sometimes of
    another's), so batches really drain, with losses mixed in; invariants after every step."""
    rng = np.random.default_rng(seed)
    harness = Harness()
    for _ in range(500):
        roll = rng.random()
        consumer = int(rng.integers(3))
        if roll < 0.35:
            run(harness, ("add", consumer, int(rng.integers(6)), int(rng.integers(1, 10))))
        elif roll < 0.85:
            held = sorted({b for _, c, b, _, _ in harness.ref.pending if c == consumer})
            pick = int(rng.choice(held)) if held and rng.random() < 0.8 else int(rng.integers(1 << 20))
            run(harness, ("complete", consumer, pick))
            if rng.random() < 0.2:
                run(harness, ("complete", consumer, pick))  # a resend: refused once done
        else:
            run(harness, ("lose", consumer))


def _refs(segment: int, *offsets: int) -> list[EntryRef]:
    return [EntryRef(SegmentId(segment), offset) for offset in offsets]


def test_docstring_example_complete_batch():
    pending = PendingMap()
    lane = LANES[0]
    a, b = _refs(0, 0, 1)
    pending.add_batch(BatchId(7), ConsumerId(1), lane, EntryColumns.of([a, b]), [500, 510])
    with pytest.raises(NotHeldError, match=r"consumer 2 completed batch 7, which it does not hold .held by consumer 1"):
        pending.complete_batch(ConsumerId(2), BatchId(7))
    done = pending.complete_batch(ConsumerId(1), BatchId(7))
    assert ({k: v.refs() for k, v in done.by_lane.items()}, done.items, done.tokens) == ({lane: [a, b]}, 2, 1010)
    with pytest.raises(NotHeldError, match="pending nowhere") as raised:  # a resend
        pending.complete_batch(ConsumerId(1), BatchId(7))
    assert isinstance(raised.value, BadInputError)
    assert pending.counters.completed == 2 and pending.counters.refused == 2 and not len(pending)
    pending.check_invariants()


def test_docstring_example_consumer_lost():
    pending = PendingMap()
    lane_l, lane_m = LANES[0], LANES[1]
    a1, a2, a3, a4 = _refs(0, 0, 1, 2, 3)
    (b1,) = _refs(1, 0)
    pending.add_batch(BatchId(1), ConsumerId(3), lane_l, EntryColumns.of([a1, a2]), [1, 2])
    pending.add_batch(BatchId(2), ConsumerId(3), lane_m, EntryColumns.of([b1]), [5])
    pending.add_batch(BatchId(4), ConsumerId(3), lane_l, EntryColumns.of([a3, a4]), [3, 4])
    assert pending.consumer_lost(ConsumerId(3)) == [
        ReturnedRun(lane_l, (a1, a2, a3, a4), (1, 2, 3, 4)), ReturnedRun(lane_m, (b1,), (5,))
    ]
    assert not len(pending)
    with pytest.raises(NotHeldError):  # its batches went with it
        pending.complete_batch(ConsumerId(3), BatchId(1))
    pending.check_invariants()
