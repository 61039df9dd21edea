"""The solitary pool's rule (pipeline/broker/pool.py) against a plain reference written here,
which recomputes who shares what by scanning every live shape's chain. Deterministic:
hypothesis is derandomised, stress runs are seeded."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.broker.ids import ConsumerId, ShapeKey
from pipeline.broker.pool import (
    MAX_DECLARED_CHAINS,
    STOPPED_OUTGROWN,
    STOPPED_SHARED,
    SolitaryPool,
    pool_shape,
)
from pipeline.wire.errors import ShapeGuardError
from pipeline.wire.shapes import POOL_SIGNATURE

DETERMINISTIC = settings(derandomize=True, database=None, deadline=None, max_examples=300)
C0 = ConsumerId(0)
# Chains over a few elements, so shapes often share one (a shape's own signature may be
# another's prefix, as a conversation's turns); the last element names the shape.
CHAINS = [(1,), (2,), (1, 3), (4, 5), (4, 6), (7, 8, 9), (7, 10), (11,), (12, 13), (12, 13, 14)]
assert len({chain[-1] for chain in CHAINS}) == len(CHAINS)


class RefPool:
    """The rule with linear scans: a shape pools from its first live item if no other live
    shape's chain holds an element of its chain and the items fit; it stops for good once
    it would hold more, or once a live shape comes to share an element with it."""

    def __init__(self, max_items: int, min_shapes: int = 0) -> None:
        self.max_items = max_items
        self.min_shapes = min_shapes
        self.declared: dict[ShapeKey, tuple[int, ...]] = {}
        self.live: dict[ShapeKey, dict] = {}  # chain, pooling, pooled, own

    def shares(self, shape: ShapeKey, chain: tuple[int, ...]) -> bool:
        return any(other != shape and other.model == shape.model and set(chain) & set(state["chain"])
                   for other, state in self.live.items())

    def declare(self, model: int, chain: tuple[int, ...]) -> None:
        shape = ShapeKey(model, chain[-1])
        if shape in self.live:
            state = self.live[shape]
            if len(chain) > len(state["chain"]):
                state["chain"] = chain
                self.stop_sharers(shape, chain)
                if state["pooling"] and self.shares(shape, chain):
                    state["pooling"] = False
            return
        self.declared[shape] = chain

    def stop_sharers(self, shape: ShapeKey, chain: tuple[int, ...]) -> None:
        for other, state in self.live.items():
            if other != shape and other.model == shape.model and set(chain) & set(state["chain"]):
                state["pooling"] = False

    def route_many(self, groups: list[tuple[ShapeKey, int]]) -> list[bool]:
        """New shapes of one frame are judged against each other's chains as well."""
        new = {shape: self.declared.get(shape, (shape.signature,)) for shape, _ in groups if shape not in self.live}
        for shape, chain in new.items():
            self.stop_sharers(shape, chain)
        shared = {shape for shape, chain in new.items()
                  if any(other != shape and other.model == shape.model and set(chain) & set(theirs)
                         for other, theirs in new.items())}
        return [self.route(shape, items, shape not in shared) for shape, items in groups]

    def route(self, shape: ShapeKey, items: int, alone_in_frame: bool = True) -> bool:
        state = self.live.get(shape)
        if state is None:
            chain = self.declared.pop(shape, (shape.signature,))
            alone = not self.shares(shape, chain) and alone_in_frame
            crowded = sum(other.model == shape.model for other in self.live) >= self.min_shapes
            self.stop_sharers(shape, chain)
            state = self.live[shape] = {"chain": chain, "pooling": self.max_items > 0 and alone and crowded
                                        and items <= self.max_items, "pooled": 0, "own": False}
        elif state["pooling"] and state["pooled"] + items > self.max_items:
            state["pooling"] = False
        if state["pooling"]:
            state["pooled"] += items
            return True
        state["own"] = True
        return False

    def leave_if_idle(self, shape: ShapeKey) -> bool:
        state = self.live[shape]
        if state["pooled"] or state["own"]:
            return False
        del self.live[shape]
        return True

    def done(self, shape: ShapeKey, items: int) -> bool:
        self.live[shape]["pooled"] -= items
        return self.leave_if_idle(shape)

    def own_retired(self, shape: ShapeKey) -> bool:
        self.live[shape]["own"] = False
        return self.leave_if_idle(shape)


class Harness:
    def __init__(self, max_items: int, min_shapes: int = 0) -> None:
        self.sut = SolitaryPool(max_items, min_shapes)
        self.ref = RefPool(max_items, min_shapes)

    def run(self, op: tuple) -> None:
        kind, model, pick, amount = op
        chain = CHAINS[pick % len(CHAINS)]
        shape = ShapeKey(model, chain[-1])
        if kind == "declare":
            self.sut.declare(model, chain)
            self.ref.declare(model, chain)
        elif kind == "route":
            assert self.sut.route(shape, amount) == self.ref.route(shape, amount), (shape, amount)
        elif kind == "frame":  # this shape and the next few, each once, in one frame
            picks = sorted({(pick + k) % len(CHAINS) for k in range(amount)})
            groups = [(ShapeKey(model, CHAINS[p][-1]), 1 + p % 3) for p in picks]
            assert self.sut.route_many(groups) == self.ref.route_many(groups), groups
        elif kind == "done":
            pooled = self.ref.live.get(shape, {}).get("pooled", 0)
            if pooled:
                items = min(pooled, amount)
                assert self.sut.done(shape, items) == self.ref.done(shape, items)
        elif kind == "retire" and self.ref.live.get(shape, {}).get("own"):
            assert self.sut.own_retired(shape) == self.ref.own_retired(shape)
        self.check()

    def check(self) -> None:
        self.sut.check_invariants()
        for model in (0, 1):
            for chain in CHAINS:
                shape = ShapeKey(model, chain[-1])
                state = self.ref.live.get(shape)
                assert self.sut.pooling(shape) == (state is not None and state["pooling"]), shape
                assert self.sut.pooled(shape) == (0 if state is None else state["pooled"]), shape
                if state is not None:
                    assert self.sut.chain_of(shape) == state["chain"], shape
        assert self.sut.live_shapes == len(self.ref.live)


operations = st.tuples(st.sampled_from(["declare", "route", "route", "frame", "done", "retire"]), st.integers(0, 1),
                       st.integers(0, len(CHAINS) - 1), st.integers(1, 5))


@DETERMINISTIC
@given(max_items=st.sampled_from([0, 1, 3, 64]), min_shapes=st.sampled_from([0, 0, 2, 4]),
       ops=st.lists(operations, max_size=80))
def test_matches_reference(max_items, min_shapes, ops):
    harness = Harness(max_items, min_shapes)
    for op in ops:
        harness.run(op)


@pytest.mark.parametrize("seed,max_items,min_shapes", [(1, 1, 0), (2, 4, 0), (3, 64, 0), (4, 4, 3)])
def test_seeded_stress(seed, max_items, min_shapes):
    rng = np.random.default_rng(seed)
    harness = Harness(max_items, min_shapes)
    kinds = ["declare", "route", "route", "frame", "done", "done", "retire"]
    for _ in range(2000):
        harness.run((kinds[int(rng.integers(len(kinds)))], int(rng.integers(2)), int(rng.integers(len(CHAINS))),
                     int(rng.integers(1, 4))))


def test_docstring_example():
    pool = SolitaryPool(max_items=2)
    a, b, c = ShapeKey(0, 0xA), ShapeKey(0, 0xAB), ShapeKey(0, 0xBC)
    pool.declare(0, (0xA,))
    pool.declare(0, (0xB, 0xAB))
    pool.declare(0, (0xB, 0xBC))
    assert pool.route(a, 1) and pool.route(b, 1)
    assert not pool.route(c, 1) and not pool.pooling(b)  # c shares b's first level: both leave
    assert pool.pooled(b) == 1  # b's pooled item stays in the pool
    assert not pool.route(a, 2) and pool.pooled(a) == 1  # outgrown
    assert pool.counters.stopped == {STOPPED_OUTGROWN: 1, STOPPED_SHARED: 1}
    assert (pool.counters.items, pool.counters.shapes) == (2, 2)
    pool.check_invariants()


def test_the_pool_takes_shapes_only_once_a_model_holds_min_shapes():
    pool = SolitaryPool(max_items=4, min_shapes=2)
    assert pool.route_many([(ShapeKey(0, 1), 1), (ShapeKey(0, 2), 1), (ShapeKey(0, 3), 1)]) == [False, False, True]
    assert not pool.route(ShapeKey(1, 1), 1)  # another model: its own count
    assert pool.own_retired(ShapeKey(0, 1)) and pool.own_retired(ShapeKey(0, 2))
    assert not pool.route(ShapeKey(0, 4), 1)  # one live shape left (3): below min_shapes again
    pool.check_invariants()


def test_new_shapes_of_one_frame_that_share_do_not_pool():
    pool = SolitaryPool(max_items=4)
    pool.declare(0, (7, 71))
    pool.declare(0, (7, 72))
    a, b, c = ShapeKey(0, 71), ShapeKey(0, 72), ShapeKey(0, 9)
    assert pool.route_many([(c, 1), (a, 1), (b, 2)]) == [True, False, False]
    assert pool.counters.stopped == {STOPPED_OUTGROWN: 0, STOPPED_SHARED: 0}  # none pooled to stop
    pool.check_invariants()


def test_a_shape_leaves_once_its_pooled_items_are_done_and_its_lanes_retired():
    pool = SolitaryPool(max_items=4)
    a = ShapeKey(0, 1)
    assert pool.route(a, 2)
    assert not pool.done(a, 1) and pool.done(a, 1)  # gone: a chain of its own may pool again
    assert pool.live_shapes == 0 and pool.route(a, 4)
    assert not pool.route(a, 1)  # outgrown: own lanes from now
    assert not pool.done(a, 4) and pool.own_retired(a)
    pool.check_invariants()


def test_max_items_at_the_limit_pools_and_past_it_does_not():
    pool = SolitaryPool(max_items=3)
    assert pool.route(ShapeKey(0, 1), 3)
    assert not pool.route(ShapeKey(0, 2), 4)  # its first items already fill more than a batch's worth
    pool.check_invariants()


def test_off_it_routes_nothing_but_keeps_chains():
    pool = SolitaryPool(max_items=0)
    pool.declare(0, (1, 2))
    assert not pool.route(ShapeKey(0, 2), 1) and pool.chain_of(ShapeKey(0, 2)) == (1, 2)
    pool.check_invariants()


def test_models_do_not_share():
    pool = SolitaryPool(max_items=8)
    assert pool.route(ShapeKey(0, 1), 1) and pool.route(ShapeKey(1, 1), 1)
    assert pool.pooling(ShapeKey(0, 1)) and pool.pooling(ShapeKey(1, 1))


def test_a_chain_declared_late_stops_a_shape_that_now_shares():
    pool = SolitaryPool(max_items=8)
    assert pool.route(ShapeKey(0, 2), 1)  # items before its chain (as after a restart)
    pool.declare(0, (1, 2))
    assert pool.pooling(ShapeKey(0, 2))  # nobody else holds 1
    pool.declare(0, (1, 5))
    assert not pool.route(ShapeKey(0, 5), 1) and not pool.pooling(ShapeKey(0, 2))
    pool.check_invariants()


def test_declared_chains_waiting_are_bounded():
    pool = SolitaryPool(max_items=8)
    for k in range(MAX_DECLARED_CHAINS + 3):
        pool.declare(0, (k + 1_000_000, k))
    assert pool.chain_of(ShapeKey(0, 0)) == (0,)  # the oldest was dropped
    assert pool.chain_of(ShapeKey(0, 5)) == (1_000_005, 5)
    pool.check_invariants()


def test_recovery_adopts_and_stops_what_shares():
    pool = SolitaryPool(max_items=4)
    pool.declare(0, (1, 2))
    pool.declare(0, (1, 3))
    pool.adopt(ShapeKey(0, 2), pooled=2)
    assert pool.pooling(ShapeKey(0, 2))
    pool.adopt(ShapeKey(0, 3), own=True)
    assert not pool.pooling(ShapeKey(0, 2)) and pool.pooled(ShapeKey(0, 2)) == 2
    pool.adopt(ShapeKey(0, 9), pooled=5)  # more than the pool holds a shape: its items stay, it pools no more
    assert not pool.pooling(ShapeKey(0, 9)) and pool.pooled(ShapeKey(0, 9)) == 5
    pool.check_invariants()


def test_guard_lets_only_pooled_shapes_ride_a_pool_batch():
    pool = SolitaryPool(max_items=4)
    assert pool.route(ShapeKey(0, 1), 1) and pool.route(ShapeKey(0, 2), 1)
    pool.guard(pool_shape(0), np.array([1, 2, 1], dtype=np.uint64), "batch", C0)
    with pytest.raises(ShapeGuardError, match="no item in the pool"):
        pool.guard(pool_shape(0), np.array([1, 7], dtype=np.uint64), "batch", C0)
    with pytest.raises(ShapeGuardError, match="no item in the pool"):
        pool.guard(pool_shape(0), np.array([POOL_SIGNATURE], dtype=np.uint64), "batch", C0)
    pool.guard(ShapeKey(0, 7), np.array([7, 7], dtype=np.uint64), "batch", C0)
    with pytest.raises(ShapeGuardError, match="not the batch's shape"):
        pool.guard(ShapeKey(0, 7), np.array([7, 1], dtype=np.uint64), "batch", C0)
