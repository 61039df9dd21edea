"""The scheduler: one thread that owns every batch's execution, every SCHEDULER_TICK_S.

Each tick, for each batch not ended, in submission order:
- a deadline passed: the batch is to stop (`expire`); a stop (expire, cancel) asks the
  executor to stop its run gracefully;
- its run's progress (the executor's `poll`) moves it on: running past its input's check
  is `in_progress`; every request answered is `finalizing`; a run that failed is run again
  (it keeps what it answered) up to MAX_JOB_FAILURES times, then the batch `failed`;
- a batch finalizing, or stopping with no run left, gets its output and error files
  (`finalize.py`), and only then its terminal status (`states.py`);
then batches waiting for a slot (validating, or a run that stopped) start while fewer than
`max_concurrent` runs are going: by priority and submission order, and a batch at risk of
its deadline first, a running one making way for it where needed (`admission.py`). A restart is the same loop on the
records as they were: what ran is resumed, what was stopping is finished.

The API's threads only create records and mark cancels (`cancel`), under the store's lock;
everything that runs or writes a batch's files happens here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pipeline.batchjob.output import CODE_CANCELLED, CODE_EXPIRED
from pipeline.service.admission import Admission, Candidate, Pace
from pipeline.service.finalize import remove_quietly, write_batch_files
from pipeline.service.limits import JOB_STOP_WAIT_S, MAX_JOB_FAILURES, SCHEDULER_TICK_S
from pipeline.service.objects import HTTP_CONFLICT, BatchRecord, priority_of
from pipeline.service.runner import (
    ANSWERED_ALL,
    CHECKING,
    ENDED,
    FAILED,
    RUNNING,
    WAITING,
    BatchRun,
    Executor,
    Progress,
)
from pipeline.service.states import (
    ANSWERED,
    CANCEL,
    EXPIRE,
    FAIL,
    FINALIZED,
    FINALIZING,
    RUNNABLE,
    STOP_CANCEL,
    STOP_EXPIRE,
    VALIDATING,
)
from pipeline.service.states import RUNNING as JOB_RUNNING
from pipeline.service.store import Store, new_id
from pipeline.wire.errors import ApiError

log = logging.getLogger("pipeline.service")

STOP_CODES = {STOP_CANCEL: CODE_CANCELLED, STOP_EXPIRE: CODE_EXPIRED}
# Progress states of a run that holds one of the max_concurrent slots.
HOLDS_SLOT = (RUNNING, CHECKING)


class Scheduler:
    """See the module's doc. `clock`: Unix seconds (a test's own)."""

    def __init__(self, store: Store, executor: Executor, max_concurrent: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.executor = executor
        self.max_concurrent = max_concurrent
        self.clock = clock
        self.last: dict[str, Progress] = {}  # each batch's latest poll
        self.admission = Admission(max_concurrent)
        self.pace = Pace()
        self.preempted: set[str] = set()  # runs stopping to make way (admission.py)
        self._stop = threading.Event()
        # Set by a create or a cancel (and the stop): the loop's next tick comes at once, so a
        # batch starts (or stops) without waiting out the tick.
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        executor.on_end = self.wake

    # ------------------------------------------------------------------ the API's side

    def cancel(self, owner: str, batch_id: str) -> BatchRecord:
        """Mark the batch cancelling (its run stops at the next tick); ApiError 409 (a conflict
        with its state, as OpenAI's) for one that ended or is finalizing, 404 for another
        tenant's."""
        with self.store.lock:
            batch = self.store.batch(owner, batch_id)
            if not batch.life.takes(CANCEL):
                raise ApiError(HTTP_CONFLICT, f"Cannot cancel a batch with status '{batch.life.status}': only a "
                                              f"validating or in_progress batch can be cancelled", "batch_id")
            self.store.step(batch, CANCEL, int(self.clock()))
        self.wake()
        return batch

    def wake(self) -> None:
        """Tick now (a batch was created or cancelled, a run ended), not at the next SCHEDULER_TICK_S."""
        self._wake.set()

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        """Recover (in the caller's thread: the API serves every batch's progress as its job
        left it from the first request on), then run the loop in its own thread."""
        self.recover()
        self._thread = threading.Thread(target=self._main, name="scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and every run gracefully (each keeps what it answered)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def _main(self) -> None:
        """The loop; runs are started (and so stopped) from this thread alone: a child's
        parent-death signal follows the thread that started it."""
        try:
            self.executor.warm()
            while not self._stop.is_set():
                self.tick()
                self._wake.wait(SCHEDULER_TICK_S)
                self._wake.clear()
        finally:
            self.executor.shutdown(JOB_STOP_WAIT_S)

    def recover(self) -> None:
        """What a kill left between a batch's end and its work's removal, removed; every
        other batch's progress read from its job's files (nothing is started here)."""
        for batch in self.store.all_batches():
            if batch.life.ended:
                self.executor.discard(self.run_of(batch))
            else:
                self._counts(batch, self.executor.poll(self.run_of(batch)))

    def _counts(self, batch: BatchRecord, progress: Progress) -> None:
        if progress.usage is not None:  # the job's status files exist
            with self.store.lock:
                batch.completed, batch.failed = progress.done - progress.failed, progress.failed
                batch.usage = progress.usage

    def run_of(self, batch: BatchRecord) -> BatchRun:
        return BatchRun(batch.id, self.store.content_path(batch.input_file_id), self.store.work_dir(batch),
                        batch.total, self.store.kept_scan(batch.input_file_id))

    def tick(self) -> None:
        now = int(self.clock())
        for batch in self.store.unfinished():
            try:
                self._step(batch, now)
            except Exception:  # noqa: BLE001 - one batch's trouble (a full disk) stops no other; retried next tick
                log.exception("batch %s: its step failed; tried again in %.1f s", batch.id, SCHEDULER_TICK_S)
        self._admit()
        try:
            self.executor.tidy(lambda: [self.run_of(batch) for batch in self.store.unfinished()])
        except Exception:  # noqa: BLE001 - freeing disk stops no batch; tried again at the next tick
            log.exception("freeing what the batches read failed; tried again in %.1f s", SCHEDULER_TICK_S)

    def _step(self, batch: BatchRecord, now: int) -> None:
        run = self.run_of(batch)
        life = batch.life
        if life.due(now):
            self._change(batch, EXPIRE, now)
            log.info("batch %s: its completion window ended: stopping", batch.id)
        if life.stop is not None and life.status != FINALIZING:
            self.executor.forget(run)  # what it left queued is not run: the engines are free at once
            self.executor.cancel(run)
        progress = self.executor.poll(run)
        self.last[batch.id] = progress
        self._counts(batch, progress)
        if progress.state in HOLDS_SLOT:
            self.pace.observe(batch.id, self.clock(), progress.done)
        else:
            self.preempted.discard(batch.id)
            self.pace.stopped(batch.id)
        if progress.state == RUNNING and life.status == VALIDATING:
            self._change(batch, JOB_RUNNING, now)
        if progress.state == ENDED:
            self._ended(batch, progress, now)
        if life.status == FINALIZING or (life.stop is not None and progress.state in (WAITING, ENDED)):
            self._finalize(batch, run, now)

    def _ended(self, batch: BatchRecord, progress: Progress, now: int) -> None:
        life = batch.life
        if progress.outcome == ANSWERED_ALL and life.takes(ANSWERED):
            if life.status == VALIDATING:  # it ran between two ticks
                self._change(batch, JOB_RUNNING, now)
            self._change(batch, ANSWERED, now)
        elif progress.outcome == FAILED and life.stop is None:
            batch.job_failures += 1
            log.warning("batch %s: its job failed (%d of %d): %s", batch.id, batch.job_failures, MAX_JOB_FAILURES,
                        progress.message)
            if batch.job_failures >= MAX_JOB_FAILURES:
                batch.errors = [{"code": "job_failed", "message": progress.message, "param": None, "line": None}]
                self._change(batch, FAIL, now)
                self.executor.forget(self.run_of(batch))
                self.executor.discard(self.run_of(batch))
            else:
                self.store.save_batch(batch)

    def _change(self, batch: BatchRecord, event: str, now: int) -> None:
        self.store.step(batch, event, now)

    def _finalize(self, batch: BatchRecord, run: BatchRun, now: int) -> None:
        """The batch's files from what its run answered, then its terminal status (each step
        again after a kill: the ids are kept in its record first, the files rewritten whole)."""
        if not batch.reserved_ids:
            with self.store.lock:
                batch.reserved_ids = [new_id("file-"), new_id("file-")]
                self.store.save_batch(batch)
        answers = self.executor.answers(run)
        source = self.store.files[batch.input_file_id]  # an unfinished batch's input cannot be deleted
        code = STOP_CODES[batch.life.stop] if batch.life.status != FINALIZING else None
        output_id, error_id = batch.reserved_ids
        paths = [self.store.content_path(file_id) for file_id in batch.reserved_ids]
        sizes = write_batch_files(answers, run.input_path, source.digest[:12], code, *paths)
        made = []
        for file_id, size, kind in zip(batch.reserved_ids, sizes, ("output", "error")):
            if size:
                self.store.add_output(batch.owner, batch.id, file_id, f"{batch.id}_{kind}.jsonl", size, now)
                made.append(file_id)
            else:
                remove_quietly(self.store.content_path(file_id))
        with self.store.lock:  # the file ids show once the status is terminal (saved by `step`)
            batch.output_file_id = output_id if output_id in made else None
            batch.error_file_id = error_id if error_id in made else None
            batch.completed, batch.failed, batch.usage = answers.completed, answers.failed, dict(answers.usage)
            self.store.step(batch, FINALIZED, now)
        log.info("batch %s: %s (%d completed, %d failed of %d)", batch.id, batch.life.status, batch.completed,
                 batch.failed, batch.total)
        self.executor.discard(run)
        self.last.pop(batch.id, None)

    def _admit(self) -> None:
        """Start runs, and stop one where a batch at risk of its deadline needs its slot, as
        the admission rule says (admission.py)."""
        if self._stop.is_set():
            return
        now = self.clock()
        batches = {}
        candidates = []
        for batch in self.store.unfinished():
            progress = self.last.get(batch.id)
            if progress is None:
                continue
            running = progress.state in HOLDS_SLOT
            # BUSY: a run an earlier server started still stops; it is resumed once it let go.
            resumable = progress.state == WAITING or (progress.state == ENDED and progress.outcome != ANSWERED_ALL)
            if not running and (batch.life.status not in RUNNABLE or batch.life.stop is not None or not resumable):
                continue
            batches[batch.id] = batch
            stopping = running and (batch.life.stop is not None or batch.id in self.preempted)
            candidates.append(Candidate(batch.id, batch.seq, priority_of(batch.metadata), batch.life.expires_at,
                                        max(0, batch.total - batch.completed - batch.failed), running, stopping,
                                        batch.owner))
        decision = self.admission.decide(candidates, now, self.pace.rate_rps, self.pace.start_s)
        for batch_id in decision.preempt:
            log.warning("batch %s: stops for batch %s, whose deadline is at risk; it resumes when a slot frees",
                     batch_id, decision.urgent[0])
            self.preempted.add(batch_id)
            self.executor.cancel(self.run_of(batches[batch_id]))
        for batch_id in decision.start:
            batch = batches[batch_id]
            ran = self.last[batch_id].usage is not None or batch.job_failures  # its job's files exist
            if (self.executor.resume if ran else self.executor.start)(self.run_of(batch)):
                self.pace.started(batch_id, now, batch.completed + batch.failed)
