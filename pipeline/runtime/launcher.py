"""`pipeline launch`: one node's whole pipeline, from a workload to a run report (SPEC §7).

    outcome = Launcher(settings, workload, console).run()
    outcome.report["lost"] == 0

What a run does, in order:
    1. the broker (its data directory: given, or a temporary one removed afterwards);
    2. one consumer per engine's GPUs (pinned with CUDA_VISIBLE_DEVICES), or `consumers` CPU ones;
    3. the producers, each feeding its round-robin share of the workload and recording in a
       shared ledger how many items it has put into its ring;
    4. a watch loop: the broker's status twice a second -> live progress; the run is done
       when every producer has handed over its share and nothing is queued or pending. A
       broker that does not answer but lives (paused, or stalled on a slow disk) is waited
       for; a full disk pauses ingest, and the run waits for space;
    5. the stop, in dependency order: producers (already gone), consumers (each finishes its
       batch in hand), then the broker;
    6. the stock-taking (`accounting.take_stock`): every item the producers accepted, and every
       item the broker took over from an earlier run, is found by id with a result, in the
       store or in a producer ring, or counted lost;
    7. the report: the broker's final counters, the results files and the stock.

Before any of it the launcher takes the data directory for the whole run (run/launch.lock)
and checks that /dev/shm holds what the run creates there: a second launch on the data
directory, one on a data directory a broker already serves, and one /dev/shm cannot hold
are refused at once, with nothing started and nothing removed.

Ctrl-C (SIGINT) reaches only this process (children run in their own process groups): the
first one stops the run in the order above and still prints the report of what was done; a
second one kills every child. Either way no process is left, and no shared-memory object
but the producer rings that still hold records the broker never stored: where the store
outlives the run (the disk tier), those rings stay for the next broker on the data directory,
which stores them before anything else. A run that fails (a child died) on a temporary data
directory keeps that directory when it holds unfinished work, and says how to finish it.

Results of a run go to `data_dir/results/run-<UTC time>/`, one JSON-lines file per consumer,
so a data directory reused across runs never mixes two runs' accounting.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.engines.vllm_options import with_flag_options
from pipeline.producer.workload import Workload
from pipeline.reporting.accounting import ResultsSummary, Stock, summarize_results, take_stock
from pipeline.runtime.datadir import release_launch
from pipeline.runtime.gpus import consumer_placements, detect_gpus, gpus_per_engine
from pipeline.runtime.inventory import (ProducerLedger, RingStock, StoreStock, producer_ring_names,
                                        results_of_earlier_runs, ring_stock, run_is_done, store_stock)
from pipeline.runtime.local import (CTX, STOP_POLL_S, ShmNeeds, await_broker, claim_data_dir, exit_text, fork_broker,
                                    process_status, remove_leftovers, start_consumer, stop_process)
from pipeline.runtime.madefiles import RESULTS_DIR
from pipeline.runtime.processes import memory_tier_dir
from pipeline.runtime.producer_processes import start_producer, start_producers
from pipeline.runtime.prompttime import PromptTimer, process_cpu_ns, process_state
from pipeline.runtime.settings import DEFAULT_CPU_CONSUMERS, LaunchSettings, engine_options_for_host
from pipeline.runtime.signals import Interrupts
from pipeline.runtime.tables import broker_config, consumer_settings, run_settings
from pipeline.wire.client import broker_status
from pipeline.wire.dirpin import DirPin, moved_message
from pipeline.wire.errors import DataDirMovedError, PipelineError
from pipeline.wire.status import BrokerStatus
from pipeline.wire.textfiles import counted

log = logging.getLogger("pipeline.launch")

# How often the watch loop asks the broker for its status (and redraws the progress).
WATCH_INTERVAL_S = 0.5
# How long a stopping producer may wait for the broker to store what it already published
# before it is killed (its ring then keeps what was not stored, for the next broker).
PRODUCER_STOP_TIMEOUT_S = 30.0
# How long a stopping producer that is making one request's prompt (foreign code, which may
# never return) is given before it is killed: a real prompt takes milliseconds.
BUSY_STOP_GRACE_S = 2.0
# Signals that mean a producer's own code crashed (foreign code: a tokenizer's abort on a
# failed allocation, a segfault), as opposed to a kill from outside (SIGKILL, SIGTERM).
CRASH_SIGNALS = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})
# How long a consumer may take to finish its batch in hand, and the broker to close its
# files, before they are killed.
STOP_TIMEOUT_S = 30.0
# How long to wait for a broker that stopped answering to be seen exiting: its exit status
# is the clearer message, and a killed process can take a moment to be reaped on a loaded
# machine (1 s was seen to fall short).
BROKER_EXIT_WAIT_S = 5.0
# Times a producer killed between requests is started again: a kill from outside is rare; one
# that keeps coming (memory the node lacks) stops the run, saying so.
MAX_IDLE_RESTARTS = 3
# A broker that lives but does not answer (SIGSTOP, a VM pause, a disk stall) is waited for;
# the launcher says so this often.
UNANSWERED_WARN_INTERVAL_S = 10.0
EXIT_OK = 0
EXIT_FAILED = 1
# The shell's convention for a process stopped by SIGINT.
EXIT_INTERRUPTED = 130


@dataclass(slots=True)
class LaunchOutcome:
    report: dict
    exit_code: int
    why: str  # "completed", "interrupted", or what failed
    data_dir: str
    results_dir: str
    history: list = field(default_factory=list)
    data_dir_kept: bool = False  # a temporary data directory kept for its unfinished work


class Launcher:
    """Runs one workload through a fresh broker, consumers and producers.

    Owner: the launching process's main thread (it installs the SIGINT handler). Not
    thread-safe. `on_status(status, now_s)` is called with every status the watch loop
    reads (the live progress display hooks in there)."""

    watch_interval_s = WATCH_INTERVAL_S
    # How often a watch asks the broker for its status (each asks at most this often): its
    # cost grows with the broker's shapes, and it is the broker's loop that answers.
    status_interval_s = WATCH_INTERVAL_S

    def __init__(self, settings: LaunchSettings, workload: Workload, on_status=None,
                 summarize: Callable[[str], ResultsSummary] = summarize_results, metrics=None) -> None:
        """`summarize(results_dir)`: this run's results, for the report (a batch job's
        collector has read them already, and passes its own). `metrics`: a prometheus_client
        collector served beside the broker's (a batch job's), with --metrics-port."""
        self.settings = settings
        self.workload = workload
        self.on_status = on_status or (lambda status, now_s: None)
        self._summarize = summarize
        self._extra_metrics = metrics
        self.on_metrics = lambda port: None  # told the metrics port (0 picks a free one)
        # The metrics port's socket (`bind_metrics_port`), bound by `run` unless its owner bound
        # it before its own long work; the MetricsServer's once it serves.
        self.metrics_listener: socket.socket | None = None
        # The data directory as its owner checked it (a batch job's), else as `run` finds it:
        # the run stops once its path leads elsewhere (`pipeline.wire.dirpin`).
        self.data_dir_pin: DirPin | None = None
        self.engine_check: Callable[[Callable[[], bool]], dict | None] = lambda stop: {}  # see `_start`
        # Called with the broker's storage directory once it and the consumers serve.
        self.before_producers: Callable[[str], None] = lambda storage_dir: None
        # Called once the broker is forked, while it recovers: the owner's own reading.
        self.while_broker_starts: Callable[[], None] = lambda: None
        self._own_data_dir = settings.data_dir is None
        self.data_dir = settings.data_dir or tempfile.mkdtemp(prefix="shape-broker-")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.results_dir = os.path.join(self.data_dir, RESULTS_DIR, f"run-{stamp}-{os.getpid()}")
        self.config = broker_config(self.data_dir, settings.broker, "settings")  # checked by LaunchSettings
        self._consumer_settings = consumer_settings(settings.consumer, "settings")  # every consumer's, likewise
        self.gpus = detect_gpus()
        self.placements = consumer_placements(self.gpus, gpus_per_engine(settings.engine_options), settings.consumers,
                                              DEFAULT_CPU_CONSUMERS)
        self.consumer_count = len(self.placements)
        # What each consumer's engine runs with: the settings', plus what this machine needs
        # that the user did not give (a vllm engine without a GPU), shown by the launch line.
        self.engine_options, self.engine_filled = engine_options_for_host(
            settings.engine, settings.engine_options, gpus=len(self.gpus), consumers=self.consumer_count,
            cores=len(os.sched_getaffinity(0)), data_dir=self.data_dir)
        self.broker = None
        self.consumers: list = []
        self.producers: list = []
        self.ledger = ProducerLedger.create(CTX, settings.producers)
        # Items published by producers the launcher stopped on a request and started again.
        self._retired_published = 0
        self._retired_busy_ns = 0
        self.restarts = 0
        self._deaths: dict[int, int] = {}  # request -> producers that died on it
        self._idle_deaths: dict[int, int] = {}  # producer -> times it was killed between requests
        self._prompt_timers: dict[int, PromptTimer] = {}  # producer index -> its time on its request
        # When the producers started, and when the watch first saw them all gone.
        self._producers_span_ns: list[int] = [0, 0]
        # Stock by item id (every item found in results, store or rings) is taken unless the
        # workload accounts for its own (a batch job: by request, in its answer log).
        self.item_stock = getattr(workload, "item_stock", True)
        self.metrics = None
        self.interrupts = Interrupts()
        self.keep_data_dir = False
        self._store_ids: np.ndarray | None = None  # the store's live item ids, once read
        # What an earlier run left on the data directory, read before the broker starts, and
        # which of it already has a result from that run (it runs again: counted).
        self.taken_over = StoreStock()
        self._done_before = np.zeros(0, dtype=np.uint64)

    def run(self) -> LaunchOutcome:
        """The run, holding the data directory throughout: refused at once, with nothing
        started or removed, when another run or a broker holds it or /dev/shm cannot hold
        the run (`claim_data_dir`), or the metrics port is in use (MetricsPortError)."""
        if self.settings.metrics_port is not None and self.metrics_listener is None:
            from pipeline.reporting.metrics_endpoint import bind_metrics_port

            self.metrics_listener = bind_metrics_port(self.settings.metrics_port)
        try:
            os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
            needs = ShmNeeds(self.settings.producers, self.consumer_count, self.config.descriptor_ring_bytes,
                             memory_tier=self.settings.storage == "memory")
            held = claim_data_dir(self.data_dir, needs)
            try:
                self.data_dir_pin = self.data_dir_pin or DirPin.take(self.data_dir)
                self.data_dir_pin.check()
                return self._run()
            finally:
                self._kill_left()
                release_launch(held)
        finally:
            if self.metrics_listener is not None:  # never served: the run failed before
                self.metrics_listener.close()

    def _kill_left(self) -> None:
        """Kill any child still alive: a run that ends by an exception in its own stop (a data
        directory removed under it) must not leave a broker and consumers serving nobody,
        and its own exit waiting for them."""
        for process in [*self.producers, *self.consumers, *([self.broker] if self.broker is not None else [])]:
            if process.is_alive():
                log.warning("%s (pid %d) still ran at the end of the run: killed", process.name, process.pid)
                process.kill()
                process.join(BROKER_EXIT_WAIT_S)

    def _run(self) -> LaunchOutcome:
        self.interrupts = Interrupts.install()
        stop = self.interrupts.stopping
        started_s = time.monotonic()
        final: BrokerStatus | None = None
        why, code = "completed", EXIT_OK
        try:
            self._start()
            final, why = self._watch(stop)
            self.data_dir_pin.check()  # a process that failed as its files went away failed for this
            code = {"completed": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(why, EXIT_FAILED)
        except BaseException as failed:
            # A start that failed (a broker that cannot start, a metrics port in use): stop
            # what did start and remove what it left, keeping whatever holds work. A data
            # directory that moved is left as a kill leaves it: nothing is touched by path.
            self._stop(final, completed=False)
            moved = self.data_dir_pin.moved()
            if moved:
                raise DataDirMovedError(moved_message(self.data_dir, moved)) from failed
            self._keep_everything(ring_stock(producer_ring_names(self.data_dir)))
            raise
        final = self._stop(final, completed=why == "completed")
        report = self._finish(final, time.monotonic() - started_s, why)
        return LaunchOutcome(report, code, why, self.data_dir, self.results_dir, data_dir_kept=self.keep_data_dir)

    # ----------------------------------------------------------------- start

    def _start(self) -> None:
        s = self.settings
        self.taken_over = self._earlier_work()
        starting = fork_broker(self.config, s.storage, s.durability)
        self.broker = starting.process  # a failure from here on stops it
        self.while_broker_starts()
        await_broker(starting)
        if s.metrics_port is not None:
            from pipeline.reporting.metrics_endpoint import MetricsServer

            socket_path = self.config.socket_path
            self.metrics = MetricsServer.start(self.metrics_listener or s.metrics_port,
                                               lambda: broker_status(socket_path),
                                               token_file=s.metrics_token_file, extra=self._extra_metrics)
            self.metrics_listener = None  # the server's now
            self.on_metrics(self.metrics.port)
        for config in self.consumer_configs():
            self.consumers.append(start_consumer(config))
        try:  # the options as vLLM read the flags (the report shows them); None: stopped meanwhile
            checked = self.engine_check(self.interrupts.stopping)
        except BaseException:  # an engine refused: its consumers have nothing to finish
            for process in self.consumers:
                stop_process(process, signal.SIGKILL)
            raise
        if checked is None:
            return  # no producer starts: the watch stops the run
        self.engine_options = with_flag_options(self.engine_options, checked)
        self.before_producers(memory_tier_dir(self.data_dir) if s.storage == "memory" else self.data_dir)
        if self.interrupts.stopping():
            return  # stopped meanwhile: no producer starts
        self._producers_span_ns[0] = time.monotonic_ns()
        self.producers = start_producers(self.config.socket_path, self.workload, s.producers, s.replay_speed,
                                         self.ledger)

    def _earlier_work(self) -> StoreStock:
        """By id, what an earlier run left here for this one to finish: the store's live
        entries (the disk tier; the memory tier starts empty) and the records of producer
        rings never stored. The broker takes all of it over; the stock at the end expects it.
        NOTE: a second scan of the store (the broker's recovery scans it again) rather than
        counting on the broker's items_recovered: a count cannot say which items, and one
        unexplained item would hide one lost (seen in review). A fresh data directory has no
        store to scan; a stopped run's is read at page-cache speed."""
        if not self.item_stock:
            return StoreStock()
        rings = ring_stock(producer_ring_names(self.data_dir))
        store = store_stock(self.data_dir) if self.settings.storage == "disk" else StoreStock()
        taken_over = StoreStock(np.union1d(store.item_ids, rings.item_ids), store.models | rings.models)
        if taken_over.item_ids.size:
            self._done_before = results_of_earlier_runs(self.results_dir, taken_over.item_ids)
        return taken_over

    def consumer_configs(self) -> list[ConsumerConfig]:
        """One consumer per engine's GPUs (`consumer_placements`: or `consumers` of them, spread
        over the groups), each serving one of the models in turn: the workload's, and those of
        what an earlier run left here (a model nobody serves would keep the run from ever
        finishing); CPU consumers where there is no GPU."""
        s = self.settings
        count = self.consumer_count
        models = sorted(set(self.workload.models) | self.taken_over.models)
        if count < len(models):
            raise ValueError(f"the workload and what earlier runs left here use {len(models)} models "
                             f"({models[:10]}) but only {counted(count, 'consumer')} {'runs' if count == 1 else 'run'}: "
                             f"each consumer serves one model (raise --consumers)")
        configs = []
        for k, placement in enumerate(self.placements):
            configs.append(ConsumerConfig(
                self.config.socket_path, self.results_dir, placement.name, model=models[k % len(models)],
                max_batch_items=s.max_batch, max_batch_tokens=s.max_batch_tokens, max_input_len=s.max_input_len,
                engine=s.engine, engine_options=dict(self.engine_options), gpu=placement.gpu,
                **self._consumer_settings))
        return configs

    # ----------------------------------------------------------------- watch

    def _watch(self, stop) -> tuple[BrokerStatus | None, str]:
        """Poll the broker until the run is done, interrupted, or a process failed; the last
        status read (None if the broker never answered)."""
        status: BrokerStatus | None = None
        unanswered_since_s: float | None = None
        warned_s = status_due_s = 0.0
        while True:
            if stop():
                return status, "interrupted"
            self.data_dir_pin.check()
            self._supervise()
            failed = self._failure()
            if failed:
                return status, failed
            try:
                if time.monotonic() >= status_due_s:
                    status_due_s = time.monotonic() + self.status_interval_s
                    status = broker_status(self.config.socket_path)
                    unanswered_since_s = None
            except (OSError, TimeoutError, PipelineError) as exc:
                status_due_s = 0.0  # asked again at the next watch
                if self.broker is None:  # a node's (`attached.py`): its owner starts it again
                    status = None
                else:
                    self.broker.join(BROKER_EXIT_WAIT_S if unanswered_since_s is None else STOP_POLL_S)
                    if not self.broker.is_alive():  # a dying broker resets connections first
                        return status, self._failure() or f"the broker stopped answering: {exc}"
                    now_s = time.monotonic()
                    unanswered_since_s = unanswered_since_s or now_s
                    if now_s - warned_s >= UNANSWERED_WARN_INTERVAL_S:
                        warned_s = now_s
                        log.warning("the broker (pid %d, %s) has not answered for %.0f s (%s); waiting for it "
                                    "(Ctrl-C stops the run)", self.broker.pid, process_status(self.broker.pid),
                                    now_s - unanswered_since_s, exc)
                    continue
            self.on_status(status, time.monotonic())
            if self._done(status):
                return status, "completed"
            time.sleep(self.watch_interval_s)

    def _failure(self) -> str:
        if self.broker is not None and not self.broker.is_alive():
            return f"the broker exited with status {self.broker.exitcode}"
        for process in self.consumers:
            if not process.is_alive():
                return f"{process.name} exited with status {process.exitcode}"
        for process in self.producers:
            if process.exitcode not in (None, 0):
                return f"{process.name} exited with status {process.exitcode}"
        return ""

    def _done(self, status: BrokerStatus) -> bool:
        if not self._producers_finished():
            return False
        published = self.ledger.total_published() + self._retired_published
        return run_is_done(status, published)

    def _producers_finished(self) -> bool:
        """Every producer handed over its share and exited (the first time: when, noted)."""
        if any(process.exitcode is None for process in self.producers):
            return False
        if not self._producers_span_ns[1]:
            self._producers_span_ns[1] = time.monotonic_ns()
        return True

    def _supervise(self) -> None:
        """A producer of a workload with a time limit per request (`busy_limit_s`: a batch
        job's chat template and tokenizer) that runs past it on one request, or crashes on
        one (SIGABRT, SIGSEGV: foreign code), or dies on the same one twice (the kernel's
        OOM killer), is stopped; the workload answers that request (`on_stuck`). A producer
        killed from outside while on a request is only started again. Either way a producer
        starts again in its place after what it published; its ring keeps that for the broker."""
        limit_s = getattr(self.workload, "busy_limit_s", None)
        if limit_s is None:
            return
        for index, process in enumerate(self.producers):
            busy = self.ledger.busy_with(index)
            if busy is None:
                self._restart_if_killed_between_requests(index, process)
                continue
            since_ns, position = busy
            if process.exitcode is None:
                if not self._ran_past(index, since_ns, limit_s, process.pid):
                    continue
                process.kill()
                process.join(BROKER_EXIT_WAIT_S)
                why = (f"it ran past the {limit_s:g}-second time limit of the chat template and tokenizer "
                       f"(--prompt-time-limit-s; the time the producer ran or was blocked on it, not time it "
                       f"was paused or waited for a core)")
            elif process.exitcode != 0:
                self._deaths[position] = self._deaths.get(position, 0) + 1
                crashed = -process.exitcode in CRASH_SIGNALS or self._deaths[position] > 1
                why = (f"the producer making it died ({exit_text(process.exitcode)}): the chat template or "
                       f"tokenizer crashed, or ran out of memory") if crashed else ""
            else:
                continue
            self._restart_producer(index, position, why)

    def _restart_if_killed_between_requests(self, index: int, process) -> None:
        """A producer killed by a signal between requests (kill -9, the OOM killer while it
        submits) starts again after what it published, at most MAX_IDLE_RESTARTS times; one
        that failed on its own (an exit status: the input changed) is not."""
        code = process.exitcode
        if code is None or code >= 0 or self._idle_deaths.get(index, 0) >= MAX_IDLE_RESTARTS:
            return
        self._idle_deaths[index] = self._idle_deaths.get(index, 0) + 1
        self._restart_producer(index, -1, "")

    def _ran_past(self, index: int, since_ns: int, limit_s: float, pid: int) -> bool:
        """Producer `index` (process `pid`) has been charged its time limit on the request
        it started at `since_ns` (`prompttime`)."""
        timer = self._prompt_timers.get(index)
        if timer is None or timer.limit_s != limit_s:
            timer = self._prompt_timers[index] = PromptTimer(limit_s)
        cpu_ns = process_cpu_ns(pid)
        if cpu_ns is None:
            return False  # gone meanwhile: its exit status is judged on the next pass
        timer.observe(since_ns, self.ledger.busy_cpu_from(index), time.monotonic_ns(), cpu_ns, process_state(pid))
        return timer.ran_past()

    def _restart_producer(self, index: int, position: int, why: str) -> None:
        """Start producer `index` again after what it published; `why` (not empty): the
        request it was on is answered by the workload and skipped."""
        if why:
            log.warning("producer %d stopped on request %d: %s; it is answered 400 and a producer starts again",
                        index, position, why)
            self.workload.on_stuck(position, why)
        elif position >= 0:
            log.warning("producer %d was killed on request %d; a producer starts again", index, position)
        else:
            log.warning("producer %d was killed between requests; a producer starts again", index)
        resume = self.ledger.resume_position(index)
        self._retired_published += self.ledger.total_published_by(index)
        self._retired_busy_ns += self.ledger.busy_ns(index)
        self.ledger.reset(index)
        self.restarts += 1
        self.producers[index] = start_producer(self.config.socket_path, self.workload, index, self.settings.producers,
                                               self.settings.replay_speed, self.ledger, start_at=resume)

    def _stop(self, final: BrokerStatus | None, completed: bool) -> BrokerStatus | None:
        """Stop every child in dependency order; a second Ctrl-C kills them instead, and so
        does a dead broker (producers would wait for it to store their records, in vain; what
        they published stays in their rings). Returns the broker's last status."""
        def forced() -> bool:  # a second Ctrl-C, or a dead broker: nobody to hand work to
            return self.interrupts.forcing() or self.broker is None or not self.broker.is_alive()

        for index, process in enumerate(self.producers):
            stop_process(process, timeout_s=PRODUCER_STOP_TIMEOUT_S, forced=lambda k=index: forced() or self._stuck(k))
        for process in self.consumers:
            stop_process(process, timeout_s=STOP_TIMEOUT_S, forced=forced)
        if not forced():
            fresh = self._fresh_status()
            if fresh is not None:
                final = fresh
            if not completed and self.settings.storage == "memory":
                # The memory tier's files go with its broker: read them while nothing can
                # change them any more (producers and consumers are stopped and drained).
                self._store_ids = store_stock(memory_tier_dir(self.data_dir)).item_ids
        if self.metrics is not None:
            self.metrics.close()
        if self.broker is not None:
            stop_process(self.broker, timeout_s=STOP_TIMEOUT_S, forced=self.interrupts.forcing)
        return final

    def producers_busy_share(self) -> float | None:
        """The share of their lifetime the producers spent making items (a workload that
        reports it: a batch job's prompts); None before they all finished."""
        start_ns, end_ns = self._producers_span_ns
        if not end_ns or end_ns <= start_ns or not self.producers:
            return None
        busy = self._retired_busy_ns + sum(self.ledger.busy_ns(k) for k in range(len(self.producers)))
        return min(1.0, busy / (len(self.producers) * (end_ns - start_ns)))

    def _stuck(self, index: int) -> bool:
        """Producer `index` has been in foreign code (a chat template) for more than
        BUSY_STOP_GRACE_S: a stop does not wait for it (its ring keeps what it published)."""
        busy = self.ledger.busy_with(index)
        return busy is not None and time.monotonic_ns() - busy[0] > BUSY_STOP_GRACE_S * 1e9

    def _fresh_status(self) -> BrokerStatus | None:
        """The broker's status now, or None if it cannot answer (the last one read stands)."""
        if self.broker is None or not self.broker.is_alive():
            return None
        try:
            return broker_status(self.config.socket_path)
        except (OSError, TimeoutError, PipelineError):
            return None

    # ----------------------------------------------------------------- stock and report

    def _finish(self, final: BrokerStatus | None, wall_s: float, why: str) -> dict:
        """Take stock, decide what stays, clean up, and build the report."""
        completed = why == "completed"
        rings = ring_stock(producer_ring_names(self.data_dir))
        try:
            results = self._summarize(self.results_dir)
            stock = self._take_stock(results, rings, completed) if self.item_stock else None
        except BaseException:
            self._keep_everything(rings)  # nothing counted: nothing may be discarded
            raise
        unfinished = stock.in_store + stock.in_rings if stock is not None else (
            len(rings.rings_holding) + (final.items_unfinished if final is not None else 1))
        durable = self.settings.storage == "disk"
        if durable and self._own_data_dir and unfinished and why not in ("completed", "interrupted"):
            self.keep_data_dir = True  # a failure must not discard work: say how to finish it
        kept = durable and (not self._own_data_dir or self.keep_data_dir)
        self._clean_up(rings, keep_rings=kept)
        from pipeline.reporting.report import build_report

        again = np.fromiter(results.item_ids, dtype=np.uint64, count=len(results.item_ids))
        not_submitted = max(0, len(self.workload) - stock.accepted) if stock is not None and not completed else 0
        report = build_report(final, results, wall_s, stock=stock, store_kept=kept, not_submitted=not_submitted,
                              unreadable_rings=rings.unreadable,
                              duplicates_across_runs=int(np.intersect1d(self._done_before, again).size))
        report["settings"] = self.process_settings()
        report["metrics_port"] = self.metrics.port if self.metrics is not None else None
        return report

    def process_settings(self) -> dict:
        """The broker's and a consumer's settings as they ran (for the report), and which of
        them differ from the defaults."""
        # The consumers' own settings on placeholders of their own options (the report skips
        # those): no GPU scan or model check again at the end of a run that may have failed.
        consumer = ConsumerConfig(self.config.socket_path, self.results_dir, "settings", **self._consumer_settings)
        return run_settings(self.config, consumer, self.settings.engine, self.consumer_count, self.engine_options,
                            self.engine_filled)

    def _take_stock(self, results, rings: RingStock, completed: bool) -> Stock:
        """Where every item is. A completed run has nothing left in the store (the broker
        said so), so only a stopped one reads the store's files."""
        if self._store_ids is None and not completed:
            storage_dir = self.data_dir if self.settings.storage == "disk" else memory_tier_dir(self.data_dir)
            self._store_ids = store_stock(storage_dir).item_ids
        store = self._store_ids if self._store_ids is not None else np.zeros(0, dtype=np.uint64)
        found = np.fromiter(results.item_ids, dtype=np.uint64, count=len(results.item_ids))
        return take_stock(self.ledger.entries(), found, store, rings.item_ids, self.taken_over.item_ids)

    def _keep_everything(self, rings: RingStock) -> None:
        """A start or a stock-taking that failed: what the store and the rings hold cannot be
        counted, so it all stays (a temporary data directory too, if it holds anything) and
        the error that stopped the run is what the user sees."""
        durable = self.settings.storage == "disk"
        if self._own_data_dir and durable and (rings.rings_holding or store_stock(self.data_dir).item_ids.size):
            self.keep_data_dir = True
            log.warning("the run stopped before its work could be counted: its data directory %s is kept",
                        self.data_dir)
        self._clean_up(rings, keep_rings=durable and (not self._own_data_dir or self.keep_data_dir))

    def _clean_up(self, rings: RingStock, keep_rings: bool) -> None:
        """Remove what the stopped processes left in /dev/shm (a memory tier a killed broker
        left too), except the producer rings that hold records never stored when the store
        outlives the run (the next broker on the data directory stores them first), and
        anything a live process uses (`remove_leftovers`)."""
        keep = set(rings.rings_holding) if keep_rings else set()
        left = remove_leftovers(self.data_dir, keep_rings=keep)
        if left:
            log.info("removed %d shared-memory objects that stopped processes left: %s", len(left), left)
        if keep:
            log.warning("%d producer rings hold records the broker has not stored: they stay for the next "
                        "broker on %s", len(keep), self.data_dir)

    def cleanup(self) -> None:
        """Remove the temporary data directory (a given one is the user's: it stays), unless
        a failed run kept it for its unfinished work."""
        if self._own_data_dir and not self.keep_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

