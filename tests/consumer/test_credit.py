"""The consumer's credit window: sized from its batch times, clamped, never over-granted."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.credit import BATCH_TIME_WEIGHT, INITIAL_CREDIT, MAX_CREDIT, MIN_CREDIT, CreditWindow
from pipeline.consumer.process import descriptors_that_fit
from pipeline.wire.layouts.descriptors import descriptor_size_bytes
from shm.ring import RingReader, RingWriter
from shm.ring_layout import RECORD_ALIGN_BYTES, RECORD_HEADER_SIZE_BYTES, align_up


def _reference_windows(batch_times: list[float], ahead_s: float, low: int, high: int) -> list[tuple[int, int]]:
    """The window after each completion, recomputed from scratch: the running mean as a
    weighted sum over every batch time so far. A (smallest, largest) pair: the sum rounds
    otherwise than the running update, which can move a quotient across a whole number."""
    windows = []
    for n in range(1, len(batch_times) + 1):
        times = batch_times[:n]
        mean = times[0] * (1 - BATCH_TIME_WEIGHT) ** (n - 1)
        for k, t in enumerate(times[1:], start=1):
            mean += BATCH_TIME_WEIGHT * (1 - BATCH_TIME_WEIGHT) ** (n - 1 - k) * t
        windows.append(tuple(_clamped(mean * (1 + e), ahead_s, low, high) for e in (1e-9, -1e-9)))
    return windows


def _clamped(mean: float, ahead_s: float, low: int, high: int) -> int:
    if mean <= 0 or ahead_s / mean >= high:
        return high
    return min(max(math.ceil(ahead_s / mean), low), high)


def test_worked_example_from_the_docstring():
    window = CreditWindow(ahead_s=0.025)
    assert window.start() == INITIAL_CREDIT
    assert window.completed(0.001) == 22  # window 25, 3 still outstanding
    assert (window.window, window.outstanding) == (25, 25)
    for _ in range(40):  # batches now take 10 ms: the window shrinks to 3
        window.completed(0.010)
        window.check_invariants()
    assert window.window == 3
    assert window.outstanding == 3
    assert window.completed(0.010) == 1  # steady state: one batch back per batch done


def test_slow_batches_keep_the_minimum_and_instant_ones_the_maximum():
    slow = CreditWindow(ahead_s=0.025)
    slow.start()
    grants = [slow.completed(0.4) for _ in range(10)]
    assert slow.window == MIN_CREDIT
    assert sum(grants) + INITIAL_CREDIT - 10 == slow.outstanding == MIN_CREDIT
    instant = CreditWindow(ahead_s=0.025)
    instant.start()
    instant.completed(0.0)
    assert instant.window == instant.outstanding == MAX_CREDIT


def test_fixed_window_never_moves():
    window = CreditWindow.fixed(7)
    assert window.start() == 7
    for batch_s in (0.0, 1.0, 0.001, 5.0):
        assert window.completed(batch_s) == 1
        assert window.window == window.outstanding == 7


def test_a_new_session_starts_over():
    window = CreditWindow(ahead_s=0.025)
    window.start()
    window.completed(0.001)
    assert window.start() == INITIAL_CREDIT  # the old session's grants died with it
    assert window.outstanding == INITIAL_CREDIT


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=2.0, allow_nan=False), min_size=1, max_size=60),
       st.floats(min_value=0.0, max_value=0.2, allow_nan=False), st.integers(1, 8), st.integers(0, 60))
def test_windows_match_a_reference_and_grants_never_exceed_them(times, ahead_s, low, extra):
    high = low + extra
    window = CreditWindow(ahead_s, low, high)
    window.start()
    expected = _reference_windows(times, ahead_s, low, high)
    for batch_s, want in zip(times, expected):
        before = window.outstanding
        grant = window.completed(batch_s)
        window.check_invariants()
        assert want[0] <= window.window <= want[1]
        # Never more held than the window (once it is reached), never a grant while above it.
        assert window.outstanding == max(before - 1, window.window)
        assert grant == max(0, window.window - (before - 1))


def test_seeded_stress_with_sessions_and_invariants():
    rng = random.Random(5)
    window = CreditWindow(ahead_s=0.02)
    granted = completed = 0
    for _ in range(20_000):
        if rng.random() < 0.002 or window.window == 0:
            granted, completed = window.start(), 0  # a reconnect: the new broker knows only this
        elif window.outstanding:
            granted += window.completed(rng.expovariate(1 / rng.choice((0.0005, 0.005, 0.3))))
            completed += 1
        window.check_invariants()
        assert granted - completed == window.outstanding


@pytest.mark.parametrize("max_batch_items", [64, 1024, 4096])
def test_the_credit_cap_always_fits_in_the_descriptor_ring(shm_name, max_batch_items):
    # Wherever the write position is (the worst: a record's worth short of the end, so the
    # next one wraps and wastes the tail), `descriptors_that_fit` records go in with nothing
    # released. (The count of records that merely fit side by side fails this.)
    capacity = 1 << 20
    fits = descriptors_that_fit(capacity, max_batch_items)
    body = descriptor_size_bytes(max_batch_items)
    record = RECORD_HEADER_SIZE_BYTES + align_up(body)
    writer = RingWriter.create(shm_name(), capacity)
    reader = RingReader.attach(writer.name)
    try:
        filler = capacity - record + RECORD_ALIGN_BYTES  # leaves a tail one alignment short
        while filler > 0:  # move the write position there, through released records
            size = min(filler - RECORD_HEADER_SIZE_BYTES, writer.max_body_bytes)
            writer.reserve(size, timeout_s=0)
            writer.commit()
            reader.release(reader.poll().end)
            filler -= RECORD_HEADER_SIZE_BYTES + align_up(size)
        for _ in range(fits):
            writer.reserve(body, timeout_s=0)
            writer.commit()
    finally:
        reader.close()
        writer.close()
        writer.unlink()


def test_a_fixed_credit_outside_its_bounds_is_refused():
    with pytest.raises(ValueError, match="credit 0 must be from 1 to 1048576 batches"):
        ConsumerConfig("/nowhere.sock", "/tmp/results", "c0", credit=0)
    with pytest.raises(ValueError, match="credit 1048577 must be from 1 to 1048576 batches"):
        ConsumerConfig("/nowhere.sock", "/tmp/results", "c0", credit=(1 << 20) + 1)
    assert ConsumerConfig("/nowhere.sock", "/tmp/results", "c0", credit=1 << 20).credit == 1 << 20
    with pytest.raises(ValueError, match="ahead_s"):
        ConsumerConfig("/nowhere.sock", "/tmp/results", "c0", ahead_s=-1.0)
