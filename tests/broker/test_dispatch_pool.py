"""The solitary pool through the real Dispatcher and disk tier (pipeline/broker/pool.py):
shapes that share nothing ride mixed batches from one set of pool lanes and files, shapes
that share keep lanes of their own and the prefix order, the guard holds for both, a restart
brings the pool back, and the work of a turn does not grow with the number of shapes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeline.broker.config import MAX_LIVE_SHAPES_LIMIT, MAX_POOL_MIN_SHAPES, BrokerConfig
from pipeline.broker.dispatch import Dispatcher
from pipeline.broker.ids import ConsumerId, ShapeKey
from pipeline.broker.packing import Contract
from pipeline.broker.pool import MAX_POOL_ITEMS, pool_shape
from pipeline.broker.selection import SHAPE_ORDER_PREFIX, SwitchReason
from pipeline.storage import DiskTier, Peeked
from pipeline.wire.errors import ConfigError, FrameError, ShapeGuardError
from pipeline.wire.shapes import POOL_SIGNATURE
from tests.support.frames import make_frame

C1, C2 = ConsumerId(1), ConsumerId(2)
CONTRACT = Contract(model=0, max_batch_items=8, max_batch_tokens=1 << 20, max_input_len=1 << 16)
POOL = pool_shape(0)


def dispatcher_on(tier: DiskTier, max_items: int = 8, **options) -> Dispatcher:
    options.setdefault("shape_order", SHAPE_ORDER_PREFIX)
    options.setdefault("affinity", True)
    options.setdefault("pool_min_shapes", 0)
    return Dispatcher(tier, pool_max_items=max_items, **options)


@pytest.fixture
def tier(tmp_path):
    tier = DiskTier.open(str(tmp_path / "data"))
    yield tier
    tier.close()


def run_batch(dispatcher: Dispatcher, consumer: ConsumerId, now_s: float = 0.0, contract: Contract = CONTRACT):
    """Hand one batch to `consumer`, commit and complete it; the batch (None: nothing)."""
    batch = dispatcher.next_batch(consumer, contract, now_s)
    if batch is not None:
        dispatcher.commit(batch)
        dispatcher.complete_batch(consumer, batch)
        dispatcher.check_invariants()
    return batch


def test_shapes_that_share_nothing_ride_full_batches_from_one_set_of_files(tier):
    dispatcher = dispatcher_on(tier)
    shapes = [(0, 1000 + k) for k in range(20)]  # 20 shapes, an item each, no chain in common
    dispatcher.ingest(make_frame(1, 0, shapes, [100] * 20), 0.0)
    dispatcher.flush()
    dispatcher.check_invariants()
    assert dispatcher.shapes() == [POOL] and dispatcher.counters().shapes == 20
    assert len(tier.store.segments) == 1  # one pool lane, one file
    sizes = []
    while (batch := run_batch(dispatcher, C1)) is not None:
        assert batch.lane.shape == POOL and len(set(batch.entries.signatures.tolist())) == len(batch.entries)
        sizes.append(len(batch.entries))
    assert sizes == [8, 8, 4]
    assert dispatcher.counters().items_completed == 20 and dispatcher.pool.live_shapes == 0
    assert dispatcher.selector.counters.switches[SwitchReason.INITIAL] == 1  # one switch for 20 shapes
    assert dispatcher.pool.counters.items == 20 and dispatcher.pool.counters.shapes == 20


def test_shapes_that_share_keep_their_own_lanes_and_order(tier):
    dispatcher = dispatcher_on(tier)
    chains = [(0, (7, 71)), (0, (7, 72)), (0, (9,))]
    frame = make_frame(1, 0, [(0, 71), (0, 72), (0, 72), (0, 9)], [100, 100, 100, 100], chains=chains)
    dispatcher.ingest(frame, 0.0)
    dispatcher.flush()
    dispatcher.check_invariants()
    assert sorted(dispatcher.shapes()) == sorted([ShapeKey(0, 71), ShapeKey(0, 72), POOL])
    order = [run_batch(dispatcher, C1).lane.shape for _ in range(3)]
    assert order[:2] in ([ShapeKey(0, 71), ShapeKey(0, 72)], [ShapeKey(0, 72), ShapeKey(0, 71)])
    assert order[2] == POOL  # the pool comes last
    assert run_batch(dispatcher, C1) is None


def test_a_consumer_on_the_pool_yields_to_a_shape_with_work(tier):
    dispatcher = dispatcher_on(tier, max_items=2)
    dispatcher.ingest(make_frame(1, 0, [(0, 100 + k) for k in range(16)], [50] * 16), 0.0)
    dispatcher.flush()
    assert run_batch(dispatcher, C1).lane.shape == POOL
    dispatcher.ingest(make_frame(1, 16, [(0, 5)] * 3, [50] * 3), 0.0)  # 3 items: outgrows the pool at once
    dispatcher.flush()
    batch = run_batch(dispatcher, C1)
    assert batch.lane.shape == ShapeKey(0, 5) and batch.switch == SwitchReason.YIELD.value
    assert run_batch(dispatcher, C1).lane.shape == POOL


def test_a_pooled_shape_that_comes_to_share_stays_in_the_pool_and_its_new_items_do_not(tier):
    dispatcher = dispatcher_on(tier)
    dispatcher.ingest(make_frame(1, 0, [(0, 71)], [100], chains=[(0, (7, 71))]), 0.0)
    dispatcher.ingest(make_frame(1, 1, [(0, 72), (0, 71)], [100, 100], chains=[(0, (7, 72))]), 0.0)
    dispatcher.flush()
    dispatcher.check_invariants()
    pool = dispatcher.pool
    assert not pool.pooling(ShapeKey(0, 71)) and pool.pooled(ShapeKey(0, 71)) == 1
    assert sorted(dispatcher.shapes()) == sorted([POOL, ShapeKey(0, 71), ShapeKey(0, 72)])
    assert pool.counters.stopped["shared"] == 1
    shapes = {run_batch(dispatcher, C1).lane.shape for _ in range(3)}
    assert shapes == {POOL, ShapeKey(0, 71), ShapeKey(0, 72)} and run_batch(dispatcher, C1) is None
    assert pool.live_shapes == 2  # own lanes retire at a tick
    dispatcher.tick(1e6)
    dispatcher.tick(2e6)
    assert pool.live_shapes == 0 and dispatcher.shapes() == []
    dispatcher.check_invariants()


class ForgingTier(DiskTier):
    """A tier whose peek names the entries' shapes wrongly (a routing bug)."""

    signature = 0

    def peek_many(self, lane, max_items):
        front = super().peek_many(lane, max_items)
        return Peeked.of(lane, [dataclasses.replace(e, signature=self.signature) for e in front])


@pytest.mark.parametrize("forged,max_items,signatures,match", [
    (4242, 8, (1, 2), "no item in the pool"),  # a pool batch: only shapes with items in the pool
    (POOL_SIGNATURE, 8, (1, 2), "no item in the pool"),
    (4242, 0, (1, 1), "not the batch's shape"),  # a shape's batch: only that shape
])
def test_guard_stops_a_batch_holding_a_chunk_that_may_not_ride_in_it(tmp_path, forged, max_items, signatures, match):
    tier = ForgingTier.open(str(tmp_path))
    tier.signature = forged
    dispatcher = dispatcher_on(tier, max_items=max_items)
    dispatcher.ingest(make_frame(1, 0, [(0, s) for s in signatures], [10, 10]), 0.0)
    dispatcher.flush()
    with pytest.raises(ShapeGuardError, match=match):
        dispatcher.next_batch(C1, CONTRACT, 0.0)
    tier.close()


def test_a_restart_brings_the_pool_and_its_shapes_back(tmp_path):
    path = str(tmp_path / "data")
    tier = DiskTier.open(path)
    dispatcher = dispatcher_on(tier)
    chains = [(0, (7, 71)), (0, (3,))]
    dispatcher.ingest(make_frame(1, 0, [(0, 71), (0, 3), (0, 3), (0, 4)], [10, 20, 30, 40], chains=chains), 0.0)
    dispatcher.flush()
    first = dispatcher.next_batch(C1, Contract(0, 1, 1 << 20, 1 << 16), 0.0)
    dispatcher.commit(first)  # held by a consumer when the broker stops: it comes back too
    tier.close()
    tier = DiskTier.open(path)
    again = dispatcher_on(tier)
    assert again.recover(0.0) == 4
    again.check_invariants()
    assert again.shapes() == [POOL] and again.pool.chain_of(ShapeKey(0, 71)) == (7, 71)
    assert {ShapeKey(0, s): again.pool.pooled(ShapeKey(0, s)) for s in (71, 3, 4)} == {
        ShapeKey(0, 71): 1, ShapeKey(0, 3): 2, ShapeKey(0, 4): 1}
    ridden = []
    while (batch := run_batch(again, C1)) is not None:
        ridden += batch.entries.signatures.tolist()
    assert sorted(ridden) == [3, 3, 4, 71] and again.pool.live_shapes == 0
    tier.close()


def test_frames_may_not_use_the_pools_signature(tier):
    with pytest.raises(FrameError, match="item 0: signature .* solitary pool's own signature"):
        make_frame(1, 0, [(0, POOL_SIGNATURE)], [10])
    dispatcher = dispatcher_on(tier)
    with pytest.raises(FrameError, match="chain at byte 0 holds .* solitary pool's own signature"):
        dispatcher.ingest(make_frame(1, 0, [(0, 5)], [10], chains=[(0, (POOL_SIGNATURE, 5))]), 0.0)
    assert dispatcher.counters().items_received == 0 and dispatcher.pool.live_shapes == 0


def test_the_pools_settings_are_checked_at_their_limits():
    assert BrokerConfig("/tmp/data", pool_max_items=MAX_POOL_ITEMS).pool_items == MAX_POOL_ITEMS
    assert BrokerConfig("/tmp/data", pool_max_items=0).pool_items == 0
    assert BrokerConfig("/tmp/data", dispatch="fifo").pool_items == 0  # baselines keep a shape a queue
    assert BrokerConfig("/tmp/data", pool_min_shapes=MAX_POOL_MIN_SHAPES).pool_min_shapes == MAX_POOL_MIN_SHAPES
    for name, limit in (("pool_max_items", MAX_POOL_ITEMS), ("pool_min_shapes", MAX_POOL_MIN_SHAPES)):
        for bad in (limit + 1, -1, True, 2.0, "8"):
            with pytest.raises(ConfigError, match=f"{name} {bad!r} must be an integer from 0"):
                BrokerConfig("/tmp/data", **{name: bad})


def test_the_live_shapes_bound_is_checked_at_its_limits():
    for good in (1, MAX_LIVE_SHAPES_LIMIT):
        assert BrokerConfig("/tmp/data", max_live_shapes=good).max_live_shapes == good
    for bad in (0, MAX_LIVE_SHAPES_LIMIT + 1, True, 2.0, "8"):
        with pytest.raises(ConfigError, match=f"max_live_shapes {bad!r} must be an integer from 1"):
            BrokerConfig("/tmp/data", max_live_shapes=bad)


def test_below_min_shapes_every_shape_has_lanes_of_its_own(tier):
    dispatcher = dispatcher_on(tier, pool_min_shapes=3)
    dispatcher.ingest(make_frame(1, 0, [(0, 1), (0, 2), (0, 3), (0, 4)], [10] * 4), 0.0)
    dispatcher.flush()
    dispatcher.check_invariants()
    assert sorted(dispatcher.shapes()) == [ShapeKey(0, 1), ShapeKey(0, 2), ShapeKey(0, 3), POOL]
    assert dispatcher.pool.pooled(ShapeKey(0, 4)) == 1


# ---------------------------------------------------------------------- the work of a turn

TURN_ITEMS = 256  # a producer frame
CONSUMER_CREDIT = 4  # batches a consumer holds at once


def turns_of_distinct_shapes(tier: DiskTier, max_items: int, shapes: int) -> list[dict]:
    """Drive `shapes` one-item shapes of no common prefix through the dispatcher, one frame a
    turn, as the broker's loop does (ingest, flush, dispatch to two consumers as far as their
    credit goes, complete what they held, tick), on a simulated clock; the work each turn
    did: segment files made and removed, lane groups appended, batches and their items."""
    dispatcher = dispatcher_on(tier, max_items)
    contract = Contract(model=0, max_batch_items=64, max_batch_tokens=1 << 20, max_input_len=1 << 16)
    store, counted = tier.store, []
    made, appends = [0], [0]
    create, append = store._new_segment, store.append

    def counting_create(*args, **kwargs):
        made[0] += 1
        return create(*args, **kwargs)

    def counting_append(*args, **kwargs):
        appends[0] += 1
        return append(*args, **kwargs)

    store._new_segment, store.append = counting_create, counting_append
    now_s, seq = 0.0, 0
    while seq < shapes or dispatcher.counters().items_completed < shapes:
        before = (made[0], len(store.segments), appends[0])
        if seq < shapes:
            count = min(TURN_ITEMS, shapes - seq)
            frame = make_frame(1, seq, [(0, 10_000 + seq + k) for k in range(count)], [64] * count)
            dispatcher.ingest(frame, now_s)
            seq += count
        dispatcher.flush()
        held = []
        for consumer in (C1, C2):
            for _ in range(CONSUMER_CREDIT):
                batch = dispatcher.next_batch(consumer, contract, now_s)
                if batch is None:
                    break
                dispatcher.commit(batch)
                held.append((consumer, batch))
        for consumer, batch in held:
            dispatcher.complete_batch(consumer, batch)
        while dispatcher.tick(now_s, 8):
            pass
        dispatcher.flush()
        counted.append({"files_made": made[0] - before[0], "files_removed": before[1] + made[0] - before[0]
                        - len(store.segments), "appends": appends[0] - before[2],
                        "batch_items": [len(b.entries) for _c, b in held]})
        now_s += 0.05
    dispatcher.check_invariants()
    return counted


def test_the_work_of_a_turn_does_not_grow_with_the_number_of_shapes(tmp_path):
    """With the pool, a turn of 256 new shapes appends to a pool lane or two and makes a file
    only when a segment fills; without it, each shape is a file of its own made and removed.
    Both at two numbers of shapes: the pool's work per turn is the same at 1,024 and 4,096."""
    per_turn = {}
    for shapes in (1024, 4096):
        tier = DiskTier.open(str(tmp_path / f"pool{shapes}"))
        per_turn[shapes] = turns_of_distinct_shapes(tier, 64, shapes)
        tier.close()
    for shapes, turns in per_turn.items():
        assert max(t["files_made"] for t in turns) <= 1 and max(t["appends"] for t in turns) <= 2
        sizes = [n for t in turns for n in t["batch_items"]]
        assert sizes == [64] * (shapes // 64)  # full batches, not one item each
    assert max(t["appends"] for t in per_turn[4096]) == max(t["appends"] for t in per_turn[1024])
    tier = DiskTier.open(str(tmp_path / "off"))
    without = turns_of_distinct_shapes(tier, 0, 1024)
    tier.close()
    assert sum(t["files_made"] for t in without) == sum(t["files_removed"] for t in without) == 1024  # a file a shape
    assert {n for t in without for n in t["batch_items"]} == {1}  # one-item batches
