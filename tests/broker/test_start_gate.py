"""The start gate (pipeline/broker/start_gate.py): dispatch waits for min_consumers to register
or for the wait to pass, whichever is first, and stays open after; its settings are checked
at and past their limits."""

from __future__ import annotations

import random

import pytest

from pipeline.broker.config import MAX_MIN_CONSUMERS_WAIT_S, BrokerConfig
from pipeline.broker.start_gate import StartGate
from pipeline.wire.errors import ConfigError


def test_it_opens_at_the_count_and_stays_open_when_consumers_leave():
    gate = StartGate(min_consumers=2, wait_s=30.0)
    assert gate.gating and gate.started_s is None
    assert not gate.is_open(100.0, registered=0)  # the wait starts at the first look
    assert not gate.is_open(101.0, registered=0)
    assert not gate.is_open(102.0, registered=1)
    assert gate.is_open(103.0, registered=2)
    assert (gate.opened_s, gate.opened_with) == (103.0, 2)
    assert gate.is_open(104.0, registered=0)  # a lost consumer does not close it
    assert not gate.gating
    gate.check_invariants()


def test_a_consumer_lost_before_it_opens_keeps_it_closed():
    gate = StartGate(min_consumers=2, wait_s=30.0)
    assert not gate.is_open(0.0, registered=1)
    assert not gate.is_open(1.0, registered=0)  # the one there went away
    assert not gate.is_open(2.0, registered=1)
    assert gate.is_open(3.0, registered=2)


def test_it_opens_when_the_wait_passes_with_fewer_consumers():
    gate = StartGate(min_consumers=3, wait_s=5.0)
    assert not gate.is_open(10.0, registered=2)
    assert not gate.is_open(14.999, registered=2)
    assert gate.is_open(15.0, registered=1) and gate.opened_with == 1
    gate.check_invariants()


@pytest.mark.parametrize("count", [0, 1])
def test_zero_or_one_consumer_is_no_gate(count):
    gate = StartGate(min_consumers=count, wait_s=30.0)
    assert not gate.gating and gate.is_open(7.0, registered=0) and gate.opened_s == 7.0


def test_a_seeded_random_run_matches_its_definition():
    rng = random.Random(0)
    for _ in range(200):
        need, wait_s, start_s = rng.randint(0, 5), rng.uniform(0, 10), rng.uniform(0, 100)
        gate = StartGate(need, wait_s)
        now_s, seen_open = start_s, False
        for step in range(20):
            now_s += rng.uniform(0, 2) if step else 0.0
            registered = rng.randint(0, 6)
            should = seen_open or need <= 1 or registered >= need or now_s - start_s >= wait_s
            assert gate.is_open(now_s, registered) == should
            seen_open = should
            gate.check_invariants()


def test_the_settings_are_checked_at_and_past_their_limits():
    config = BrokerConfig("/tmp/data", max_consumers=4, min_consumers=4, min_consumers_wait_s=MAX_MIN_CONSUMERS_WAIT_S)
    assert (config.min_consumers, config.min_consumers_wait_s) == (4, MAX_MIN_CONSUMERS_WAIT_S)
    assert BrokerConfig("/tmp/data", min_consumers=0, min_consumers_wait_s=0).min_consumers == 0
    with pytest.raises(ConfigError, match="max_consumers '8' must be an integer"):
        BrokerConfig("/tmp/data", max_consumers="8", min_consumers=2)  # its own error, not a TypeError
    for name, bad, match in [("min_consumers", 5, "min_consumers 5 must be an integer from 0 to max_consumers"),
                             ("min_consumers", -1, "min_consumers -1"), ("min_consumers", True, "min_consumers True"),
                             ("min_consumers", 2.0, "min_consumers 2.0"),
                             ("min_consumers_wait_s", MAX_MIN_CONSUMERS_WAIT_S + 1, "min_consumers_wait_s 86401"),
                             ("min_consumers_wait_s", -0.1, "min_consumers_wait_s -0.1"),
                             ("min_consumers_wait_s", float("nan"), "min_consumers_wait_s nan"),
                             ("min_consumers_wait_s", "5", "min_consumers_wait_s '5'")]:
        with pytest.raises(ConfigError, match=match):
            BrokerConfig("/tmp/data", max_consumers=4, **{name: bad})
