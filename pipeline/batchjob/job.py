"""A batch job: an OpenAI Batch file through the pipeline into one output line per request,
resumable after any stop, in memory that does not grow with the file.

    job = BatchJob(spec, say=print)
    job.prepare()        # paths checked, the data directory locked, the input scanned (or
                         # checked against the job's manifest), what earlier runs answered
                         # (a resume with work left reads that in `run`, beside the broker's start)
    code = job.run()     # the pipeline on what is left: the launcher, with the job's producers
                         # (started once the broker, having read the store, serves: what an
                         # earlier run left there is found beside the first dispatches)
    code = job.finish(code)   # the output (and error file, summary, report) once all is answered

The job's files (DATA_DIR/job/): its manifest (`manifest.py`: what the job is and everything
its answers depend on), the input's sparse index (`input.idx`), the answer log and its
records (`answers.py`; with `--output-order completion` the log is the output file itself),
where the collector read each results file up to (`collect.py`), producers' refusals
(`rejections.py`), the lock a running job holds, and its status (`status.json`, for
`pipeline status`). A run plans from them: answered requests are not run again, those still
in the store or a producer ring are delivered by the broker, and only the rest submitted.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from pipeline.batchjob.answers import LOG_NAME, AnswerLog, answer_records, log_fits_records
from pipeline.batchjob.assemble import MERGE_DIR, write_in_input_order
from pipeline.batchjob.collect import Collector, forget_answers
from pipeline.batchjob.embeddings import served_by
from pipeline.batchjob.inputcheck import InputCheck
from pipeline.batchjob.jobstatus import WRITING, input_changed_note
from pipeline.batchjob.layout import LOG_ERRORS, LOG_OUTPUT
from pipeline.batchjob.manifest import (
    INDEX_NAME,
    INPUT_CHANGED_NAME,
    JOB_DIR,
    LINES_NAME,
    LOCK_NAME,
    MODEL_COPY_DIR,
    STATUS_NAME,
    JobManifest,
    depends_on,
    differences,
    load_manifest,
    mismatch_error,
    snapshot_model_files,
    write_manifest,
)
from pipeline.batchjob.outfiles import OWN, OwnFiles, Publish, Target, identity, open_log
from pipeline.batchjob.jobfiles import (
    check_data_dir_is_the_jobs,
    holds_unfinished_scan,
    remove_data_dir,
    remove_job_dir,
)
from pipeline.batchjob.paths import OutputPath, check_input, check_outputs, replace_file, unless_disk_full
from pipeline.batchjob.progress import JobCounts, JobTracker, JobView, paced_by
from pipeline.batchjob.prescan import scan_or_adopt
from pipeline.batchjob.queued import mark_queued
from pipeline.batchjob.scan import InputScan, input_digest, read_index, write_index
from pipeline.batchjob.telemetry import JobTelemetry
from pipeline.batchjob.spec import OUTPUT_ORDERS, JobSpec, JobSummary
from pipeline.batchjob.workload import JobInput, JobWorkload, bits_set
from pipeline.reporting.progress import DISK_FULL_ALERT
from pipeline.runtime.datadir import check_data_dir, check_room, describe_holder, hold_lock, holder_gone, release_lock
from pipeline.runtime.inventory import producer_ring_names
from pipeline.runtime.settings import LaunchSettings
from pipeline.wire.dirpin import DirPin, moved_message, real_parent
from pipeline.wire.errors import (
    DataDirMovedError,
    FileOpError,
    InputChangedError,
    JobOutputError,
    JobPathError,
    PipelineError,
)
from pipeline.wire.textfiles import counted, printable

# How often the job's status file and the collector's read positions are saved while it runs.
SAVE_INTERVAL_S = 2.0


class BatchJob:
    """See the module's doc. Owner: the command's main thread; not thread-safe."""

    def __init__(self, spec: JobSpec, say: Callable[[str], None], show: Callable[[JobView, float], None]) -> None:
        assert spec.output_order in OUTPUT_ORDERS, spec.output_order
        self.spec = spec
        assert spec.settings.data_dir is not None
        self.data_dir = real_parent(spec.settings.data_dir)
        self.pin: DirPin | None = None  # the data directory as prepare checked it
        self.say = say
        self.show = show
        self._lock_fd = -1
        self._save_full = False  # the last save of the status found the disk full
        self.model_files = self.spec.model_dir  # the job's copies of the model's files, once made
        self._created_data_dir = False
        self.new_job = False
        self.manifest: JobManifest | None = None
        self.job_input: JobInput | None = None
        self.input_check: InputCheck | None = None  # a resume's digest of its input
        self.log: AnswerLog | None = None
        self.collector: Collector | None = None
        self._input_fd = -1
        self.skip = np.zeros(0, dtype=np.uint8)
        self.tracker: JobTracker | None = None
        self.telemetry = JobTelemetry()  # its log once the answers are read
        self.report: dict | None = None
        self._run_started_s = time.monotonic()
        self._answered_before = 0
        self._saved_s = 0.0
        self._producers_busy: float | None = None
        # --metrics-port's socket, bound first thing (the launcher's once the job runs), and its port.
        self.metrics_listener: socket.socket | None = None
        self.metrics_port: int | None = None
        # vLLM's check of the engine (`EngineFlags.verdict`), awaited before a request is submitted.
        self.engine_verdict: Callable[..., dict | None] = lambda wait, stop=None: {}

    # ------------------------------------------------------------------ prepare

    def prepare(self) -> None:
        """Everything checked and read before anything starts (the module's doc)."""
        spec = self.spec
        self._bind_metrics()
        input_path = check_input(spec.input_path)
        have = load_manifest(self.data_dir) if os.path.isdir(self.data_dir) else None
        unfinished = have is None and holds_unfinished_scan(self.data_dir)
        check_data_dir_is_the_jobs(self.data_dir, has_manifest=have is not None or unfinished)
        self.new_job = have is None
        self.own_files = OwnFiles(self.data_dir, have.log_mark if have is not None else None)
        outputs = self._outputs()
        expects = check_outputs(outputs, input_path, self.data_dir, self.own_files.own, spec.overwrite)
        self._make_data_dir(have is None)
        self._lock()
        self.pin = DirPin.take(self.data_dir)
        if unfinished:  # checked again under the lock: the scan of a new job made this directory
            self._created_data_dir = True
            self.say(f"run-batch: {printable(self.data_dir)} holds what a stopped check of an input left (no job was "
                     f"made there): it is checked again")
        self.targets = {out.role: Target.open(out.role, out.path, expect, self.own_files.own(out.path))
                        for out, expect in zip(outputs, expects)}
        wanted, scan = self._wanted_manifest(input_path, have)
        if have is not None:
            changed = differences(have, wanted)
            if changed:
                raise mismatch_error(self.data_dir, have, changed)
            self.manifest = replace(have, input_path=input_path)  # the same bytes, wherever they are now
            if have.input_path != input_path:
                write_manifest(self.data_dir, self.manifest)
        else:
            self.manifest = wanted
            write_index(os.path.join(self.data_dir, JOB_DIR, INDEX_NAME), scan)
            write_manifest(self.data_dir, wanted)
        index = scan.index if have is None else read_index(os.path.join(self.data_dir, JOB_DIR, INDEX_NAME),
                                                           self.manifest)
        self.job_input = JobInput(input_path, self.manifest.requests, index,
                                  os.path.join(self.data_dir, JOB_DIR, LINES_NAME))
        with contextlib.suppress(FileNotFoundError):  # of an earlier run
            os.unlink(os.path.join(self.data_dir, JOB_DIR, INPUT_CHANGED_NAME))
        self.skip = np.zeros(-(-self.manifest.requests // 8), dtype=np.uint8)
        if self.new_job or answer_records(self.data_dir) >= self.manifest.requests:
            self._open_answers()  # a new job's are empty; a finished job's end the run at once
        # else `run` reads them while the broker recovers the store (`open_answers`)

    def open_answers(self) -> None:
        """The answers so far, read once (by `prepare`, or else by `run` beside the broker's
        start, or by whichever step needs them first)."""
        if self.log is None:
            self._open_answers()

    def _bind_metrics(self) -> None:
        """The metrics port bound before any long work (the input's scan) and before the data
        directory is made: one in use is refused in one line (MetricsPortError) with nothing
        left behind; the port a 0 picked is said now, and kept in the status file."""
        if self.spec.settings.metrics_port is None:
            return
        from pipeline.reporting.metrics_endpoint import bind_metrics_port

        self.metrics_listener = bind_metrics_port(self.spec.settings.metrics_port)
        self.metrics_port = self.metrics_listener.getsockname()[1]
        self.say(f"run-batch: metrics: http://127.0.0.1:{self.metrics_port}/metrics")

    def _outputs(self) -> list[OutputPath]:
        spec = self.spec
        found = [OutputPath("output file", os.path.abspath(spec.output_path))]
        for role, path in (("error file", spec.error_file), ("run report", spec.report_path),
                           ("job summary", spec.summary_path)):
            if path is not None:
                found.append(OutputPath(role, os.path.abspath(path)))
        return found

    def _make_data_dir(self, new_job: bool) -> None:
        check_data_dir(self.data_dir)
        if new_job:  # a resume is checked once it knows whether anything is left to run (`run`)
            check_room(self.data_dir)
        if not os.path.lexists(self.data_dir):
            os.makedirs(self.data_dir, mode=0o700)
            self._created_data_dir = True
        os.makedirs(os.path.join(self.data_dir, JOB_DIR), mode=0o700, exist_ok=True)

    def _lock(self) -> None:
        """Hold the job's lock for the whole run: one run of a job at a time. Held by this
        process alone: its children (broker, consumers, producers) never hold it, so a run
        killed without a word frees it at once."""
        path = os.path.join(self.data_dir, JOB_DIR, LOCK_NAME)
        held = hold_lock(path)
        if isinstance(held, int):
            self._lock_fd = held
            return
        if holder_gone(held):
            raise JobPathError(f"{path} is held by a process an earlier run of this job left (pid {held}, which "
                               f"started it, is gone): it exits within seconds of its parent; if it does not, "
                               f"find it with `fuser {path}`, stop it, and run this again")
        raise JobPathError(f"a run of this job holds {self.data_dir} ({describe_holder(held)}): wait for it to "
                           f"finish, or stop it (Ctrl-C where it runs) and run this again")

    def _wanted_manifest(self, input_path: str, have: JobManifest | None) -> tuple[JobManifest, InputScan]:
        """This run's idea of the job: a fresh scan of the input for a new job (refused with
        its bad lines), its digest alone for a resume."""
        spec = self.spec
        adopted = False
        if have is None:  # the batch service's scan at upload, where it has one
            scan, adopted = scan_or_adopt(input_path, os.path.join(self.data_dir, JOB_DIR), spec.input_scan,
                                          self._scanning)
        else:
            size, digest = os.stat(input_path).st_size, have.input_xxh3
            if size != have.input_bytes:  # refused now, naming both digests
                size, digest = input_digest(input_path)
            else:  # read beside the run (`inputcheck.py`)
                self.input_check = InputCheck(input_path, have)
            scan = InputScan(input_path, size, digest, have.requests)
        self.model_files = snapshot_model_files(spec.model_dir, os.path.join(self.data_dir, JOB_DIR, MODEL_COPY_DIR))
        fields = dict(
            created_s=int(time.time()), input_path=input_path, input_bytes=scan.input_bytes,
            input_xxh3=scan.input_xxh3, requests=scan.requests, served_model=spec.served_model,
            output_path=os.path.abspath(spec.output_path), output_order=spec.output_order,
            error_file=os.path.abspath(spec.error_file) if spec.error_file else None,
            tool_call_parser=spec.tool_calling.parser, enable_auto_tool_choice=spec.tool_calling.auto,
            **served_by(spec.settings.engine_options, spec.model_dir),
            depends_on=depends_on(spec.model_dir, spec.settings.engine, spec.settings.engine_options,
                                  spec.settings.max_input_len, spec.chat_template, self.model_files))
        wanted = JobManifest.new(**fields) if have is None else replace(have, **fields)
        if adopted:  # its input's digest checked beside the run, as a resume's
            self.input_check = InputCheck(input_path, wanted)
        return wanted, scan

    def _scanning(self, read_bytes: int, requests: int) -> None:
        self.engine_verdict(False)  # a refusal that came meanwhile stops a long scan
        self.say(f"run-batch: checking {printable(self.spec.input_path)}: {read_bytes / 1e6:,.0f} MB read, "
                 f"{counted(requests, 'request')} so far")

    def _open_answers(self) -> None:
        from pipeline.batchjob.chat import ChatTokenizer

        manifest = self.manifest
        if manifest.output_order == "completion":
            logs, opened = self._completion_logs()
        else:
            logs, opened = {LOG_OUTPUT: os.path.join(self.data_dir, JOB_DIR, LOG_NAME)}, None
        self.log = AnswerLog.open(self.data_dir, manifest.requests, logs, opened)
        self._input_fd = os.open(self.job_input.path, os.O_RDONLY | os.O_CLOEXEC)
        tokenizer = ChatTokenizer.load(self.model_files, chat_template=self.spec.chat_template)
        error_log = LOG_ERRORS if LOG_ERRORS in logs else LOG_OUTPUT
        self.collector = Collector(self.data_dir, manifest, self._input_fd, tokenizer.decode, self.log, error_log,
                                   tokenizer.token_text, tokenizer.vocab_size, results_root=self.spec.node_dir)
        if self.new_job and self.spec.node_dir is not None:
            self.collector.skip_results_so_far()
        self.collect_all()
        self._answered_before = self.log.done
        np.bitwise_or(self.skip, self.log.done_bits(), out=self.skip)
        self.tracker = JobTracker(manifest.requests)
        self.telemetry.log = self.log

    def _completion_logs(self) -> tuple[dict[int, str], dict[int, int]]:
        """The completion-order output (and error file): the job's own files, appended to, or,
        where one is missing or not the file the job made (replaced, edited, or allowed to
        be replaced: --overwrite), all of them made anew and the answers collected again
        from the results files, which hold every one (on a node, what every job had read is
        freed: those requests run again)."""
        targets = {LOG_OUTPUT: self.targets["output file"]}
        if "error file" in self.targets:
            targets[LOG_ERRORS] = self.targets["error file"]
        opened: dict[int, int] = {}
        try:
            if all(t.expect == OWN and t.current() is not None for t in targets.values()):
                for log, target in targets.items():
                    opened[log] = open_log(target, False, self.manifest.log_mark)
                if all(log_fits_records(self.data_dir, log, fd) for log, fd in opened.items()):
                    return {log: t.path for log, t in targets.items()}, opened
                for fd in opened.values():  # edited in place since: made anew below
                    os.close(fd)
                opened.clear()
            forget_answers(self.data_dir)
            for log, target in targets.items():
                opened[log] = open_log(target, True, self.manifest.log_mark)
                self.own_files.made(target.path, identity(os.fstat(opened[log])))
        except BaseException:
            for fd in opened.values():
                os.close(fd)
            raise
        return {log: t.path for log, t in targets.items()}, opened

    def find_pending(self, storage_dir: str | None = None) -> None:
        """What an earlier run left in the store (`storage_dir`, default the data directory)
        or a producer ring, which the broker delivers: marked in `skip` with what is answered,
        so that only the rest is submitted; said in one line. A local run calls it once the
        broker serves (it has recovered the store and stored what the rings held), beside its
        first dispatches. An entry a consumer completes during the read may be missed by it,
        but its answer was written before its completion: collected after the read. A new
        job on a node has nothing there yet: the node's store is not read."""
        self.open_answers()
        if not (self.new_job and self.spec.node_dir is not None):
            mark_queued(self.skip, storage_dir or self.data_dir,
                        producer_ring_names(self.spec.node_dir or self.data_dir), self.manifest)
        self.collect_all()
        np.bitwise_or(self.skip, self.log.done_bits(), out=self.skip)
        self._say_plan()

    def unqueued(self) -> int:
        """Requests of a job on a node neither answered nor queued there (a ring a stopping
        node removed before its broker stored it, a damaged entry): the run ends, and the
        next one submits them (`AttachedLauncher`)."""
        queued = np.zeros_like(self.skip)
        mark_queued(queued, self.spec.node_dir, producer_ring_names(self.spec.node_dir), self.manifest)
        self.collect_all()
        np.bitwise_or(queued, self.log.done_bits(), out=queued)
        return self.manifest.requests - bits_set(queued, self.manifest.requests)

    def _say_plan(self) -> None:
        waiting = self.manifest.requests - self.to_submit - self.log.done  # neither answered nor to submit
        self.say(f"run-batch: {counted(self.manifest.requests, 'request')} in {printable(self.manifest.input_path)}: "
                 f"{self.log.done:,} answered already ({self.log.failed:,} failed), {waiting:,} waiting in the store, "
                 f"{self.to_submit:,} to submit; data directory {printable(self.data_dir)}")

    # ------------------------------------------------------------------ run

    @property
    def to_submit(self) -> int:
        return self.manifest.requests - bits_set(self.skip, self.manifest.requests)

    def run(self) -> int:
        """The pipeline on what is left; the launcher's exit status (0 when nothing was left)."""
        self._run_started_s = time.monotonic()
        if self.log is not None and self.log.done == self.manifest.requests:
            self._say_plan()
            return 0
        if not self.new_job:
            check_room(self.data_dir, holds_work=True)
        workload = JobWorkload(self.job_input, self.skip, self.manifest, self.model_files, self.data_dir,
                               self.spec.limits, self.spec.chat_template, pin=self.pin)
        launcher = self._launcher(workload)
        launcher.metrics_listener, self.metrics_listener = self.metrics_listener, None
        launcher.data_dir_pin = self.pin
        launcher.engine_check = lambda stop: self.engine_verdict(True, stop)
        launcher.while_broker_starts = lambda: self._read_beside_broker(launcher.results_dir)
        launcher.before_producers = self.find_pending
        try:
            outcome = launcher.run()
        except BaseException as failed:
            moved = self.pin.moved()
            if moved:  # whatever failed first, by path, failed for this: nothing is read or written there
                raise DataDirMovedError(moved_message(self.data_dir, moved)) from failed
            try:  # what was answered before the failure is kept; the failure is what is said
                if self.collector is not None:  # the answers were read (`_read_beside_broker`)
                    self._catch_up()
            except Exception as exc:  # noqa: BLE001 - the first error stands
                self.say(f"run-batch: the answers written so far could not all be read back: {exc}")
            raise
        finally:
            launcher.cleanup()
        self._catch_up()
        self.report = outcome.report
        self.report["outcome"] = outcome.why
        self._producers_busy = launcher.producers_busy_share()
        if outcome.why not in ("completed", "interrupted"):
            self.say(f"run-batch: the run stopped: {outcome.why}")
        return outcome.exit_code

    def _launcher(self, workload: JobWorkload):
        """The launcher of this run: its own broker and consumers, or the producers alone on
        the node of `spec.node_dir` (the batch service's), done once every request is answered."""
        from pipeline.runtime.attached import AttachedLauncher
        from pipeline.runtime.launcher import Launcher

        def summarize(results_dir: str):  # the collector is made beside the broker's start
            return self.collector.summary(results_dir)

        if self.spec.node_dir is None:
            return Launcher(self._run_settings(), workload, on_status=self._poll, summarize=summarize,
                            metrics=self.telemetry)
        return AttachedLauncher(self._run_settings(), workload, self.spec.node_dir, self.manifest.requests,
                                answered=lambda: self.log.done, unqueued=self.unqueued, on_status=self._poll,
                                summarize=summarize, metrics=self.telemetry)

    def _read_beside_broker(self, results_dir: str) -> None:
        """The answers so far, read while the broker recovers the store (its first dispatch
        waits for neither alone); this run's results collected from `results_dir`."""
        self.open_answers()
        self.collector.tally(results_dir)

    def _run_settings(self) -> LaunchSettings:
        """The launch settings, with the sim's tokenizer read from the job's copy of the model's
        files (as the producers' is), not the model directory, which may change meanwhile."""
        settings = replace(self.spec.settings, data_dir=self.data_dir)
        options = settings.engine_options
        if options.get("tokenizer") == self.spec.model_dir:
            settings = replace(settings, engine_options={**options, "tokenizer": self.model_files})
        return settings

    def _poll(self, status, now_s: float) -> None:
        """Every watch of the launcher (each after its check of the data directory's pin):
        new answers into the log, progress, saved state."""
        self._refuse_changed_input(wait=False)
        self.collector.collect()
        self.telemetry.observe(self.collector.latencies_s)
        self.collector.latencies_s.clear()
        self.tracker.observe(self._counts(), now_s)
        if now_s - self._saved_s >= SAVE_INTERVAL_S:
            self._saved_s = now_s
            self._save()
        view = self.tracker.view()
        if self.collector.disk_full or self._save_full:
            full = self.collector.disk_full_path or self.data_dir
            view.alert = f"DISK FULL: answers wait in the results files until the disk of {full} has room"
        elif getattr(status, "disk_full", False):
            view.alert = DISK_FULL_ALERT
        self.show(view, now_s)

    def _save(self) -> None:
        """The read positions and the status file, as the run goes; a full disk skips a save
        (the next one writes both: both are rebuilt from the answer log and results anyway)."""
        self._save_full = True
        with unless_disk_full():
            self.collector.save()
            self.write_status("running")
            self._save_full = False

    def _catch_up(self) -> None:
        self.collect_all()
        # Every answer in: what is left is writing the outputs (a merge of a big job takes a while).
        self.write_status(WRITING if self.log.done == self.manifest.requests else "stopped")

    def collect_all(self) -> None:
        """Every answer written so far into the log (a run's start and end); the read
        positions saved unless the disk is full (they are rebuilt from the log and results)."""
        self.pin.check()
        while self.collector.collect():
            pass
        with unless_disk_full():
            self.collector.save()

    def _counts(self) -> JobCounts:
        log = self.log
        return JobCounts(log.done, log.failed, log.usage.prompt_tokens, log.usage.completion_tokens,
                         log.usage.cached_tokens, dict(log.by_status))

    def write_status(self, state: str) -> None:
        """The job's status file (`pipeline status --data-dir`): its view and state. A full
        disk leaves the last one (`pipeline status` counts the answer records anyway)."""
        self.tracker.observe(self._counts(), time.monotonic())
        status = {"state": state, "pid": os.getpid(), "updated_s": int(time.time()),
                  "input": self.manifest.input_path, "output": self.manifest.output_path,
                  "output_order": self.manifest.output_order, "metrics_port": self.metrics_port,
                  **self.tracker.view().as_json()}
        with unless_disk_full():
            replace_file(os.path.join(self.data_dir, JOB_DIR, STATUS_NAME), [json.dumps(status).encode() + b"\n"])

    # ------------------------------------------------------------------ finish

    def finish(self, code: int) -> tuple[int, JobSummary]:
        """The output once every request has its answer; the summary; the exit status."""
        self.pin.check()
        self._refuse_changed_input(wait=True)
        self.open_answers()  # a run stopped before it read them
        log = self.log
        written = log.done == self.manifest.requests and not (self.input_check and self.input_check.said)
        summary = self._summary(written)
        if written:
            try:
                self._write_outputs()
                self._write_summaries(summary)
            except OSError as exc:
                if isinstance(exc, PipelineError) and not isinstance(exc, FileOpError):
                    raise  # a path's own problem (JobPathError), said as it is
                raise JobOutputError(f"cannot write the outputs ({', '.join(t.path for t in self.targets.values())}): "
                                     f"{exc}; every answer is kept in {self.data_dir}: once the disk or directory "
                                     f"named takes it, the same command writes them without running anything") \
                    from exc
            self.write_status("completed")
            code = 0
        else:
            self.write_status("stopped")
            code = code or 1
            changed = input_changed_note(self.data_dir)
            if changed is not None:
                raise InputChangedError(f"{changed}. The answers so far are kept: with the input as it was, the same "
                                        f"command finishes the job; to run the file as it is now, give another "
                                        f"--data-dir")
        return code, summary

    def _refuse_changed_input(self, wait: bool) -> None:
        """The job's refusal (JobMismatchError), once, when its input's digest shows another
        file; with `wait`, the digest is waited for."""
        check = self.input_check
        error = check.error(self.data_dir, wait) if check is not None and not check.said else None
        if error is not None:
            check.said = True
            self.write_status("stopped")
            raise error

    def _write_outputs(self) -> None:
        manifest = self.manifest
        if manifest.output_order == "completion":
            for log, fd in self.log.fds().items():  # still the files it appended to (not replaced meanwhile)
                target = self.targets["output file" if log == LOG_OUTPUT else "error file"]
                now = target.current()
                if now is None or identity(now) != identity(os.fstat(fd)):
                    raise JobPathError(f"{target.role} {target.path} was replaced or removed while the job ran: its "
                                       f"answers are kept; the same command writes it anew from them (with "
                                       f"--overwrite if a file of yours is there now)")
            self.log.sync()
            return
        output = self.targets["output file"]
        errors = self.targets.get("error file")
        made = write_in_input_order(self.data_dir, os.path.join(self.data_dir, JOB_DIR, LOG_NAME), manifest.requests,
                                    lambda: Publish(output), (lambda: Publish(errors)) if errors else None,
                                    os.path.join(self.data_dir, JOB_DIR, MERGE_DIR))
        for target, done in zip((output, errors), made):
            self.own_files.made(target.path, done)

    def _summary(self, written: bool) -> JobSummary:
        log = self.log
        failed = {code: n for code, n in sorted(log.by_status.items()) if code != 200}
        wall_s = time.monotonic() - self._run_started_s
        return JobSummary(self.manifest.requests, log.by_status.get(200, 0), log.failed, failed,
                          log.usage.prompt_tokens, log.usage.completion_tokens, log.usage.cached_tokens, wall_s,
                          log.done - self._answered_before, self._paced_by(), written)

    def _paced_by(self) -> str:
        if self.report is None:
            return "nothing ran"
        return paced_by(self._producers_busy, self.report.get("busy_fraction"))

    def _write_summaries(self, summary: JobSummary) -> None:
        """The summary beside the output, and the run report, after the output."""
        found = {"job summary": {"job": summary.as_json()}, "run report": {**(self.report or {}),
                                                                           "job": summary.as_json()}}
        for role, document in found.items():
            target = self.targets.get(role)
            if target is not None:
                out = Publish(target)
                try:
                    out.write(json.dumps(document, indent=1, default=str).encode() + b"\n")
                    self.own_files.made(target.path, out.commit())
                finally:
                    out.abandon()

    def close(self, remove: bool) -> list[str]:
        """Release the job's files; with `remove`, remove the data directory (what the
        product made in it); the names left there."""
        if self.log is not None:
            self.log.close()
        if self._input_fd >= 0:
            os.close(self._input_fd)
            self._input_fd = -1
        for target in getattr(self, "targets", {}).values():
            target.close()
        if self.metrics_listener is not None:  # never served: nothing was left to run
            self.metrics_listener.close()
        left: list[str] = []
        if remove:
            left = remove_data_dir(self.data_dir, self.pin.identity if self.pin is not None else None)
        if self._lock_fd >= 0:
            release_lock(self._lock_fd)
            self._lock_fd = -1
        return left

    def abandon_new(self) -> None:
        """A new job refused or stopped before anything ran: its metrics port freed; the data
        directory it created removed, or, in one that was there, what it made there (its job
        directory); a job that does not hold its lock (another run's) touches nothing."""
        if self.metrics_listener is not None:
            self.metrics_listener.close()
        if self._lock_fd < 0 or not self.new_job:
            self.close(remove=False)
        elif self._created_data_dir:
            self.close(remove=True)
        else:
            remove_job_dir(self.data_dir)
            self.close(remove=False)

