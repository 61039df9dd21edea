"""How a batch is executed, behind one small interface the scheduler drives:

    executor.warm()           start what every run needs, before the first (the node), where kept
    executor.ready()          whether that serves (/health)
    executor.start(run)       run it
    executor.resume(run)      run it again after a stop, a failure or a restart: what was answered stays
    executor.poll(run)        its Progress: waiting, busy, checking, running, or ended (and how:
                              said once, at the poll that finds it; waiting after that)
    executor.cancel(run)      stop it gracefully: what was answered is kept
    executor.forget(run)      it ended (cancelled, expired, failed): what it left queued is not run
    executor.answers(run)     what a stopped run answered: its output and error lines, which requests
    executor.discard(run)     its work files, once the batch's own files are written
    executor.shutdown(wait_s) stop every run gracefully (the server stops)
    executor.on_end = wake    called, from any thread, when a run ends (the scheduler ticks at once)

`RunBatchExecutor` runs each batch as a `pipeline run-batch` job, a child process with its
own data directory in the batch's work folder, its output appended as answers come
(`--output-order completion`: a stop keeps every answer in it) and failures to
`--error-file`. Its progress is the job's own status files (`jobstatus.job_status`). A
job's resume is the same command: run-batch answers each request once across any number
of runs. A child gets SIGTERM (a graceful stop) if the server dies; a restarted server
waits for such a job to let go of its lock (`busy`) before it runs it again.

With a node (`pipeline.runtime.node`: one broker and its consumers, started with the first
job and kept until the executor shuts down, started again if it stopped), every job runs on
it (`run-batch --node`): its producers feed the node's broker and it reads its answers from
the node's results, so the jobs' requests meet in one prefix-ordered store and engine cache,
and no job pays an engine's start. The node's data directory is DATA_DIR/node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from pipeline.batchjob.answers import records_path
from pipeline.batchjob.jobfiles import remove_data_dir
from pipeline.batchjob.jobstatus import CHECKING, job_status
from pipeline.batchjob.layout import ANSWER_RECORD_SIZE_BYTES, LOG_ERRORS, LOG_OUTPUT, valid_records
from pipeline.batchjob.manifest import load_manifest
from pipeline.batchjob.reclaim import reclaim_results
from pipeline.batchjob.workload import job_models
from pipeline.runtime.local import stop_with_parent
from pipeline.runtime.node import NodeHandle, NodeSpec
from pipeline.runtime.settings import LaunchSettings
from pipeline.service.limits import (
    JOB_LOG_TAIL_BYTES,
    JOB_LOG_TAIL_LINES,
    NODE_RETRY_FIRST_S,
    NODE_RETRY_MAX_S,
    NODE_STABLE_S,
    RECLAIM_INTERVAL_S,
)
from pipeline.wire.errors import JobMismatchError, NodeStartError
from pipeline.wire.owners import add_ended_owner

log = logging.getLogger("pipeline.service")

# Progress states.
WAITING = "waiting"  # not running (never started, or stopped)
BUSY = "busy"  # a job an earlier server started still stops (its lock held)
CHECKING = CHECKING  # the job checks its input
RUNNING = "running"  # the job runs its requests
ENDED = "ended"  # the run ended (see its outcome): said once
# Outcomes of an ended run.
ANSWERED_ALL = "answered all"
STOPPED = "stopped"
FAILED = "failed"
# run-batch's exit statuses: every request answered; stopped by a signal (130: the
# launcher's interrupt; 128 + signal while it checked its input).
EXIT_ANSWERED = 0
EXIT_STOPPED = frozenset({130, 128 + signal.SIGTERM, 128 + signal.SIGINT, 128 + signal.SIGHUP,
                          -signal.SIGTERM, -signal.SIGINT, -signal.SIGKILL})
# A job's files in its batch's work folder.
DATA_NAME = "data"
OUTPUT_NAME = "output.jsonl"
ERRORS_NAME = "errors.jsonl"
SUMMARY_NAME = "summary.json"
LOG_NAME = "log.txt"
# Records read at a time (640 KiB).
RECORD_CHUNK = 1 << 14
# A job's token counts, as its records and status file name them.
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")


@dataclass(slots=True, frozen=True)
class BatchRun:
    """What an executor is told of a batch."""

    batch_id: str
    input_path: str
    work_dir: str
    requests: int
    input_scan: str | None = None  # the input's scan kept at upload (`prescan.py`'s prefix)


@dataclass(slots=True)
class Progress:
    state: str
    done: int = 0
    failed: int = 0
    usage: dict[str, int] | None = None
    outcome: str | None = None  # once ENDED
    message: str | None = None  # a failed run's last words


@dataclass(slots=True)
class Answers:
    """What a stopped run answered: each log's path and the bytes of it that hold whole,
    recorded answers (None: no such log), and a bit per request answered."""

    output_path: str | None
    output_bytes: int
    error_path: str | None
    error_bytes: int
    answered: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint8))
    completed: int = 0  # answers in the output (status 200)
    failed: int = 0  # answers in the error file
    usage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(USAGE_KEYS, 0))

    def is_answered(self, index: int) -> bool:
        return index >> 3 < len(self.answered) and bool(self.answered[index >> 3] >> (index & 7) & 1)


def _nothing() -> None:
    pass


class Executor(ABC):
    """See the module's doc. Called from the scheduler's thread only, but for `on_end`, which
    the executor calls from any thread."""

    on_end: Callable[[], None] = staticmethod(_nothing)

    def warm(self) -> None:
        """Start what every run needs before the first batch comes (nothing where each run
        starts its own)."""

    def ready(self) -> bool:
        """Whether what every run needs serves (the server's /health); from any thread."""
        return True

    @abstractmethod
    def start(self, run: BatchRun) -> bool:
        """Run it; False where it cannot start yet (BUSY)."""

    @abstractmethod
    def resume(self, run: BatchRun) -> bool:
        """Run what is left of it (it ran before); False where it cannot start yet (BUSY)."""

    @abstractmethod
    def poll(self, run: BatchRun) -> Progress: ...

    @abstractmethod
    def cancel(self, run: BatchRun) -> None: ...

    def forget(self, run: BatchRun) -> None:
        """The batch ended before its end (cancelled, expired, failed): its requests still
        queued are not run. Nothing to do where each run's queue goes with it."""

    def tidy(self, runs: Callable[[], list[BatchRun]]) -> None:
        """Give back what `runs()` (every batch not ended) no longer need of what runs share;
        asked each tick. Nothing where each run's files go with it."""

    @abstractmethod
    def answers(self, run: BatchRun) -> Answers: ...

    @abstractmethod
    def discard(self, run: BatchRun) -> None: ...

    @abstractmethod
    def running(self) -> int:
        """Runs started and not ended."""

    @abstractmethod
    def shutdown(self, wait_s: float) -> None: ...


class RunBatchExecutor(Executor):
    """Each batch a `pipeline run-batch` child process (the module's doc). `job_args`: the
    command line's engine and model options, the same for every job."""

    def __init__(self, job_args: list[str], node: NodeSpec | None = None) -> None:
        self.job_args = list(job_args)
        self.children: dict[str, subprocess.Popen] = {}
        self._signalled: set[str] = set()
        self.node = NodeHandle(node) if node is not None else None
        self._forgotten: set[str] = set()  # batches whose items the node skips (`forget`)
        self._node_started_s = 0.0
        self._node_failures = 0  # starts that failed, or were followed by a stop within NODE_STABLE_S
        self._node_retry_s = 0.0  # no node start before this (`clock`)
        self._reclaim_s = 0.0  # no freeing of the node's results before this (`clock`)
        self.clock: Callable[[], float] = time.monotonic  # a test's own

    def command(self, run: BatchRun) -> list[str]:
        path = run.work_dir
        node = ["--node", self.node.spec.settings.data_dir] if self.node is not None else []
        return [sys.executable, "-m", "pipeline", "run-batch", *node, "-i", run.input_path,
                "-o", os.path.join(path, OUTPUT_NAME), "--error-file", os.path.join(path, ERRORS_NAME),
                "--output-order", "completion", "--data-dir", os.path.join(path, DATA_NAME),
                "--summary-file", os.path.join(path, SUMMARY_NAME),
                *(["--input-scan", run.input_scan] if run.input_scan is not None else []), *self.job_args]

    def start(self, run: BatchRun) -> bool:
        assert run.batch_id not in self.children, run.batch_id
        if _held(run) or not self._node_serves():
            return False
        os.makedirs(run.work_dir, mode=0o700, exist_ok=True)
        log_fd = os.open(os.path.join(run.work_dir, LOG_NAME), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                         0o600)
        try:
            child = subprocess.Popen(self.command(run), stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                     process_group=0, preexec_fn=stop_with_parent(), close_fds=True)
        finally:
            os.close(log_fd)
        self.children[run.batch_id] = child
        self._signalled.discard(run.batch_id)
        self._watch(child)
        log.info("batch %s: job started (pid %d, %s)", run.batch_id, child.pid, run.work_dir)
        return True

    def warm(self) -> None:
        """The node, started with the server: a batch's job finds its broker serving."""
        self._node_serves()

    def ready(self) -> bool:
        return self.node is None or self.node.alive()

    def _node_serves(self) -> bool:
        """Whether the node serves, started now where it does not (the first job's start, or
        it stopped: a process of it died); False while it cannot start. A node that failed
        to start, or stopped within NODE_STABLE_S of its start (a request that kills an
        engine each time it runs), is started again only after a wait that doubles from
        NODE_RETRY_FIRST_S each time, never in a loop."""
        if self.node is None or self.node.alive():
            return True
        now_s = self.clock()
        if self.node.node_pid is not None:  # seen gone now: its life judged by this
            log.warning("the node (pid %d) stopped: started again", self.node.node_pid)
            self.node.stop()
            self._node_failures = self._node_failures + 1 if now_s - self._node_started_s < NODE_STABLE_S else 0
            self._node_retry_s = now_s + self._node_wait_s() if self._node_failures else now_s
        if now_s < self._node_retry_s:
            return False
        try:
            info = self.node.start()
        except NodeStartError as exc:
            self._node_failures += 1
            self._node_retry_s = now_s + self._node_wait_s()
            log.error("%s; tried again in %.0f s", exc, self._node_retry_s - now_s)
            return False
        self._node_started_s = self.clock()
        log.info("node started (pid %d, %d consumers, %s)", info["node_pid"], info["consumers"],
                 self.node.spec.settings.data_dir)
        return True

    def _node_wait_s(self) -> float:
        return min(NODE_RETRY_MAX_S, NODE_RETRY_FIRST_S * 2 ** self._node_failures)

    def resume(self, run: BatchRun) -> bool:
        """The same command: run-batch resumes a job on its data directory."""
        return self.start(run)

    def _watch(self, child: subprocess.Popen) -> None:
        """`on_end` once the child ends, from a thread that waits on its pidfd (opened here,
        before the scheduler's thread can reap the child, so the pid is still the child's)
        and leaves the reaping to `poll`.
        NOTE: the scheduler's tick alone found an ended job 0.1 s late on average, 1.4% of a
        7 s job's wall time (`pipeline bench serve`'s overhead target is 5%)."""
        try:
            fd = os.pidfd_open(child.pid)
        except OSError as exc:  # no pidfd here (an old kernel, a seccomp filter, no descriptor left)
            log.debug("no pidfd for job pid %d (%s): its end is found at the next tick", child.pid, exc)
            return
        watcher = threading.Thread(target=_wait_then, args=(fd, self.on_end), name=f"job-{child.pid}", daemon=True)
        try:
            watcher.start()
        except RuntimeError:  # no thread to be had: the tick finds the end
            os.close(fd)

    def poll(self, run: BatchRun) -> Progress:
        if self.children:
            self._node_serves()  # jobs on a node that stopped wait for the next one
        child = self.children.get(run.batch_id)
        if child is None:
            progress = job_progress(run)
            if _held(run):
                progress.state = BUSY
            return progress
        code = child.poll()
        if code is None:
            return job_progress(run, RUNNING)
        del self.children[run.batch_id]
        progress = job_progress(run, ENDED)
        if code == EXIT_ANSWERED:
            progress.outcome = ANSWERED_ALL
        elif code in EXIT_STOPPED:
            progress.outcome = STOPPED
        else:
            progress.outcome, progress.message = FAILED, _log_tail(run, code)
        log.info("batch %s: job ended (%s, exit status %d)", run.batch_id, progress.outcome, code)
        return progress

    def cancel(self, run: BatchRun) -> None:
        child = self.children.get(run.batch_id)
        if child is not None and run.batch_id not in self._signalled:
            self._signalled.add(run.batch_id)
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)

    def forget(self, run: BatchRun) -> None:
        """The node's consumers answer the job's items still queued without running them
        (`wire/owners.py`: its id, from its manifest, among the node's ended owners), so a
        cancelled batch stops taking the engines at once; once per batch and server."""
        if self.node is None or run.batch_id in self._forgotten:
            return
        try:
            manifest = load_manifest(os.path.join(run.work_dir, DATA_NAME))
            if manifest is not None:  # None: it submitted nothing yet (asked again at the next tick)
                add_ended_owner(self.node.spec.settings.data_dir, manifest.job_id)
                self._forgotten.add(run.batch_id)
        except JobMismatchError as exc:  # damaged: its items run, their answers read by nobody
            log.warning("batch %s: its queued requests are not skipped: %s", run.batch_id, exc)
            self._forgotten.add(run.batch_id)
        except OSError as exc:  # no room for the record, say: asked again at the next tick
            log.warning("batch %s: its queued requests are not skipped yet: %s", run.batch_id, exc)

    def tidy(self, runs: Callable[[], list[BatchRun]]) -> None:
        """The node's results that every job of `runs()` has read: their disk freed
        (`batchjob/reclaim.py`), every RECLAIM_INTERVAL_S."""
        now_s = self.clock()
        if self.node is None or now_s < self._reclaim_s:
            return
        self._reclaim_s = now_s + RECLAIM_INTERVAL_S
        live = self.node.info.get("results_dir") if self.node.alive() else None  # unknown: none removed
        freed = reclaim_results(self.node.spec.settings.data_dir,
                                [os.path.join(run.work_dir, DATA_NAME) for run in runs()], live)
        if freed:
            log.info("node results: %d MiB that every job read freed", freed >> 20)

    def answers(self, run: BatchRun) -> Answers:
        assert run.batch_id not in self.children, run.batch_id
        output, errors = (os.path.join(run.work_dir, name) for name in (OUTPUT_NAME, ERRORS_NAME))
        found = Answers(output if os.path.exists(output) else None, 0, errors if os.path.exists(errors) else None, 0,
                        np.zeros((run.requests + 7) // 8, dtype=np.uint8))
        try:
            with open(records_path(os.path.join(run.work_dir, DATA_NAME)), "rb") as f:
                while raw := f.read(RECORD_CHUNK * ANSWER_RECORD_SIZE_BYTES):
                    records = valid_records(raw)
                    _mark(found, records[records["index"] < run.requests])
                    if records.size * ANSWER_RECORD_SIZE_BYTES < len(raw):  # a torn tail: nothing after it counts
                        break
        except FileNotFoundError:
            pass  # it never ran past its input's check
        return found

    def discard(self, run: BatchRun) -> None:
        assert run.batch_id not in self.children, run.batch_id
        data = os.path.join(run.work_dir, DATA_NAME)
        left = remove_data_dir(data) if os.path.isdir(data) else []
        if left:
            log.warning("batch %s: %s kept: it holds %s, which the job did not make", run.batch_id, data,
                        ", ".join(left[:5]))
            return
        for name in (OUTPUT_NAME, ERRORS_NAME, SUMMARY_NAME, LOG_NAME):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(run.work_dir, name))
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(run.work_dir)

    def running(self) -> int:
        return len(self.children)

    def shutdown(self, wait_s: float) -> None:
        """SIGTERM to every job, then wait up to `wait_s` for them all; a job still running
        then is killed (resumed at the next start like any stopped one)."""
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
        for batch_id, child in list(self.children.items()):
            try:
                child.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                log.warning("batch %s: its job (pid %d) did not stop within %.0f s: killed", batch_id, child.pid,
                            wait_s)
                child.kill()
                child.wait()
        self.children.clear()
        if self.node is not None:
            self.node.stop()


def node_spec(settings: LaunchSettings, node_dir: str) -> NodeSpec:
    """The node of a service whose jobs run with `settings` (every job's: the same model and
    engine), on `node_dir`: it serves the model and each of its LoRA adapters (the model ids
    a job's items carry, `JobWorkload.models`)."""
    return NodeSpec(replace(settings, data_dir=node_dir),
                    job_models(len(settings.engine_options.get("lora_modules") or ())))


def _wait_then(pidfd: int, then: Callable[[], None]) -> None:
    """Wait until the process of `pidfd` ends (its pidfd turns readable), close it, `then()`."""
    try:
        waiter = select.poll()  # NOTE: not select.select, which refuses a descriptor past 1023
        waiter.register(pidfd, select.POLLIN)
        waiter.poll()
    finally:
        os.close(pidfd)
    then()


def job_progress(run: BatchRun, state: str = WAITING) -> Progress:
    """The job's counts from its own status files; CHECKING while a RUNNING job checks its
    input."""
    try:
        status = job_status(os.path.join(run.work_dir, DATA_NAME)) if os.path.isdir(run.work_dir) else None
    except (JobMismatchError, OSError):
        status = None  # damaged or half-written: the next poll reads it again
    if state == RUNNING and (status is None or status.get("state") == CHECKING):
        state = CHECKING  # started, its input not checked yet
    if status is None:
        return Progress(state)
    usage = {key: int(status.get(key, 0)) for key in USAGE_KEYS}
    return Progress(state, int(status.get("done", 0)), int(status.get("failed", 0)), usage)


def _held(run: BatchRun) -> bool:
    """Whether a process holds the job's lock (a run an earlier server started, stopping)."""
    data = os.path.join(run.work_dir, DATA_NAME)
    try:
        status = job_status(data) if os.path.isdir(data) else None
    except (JobMismatchError, OSError):
        return False
    return bool(status and status.get("running"))


def _mark(found: Answers, records: np.ndarray) -> None:
    """Records (one per answered request: the job drops a second answer) into `found`."""
    index = records["index"].astype(np.int64)
    np.bitwise_or.at(found.answered, index >> 3, (1 << (index & 7)).astype(np.uint8))
    for log_id in (LOG_OUTPUT, LOG_ERRORS):
        mine = records[records["log"] == log_id]
        if not mine.size:
            continue
        end = int((mine["log_offset"].astype(np.int64) + mine["line_bytes"]).max())
        if log_id == LOG_OUTPUT:
            found.output_bytes = max(found.output_bytes, end)
            found.completed += int(mine.size)
        else:
            found.error_bytes = max(found.error_bytes, end)
            found.failed += int(mine.size)
    for key in USAGE_KEYS:
        found.usage[key] += int(records[key].astype(np.int64).sum())


def _log_tail(run: BatchRun, code: int) -> str:
    """The last lines of a failed job's log, for its batch's errors."""
    path = os.path.join(run.work_dir, LOG_NAME)
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - JOB_LOG_TAIL_BYTES))
            lines = f.read().decode("utf-8", errors="replace").splitlines()[-JOB_LOG_TAIL_LINES:]
    except OSError:
        lines = []
    return f"the job exited with status {code}" + (": " + " / ".join(line.strip() for line in lines) if lines else "")
