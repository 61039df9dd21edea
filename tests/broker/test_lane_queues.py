"""LaneTable (pipeline/broker/lanes/queues.py) on its own: its min/max windows against a brute
force over plain lists, through every queue event in random order. Deterministic seeds."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from pipeline.broker.lanes.queues import NOTHING_QUEUED, LaneTable, group_suffix_minima
from tests.support.lanes_audit import check_windows


def test_group_suffix_minima_docstring_example():
    keys = np.array([5, 9, 7, 7, 4, 3])
    group = np.array([0, 0, 0, 0, 1, 1])
    entries, bounds = group_suffix_minima(keys, group, np.array([10, 96]))
    assert entries == [(10, 5), (13, 7), (101, 3)] and bounds == [0, 2, 3]


def test_module_docstring_example():
    table = LaneTable()
    lane = table.grow()
    table.target[lane] = 505
    for length in (505, 490, 500):
        table.enqueue(lane, length, 0.0)
    assert list(table.mins[lane]) == [(1, 490), (2, 500)]
    assert list(table.maxs[lane]) == [(0, -505), (2, -500)]
    table.dispatch(lane, [505])
    assert (table.front_min(lane), table.front_max(lane)) == (490, 500)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_windows_match_brute_force_through_every_event(seed):
    """Single and bulk enqueues (fold_all), dispatches across the returned/main boundary,
    returns and completions on a few lanes, checked after every step; then release."""
    rng = np.random.default_rng(seed)
    table = LaneTable()
    lanes = [table.grow() for _ in range(4)]
    target = 600
    for lane in lanes:
        table.target[lane] = target
    main = {lane: deque[int]() for lane in lanes}
    returned: dict[int, list[int]] = {lane: [] for lane in lanes}  # front first
    pending: dict[int, list[int]] = {lane: [] for lane in lanes}  # dispatch order
    for _ in range(500):
        roll, lane = rng.random(), lanes[int(rng.integers(len(lanes)))]
        if roll < 0.3:
            length = int(rng.integers(480, target + 1))
            table.enqueue(lane, length, 1.0)
            main[lane].append(length)
        elif roll < 0.5:
            values = rng.integers(480, target + 1, int(rng.integers(1, 40)))
            into = rng.choice(lanes, values.size).astype(np.int32)
            table.fold_all(values, into, 2.0, qmin_current=False)
            for value, into_lane in zip(values.tolist(), into.tolist()):
                main[into_lane].append(value)
        elif roll < 0.75:
            count = min(int(rng.integers(1, 12)), len(returned[lane]) + len(main[lane]))
            front = returned[lane][:count]
            returned[lane] = returned[lane][count:]
            front += [main[lane].popleft() for _ in range(count - len(front))]
            table.dispatch(lane, front)
            pending[lane] += front
        elif roll < 0.9:
            count = int(rng.integers(0, len(pending[lane]) + 1))
            back = pending[lane][len(pending[lane]) - count :]
            del pending[lane][len(pending[lane]) - count :]
            table.give_back(lane, back)
            returned[lane] = back + returned[lane]
        else:
            count = int(rng.integers(0, len(pending[lane]) + 1))
            table.complete(lane, count)
            del pending[lane][:count]
        for each in lanes:
            table.check_lane(each)
            check_windows(table, each, list(main[each]), returned[each])
            assert table.pending_items[each] == len(pending[each])
    for lane in lanes:  # drain, complete and release every lane
        table.dispatch(lane, returned[lane] + list(main[lane]))
        table.complete(lane, table.pending_items[lane])
        table.release(lane)
        row = (table.target[lane], table.qmin[lane], table.queued_tokens[lane])
        assert row == (0, NOTHING_QUEUED, 0), lane
