"""The admission rule against a reference that plans by stepping through time, on seeded
random queues, and on the cases it exists for: a batch at risk of its deadline starts
first and a running one makes way; a hopeless one, priority alone, or an unknown rate move
nothing; a run that would then miss its own deadline is not stopped. The pace: its start
and rate, at the sample's limits and one short of them."""

from __future__ import annotations

import random

import pytest

from pipeline.service.admission import MIN_RATE_REQUESTS, MIN_RATE_SPAN_S, Admission, Candidate, Decision, Pace

NOW_S = 1_000_000.0


def waiting(batch_id: str, seq: int, left: int, deadline_in_s: float, priority: int = 0) -> Candidate:
    return Candidate(batch_id, seq, priority, NOW_S + deadline_in_s, left, running=False)


def running(batch_id: str, seq: int, left: int, deadline_in_s: float, priority: int = 0,
            stopping: bool = False) -> Candidate:
    return Candidate(batch_id, seq, priority, NOW_S + deadline_in_s, left, running=True, stopping=stopping)


# ---------------------------------------------------------------------- the reference


def reference(candidates: list[Candidate], slots: int, now_s: float, rate: float | None, start_s: float) -> Decision:
    """The module doc's rule, planned by stepping a clock from slot to slot."""
    # Step 1: walk the submissions; each place goes to its tenant's best batch not placed yet.
    left = {}
    for c in candidates:
        left.setdefault(c.tenant, []).append(c)
    queue = []
    for c in sorted(candidates, key=lambda c: c.seq):
        best = min(left[c.tenant], key=lambda b: (b.priority, b.seq))
        left[c.tenant].remove(best)
        queue.append(best)
    holding = [c for c in queue if c.running]
    free_now = max(0, slots - len(holding))

    def first_free(chosen):
        return [c.batch_id for c in chosen if not c.running][:free_now]

    if not rate:
        return Decision(start=first_free(queue))
    # The plan: slot k frees at `slot_free[k]`.
    slot_free = [now_s + c.left / rate for c in holding if not c.stopping][:slots]
    slot_free += [now_s] * (slots - len(slot_free))
    end = {c.batch_id: now_s + c.left / rate for c in holding}
    for c in queue:
        if not c.running:
            k = min(range(slots), key=lambda i: (slot_free[i], i))
            end[c.batch_id] = slot_free[k] + start_s + c.left / rate
            slot_free[k] = end[c.batch_id]
    urgent = [c for c in queue if not c.running and end[c.batch_id] > c.deadline_s
              and now_s + start_s + c.left / rate <= c.deadline_s]
    urgent.sort(key=lambda c: (c.deadline_s, queue.index(c)))
    freeing = free_now + sum(c.stopping for c in queue)
    preempt: list[str] = []
    for u in urgent:
        if freeing:
            freeing -= 1
            continue
        resume_s = now_s + start_s + u.left / rate
        for c in queue[::-1]:
            if c.running and not c.stopping and c.batch_id not in preempt and \
                    resume_s + start_s + c.left / rate <= c.deadline_s:
                preempt.append(c.batch_id)
                break
    order = urgent + [c for c in queue if c not in urgent]
    return Decision(first_free(order), preempt, [c.batch_id for c in urgent])


def random_queue(rng: random.Random) -> tuple[list[Candidate], int]:
    slots = rng.randint(1, 4)
    out = []
    holding = 0
    for k in range(rng.randint(0, 9)):
        is_running = holding < slots and rng.random() < 0.4
        holding += is_running
        deadline_s = NOW_S + rng.choice([rng.uniform(-10, 400), 200.0])  # equal deadlines too: their ties
        out.append(Candidate(f"b{k}", k, rng.choice([0, 0, 0, -1, 5]), deadline_s, rng.randint(0, 2000), is_running,
                             is_running and rng.random() < 0.2, rng.choice(["", "", "t1", "t2"])))
    return out, slots


@pytest.mark.parametrize("seed", range(40))
def test_the_rule_decides_as_the_reference_on_random_queues(seed):
    rng = random.Random(seed)
    for _ in range(100):
        candidates, slots = random_queue(rng)
        rate = rng.choice([None, 5.0, 20.0, 100.0])
        start_s = rng.choice([0.0, 3.0, 30.0])
        policy = Admission(slots)
        decision = policy.decide(candidates, NOW_S, rate, start_s)
        policy.check_invariants(candidates, decision)
        assert decision == reference(candidates, slots, NOW_S, rate, start_s)


# ---------------------------------------------------------------------- the cases


def test_a_short_deadline_behind_a_long_job_makes_it_give_way():
    long = running("long", 1, left=1000, deadline_in_s=86_400)  # 100 s of work at 10/s, a day to do it
    short = waiting("short", 2, left=50, deadline_in_s=30)  # 5 s of work, due in 30 s: behind long, at 105 s
    decision = Admission(1).decide([long, short], NOW_S, rate_rps=10.0, start_s=2.0)
    assert decision == Decision(start=[], preempt=["long"], urgent=["short"])
    # Next tick: the long run is stopping; nothing more stops, and once its slot is free the short one starts.
    stopping = running("long", 1, left=990, deadline_in_s=86_400, stopping=True)
    assert Admission(1).decide([stopping, short], NOW_S, 10.0, 2.0).preempt == []
    stopped = waiting("long", 1, left=990, deadline_in_s=86_400)
    assert Admission(1).decide([stopped, short], NOW_S, 10.0, 2.0).start == ["short"]


def test_urgent_batches_start_by_earliest_deadline():
    # 21 s each: in queue order b would end at 42 s (due at 25) and c at 63 s (due at 40).
    queue = [waiting("a", 1, 200, 60), waiting("c", 2, 200, 40), waiting("b", 3, 200, 25), waiting("d", 4, 200, 500)]
    decision = Admission(1).decide(queue, NOW_S, rate_rps=10.0, start_s=1.0)
    assert decision.urgent == ["b", "c"] and decision.start == ["b"]


def test_a_batch_that_cannot_make_it_even_now_keeps_its_place():
    long = running("long", 1, left=1000, deadline_in_s=86_400)
    hopeless = waiting("hopeless", 2, left=500, deadline_in_s=10)  # 50 s of work due in 10
    assert Admission(1).decide([long, hopeless], NOW_S, 10.0, 2.0) == Decision()


def test_a_run_that_would_miss_its_own_deadline_does_not_give_way():
    tight = running("tight", 1, left=400, deadline_in_s=45)  # 40 s left, due in 45: the short one's 7 s make it late
    short = waiting("short", 2, left=50, deadline_in_s=30)
    decision = Admission(1).decide([tight, short], NOW_S, 10.0, 2.0)
    assert decision.urgent == ["short"] and decision.preempt == []


def test_priority_orders_the_queue_but_stops_no_run():
    busy = running("busy", 1, left=1000, deadline_in_s=86_400)
    later = waiting("later", 2, left=10, deadline_in_s=86_400)
    sooner = waiting("sooner", 3, left=10, deadline_in_s=86_400, priority=-5)
    assert Admission(1).decide([busy, later, sooner], NOW_S, 10.0, 2.0) == Decision()
    assert Admission(3).decide([busy, later, sooner], NOW_S, 10.0, 2.0).start == ["sooner", "later"]


def test_a_tenants_priority_reorders_its_own_batches_only():
    mine_late = waiting("mine-late", 1, 10, 86_400, priority=0)
    theirs = Candidate("theirs", 2, 0, NOW_S + 86_400, 10, running=False, tenant="other")
    mine_urgent = waiting("mine-raised", 3, 10, 86_400, priority=-1_000_000)
    # The raised batch takes its tenant's first place (1), never the other tenant's (2).
    assert Admission(3).decide([mine_late, theirs, mine_urgent], NOW_S, None, 0.0).start == \
        ["mine-raised", "theirs", "mine-late"]
    assert Admission(1).decide([mine_late, theirs, mine_urgent], NOW_S, None, 0.0).start == ["mine-raised"]
    lone = [waiting("a", 1, 10, 86_400), waiting("b", 2, 10, 86_400, priority=-1)]
    assert Admission(2).decide(lone, NOW_S, None, 0.0).start == ["b", "a"]  # one tenant: priority, then order


def test_without_a_rate_the_queue_order_stands():
    long = running("long", 1, left=1000, deadline_in_s=86_400)
    short = waiting("short", 2, left=50, deadline_in_s=1)
    assert Admission(1).decide([long, short], NOW_S, None, 0.0) == Decision()
    assert Admission(2).decide([long, short], NOW_S, None, 0.0).start == ["short"]


def test_a_stopping_slot_counts_as_freeing():
    # u2 would start when u1 ends (11 s) and end at 22 s, due at 15: urgent, and x's freeing slot is its.
    queue = [running("x", 1, 1000, 86_400, stopping=True), running("y", 2, 1000, 86_400),
             waiting("u1", 3, 100, 20), waiting("u2", 4, 100, 15)]
    decision = Admission(2).decide(queue, NOW_S, 10.0, 1.0)
    assert decision == Decision(start=[], preempt=[], urgent=["u2"])


# ---------------------------------------------------------------------- the pace


def test_the_pace_measures_a_runs_start_and_then_its_rate():
    pace = Pace()
    pace.started("b", 100.0, done=0)
    pace.observe("b", 101.0, done=0)
    assert (pace.rate_rps, pace.start_s) == (None, 0.0)
    pace.observe("b", 104.0, done=8)  # the first answers, 4 s after the start
    assert pace.start_s == 4.0 and pace.rate_rps is None
    pace.observe("b", 104.0 + MIN_RATE_SPAN_S, done=8 + MIN_RATE_REQUESTS)  # at both limits: a rate
    assert pace.rate_rps == pytest.approx(MIN_RATE_REQUESTS / MIN_RATE_SPAN_S)


@pytest.mark.parametrize("span_s, answers", [(MIN_RATE_SPAN_S - 0.01, MIN_RATE_REQUESTS),
                                             (MIN_RATE_SPAN_S, MIN_RATE_REQUESTS - 1)])
def test_a_sample_short_of_either_limit_is_no_rate(span_s, answers):
    pace = Pace()
    pace.started("b", 0.0, done=0)
    pace.observe("b", 1.0, done=1)
    pace.observe("b", 1.0 + span_s, done=1 + answers)
    assert pace.rate_rps is None


def test_a_stopped_run_is_forgotten_and_a_resumed_one_measured_again():
    pace = Pace()
    pace.started("b", 0.0, done=0)
    pace.stopped("b")
    pace.observe("b", 5.0, done=100)
    assert (pace.rate_rps, pace.start_s) == (None, 0.0)
    pace.started("b", 10.0, done=100)
    pace.observe("b", 12.0, done=110)
    assert pace.start_s == 2.0
