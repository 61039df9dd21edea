"""The offline padding policies (lab/bench/offline.py): the packers against a reference,
the buckets, the optimum's fill, and results that are shares."""

from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.bench import offline
from pipeline.broker.packing import Contract

SMALL = Contract(0, 4, 100, 1000)


def reference_own_longest(lengths: list[int], contract: Contract) -> tuple[int, int, int]:
    """Items, real and padded tokens of the first batch, taking items while the batch padded to
    its own longest still fits (at least one)."""
    taken: list[int] = []
    for n in lengths:
        if len(taken) == contract.max_batch_items:
            break
        if taken and (len(taken) + 1) * max(*taken, n) > contract.max_batch_tokens:
            break
        taken.append(n)
    return len(taken), sum(taken), len(taken) * max(taken)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 150), min_size=1, max_size=12))
def test_own_longest_matches_the_reference(lengths):
    queue = deque(lengths)
    batch = offline.pack_own_longest(queue, SMALL)
    assert (batch.items, batch.real_tokens, batch.padded_tokens) == reference_own_longest(lengths, SMALL)
    assert list(queue) == lengths[batch.items:]  # the rest stays, in order


def test_buckets_serve_the_most_tokens_first_and_pad_to_their_own_longest():
    policy = offline.BucketPolicy(lambda v: (v - 1) // 64)
    policy.add(np.array([10, 70, 20, 80, 90]), 0.0)
    first = policy.take(SMALL)  # bucket 1 (70 + 80 + 90 tokens) before bucket 0 (30)
    assert (first.items, first.real_tokens, first.padded_tokens) == (1, 70, 70)  # 2 x 80 > 100
    policy.take(SMALL), policy.take(SMALL)
    last = policy.take(SMALL)
    assert (last.items, last.real_tokens, last.padded_tokens) == (2, 30, 40)


def test_the_optimum_fills_batches_and_lanes_pad_less_than_fifo():
    rng = np.random.default_rng(3)
    stream = np.maximum(1, np.rint(rng.lognormal(np.log(512), 1.0, 20_000))).astype(np.int64)
    best = offline.offline_optimum(stream, same_packer=True)
    fifo = offline.simulate(offline.POLICIES["FIFO, no buckets (own longest)"], stream, 1000)
    lanes = offline.simulate(offline.POLICIES[offline.DEFAULT_POLICY], stream, 1000)
    for result in (best, fifo, lanes):
        offline.check_invariants(result)
    assert best.fill > lanes.fill and best.efficiency > 0.98
    assert lanes.efficiency > fifo.efficiency + 0.3
    assert best.efficiency - lanes.efficiency < 0.01  # the lane policy's acceptance target


def test_a_contract_of_more_tokens_takes_the_long_items_too():
    stream = np.array([100_000, 5, 120_000, 7] * 50, dtype=np.int64)
    wide = Contract(0, 64, 262_144, 262_144)
    result = offline.simulate(offline.POLICIES["power-of-two buckets (own longest)"], stream, 20, wide)
    offline.check_invariants(result)
    assert offline.offline_optimum(stream, True, wide).fill > 0
