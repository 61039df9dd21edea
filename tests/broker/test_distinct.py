"""DistinctCount (pipeline/broker/distinct.py) against a set: exact up to its limit and at it,
an estimate within four standard errors one past it and far past it, duplicates and the
order of adding changing nothing; its invariants after every step of a seeded random run."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.broker.distinct import DISTINCT_EXACT_LIMIT, REGISTER_BITS, DistinctCount

STANDARD_ERROR = 1.04 / np.sqrt(1 << REGISTER_BITS)


def pairs(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    models = rng.integers(0, 4, count, dtype=np.uint64)
    signatures = rng.integers(0, 1 << 63, count, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    return models, signatures


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), max_size=200), st.integers(1, 64))
def test_below_the_limit_the_count_is_the_sets(added, exact_limit):
    counter, reference = DistinctCount(exact_limit), set()
    for model, signature in added:
        counter.add_many(np.array([model], dtype=np.uint64), np.array([signature], dtype=np.uint64))
        reference.add((model, signature))
        counter.check_invariants()
        assert counter.exact == (len(reference) <= exact_limit)
        if counter.exact:
            assert counter.count == len(reference)


def test_at_the_limit_exact_one_past_estimated():
    models, signatures = pairs(DISTINCT_EXACT_LIMIT + 1, seed=1)
    counter = DistinctCount()
    counter.add_many(models[:-1], signatures[:-1])
    counter.add_many(models[:-1], signatures[:-1])  # again: nothing new
    assert counter.exact and counter.count == DISTINCT_EXACT_LIMIT
    counter.add_many(models[-1:], signatures[-1:])
    counter.check_invariants()
    assert not counter.exact
    assert abs(counter.count / (DISTINCT_EXACT_LIMIT + 1) - 1) < 4 * STANDARD_ERROR


@pytest.mark.parametrize("count, seed", [(50_000, 2), (400_000, 3)])
def test_far_past_the_limit_the_estimate_holds_and_duplicates_change_nothing(count, seed):
    models, signatures = pairs(count, seed)
    counter = DistinctCount()
    for part in np.array_split(np.arange(count), 7):
        counter.add_many(models[part], signatures[part])
    once = counter.count
    counter.add_many(models[::-1], signatures[::-1])
    counter.check_invariants()
    assert counter.count == once and abs(once / count - 1) < 4 * STANDARD_ERROR


def test_the_same_signature_under_two_models_is_two_shapes():
    counter = DistinctCount()
    counter.add_many(np.array([0, 1, 0], dtype=np.uint64), np.array([7, 7, 7], dtype=np.uint64))
    assert counter.count == 2


def test_the_count_never_falls_across_the_switch_and_after():
    """A counter for Prometheus: at the switch from exact to estimated (an estimate can be
    below the exact count it follows), and as the estimate moves, the count never goes down."""
    models, signatures = pairs(DISTINCT_EXACT_LIMIT + 3000, seed=7)  # its estimate starts below the limit
    counter = DistinctCount()
    counter.add_many(models[:DISTINCT_EXACT_LIMIT - 1], signatures[:DISTINCT_EXACT_LIMIT - 1])
    last, estimates = counter.count, []
    for k in range(DISTINCT_EXACT_LIMIT - 1, models.size):  # one at a time across the switch
        counter.add_many(models[k:k + 1], signatures[k:k + 1])
        assert counter.count >= last, k
        last = counter.count
        estimates.append(counter.estimate())
    counter.check_invariants()
    assert min(estimates[1:]) < DISTINCT_EXACT_LIMIT  # the raw estimate did fall below: the floor held
