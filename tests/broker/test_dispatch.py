"""The dispatcher (pipeline/broker/dispatch.py) over the disk tier: end to end with many
shapes and lengths, two consumers of different contracts and a lost consumer (in `process`,
and smaller in `power` with rotating segments), plus the individual promises (contracts,
returned work first, the guard, idempotent ingest, tick). Deterministic: seeded, no wall
clock."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tests.support.frames import make_frame, token_ids

from pipeline.broker.dispatch import Batch, Dispatcher
from pipeline.broker.ids import BatchId, ConsumerId, ShapeKey
from pipeline.broker.lanes import MAX_LENGTH_TOKENS
from pipeline.broker.packing import Contract, pad_to_tokens
from pipeline.storage import DiskTier, Durability, Peeked, PeekedEntry, StorageTier
from pipeline.wire.errors import ItemTooLongError, NotHeldError, ShapeGuardError, StaleBatchError

NS = 1_000_000_000
BIG = Contract(model=0, max_batch_items=64, max_batch_tokens=65_536, max_input_len=8192)
SMALL = Contract(model=0, max_batch_items=16, max_batch_tokens=8_192, max_input_len=2048)


@pytest.fixture
def tier(tmp_path):
    """A disk tier (`process`) in the test's own directory, closed after."""
    opened = DiskTier.open(str(tmp_path / "store"))
    yield opened
    opened.close()


def check_batch(batch: Batch, contract: Contract, tier: StorageTier) -> None:
    """Shape-pure, one lane, within the contract unless it holds one item, tokens intact."""
    assert batch.entries and all(e.lane == batch.lane for e in batch.entries)
    count = len(batch.entries)
    assert count == 1 or (count <= contract.max_batch_items
                          and batch.padded_tokens <= contract.max_batch_tokens)
    assert batch.pad_to_tokens % 8 == 0 and batch.pad_to_tokens >= max(e.length for e in batch.entries)
    for entry in batch.entries:
        assert np.array_equal(tier.read_tokens(entry.ref), token_ids(entry.item_id, entry.length))


class Pipeline:
    """Producers, the dispatcher and consumers in one loop, with everything checked."""

    def __init__(self, tier: StorageTier, seed: int, shapes: int, items: int, max_age_s: float | None = None) -> None:
        self.rng = np.random.default_rng(seed)
        self.tier = tier
        self.dispatcher = Dispatcher(self.tier, max_age_s=max_age_s)
        self.now_s = 0.0
        sigs = [int(s) for s in self.rng.integers(1, 2**64, shapes, dtype=np.uint64)]
        # Shapes of unequal popularity; lengths log-normal with a few above every contract.
        weights = self.rng.dirichlet(np.ones(shapes))
        self.stream_shapes = [(0, sigs[i]) for i in self.rng.choice(shapes, items, p=weights)]
        lengths = np.maximum(1, self.rng.lognormal(np.log(400), 1.0, items)).astype(int)
        lengths[self.rng.choice(items, 3, replace=False)] = 70_000  # > 65,536: alone in a batch
        self.stream_lengths = lengths.tolist()
        self.fed = 0
        self.seqs = [0, 0, 0]  # three producers
        self.in_flight: dict[ConsumerId, list[Batch]] = {}
        self.completed: dict[int, int] = {}  # item id -> times completed
        self.batches: list[Batch] = []

    def feed(self, count: int) -> None:
        while count and self.fed < len(self.stream_lengths):
            size = min(count, int(self.rng.integers(1, 200)), len(self.stream_lengths) - self.fed)
            producer = int(self.rng.integers(3))
            part = slice(self.fed, self.fed + size)
            frame = make_frame(producer, self.seqs[producer], self.stream_shapes[part],
                               self.stream_lengths[part], submit_ns=int(self.now_s * NS))
            report = self.dispatcher.ingest(frame, self.now_s)
            assert report.items == size and report.duplicates == 0
            if self.rng.random() < 0.05:  # the ring presents it again (a restart): skipped
                assert self.dispatcher.ingest(frame, self.now_s).duplicates == size
            self.dispatcher.flush()  # the loop protocol: before release, before serving
            self.seqs[producer] += size
            self.fed += size
            count -= size

    def serve(self, consumer: ConsumerId, contract: Contract) -> Batch | None:
        batch = self.dispatcher.next_batch(consumer, contract, self.now_s)
        if batch is None:
            return None
        check_batch(batch, contract, self.tier)
        if self.rng.random() < 0.05:  # the channel was full
            self.dispatcher.abandon(batch)
            return None
        self.dispatcher.commit(batch)
        self.in_flight.setdefault(consumer, []).append(batch)
        self.batches.append(batch)
        return batch

    def finish(self, consumer: ConsumerId) -> None:
        """The consumer completes its oldest batch (sometimes resending the report)."""
        batch = self.in_flight[consumer].pop(0)
        done = self.dispatcher.complete_batch(consumer, batch)
        assert done.items == len(batch.entries)
        if self.rng.random() < 0.1:  # a resent report: refused, nothing counted twice
            with pytest.raises(NotHeldError):
                self.dispatcher.complete_batch(consumer, batch)
        for entry in batch.entries:
            self.completed[entry.item_id] = self.completed.get(entry.item_id, 0) + 1

    def lose(self, consumer: ConsumerId) -> list[list[PeekedEntry]]:
        """The consumer is lost; returns, per affected lane, the returned entries in order."""
        held = self.in_flight.pop(consumer, [])
        returned = self.dispatcher.consumer_lost(consumer)
        assert returned == sum(len(b.entries) for b in held)
        by_lane: dict = {}
        for batch in held:
            by_lane.setdefault(batch.lane, []).extend(batch.entries)
        for lane, entries in by_lane.items():  # returned work goes first, in original order
            front = self.tier.peek_many(lane, len(entries))
            assert front.refs == [e.ref for e in entries]
        return list(by_lane.values())

    def step_time(self) -> None:
        self.now_s += 0.05
        if self.rng.random() < 0.1:
            self.dispatcher.tick(self.now_s)
            assert_nothing_due(self.dispatcher, self.now_s)


def assert_nothing_due(dispatcher: Dispatcher, now_s: float) -> None:
    """After a tick, ticking every shape (the reference: what the dispatcher did before it
    scheduled its ticks) would change nothing: no quiescing lane is drained, and no active
    lane is idle with fewer than quiesce_below_items queued (ShapeLanes.tick's own rules)."""
    for shape in dispatcher.shapes():
        lanes = dispatcher.lanes(shape)
        cfg = lanes.config
        for view in lanes.lanes():
            if view.quiescing:
                assert view.queued_items or view.pending_items, (shape, view)
            else:
                idle = now_s - view.last_seen_s >= cfg.quiesce_idle_s
                assert not (idle and view.queued_items < cfg.quiesce_below_items), (shape, view)


def run_to_the_end(pipeline: Pipeline, backlog: int, lost_at: int, check_every: int = 1) -> None:
    """Feed a backlog, then stream while two consumers work; consumer 2 is lost at step
    `lost_at` and reconnects as 3. Runs until everything is completed."""
    dispatcher = pipeline.dispatcher
    pipeline.feed(backlog)
    contracts = {ConsumerId(1): BIG, ConsumerId(2): SMALL}
    steps = 0
    while True:
        steps += 1
        pipeline.feed(int(pipeline.rng.integers(0, 40)))
        for consumer, contract in list(contracts.items()):
            pipeline.serve(consumer, contract)
            if len(pipeline.in_flight.get(consumer, [])) > 2 or pipeline.rng.random() < 0.3:
                if pipeline.in_flight.get(consumer):
                    pipeline.finish(consumer)
        if steps == lost_at:
            assert pipeline.in_flight.get(ConsumerId(2))
            pipeline.lose(ConsumerId(2))
            contracts[ConsumerId(3)] = contracts.pop(ConsumerId(2))  # it reconnects
        pipeline.step_time()
        if steps % check_every == 0:
            dispatcher.check_invariants()
        if pipeline.fed == len(pipeline.stream_lengths) and not any(pipeline.in_flight.values()) \
                and not pipeline.tier.queued_items():
            break
        assert steps < 5000
    dispatcher.check_invariants()


def test_end_to_end_two_consumers_one_lost(tier):
    pipeline = Pipeline(tier, seed=7, shapes=10, items=2500)
    dispatcher = pipeline.dispatcher
    # Invariants every 16th step (about 40 checks): each scans every segment file (about 400
    # here), seconds a check at this size.
    run_to_the_end(pipeline, backlog=1500, lost_at=60, check_every=16)  # a backlog, then streaming
    # Every item completed exactly once; the accounting closes.
    assert len(pipeline.completed) == 2500 and set(pipeline.completed.values()) == {1}
    c = dispatcher.counters()
    assert c.items_received == c.items_completed == 2500
    assert c.tokens_received == c.tokens_completed == sum(pipeline.stream_lengths)
    assert c.items_routed - c.items_returned == 2500 and c.items_returned > 0
    # Sticky draining: consecutive batches change shape only at a counted switch, and there
    # are few of them (no starvation bound: each shape is drained before the next).
    changes = sum(1 for a, b in zip(pipeline.batches, pipeline.batches[1:])
                  if a.lane.shape != b.lane.shape)
    # (Each consumer's first shape is an initial switch: it joins the model's current shape.)
    assert changes == sum(c.switches.values()) - c.switches["initial"]
    assert c.switches["starvation"] == 0 and changes <= 3 * 10, c.switches
    assert sum(1 for b in pipeline.batches if len(b.entries) == 1 and b.pad_to_tokens > 65_536) >= 3
    assert c.lanes.released > 0  # ticks retired idle lanes while the stream went on


def test_end_to_end_over_the_disk_tier(tmp_path):
    """The same run, smaller, over real segment files in `power` (group commit at flush),
    with small segments so they rotate and finished ones are deleted whole."""
    tier = DiskTier.open(str(tmp_path), Durability.POWER, segment_max_bytes=256 << 10)
    pipeline = Pipeline(tier, seed=11, shapes=4, items=700)
    run_to_the_end(pipeline, backlog=400, lost_at=25, check_every=20)
    assert len(pipeline.completed) == 700 and set(pipeline.completed.values()) == {1}
    c = pipeline.dispatcher.counters()
    assert c.items_received == c.items_completed == 700 and c.items_returned > 0
    assert c.tokens_received == c.tokens_completed == sum(pipeline.stream_lengths)
    tier.close()
    reopened = DiskTier.open(str(tmp_path))
    assert reopened.recovery.live_entries == 0
    reopened.close()


def test_returned_work_goes_first_in_the_next_batch(tier):
    dispatcher = Dispatcher(tier)
    frame = make_frame(0, 0, [(0, 5)] * 10, [100 + k for k in range(10)])
    dispatcher.ingest(frame, 0.0)
    dispatcher.flush()
    three = Contract(0, 3, 65_536, 200)
    first = dispatcher.next_batch(ConsumerId(1), three, 0.0)
    dispatcher.commit(first)
    second = dispatcher.next_batch(ConsumerId(2), three, 0.0)
    dispatcher.commit(second)
    assert dispatcher.consumer_lost(ConsumerId(1)) == 3
    again = dispatcher.next_batch(ConsumerId(2), Contract(0, 5, 65_536, 200), 0.0)
    assert again.refs[:3] == first.refs  # ahead of items 6..9, in the original order
    # Returned entries and the rest of the lane, column by column alike.
    assert again.entries.lengths.tolist() == [100, 101, 102, 106, 107]
    assert [e.item_id for e in again.entries] == again.entries.item_ids.tolist()
    assert list(again.entries) == list(tier.peek_many(again.lane, 5))
    dispatcher.commit(again)
    dispatcher.check_invariants()


def test_full_only_waits_for_a_lane_that_fills_a_batch(tier):
    dispatcher = Dispatcher(tier)
    dispatcher.ingest(make_frame(0, 0, [(0, 5)] * 5, [100] * 5), 0.0)
    by_items = Contract(0, 8, 65_536, 1000)
    assert dispatcher.next_batch(ConsumerId(1), by_items, 0.0, full_only=True) is None  # 5 of 8
    by_tokens = Contract(0, 64, 5 * 104, 1000)  # 5 items padded to 104 fill the token budget
    full = dispatcher.next_batch(ConsumerId(1), by_tokens, 0.0, full_only=True)
    assert full is not None and len(full.entries) == 5
    dispatcher.abandon(full)
    dispatcher.ingest(make_frame(0, 5, [(0, 5)] * 1, [100]), 0.0)
    enough = dispatcher.next_batch(ConsumerId(1), by_items, 0.0, full_only=True)  # 6 of 8: 75%
    assert enough is not None and len(enough.entries) == 6
    dispatcher.commit(enough)
    # Shape 5 is drained; shape 6 has 2 of 8: a full-only request neither takes them nor
    # switches to shape 6 (nor counts a switch) on their account.
    dispatcher.ingest(make_frame(0, 6, [(0, 6)] * 2, [100] * 2), 0.0)
    switches = dict(dispatcher.counters().switches)
    assert dispatcher.next_batch(ConsumerId(1), by_items, 0.0, full_only=True) is None
    assert dispatcher.counters().switches == switches
    assert dispatcher._selector.current(0, consumer=ConsumerId(1)).signature == 5
    partial = dispatcher.next_batch(ConsumerId(1), by_items, 0.0)  # a consumer that needs work
    assert partial is not None and partial.lane.signature == 6 and len(partial.entries) == 2
    dispatcher.commit(partial)
    assert sum(dispatcher.counters().switches.values()) == sum(switches.values()) + 1
    dispatcher.check_invariants()


def test_full_only_takes_a_partial_batch_nothing_will_fill(tier):
    """A lane that took no item for PARTIAL_WAIT_S will not fill by waiting: full_only gives
    its partial batch (one item of 8) from then on, not a moment before."""
    from pipeline.broker.pacing import PARTIAL_WAIT_S
    dispatcher = Dispatcher(tier)
    dispatcher.ingest(make_frame(0, 0, [(0, 5)], [100]), 1.0)
    by_items = Contract(0, 8, 65_536, 1000)
    assert dispatcher.next_batch(ConsumerId(1), by_items, 1.0 + PARTIAL_WAIT_S * 0.99, full_only=True) is None
    late = dispatcher.next_batch(ConsumerId(1), by_items, 1.0 + PARTIAL_WAIT_S, full_only=True)
    assert late is not None and len(late.entries) == 1
    dispatcher.commit(late)
    dispatcher.check_invariants()


def test_stale_commit_changes_nothing_and_the_entries_stay_dispatchable(tier):
    dispatcher = Dispatcher(tier)
    dispatcher.ingest(make_frame(0, 0, [(0, 5)] * 6, [100] * 6), 0.0)
    contract = Contract(0, 2, 65_536, 100)
    taken = dispatcher.next_batch(ConsumerId(1), contract, 0.0)
    dispatcher.commit(taken)
    batch = dispatcher.next_batch(ConsumerId(2), contract, 0.0)
    dispatcher.consumer_lost(ConsumerId(1))  # its entries go back in front of `batch`'s
    with pytest.raises(StaleBatchError):
        dispatcher.commit(batch)
    dispatcher.check_invariants()
    retry = dispatcher.next_batch(ConsumerId(2), contract, 0.0)
    assert retry.refs == taken.refs
    dispatcher.abandon(retry)
    assert dispatcher.next_batch(ConsumerId(2), contract, 0.0).refs == taken.refs


class MisroutingTier(DiskTier):
    """A tier whose peek hands back entries stored under another shape (a routing bug)."""

    def peek_many(self, lane, max_items):
        return Peeked.of(lane, [dataclasses.replace(e, lane=e.lane._replace(signature=e.lane.signature + 1))
                                for e in super().peek_many(lane, max_items)])


def test_guard_stops_a_chunk_of_another_shape(tmp_path):
    dispatcher = Dispatcher(MisroutingTier.open(str(tmp_path)))
    dispatcher.ingest(make_frame(0, 0, [(0, 5)] * 2, [100, 100]), 0.0)
    with pytest.raises(ShapeGuardError, match="poisoned cache"):
        dispatcher.next_batch(ConsumerId(1), BIG, 0.0)


def test_ingest_groups_mixed_frames_and_is_idempotent(tier):
    dispatcher = Dispatcher(tier)
    shapes = [(0, 1), (0, 1), (1, 2), (0, 1), (1, 2), (0, 3)]
    frame = make_frame(4, 0, shapes, [500, 510, 90, 1000, 95, 7])
    report = dispatcher.ingest(frame, 0.0)
    assert (report.items, report.tokens, report.duplicates) == (6, 2202, 0)
    assert sorted(dispatcher.shapes()) == [ShapeKey(0, 1), ShapeKey(0, 3), ShapeKey(1, 2)]
    lanes = dispatcher.lanes(ShapeKey(0, 1))
    assert lanes.lane_count == 2  # 500 and 510 share a lane, 1000 opens one
    again = dispatcher.ingest(frame, 0.0)
    assert (again.items, again.duplicates) == (0, 6)
    later = make_frame(4, 6, [(0, 1)], [505])  # the producer's next seq is new work
    assert dispatcher.ingest(later, 0.0).items == 1
    assert dispatcher.counters().duplicate_items == 6
    dispatcher.check_invariants()


def test_ingest_refuses_too_long_items_before_touching_anything(tier):
    dispatcher = Dispatcher(tier)
    frame = make_frame(0, 0, [(0, 1)] * 2, [5, 6])
    items = frame.items.copy()
    items["length"][1] = MAX_LENGTH_TOKENS + 1
    with pytest.raises(ItemTooLongError, match="item 1"):
        dispatcher.ingest(dataclasses.replace(frame, items=items), 0.0)
    assert dispatcher.counters().items_received == 0 and not dispatcher.shapes()


def test_completion_of_what_a_consumer_does_not_hold(tier):
    dispatcher = Dispatcher(tier)
    dispatcher.ingest(make_frame(0, 0, [(0, 1)] * 4, [8] * 4), 0.0)
    batch = dispatcher.next_batch(ConsumerId(1), BIG, 0.0)
    dispatcher.commit(batch)
    with pytest.raises(NotHeldError):
        dispatcher.complete_batch(ConsumerId(2), batch)  # another consumer's
    with pytest.raises(NotHeldError):
        dispatcher.complete_batch(ConsumerId(1), dataclasses.replace(batch, batch_id=BatchId(999)))  # never committed
    assert dispatcher.complete_batch(ConsumerId(1), batch).items == 4
    dispatcher.check_invariants()


def test_tick_releases_idle_lanes_and_retires_shapes(tier):
    dispatcher = Dispatcher(tier)
    dispatcher.ingest(make_frame(0, 0, [(0, 1)] * 3 + [(0, 2)], [100, 300, 900, 50]), 0.0)
    while (batch := dispatcher.next_batch(ConsumerId(1), BIG, 1.0)) is not None:
        dispatcher.commit(batch)
        dispatcher.tick(2.0)  # not idle long enough, and still pending
        dispatcher.complete_batch(ConsumerId(1), batch)
    before = dispatcher.counters().lanes
    dispatcher.tick(5.0)
    assert not dispatcher.shapes() and not tier.lane_keys()
    after = dispatcher.counters()
    assert after.lanes.released == after.lanes.new_lanes == before.new_lanes == 4
    assert after.lanes_in_use == 0 and after.items_completed == 4
    assert after.shapes == 0 and after.shapes_seen == 2  # retired shapes stay counted as the run's
    dispatcher.ingest(make_frame(0, 4, [(0, 1)], [100]), 6.0)  # the shape comes back
    assert dispatcher.next_batch(ConsumerId(1), BIG, 6.0) is not None
    assert dispatcher.counters().shapes_seen == 2  # the same shape again: not a new one
    dispatcher.check_invariants()


def test_tick_visits_only_the_shapes_that_are_due(tier, monkeypatch):
    """1,000 one-item shapes: a tick before any lane could quiesce ticks none of them; once
    they are idle and done, one tick retires all (as ticking every shape did)."""
    from pipeline.broker.lanes import ShapeLanes
    dispatcher = Dispatcher(tier)
    dispatcher.ingest(make_frame(0, 0, [(0, s) for s in range(1, 1001)], [100] * 1000), 0.0)
    ticked = []
    real_tick = ShapeLanes.tick
    monkeypatch.setattr(ShapeLanes, "tick", lambda self, now_s: ticked.append(self) or real_tick(self, now_s))
    while (batch := dispatcher.next_batch(ConsumerId(1), BIG, 1.0)) is not None:
        dispatcher.commit(batch)
        dispatcher.complete_batch(ConsumerId(1), batch)
    assert dispatcher.tick(4.9) is False
    assert ticked == [] and len(dispatcher.shapes()) == 1000
    assert dispatcher.tick(5.0, max_shapes=300) is True  # the rest is left for the next calls
    assert len(ticked) == 300 and len(dispatcher.shapes()) == 700
    dispatcher.check_invariants()
    assert dispatcher.tick(5.0) is False
    assert len(ticked) == 1000 and not dispatcher.shapes() and not tier.lane_keys()
    dispatcher.check_invariants()


def test_a_frame_stored_in_slices_is_dispatchable_only_once_whole(tier):
    """ingest(max_groups=3) of a frame of 10 shapes stores it over 4 calls; meanwhile only
    the earlier frame's items are dispatched, though the new frame's items of the same
    shape sit behind them in the lane; then every item is, once."""
    dispatcher = Dispatcher(tier)
    assert dispatcher.ingest(make_frame(0, 0, [(0, 1)] * 2, [100, 100]), 0.0).items == 2
    frame = make_frame(0, 2, [(0, 1)] * 3 + [(0, s) for s in range(2, 11)], [100] * 12)
    assert dispatcher.ingest(frame, 0.0, max_groups=3) is None and dispatcher.storing
    served = []
    for calls in range(1, 10):
        dispatcher.flush()
        dispatcher.check_invariants()
        while (batch := dispatcher.next_batch(ConsumerId(1), BIG, 1.0)) is not None:
            dispatcher.commit(batch)
            served += batch.entries.item_ids.tolist()
        if calls == 1:
            assert sorted(served) == [0, 1], served  # the earlier frame only
        report = dispatcher.store_more(3)
        if report is not None:
            break
        assert served == [0, 1]
    assert calls == 3 and report.items == 12 and not dispatcher.storing
    dispatcher.flush()
    while (batch := dispatcher.next_batch(ConsumerId(1), BIG, 1.0)) is not None:
        dispatcher.commit(batch)
        served += batch.entries.item_ids.tolist()
    assert sorted(served) == list(range(14))
    dispatcher.check_invariants()


def test_a_frame_of_fewer_new_shapes_than_a_slice_is_stored_whole(tier):
    """Slices are for frames of many new shapes: 12 groups of which 2 are new shapes, with
    max_groups=3, are stored at once (2 new shapes, one short of the slice); 4 new shapes
    are sliced."""
    dispatcher = Dispatcher(tier)
    known = [(0, s) for s in range(1, 11)]
    assert dispatcher.ingest(make_frame(0, 0, known, [100] * 10), 0.0).items == 10
    frame = make_frame(0, 10, known + [(0, 11), (0, 12)], [100] * 12)
    report = dispatcher.ingest(frame, 0.0, max_groups=3)
    assert report is not None and report.items == 12 and not dispatcher.storing
    dispatcher.flush()
    frame = make_frame(0, 22, [(0, 13), (0, 14), (0, 15), (0, 16)], [100] * 4)
    assert dispatcher.ingest(frame, 0.0, max_groups=3) is None and dispatcher.storing  # 4 new: sliced
    assert dispatcher.store_more(3).items == 4
    dispatcher.check_invariants()


def test_starvation_bound_through_the_dispatcher(tier):
    dispatcher = Dispatcher(tier, max_age_s=30.0)
    old, busy = (0, 0xA), (0, 0xB)
    dispatcher.ingest(make_frame(0, 0, [old] * 2, [100] * 2, submit_ns=0), 0.0)
    dispatcher.ingest(make_frame(1, 0, [busy] * 200, [100] * 200, submit_ns=10 * NS), 10.0)
    contract = Contract(0, 4, 65_536, 100)
    served = []
    for now_s in (11.0, 12.0, 31.0):
        batch = dispatcher.next_batch(ConsumerId(1), contract, now_s)
        dispatcher.commit(batch)
        served.append(batch.lane.signature)
    assert served == [0xB, 0xB, 0xA]  # A's items waited 31 s: served although B has tokens
    assert dispatcher.counters().switches == {"initial": 1, "drained": 0, "starvation": 1, "takeover": 0, "order": 0,
                                               "yield": 0}
    dispatcher.check_invariants()


def test_pad_to_is_the_lane_queue_longest(tier):
    dispatcher = Dispatcher(tier)
    dispatcher.ingest(make_frame(0, 0, [(0, 1)] * 4, [500, 505, 509, 501]), 0.0)
    batch = dispatcher.next_batch(ConsumerId(1), Contract(0, 2, 65_536, 1), 0.0)
    assert len(batch.entries) == 2 and batch.pad_to_tokens == pad_to_tokens(509) == 512
    dispatcher.commit(batch)
    batch = dispatcher.next_batch(ConsumerId(1), Contract(0, 2, 65_536, 1), 0.0)
    assert batch.pad_to_tokens == 512  # 509 is still queued


def test_one_outstanding_batch_at_a_time(tier):
    dispatcher = Dispatcher(tier)
    dispatcher.ingest(make_frame(0, 0, [(0, 1)] * 4, [8] * 4), 0.0)
    batch = dispatcher.next_batch(ConsumerId(1), Contract(0, 1, 64, 1), 0.0)
    with pytest.raises(AssertionError):
        dispatcher.next_batch(ConsumerId(2), BIG, 0.0)
    dispatcher.consumer_lost(ConsumerId(1))  # its uncommitted batch is simply dropped
    assert dispatcher.next_batch(ConsumerId(2), BIG, 0.0).refs[0] == batch.refs[0]
