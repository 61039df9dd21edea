"""The baseline dispatch policies (pipeline/broker/baselines.py) behind the same interface
as the product's: FIFO serves the oldest item's shape every batch, round-robin the next
shape with work; every change of shape a counted switch, every batch through the guard."""

from __future__ import annotations

import random

import pytest

from pipeline.broker.baselines import FifoPolicy, RoundRobinPolicy
from pipeline.broker.ids import ConsumerId, ShapeKey
from pipeline.broker.selection import SwitchReason

C = ConsumerId(1)
MS = 1_000_000
A, B, D = ShapeKey(0, 0xA), ShapeKey(0, 0xB), ShapeKey(0, 0xD)


def serve(policy, tokens: int = 100) -> ShapeKey | None:
    shape = policy.select(0, 0.0, consumer=C, batch_tokens=1000)
    if shape is not None:
        policy.guard(shape, consumer=C)
        policy.on_dispatched(shape, tokens, [0])
    return shape


def test_fifo_serves_the_shape_of_the_oldest_item_every_batch():
    fifo = FifoPolicy()
    fifo.on_queued(B, 100, [5 * MS])
    fifo.on_queued(A, 200, [1 * MS, 9 * MS])
    fifo.on_queued(D, 100, [3 * MS])
    order = []
    for arrivals in ([1 * MS], [3 * MS], [5 * MS], [9 * MS]):
        shape = fifo.select(0, 0.0, consumer=C)
        order.append(shape)
        fifo.on_dispatched(shape, 100, arrivals)
    assert order == [A, D, B, A] and fifo.select(0, 0.0, consumer=C) is None
    assert fifo.counters.switches[SwitchReason.ORDER] == 3
    fifo.check_invariants()


def test_round_robin_takes_each_shape_with_work_in_turn():
    rr = RoundRobinPolicy()
    for shape in (A, B, D):
        rr.on_queued(shape, 300, [0])
    assert [serve(rr) for _ in range(7)] == [A, B, D, A, B, D, A]  # A is empty now
    assert [serve(rr) for _ in range(3)] == [B, D, None]
    assert rr.counters.switches[SwitchReason.ORDER] == 8  # every batch but the first changed shape
    rr.check_invariants()


@pytest.mark.parametrize("policy_class", [FifoPolicy, RoundRobinPolicy])
def test_a_seeded_random_run_keeps_every_invariant_and_never_idles(policy_class):
    rng = random.Random(3)
    policy = policy_class()
    shapes = [ShapeKey(0, s) for s in range(1, 9)]
    arrivals: dict[ShapeKey, list[int]] = {shape: [] for shape in shapes}
    for step in range(2000):
        if rng.random() < 0.5:
            shape = rng.choice(shapes)
            policy.on_queued(shape, 100, [step * MS])
            arrivals[shape].append(step * MS)
        else:
            consumer = ConsumerId(rng.randrange(2))
            chosen = policy.select(0, 0.0, consumer=consumer)
            assert (chosen is None) == (not any(arrivals.values()))  # never idle while work waits
            if chosen is not None:
                policy.guard(chosen, consumer=consumer)
                if policy_class is FifoPolicy:  # the oldest item is of the chosen shape
                    assert min(arrivals[chosen]) == min(a for q in arrivals.values() for a in q)
                policy.on_dispatched(chosen, 100, [arrivals[chosen].pop(0)])
        policy.check_invariants()
