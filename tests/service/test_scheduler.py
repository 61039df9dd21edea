"""The scheduler over the real store and a scripted executor, its clock a number: batches
start in submission order within the concurrency limit, a cancel and a deadline stop a run
and end with a line per request, a failing job is retried then fails, and a restart resumes
what ran. No process runs: the executor is a script of what a job would do."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from pipeline.service.limits import MAX_JOB_FAILURES
from pipeline.service.objects import HTTP_CONFLICT, BatchCreate
from pipeline.service.runner import (
    ANSWERED_ALL,
    ENDED,
    FAILED,
    RUNNING,
    STOPPED,
    WAITING,
    Answers,
    BatchRun,
    Executor,
    Progress,
)
from pipeline.service.scheduler import Scheduler
from pipeline.service.store import Store
from pipeline.wire.errors import ApiError

WINDOW_S = 1000
OWNER = "team-a"
QUOTA = 1 << 30


class Script(Executor):
    """What each batch's job does, as the test says: `answer` and `end` move it on."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.tidied: list[list[str]] = []  # each `tidy`'s batches

    def start(self, run: BatchRun) -> bool:
        self.calls.append(("start", run.batch_id))
        self.jobs[run.batch_id] = {"state": RUNNING, "answered": set(), "outcome": None}
        return True

    def resume(self, run: BatchRun) -> bool:
        self.calls.append(("resume", run.batch_id))
        job = self.jobs.setdefault(run.batch_id, {"answered": set()})
        job.update(state=RUNNING, outcome=None)
        return True

    def poll(self, run: BatchRun) -> Progress:
        job = self.jobs.get(run.batch_id)
        if job is None:
            return Progress(WAITING)
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        progress = Progress(job["state"], len(job["answered"]), 0, usage, job["outcome"])
        if job["state"] == ENDED:  # said once
            job["state"] = WAITING
        return progress

    def forget(self, run: BatchRun) -> None:
        self.calls.append(("forget", run.batch_id))

    def tidy(self, runs) -> None:
        self.tidied.append([run.batch_id for run in runs()])

    def cancel(self, run: BatchRun) -> None:
        self.calls.append(("cancel", run.batch_id))
        job = self.jobs.get(run.batch_id)
        if job is not None and job["state"] == RUNNING:
            job.update(state=ENDED, outcome=STOPPED)

    def answers(self, run: BatchRun) -> Answers:
        job = self.jobs.get(run.batch_id, {"answered": set()})
        os.makedirs(run.work_dir, exist_ok=True)
        path = os.path.join(run.work_dir, "out.jsonl")
        with open(path, "wb") as f:
            for index in sorted(job["answered"]):
                f.write(json.dumps({"custom_id": f"r{index}", "response": {"status_code": 200}}).encode() + b"\n")
        bits = np.zeros((run.requests + 7) // 8, dtype=np.uint8)
        for index in job["answered"]:
            bits[index >> 3] |= 1 << (index & 7)
        return Answers(path, os.path.getsize(path), None, 0, bits, completed=len(job["answered"]))

    def discard(self, run: BatchRun) -> None:
        self.calls.append(("discard", run.batch_id))

    def running(self) -> int:
        return sum(1 for job in self.jobs.values() if job["state"] == RUNNING)

    def shutdown(self, wait_s: float) -> None:
        pass

    def answer(self, batch_id: str, indices) -> None:
        self.jobs[batch_id]["answered"].update(indices)

    def end(self, batch_id: str, outcome: str) -> None:
        self.jobs[batch_id].update(state=ENDED, outcome=outcome)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path):
    opened = Store.open(str(tmp_path / "d"))
    yield opened
    opened.close()


def new_batches(store: Store, clock: Clock, count: int, requests: int = 4) -> list:
    lines = "".join(json.dumps({"custom_id": f"r{k}", "method": "POST", "url": "/v1/completions", "body": {}}) + "\n"
                    for k in range(requests)).encode()
    source = store.upload(OWNER, "in.jsonl", io.BytesIO(lines), len(lines), len(lines), QUOTA, int(clock()))
    return [store.create_batch(OWNER, BatchCreate(source.id, "/v1/completions", None), "m", WINDOW_S, 10,
                               int(clock())) for _ in range(count)]


def content(store: Store, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    with open(store.content_path(file_id)) as f:
        return [json.loads(line) for line in f]


def test_a_run_that_ends_wakes_the_scheduler(store):
    script = Script()
    scheduler = Scheduler(store, script, max_concurrent=1, clock=Clock())
    assert not scheduler._wake.is_set()
    script.on_end()
    assert scheduler._wake.is_set()


def test_batches_start_in_submission_order_within_the_limit(store):
    clock, script = Clock(), Script()
    scheduler = Scheduler(store, script, max_concurrent=1, clock=clock)
    first, second, third = new_batches(store, clock, 3)
    scheduler.tick()
    assert script.calls == [("start", first.id)]
    scheduler.tick()
    assert first.life.status == "in_progress" and second.life.status == "validating"
    script.answer(first.id, range(4))
    script.end(first.id, ANSWERED_ALL)
    scheduler.tick()
    assert first.life.status == "completed" and (first.completed, first.failed) == (4, 0)
    assert [row["custom_id"] for row in content(store, first.output_file_id)] == ["r0", "r1", "r2", "r3"]
    assert first.error_file_id is None
    assert script.calls[-2:] == [("discard", first.id), ("start", second.id)]
    assert third.life.status == "validating"


def test_a_waiting_batch_past_its_deadline_expires_without_running(store):
    clock, script = Clock(), Script()
    scheduler = Scheduler(store, script, max_concurrent=1, clock=clock)
    running, waiting = new_batches(store, clock, 2)
    scheduler.tick()
    script.answer(running.id, [0, 2])
    clock.now += WINDOW_S
    scheduler.tick()  # both due: the running one is told to stop, the waiting one ends at once
    assert ("cancel", running.id) in script.calls and ("start", waiting.id) not in script.calls
    assert waiting.life.status == "expired" and waiting.output_file_id is None
    assert [row["error"]["code"] for row in content(store, waiting.error_file_id)] == ["batch_expired"] * 4
    scheduler.tick()  # the stopped run's answers are its output
    assert running.life.status == "expired" and running.completed == 2
    assert [row["custom_id"] for row in content(store, running.output_file_id)] == ["r0", "r2"]
    assert [row["custom_id"] for row in content(store, running.error_file_id)] == ["r1", "r3"]


def test_a_cancel_stops_the_run_and_ends_with_a_line_per_request(store):
    clock, script = Clock(), Script()
    scheduler = Scheduler(store, script, max_concurrent=1, clock=clock)
    (batch,) = new_batches(store, clock, 1)
    scheduler.tick()
    script.answer(batch.id, [1])
    scheduler.cancel(OWNER, batch.id)
    assert batch.life.status == "cancelling"
    scheduler.tick()
    # Its queued requests are not run, then its run stops.
    assert script.calls.index(("forget", batch.id)) < script.calls.index(("cancel", batch.id))
    scheduler.tick()
    assert batch.life.status == "cancelled"
    assert [row["custom_id"] for row in content(store, batch.output_file_id)] == ["r1"]
    assert {row["error"]["code"] for row in content(store, batch.error_file_id)} == {"batch_cancelled"}
    with pytest.raises(ApiError, match="Cannot cancel a batch with status 'cancelled'") as refused:
        scheduler.cancel(OWNER, batch.id)
    assert refused.value.status == HTTP_CONFLICT


def test_every_tick_tidies_after_the_batches_not_ended(store):
    clock, script = Clock(), Script()
    scheduler = Scheduler(store, script, max_concurrent=1, clock=clock)
    first, second = new_batches(store, clock, 2)
    scheduler.tick()
    assert script.tidied[-1] == [first.id, second.id]  # the waiting one's job may have run before
    script.answer(first.id, range(4))
    script.end(first.id, ANSWERED_ALL)
    while first.life.status != "completed":
        scheduler.tick()
    scheduler.tick()
    assert script.tidied[-1] == [second.id]  # an ended batch's job reads nothing more


def test_a_failing_job_is_resumed_then_fails_the_batch(store):
    clock, script = Clock(), Script()
    scheduler = Scheduler(store, script, max_concurrent=1, clock=clock)
    (batch,) = new_batches(store, clock, 1)
    scheduler.tick()
    for attempt in range(1, MAX_JOB_FAILURES + 1):
        script.end(batch.id, FAILED)
        scheduler.tick()
        assert batch.job_failures == attempt
    assert batch.life.status == "failed" and batch.errors[0]["code"] == "job_failed"
    assert script.calls[-2:] == [("forget", batch.id), ("discard", batch.id)]
    assert [call for call, _ in script.calls if call in ("start", "resume")] == \
        ["start"] + ["resume"] * (MAX_JOB_FAILURES - 1)


def test_a_restart_reads_the_records_and_resumes_what_ran(tmp_path):
    clock, script = Clock(), Script()
    store = Store.open(str(tmp_path / "d"))
    (batch,) = new_batches(store, clock, 1)
    Scheduler(store, script, max_concurrent=1, clock=clock).tick()
    Scheduler(store, script, max_concurrent=1, clock=clock).tick()
    assert batch.life.status == "in_progress"
    script.answer(batch.id, [0])
    store.close()  # as a kill leaves it: the job stopped, its answers kept
    script.jobs[batch.id]["state"] = WAITING
    again = Store.open(str(tmp_path / "d"))
    try:
        (found,) = again.unfinished()
        assert (found.id, found.life.status, found.total) == (batch.id, "in_progress", 4)
        scheduler = Scheduler(again, script, max_concurrent=1, clock=clock)
        scheduler.recover()
        assert found.completed == 1  # from the job's files, before anything runs
        scheduler.tick()
        assert script.calls[-1] == ("resume", batch.id)
    finally:
        again.close()


def batch_of(store: Store, clock: Clock, requests: int, window_s: int, metadata: dict | None = None):
    lines = "".join(json.dumps({"custom_id": f"r{k}", "method": "POST", "url": "/v1/completions", "body": {}}) + "\n"
                    for k in range(requests)).encode()
    source = store.upload(OWNER, "in.jsonl", io.BytesIO(lines), len(lines), len(lines), QUOTA, int(clock()))
    return store.create_batch(OWNER, BatchCreate(source.id, "/v1/completions", metadata), "m", window_s, 10,
                              int(clock()))


def test_a_batch_at_risk_of_its_deadline_runs_first_and_the_long_one_resumes(store):
    clock, script = Clock(), Script()
    scheduler = Scheduler(store, script, max_concurrent=1, clock=clock)
    long = batch_of(store, clock, 400, WINDOW_S)
    scheduler.tick()
    clock.now += 1
    script.answer(long.id, range(10))
    scheduler.tick()  # its first answers: a run starts in 1 s
    clock.now += 2
    script.answer(long.id, range(50))
    scheduler.tick()  # 40 answers in 2 s: 20 a second, 350 left (17.5 s)
    assert (scheduler.pace.start_s, scheduler.pace.rate_rps) == (1.0, 20.0)
    short = batch_of(store, clock, 40, 10)  # 2 s of work, due in 10: behind the long one it ends at 21.5 s
    scheduler.tick()
    assert script.calls[-1] == ("cancel", long.id) and long.id in scheduler.preempted
    assert ("forget", long.id) not in script.calls  # made way: its requests stay queued, to resume
    scheduler.tick()  # the long run stopped; the short one takes its slot
    assert script.calls[-1] == ("start", short.id) and long.life.status == "in_progress"
    clock.now += 3
    script.answer(short.id, range(40))
    script.end(short.id, ANSWERED_ALL)
    scheduler.tick()
    assert short.life.status == "completed" and short.life.completed_at <= short.life.expires_at
    assert script.calls[-1] == ("resume", long.id)
    script.answer(long.id, range(400))
    script.end(long.id, ANSWERED_ALL)
    scheduler.tick()
    assert long.life.status == "completed" and long.completed == 400


def test_priority_orders_the_waiting_batches(store):
    clock, script = Clock(), Script()
    scheduler = Scheduler(store, script, max_concurrent=1, clock=clock)
    first = batch_of(store, clock, 4, WINDOW_S)
    later = batch_of(store, clock, 4, WINDOW_S)
    sooner = batch_of(store, clock, 4, WINDOW_S, {"priority": "-1"})
    scheduler.tick()
    assert script.calls == [("start", sooner.id)]
    script.answer(sooner.id, range(4))
    script.end(sooner.id, ANSWERED_ALL)
    scheduler.tick()
    assert script.calls[-1] == ("start", first.id) and later.life.status == "validating"
