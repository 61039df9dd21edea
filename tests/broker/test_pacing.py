"""BatchPacing (pipeline/broker/pacing.py): the rule at its constants and one past them,
against a reference statement of it, and a seeded run of one lane and one consumer on a
simulated clock: a batch that is not full never goes to a consumer holding enough, and
nothing waits forever once arrivals stop."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.broker.pacing import (
    FULL_ENOUGH_PERCENT,
    HUNGRY_FILL_SLICE_S,
    PACING,
    PARTIAL_BATCHES_AHEAD,
    PARTIAL_WAIT_S,
    BatchPacing,
)


def reference_goes(pacing: BatchPacing, held: int, available: int, fits: int, idle_s: float) -> bool:
    """Whether a lane's next batch goes to a consumer holding `held` batches: the rule as
    the module docstring states it, in exact fractions."""
    if held < pacing.batches_ahead:
        return True  # it may run dry: it takes what there is
    full_enough = Fraction(available, fits) >= Fraction(pacing.full_enough_percent, 100)
    return full_enough or idle_s >= pacing.partial_wait_s


def goes(pacing: BatchPacing, held: int, available: int, fits: int, idle_s: float) -> bool:
    return pacing.partial_allowed(held) or pacing.worth_sending(available, fits, idle_s)


pacings = st.builds(BatchPacing, st.integers(1, 8), st.integers(1, 100), st.floats(0.0, 2.0), st.floats(1e-4, 0.05))


def test_a_consumer_short_of_batches_takes_a_partial_one_and_one_more_does_not() -> None:
    assert PACING.partial_allowed(PARTIAL_BATCHES_AHEAD - 1)
    assert not PACING.partial_allowed(PARTIAL_BATCHES_AHEAD)
    assert PACING.partial_allowed(0)


def test_full_enough_at_the_percent_and_not_one_item_below() -> None:
    fits = 64
    at = fits * FULL_ENOUGH_PERCENT // 100  # 48 of 64: exactly 75%
    assert PACING.worth_sending(at, fits, idle_s=0.0)
    assert not PACING.worth_sending(at - 1, fits, idle_s=0.0)
    assert PACING.worth_sending(fits, fits, idle_s=0.0)
    assert PACING.worth_sending(5 * fits, fits, idle_s=0.0)  # a deep lane: a whole batch is there


def test_an_idle_lane_sends_at_the_wait_and_not_before() -> None:
    assert PACING.worth_sending(1, 64, idle_s=PARTIAL_WAIT_S)
    assert not PACING.worth_sending(1, 64, idle_s=PARTIAL_WAIT_S * 0.99)
    assert not PACING.worth_sending(0, 64, idle_s=0.0)


def test_the_fill_slice_is_short_only_while_a_consumer_is_hungry() -> None:
    assert PACING.fill_slice_s(0.010, hungry=True) == HUNGRY_FILL_SLICE_S
    assert PACING.fill_slice_s(0.010, hungry=False) == 0.010
    assert PACING.fill_slice_s(HUNGRY_FILL_SLICE_S / 2, hungry=True) == HUNGRY_FILL_SLICE_S / 2  # never longer


def test_hungry_needs_credit_and_few_batches() -> None:
    assert PACING.hungry([(1, PARTIAL_BATCHES_AHEAD - 1)])
    assert not PACING.hungry([(0, 0)])  # no credit: it can take nothing
    assert not PACING.hungry([(5, PARTIAL_BATCHES_AHEAD)])
    assert PACING.hungry([(5, PARTIAL_BATCHES_AHEAD), (1, 0)])
    assert not PACING.hungry([])


@pytest.mark.parametrize("fields", [dict(batches_ahead=0), dict(full_enough_percent=0),
                                    dict(full_enough_percent=101), dict(partial_wait_s=-1.0),
                                    dict(hungry_fill_slice_s=0.0)])
def test_a_rule_that_would_starve_or_never_send_is_our_bug(fields: dict) -> None:
    with pytest.raises(AssertionError):
        BatchPacing(**fields)


@given(pacings, st.integers(0, 10), st.integers(0, 300), st.integers(1, 128), st.floats(0.0, 3.0))
def test_the_rule_is_its_reference(pacing: BatchPacing, held: int, available: int, fits: int, idle_s: float) -> None:
    assert goes(pacing, held, available, fits, idle_s) == reference_goes(pacing, held, available, fits, idle_s)


@given(pacings, st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10)), max_size=6))
def test_hungry_is_any_consumer_with_credit_that_may_run_dry(pacing: BatchPacing, consumers) -> None:
    expected = any(credit > 0 and held < pacing.batches_ahead for credit, held in consumers)
    assert pacing.hungry(consumers) == expected


@pytest.mark.parametrize("seed", range(20))
def test_a_seeded_lane_and_consumer_on_a_simulated_clock(seed: int) -> None:
    """Items arrive in bursts for a while, then stop; a consumer with a window of batches
    completes one now and then. Every step: a batch that is not worth sending went only to a
    consumer holding fewer than batches_ahead; after the arrivals stop, everything is sent
    within partial_wait_s plus the consumer's completions."""
    rng = random.Random(seed)
    pacing = BatchPacing(rng.randint(1, 6), rng.randint(10, 100), rng.choice([0.0, 0.05, 0.25]))
    fits, window, step_s = rng.randint(1, 32), rng.randint(1, 16), 0.01
    queued, held, sent, arrived, now_s, last_arrival_s = 0, 0, 0, 0, 0.0, 0.0
    arrivals_end_s = rng.uniform(0.5, 3.0)
    while now_s < arrivals_end_s + pacing.partial_wait_s + window * step_s * 4 + 1.0:
        now_s += step_s
        if now_s < arrivals_end_s and rng.random() < 0.3:
            burst = rng.randint(1, fits * 2)
            queued, arrived, last_arrival_s = queued + burst, arrived + burst, now_s
        if held and rng.random() < 0.5:
            held -= 1  # a batch completed
        while queued and held < window:
            take = min(queued, fits)
            worth = pacing.worth_sending(queued, fits, now_s - last_arrival_s)
            if not goes(pacing, held, queued, fits, now_s - last_arrival_s):
                break
            assert worth or held < pacing.batches_ahead, (held, queued, fits)
            queued, held, sent = queued - take, held + 1, sent + take
            pacing.check_invariants()
    assert queued == 0 and sent == arrived, (queued, sent, arrived)
