"""The pending map (pipeline/broker/storage/pending.py) against a plain reference written here.
Deterministic: hypothesis is derandomised, stress runs are seeded."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.broker.ids import (
    BatchId,
    ConsumerId,
    EntryRef,
    LaneId,
    LaneKey,
    SegmentId,
)
from pipeline.broker.storage.pending import PendingMap, ReturnedRun
from pipeline.wire.errors import BadInputError, NotHeldError

DETERMINISTIC = settings(derandomize=True, database=None, deadline=None, max_examples=200)
LANES = [LaneKey(0, 11, LaneId(0)), LaneKey(0, 11, LaneId(1)), LaneKey(1, 22, LaneId(0))]


class RefPending:
    """Every pending entry in one list in commit order; every completion remembered per
    consumer in a list, of which the last `window` count as recent."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.pending: list[tuple[EntryRef, int, int, LaneKey, int]] = []  # ref, consumer, batch, lane, length
        self.completed: dict[int, list[EntryRef]] = {}

    def add(self, batch: int, consumer: int, lane: LaneKey, refs: list[EntryRef], lengths: list[int]) -> None:
        self.pending += [(r, consumer, batch, lane, n) for r, n in zip(refs, lengths)]

    def complete(self, consumer: int, refs: list[EntryRef]) -> tuple[dict, int, int, int] | None:
        """(by_lane, items, tokens, duplicates), or None where NotHeldError is due."""
        recent = self.completed.get(consumer, [])[-self.window:] if self.window else []
        held = {r: (lane, n) for r, c, _, lane, n in self.pending if c == consumer}
        seen: list[EntryRef] = []
        duplicates = 0
        for ref in refs:
            if ref in seen or ref in recent:
                duplicates += 1
            elif ref in held:
                seen.append(ref)
            else:
                return None
        by_lane: dict[LaneKey, list[EntryRef]] = {}
        for ref in seen:
            by_lane.setdefault(held[ref][0], []).append(ref)
        self.pending = [p for p in self.pending if p[0] not in seen]
        self.completed.setdefault(consumer, []).extend(seen)
        return by_lane, len(seen), sum(held[r][1] for r in seen), duplicates

    def lose(self, consumer: int) -> list[ReturnedRun]:
        runs: dict[LaneKey, tuple[list, list]] = {}
        for ref, c, _, lane, n in self.pending:  # already in commit order, batch order
            if c == consumer:
                runs.setdefault(lane, ([], []))[0].append(ref)
                runs[lane][1].append(n)
        self.pending = [p for p in self.pending if p[1] != consumer]
        self.completed.pop(consumer, None)
        return [ReturnedRun(lane, tuple(refs), tuple(ns)) for lane, (refs, ns) in runs.items()]


class Harness:
    def __init__(self, window: int) -> None:
        self.sut = PendingMap(recent_per_consumer=window)
        self.ref = RefPending(window)
        self.next_offset = 0
        self.next_batch = 0
        self.ever: list[EntryRef] = []

    def add(self, consumer: int, lane_pick: int, size: int) -> None:
        lane = LANES[lane_pick % len(LANES)]
        refs = [EntryRef(SegmentId(lane_pick % len(LANES)), self.next_offset + i) for i in range(size)]
        lengths = [100 + (self.next_offset + i) % 37 for i in range(size)]
        self.next_offset += size
        self.ever += refs
        self.sut.add_batch(BatchId(self.next_batch), ConsumerId(consumer), lane, refs, lengths)
        self.ref.add(self.next_batch, consumer, lane, refs, lengths)
        self.next_batch += 1

    def complete(self, consumer: int, picks: list[int]) -> None:
        refs = [self.ever[p % len(self.ever)] for p in picks] if self.ever else []
        want = self.ref.complete(consumer, refs)
        before = self.sut.counters.completed
        if want is None:
            with pytest.raises(NotHeldError):
                self.sut.complete(ConsumerId(consumer), refs)
            assert self.sut.counters.completed == before  # nothing applied
            return
        done = self.sut.complete(ConsumerId(consumer), refs)
        assert (done.by_lane, done.items, done.tokens, done.duplicates) == want

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
    st.tuples(st.just("complete"), consumers, st.lists(st.integers(0, 10_000), max_size=8)),
    st.tuples(st.just("lose"), consumers),
)


def run(harness: Harness, op: tuple) -> None:
    kind, *args = op
    {"add": harness.add, "complete": harness.complete, "lose": harness.lose}[kind](*args)
    harness.check()


@DETERMINISTIC
@given(window=st.sampled_from([0, 1, 3, 16_384]), ops=st.lists(operations, max_size=50))
def test_matches_reference(window, ops):
    harness = Harness(window)
    for op in ops:
        run(harness, op)


@pytest.mark.parametrize("seed,window", [(1, 4), (2, 16_384), (3, 0)])
def test_seeded_stress(seed, window):
    """Mostly valid completions (of what the consumer holds, sometimes resent) so batches
    really drain, with losses and refusals mixed in; invariants after every step."""
    rng = np.random.default_rng(seed)
    harness = Harness(window)
    for _ in range(500):
        roll = rng.random()
        consumer = int(rng.integers(3))
        if roll < 0.35:
            run(harness, ("add", consumer, int(rng.integers(6)), int(rng.integers(1, 10))))
        elif roll < 0.85:
            held = [i for i, r in enumerate(harness.ever)
                    if (h := harness.sut.holder(r)) is not None and h.consumer == consumer]
            picks = [int(p) for p in rng.choice(held, size=min(len(held), 5), replace=False)] if held else []
            if rng.random() < 0.3:
                picks += [int(rng.integers(len(harness.ever)))] if harness.ever else []
            run(harness, ("complete", consumer, picks))
            if picks and rng.random() < 0.3:
                run(harness, ("complete", consumer, picks))  # a resend
        else:
            run(harness, ("lose", consumer))


def _refs(segment: int, *offsets: int) -> list[EntryRef]:
    return [EntryRef(SegmentId(segment), offset) for offset in offsets]


def test_docstring_example_complete():
    pending = PendingMap()
    lane = LANES[0]
    a, b = _refs(0, 0, 1)
    pending.add_batch(BatchId(1), ConsumerId(1), lane, [a, b], [500, 510])
    first = pending.complete(ConsumerId(1), [a])
    assert (first.by_lane, first.items, first.tokens, first.duplicates) == ({lane: [a]}, 1, 500, 0)
    second = pending.complete(ConsumerId(1), [a, b])
    assert (second.by_lane, second.items, second.duplicates) == ({lane: [b]}, 1, 1)
    with pytest.raises(NotHeldError, match=r"consumer 2 completed entry \(0, 1\)"):
        pending.complete(ConsumerId(2), [b])
    assert pending.counters.duplicates == 1 and pending.counters.refused == 1
    pending.check_invariants()


def test_docstring_example_consumer_lost():
    pending = PendingMap()
    lane_l, lane_m = LANES[0], LANES[1]
    a1, a2, a3, a4 = _refs(0, 0, 1, 2, 3)
    (b1,) = _refs(1, 0)
    pending.add_batch(BatchId(1), ConsumerId(3), lane_l, [a1, a2], [1, 2])
    pending.add_batch(BatchId(2), ConsumerId(3), lane_m, [b1], [5])
    pending.add_batch(BatchId(4), ConsumerId(3), lane_l, [a3, a4], [3, 4])
    pending.complete(ConsumerId(3), [a2])
    assert pending.consumer_lost(ConsumerId(3)) == [
        ReturnedRun(lane_l, (a1, a3, a4), (1, 3, 4)), ReturnedRun(lane_m, (b1,), (5,))
    ]
    assert not len(pending)
    with pytest.raises(NotHeldError):  # its window went with it
        pending.complete(ConsumerId(3), [a2])
    pending.check_invariants()


def test_refusal_applies_nothing_even_after_valid_refs():
    pending = PendingMap()
    a, b, c = _refs(0, 0, 1, 2)
    pending.add_batch(BatchId(0), ConsumerId(1), LANES[0], [a, b], [1, 1])
    pending.add_batch(BatchId(1), ConsumerId(2), LANES[0], [c], [1])
    with pytest.raises(NotHeldError, match="held by consumer 2") as raised:
        pending.complete(ConsumerId(1), [a, b, c])
    assert isinstance(raised.value, BadInputError)
    assert len(pending) == 3 and pending.held_by(ConsumerId(1)) == 2
    pending.check_invariants()


def test_resend_older_than_the_window_is_refused():
    pending = PendingMap(recent_per_consumer=2)
    refs = _refs(0, 0, 1, 2)
    pending.add_batch(BatchId(0), ConsumerId(1), LANES[0], refs, [1, 1, 1])
    pending.complete(ConsumerId(1), refs)
    assert pending.complete(ConsumerId(1), refs[1:]).duplicates == 2  # the last two remembered
    with pytest.raises(NotHeldError, match="pending nowhere"):
        pending.complete(ConsumerId(1), refs[:1])
    pending.check_invariants()


def test_complete_batch_is_complete_of_the_batch_in_bulk():
    pending = PendingMap(recent_per_consumer=3)
    lane = LANES[0]
    a, b, c, d = _refs(0, 0, 1, 2, 3)
    pending.add_batch(BatchId(1), ConsumerId(1), lane, [a, b, c], [500, 510, 520])
    pending.add_batch(BatchId(2), ConsumerId(2), lane, [d], [7])
    with pytest.raises(NotHeldError, match="batch 2, which it does not hold .held by consumer 2"):
        pending.complete_batch(ConsumerId(1), BatchId(2))
    pending.complete(ConsumerId(1), [b])  # one entry first, one by one
    done = pending.complete_batch(ConsumerId(1), BatchId(1))  # the rest, not counted twice
    assert (done.by_lane, done.items, done.tokens, done.duplicates) == ({lane: [a, c]}, 2, 1020, 0)
    assert pending.complete(ConsumerId(1), [a, b, c]).duplicates == 3  # all in the window
    with pytest.raises(NotHeldError, match="pending nowhere"):
        pending.complete_batch(ConsumerId(1), BatchId(1))
    assert len(pending) == 1 and pending.counters.completed == 3 and pending.counters.refused == 2
    pending.check_invariants()
