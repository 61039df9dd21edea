"""Which batches run, and which one makes way: the service's admission rule. Pure: the
scheduler passes the time and what it measured; nothing here reads a clock or a file.

The rule, for `slots` runs at once:
1. Queue order: submission order, each tenant's batches then ordered among themselves by
   priority (their metadata's "priority", in vLLM's sense: the lower, the sooner; 0 when not
   given): a tenant's batches take the places its batches were submitted at, the one of
   highest priority the first of them. So a priority raises a batch past its own tenant's,
   never past another tenant's (any key could name one). With one tenant (a server without
   keys) it is priority, then submission order.
2. The plan in queue order: a running batch keeps its slot until its requests left are
   answered (left / rate_rps); a waiting batch takes the first slot to free and needs the
   start of a run (start_s) and its own requests. A batch whose planned end passes its
   deadline is *at risk*.
3. An at-risk batch that would still meet its deadline if it started now is *urgent*.
   Urgent batches start first, by earliest deadline (EDF: on one queue, the order that
   meets every deadline that can be met). An urgent batch that finds no slot free or
   freeing makes a running one give way: the latest in queue order that would still meet
   its own deadline resumed after the urgent one (the scheduler stops it gracefully: what
   it answered is kept, and it resumes when a slot frees). A batch that cannot meet its
   deadline even now keeps its place in the queue: moving it ahead would only make others
   late too.
4. Free slots then go to the urgent batches, then to the rest in queue order.
Without a measured rate nothing is at risk (nothing says how long a batch takes), and
priority alone never stops a run: it orders the queue.

Below this rule, on the node every run shares (`runtime/node.py`), dispatch is prefix order:
the broker takes the running batches' queued requests together by shape, so batches that
share system prompts share the engines' cache. A run keeps at most a window of its requests
queued (`runtime/attached.py`'s NODE_WINDOW_ITEMS), so a run that stops to make way keeps
the engines only while that window drains, and then the urgent batch's requests are what the
node dispatches: earliest deadline first where a deadline is at risk,
prefix order otherwise. `rate_rps` is a run's rate as measured while sharing the node.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class Candidate:
    """A batch not ended, as admission sees it."""

    batch_id: str
    seq: int  # submission order
    priority: int  # the lower, the sooner
    deadline_s: float  # Unix seconds
    left: int  # requests not yet answered
    running: bool  # its run holds a slot (stopping ones too)
    stopping: bool = False  # asked to stop (a preemption, or a cancel): its slot is freeing
    tenant: str = ""  # whose it is: its priority orders its tenant's batches only

    @property
    def queue_key(self) -> tuple[int, int]:
        return (self.priority, self.seq)


@dataclass(slots=True)
class Decision:
    """What the scheduler does this tick: stop `preempt` (gracefully), start `start` in order;
    `urgent`: the batches at risk that can still make it (for the log and the metrics)."""

    start: list[str] = field(default_factory=list)
    preempt: list[str] = field(default_factory=list)
    urgent: list[str] = field(default_factory=list)


class Admission:
    """See the module's doc. `rate_rps`: requests a run answers per second (None: not
    measured yet); `start_s`: what a run takes to start before its first answer."""

    def __init__(self, slots: int) -> None:
        assert slots >= 1, slots
        self.slots = slots

    def decide(self, candidates: list[Candidate], now_s: float, rate_rps: float | None,
               start_s: float) -> Decision:
        queue = queue_order(candidates)
        if rate_rps is None or rate_rps <= 0:
            return Decision(start=self._fill(queue, [], self._free(queue)))
        ends = plan_ends(queue, self.slots, now_s, rate_rps, start_s)
        place = {c.batch_id: k for k, c in enumerate(queue)}  # an urgent tie: queue order
        urgent = sorted((c for c in queue if not c.running and ends[c.batch_id] > c.deadline_s
                         and now_s + start_s + c.left / rate_rps <= c.deadline_s),
                        key=lambda c: (c.deadline_s, place[c.batch_id]))
        freeing = self._free(queue) + sum(1 for c in queue if c.stopping)
        preempt: list[str] = []
        for u in urgent:
            if freeing > 0:  # a slot free now, or freeing: no run needs to stop for it
                freeing -= 1
                continue
            victim = self._victim(queue, preempt, now_s + start_s + u.left / rate_rps, rate_rps, start_s)
            if victim is not None:
                preempt.append(victim)
        return Decision(self._fill(queue, urgent, self._free(queue)), preempt, [c.batch_id for c in urgent])

    @staticmethod
    def _victim(queue: list[Candidate], taken: list[str], resume_s: float, rate_rps: float,
                start_s: float) -> str | None:
        """The running batch to make way, latest in queue order first: one not stopping yet,
        that still meets its deadline resumed at `resume_s` (when the urgent one ends)."""
        for c in reversed(queue):
            if (c.running and not c.stopping and c.batch_id not in taken
                    and resume_s + start_s + c.left / rate_rps <= c.deadline_s):
                return c.batch_id
        return None

    def _free(self, queue: list[Candidate]) -> int:
        return max(0, self.slots - sum(1 for c in queue if c.running))

    @staticmethod
    def _fill(queue: list[Candidate], first: list[Candidate], free: int) -> list[str]:
        chosen: list[str] = []
        for c in [*first, *queue]:
            if len(chosen) == free:
                break
            if not c.running and c.batch_id not in chosen:
                chosen.append(c.batch_id)
        return chosen

    def check_invariants(self, candidates: list[Candidate], decision: Decision) -> None:
        """What any decision keeps: it starts only waiting batches, never more than the free
        slots; it stops only running ones not already stopping, and never an urgent one."""
        by_id = {c.batch_id: c for c in candidates}
        assert len(set(decision.start)) == len(decision.start)
        assert all(not by_id[b].running for b in decision.start)
        assert len(decision.start) <= self._free(list(candidates))
        assert all(by_id[b].running and not by_id[b].stopping for b in decision.preempt)
        assert all(not by_id[b].running for b in decision.urgent)
        assert len(decision.preempt) <= len(decision.urgent)


def queue_order(candidates: list[Candidate]) -> list[Candidate]:
    """The rule's step 1: submission order, each tenant's places filled with its own batches
    by (priority, submission)."""
    by_seq = sorted(candidates, key=lambda c: c.seq)
    places: dict[str, list[int]] = {}
    for place, c in enumerate(by_seq):
        places.setdefault(c.tenant, []).append(place)
    queue: list[Candidate] = list(by_seq)
    for tenant, taken in places.items():
        mine = sorted((by_seq[place] for place in taken), key=lambda c: c.queue_key)
        for place, c in zip(taken, mine):
            queue[place] = c
    return queue


class Pace:
    """A run's requests per second and what a run takes from its start to its first answer,
    as the scheduler's polls show them (each poll tells the time: nothing here reads a
    clock). Both are moving averages over the runs seen, so a slower model or a loaded
    machine shows within a few polls."""

    def __init__(self) -> None:
        self.rate_rps: float | None = None
        self._start_s: float | None = None
        self._runs: dict[str, _Run] = {}

    @property
    def start_s(self) -> float:
        return self._start_s or 0.0

    def started(self, batch_id: str, now_s: float, done: int) -> None:
        self._runs[batch_id] = _Run(now_s, done)

    def stopped(self, batch_id: str) -> None:
        self._runs.pop(batch_id, None)

    def observe(self, batch_id: str, now_s: float, done: int) -> None:
        run = self._runs.get(batch_id)
        if run is None or done <= run.done:
            return
        if run.first_s is None:  # its first answer: the start is measured, the rate from here
            run.first_s, run.first_done = now_s, done
            self._start_s = _mean(self._start_s, now_s - run.started_s)
        elif now_s - run.first_s >= MIN_RATE_SPAN_S and done - run.first_done >= MIN_RATE_REQUESTS:
            self.rate_rps = _mean(self.rate_rps, (done - run.first_done) / (now_s - run.first_s))
            run.first_s, run.first_done = now_s, done
        run.done = done


@dataclass(slots=True)
class _Run:
    started_s: float
    done: int
    first_s: float | None = None
    first_done: int = 0


# A rate is measured over at least this long and this many answers: one batch of answers
# landing at once is not a rate.
MIN_RATE_SPAN_S = 2.0
MIN_RATE_REQUESTS = 16
# The weight of a new measurement in the moving averages.
PACE_WEIGHT = 0.3


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - PACE_WEIGHT) * old + PACE_WEIGHT * new


def plan_ends(queue: list[Candidate], slots: int, now_s: float, rate_rps: float, start_s: float) -> dict[str, float]:
    """Each batch's planned end in `queue`'s order: running ones where they are, then each
    waiting one on the first slot to free (a heap of the slots' free times)."""
    ends: dict[str, float] = {}
    free_at: list[float] = []
    for c in queue:
        if c.running:
            ends[c.batch_id] = now_s + c.left / rate_rps
            if not c.stopping:
                free_at.append(ends[c.batch_id])
    free_at = sorted(free_at)[:slots] + [now_s] * max(0, slots - len(free_at))
    heapq.heapify(free_at)
    for c in queue:
        if not c.running:
            begin = heapq.heappop(free_at)
            ends[c.batch_id] = begin + start_s + c.left / rate_rps
            heapq.heappush(free_at, ends[c.batch_id])
    return ends
