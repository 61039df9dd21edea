"""The dispatcher's schedule of lane ticks (pipeline/broker/lanes/schedule.py) against a
reference: a dict of each key's earliest offered time, popped in time order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.broker.lanes.schedule import TickSchedule

_ops = st.lists(st.one_of(
    st.tuples(st.just("offer"), st.integers(0, 30), st.one_of(st.none(), st.integers(-5, 100).map(float))),
    st.tuples(st.just("pop"), st.integers(-5, 100).map(float), st.one_of(st.none(), st.integers(0, 5))),
), max_size=300)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_schedule_matches_the_reference(ops):
    schedule, reference = TickSchedule(), {}
    for op, a, b in ops:
        if op == "offer":
            if b is not None and (a not in reference or b < reference[a]):
                reference[a] = b
            schedule.offer(a, b)
        else:
            due = sorted((at, key) for key, at in reference.items() if at <= a)
            got = schedule.pop_due(a, b)
            assert len(got) == (len(due) if b is None else min(b, len(due)))
            assert [reference[k] for k in got] == sorted(reference[k] for k in got)  # earliest first
            assert all(reference[k] <= a for k in got)
            if got:  # nothing later was taken before something earlier
                assert max(reference[k] for k in got) <= min([at for at, key in due if key not in got] or [float("inf")])
            for key in got:
                del reference[key]
            assert schedule.any_due(a) >= bool(len(due) > len(got))
        schedule.check_invariants()
        assert len(schedule) == len(reference) and all(schedule.due_at(k) == at for k, at in reference.items())


def test_an_earlier_offer_wins_and_a_later_one_is_ignored():
    schedule = TickSchedule()
    schedule.offer("a", 5.0)
    schedule.offer("a", 7.0)
    schedule.offer("a", 2.0)
    assert schedule.pop_due(1.9) == [] and schedule.pop_due(2.0) == ["a"] and schedule.pop_due(10.0) == []
