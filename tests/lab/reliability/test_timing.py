"""The kill campaigns' figures (lab/reliability/timing.py): percentiles, and the items a
lost consumer's loss sent back, read off results lines, against a simulated one-lane broker."""

from __future__ import annotations

import random

from lab.reliability.timing import Line, Loss, percentiles, redeliveries
from pipeline.wire.layouts.frames import make_item_id


def test_percentiles_are_nearest_rank():
    assert percentiles([]) == {"n": 0, "p50": None, "p99": None, "max": None}
    values = [float(v) for v in range(1, 101)]
    random.Random(0).shuffle(values)
    assert percentiles(values) == {"n": 100, "p50": 50.0, "p99": 99.0, "max": 100.0}
    assert percentiles([3.0]) == {"n": 1, "p50": 3.0, "p99": 3.0, "max": 3.0}


def _one_lane(producers: int, items: int, batch: int, lost_at: int, seed: int, a_takes: int = 3):
    """A FIFO lane of `producers`' items interleaved, one batch handed out per tick (time 10
    x tick): to consumer a on even ticks, which completes it `a_takes` ticks later, else to b,
    which completes it within its tick. At tick `lost_at` (before its batch) a is lost: the
    batches it has not completed go back to the front of the lane, in order, and every later
    batch goes to b. Returns the results lines and the ids sent back."""
    rng = random.Random(seed)
    counters = [0] * producers
    lane = []
    for _ in range(items):
        p = rng.randrange(producers)
        lane.append(make_item_id(p + 1, counters[p]))
        counters[p] += 1
    lines, sent_back, tick = [], set(), 0
    a_batches: list[tuple[int, list[int]]] = []
    while lane:
        if tick == lost_at:
            held = [(t, ids) for t, ids in a_batches if t + a_takes > lost_at]
            sent_back = {i for _, ids in held for i in ids}
            lane = [i for _, ids in held for i in ids] + lane
            lines += [Line(i, "a", t * 10, (t + a_takes) * 10) for t, ids in a_batches if t + a_takes <= lost_at
                      for i in ids]
        taken, lane = lane[:batch], lane[batch:]
        if tick < lost_at and tick % 2 == 0:
            a_batches.append((tick, taken))
        else:
            lines += [Line(i, "b", tick * 10, tick * 10 + 7) for i in taken]
        tick += 1
    return lines, sent_back


def test_redelivered_items_are_found_exactly_on_one_lane():
    for seed in range(20):
        takes = 3 + seed % 4  # a holds one or two batches at the loss
        lines, sent_back = _one_lane(producers=1, items=400, batch=8, lost_at=22, seed=seed, a_takes=takes)
        (found,) = redeliveries(lines, [Loss("a", "kill", 22 * 10 - 5, 10**9)])
        assert sent_back and found.items == len(sent_back)
        last = max(line.done_ns for line in lines if line.item_id in sent_back)
        assert found.latency_s == (last - (22 * 10 - 5)) / 1e9


def test_with_several_producers_an_item_is_told_by_its_own_producers_order():
    """An item whose producer had no later item handed out before the loss looks fresh:
    found never exceeds what was sent back, and finds most of it."""
    for seed in range(20):
        lines, sent_back = _one_lane(producers=2 + seed % 2, items=400, batch=8, lost_at=22, seed=seed, a_takes=5)
        (found,) = redeliveries(lines, [Loss("a", "kill", 22 * 10 - 5, 10**9)])
        assert len(sent_back) // 2 <= found.items <= len(sent_back)


def test_a_loss_holding_nothing_finds_nothing():
    lines, sent_back = _one_lane(producers=2, items=200, batch=8, lost_at=12, seed=3, a_takes=1)
    (found,) = redeliveries(lines, [Loss("a", "kill", 12 * 10 - 5, 10**9)])
    assert not sent_back and found.items == 0 and found.latency_s is None


def test_the_latest_batch_handed_out_cannot_be_told_and_is_never_overcounted():
    """a lost holding the last batch dispatched before the loss: nothing dispatched earlier
    has a later sequence, so its items look fresh. The campaign compares the count with the
    broker's items_returned and says so."""
    lines, sent_back = _one_lane(producers=1, items=400, batch=8, lost_at=21, seed=1)
    (found,) = redeliveries(lines, [Loss("a", "kill", 21 * 10 - 5, 10**9)])
    assert len(sent_back) == 8 and found.items == 0


def test_only_the_window_until_the_next_fault_counts():
    lines, sent_back = _one_lane(producers=1, items=400, batch=8, lost_at=22, seed=1)
    # The next fault comes before the redelivered batches are handed out: none is this loss's.
    (found,) = redeliveries(lines, [Loss("a", "kill", 22 * 10 - 5, 22 * 10 - 1)])
    assert sent_back and found.items == 0
    # A paused consumer's batches cannot be handed out before its silence is judged: judged
    # from later, the same lines give the same answer.
    (paused,) = redeliveries(lines, [Loss("a", "stop", 22 * 10 - 5, 10**9, returned_ns=22 * 10 - 1)])
    assert paused.items == len(sent_back)


def test_a_soak_judges_only_the_losses_whose_redelivery_it_can_measure():
    from lab.reliability.soak import judged_redeliveries

    rows = [{"items": 32, "returned_by_broker": 32, "latency_s": 0.1, "broker_restarted": False},
            {"items": 0, "returned_by_broker": 32, "latency_s": None, "broker_restarted": False},  # mixed-feed items
            {"items": 88, "returned_by_broker": 32, "latency_s": 56.8, "broker_restarted": False},  # not only its own
            {"items": 32, "returned_by_broker": 32, "latency_s": 9.0, "broker_restarted": True}]
    assert judged_redeliveries(rows) == ([0.1], {"premise not held": 2, "broker restarted in the window": 1})
