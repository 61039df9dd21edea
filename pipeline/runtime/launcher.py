"""`pipeline launch`: one node's whole pipeline, from a workload to a run report (SPEC §7).

    outcome = Launcher(settings, workload, console).run()
    outcome.report["lost"] == 0

What a run does, in order:
    1. the broker (its data directory: given, or a temporary one removed afterwards);
    2. one consumer per GPU (pinned with CUDA_VISIBLE_DEVICES), or `consumers` CPU ones;
    3. the producers, each feeding its round-robin share of the workload;
    4. a watch loop: the broker's status twice a second -> live progress; the run is done
       when every producer has handed over its share and nothing is queued or pending;
    5. the stop, in dependency order: producers (already gone), consumers (each finishes its
       batch in hand), then the broker;
    6. the report: the broker's final counters against the consumers' results files.

Ctrl-C (SIGINT) reaches only this process (children run in their own process groups): the
first one stops the run in the order above and still prints the report of what was done; a
second one kills every child. Either way no process and no shared-memory object is left:
what a killed child could not unlink, this process removes (it owns the run).

Results of a run go to `data_dir/results/run-<UTC time>/`, one JSON-lines file per consumer,
so a data directory reused across runs never mixes two runs' accounting.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field

from pipeline.accounting import summarize_results
from pipeline.broker.service import BrokerConfig
from pipeline.broker.storage.inspect import live_item_ids
from pipeline.errors import ProtocolError
from pipeline.consumer.process import ConsumerConfig
from pipeline.producer.workload import Workload
from pipeline.runtime.gpus import detect_gpus
from pipeline.runtime.local import (
    CTX,
    STOP_POLL_S,
    broker_status,
    dispatched_segments,
    own_process_group,
    remove_leftovers,
    start_child,
    start_broker,
    start_consumer,
    stop_process,
)
from pipeline.runtime.settings import DEFAULT_CPU_CONSUMERS, LaunchSettings
from pipeline.runtime.signals import stop_on_signals

log = logging.getLogger("pipeline.launch")

# How often the watch loop asks the broker for its status (and redraws the progress).
WATCH_INTERVAL_S = 0.5
# How long a stopping producer may wait for the broker to store what it already published.
PRODUCER_STOP_TIMEOUT_S = 30.0
# How long a consumer may take to finish its batch in hand, and the broker to close its
# files, before they are killed.
STOP_TIMEOUT_S = 30.0
# How long to wait for a broker that stopped answering to be seen exiting: its exit status
# is the clearer message, and a killed process can take a moment to be reaped on a loaded
# machine (1 s was seen to fall short).
BROKER_EXIT_WAIT_S = 5.0
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


def _produce_main(socket_path: str, workload: Workload, index: int, count: int,
                  replay_speed: float | None) -> None:
    """A producer process: feed its share, then wait until the broker stored all of it.
    SIGTERM stops the feed between submit calls; what went in is still handed over."""
    own_process_group()
    stop = stop_on_signals((signal.SIGTERM,))
    from pipeline.producer.client import BrokerProducer
    from pipeline.producer.feed import feed

    code = 0
    try:
        client = BrokerProducer(socket_path)
        try:
            items = itertools.takewhile(lambda _item: not stop(), workload.items(index, count))
            feed(client, items, replay_speed=replay_speed)
        finally:
            client.close(timeout_s=PRODUCER_STOP_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a child reports any failure by its status
        log.error("producer %d: %s: %s", index, type(exc).__name__, exc)
        code = 1
    os._exit(code)


@dataclass(slots=True)
class Interrupts:
    """How many stop signals (SIGINT, SIGTERM) the launcher got: one asks for an orderly
    stop, two for a forceful one. The handler only counts: the launcher's code checks, so a
    second Ctrl-C can never cut its stop, report or clean-up short.
    NOTE: not `stop_on_signals`, whose second signal ends the process at once, and not a
    KeyboardInterrupt raised by the handler: either would skip killing the children and
    removing what they leave. Owner: the launcher's main thread."""

    count: int = 0

    @classmethod
    def install(cls) -> Interrupts:
        interrupts = cls()

        def handle(_signum, _frame) -> None:
            interrupts.count += 1

        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, handle)
        return interrupts

    def stopping(self) -> bool:
        return self.count >= 1

    def forcing(self) -> bool:
        return self.count >= 2


def start_producers(socket_path: str, workload: Workload, count: int, replay_speed: float | None) -> list:
    """`count` producer processes, producer k feeding items k, k + count, ... of `workload`."""
    processes = []
    for index in range(count):
        process = CTX.Process(target=_produce_main, name=f"producer-{index}",
                              args=(socket_path, workload, index, count, replay_speed))
        start_child(process)
        processes.append(process)
    return processes


@dataclass(slots=True)
class FeedOutcome:
    failed: int  # producers that exited with an error
    interrupted: bool  # Ctrl-C: the producers stopped feeding and handed over what they had


def feed_processes(socket_path: str, workload: Workload, count: int, replay_speed: float | None) -> FeedOutcome:
    """Feed `workload` through `count` producer processes and wait until all of it is stored
    (or Ctrl-C: the producers then stop feeding and hand over what they submitted; a second
    Ctrl-C kills them)."""
    interrupts = Interrupts.install()
    processes = start_producers(socket_path, workload, count, replay_speed)
    while any(p.is_alive() for p in processes) and not interrupts.stopping():
        processes[0].join(STOP_POLL_S)  # any of them: the loop checks them all
    for process in processes:
        stop_process(process, timeout_s=PRODUCER_STOP_TIMEOUT_S, forced=interrupts.forcing)
    return FeedOutcome(sum(1 for p in processes if p.exitcode != 0 and not interrupts.stopping()),
                       interrupts.stopping())


class Launcher:
    """Runs one workload through a fresh broker, consumers and producers.

    Owner: the launching process's main thread (it installs the SIGINT handler). Not
    thread-safe. `on_status(status, now_s)` is called with every status the watch loop
    reads (the live progress display hooks in there)."""

    def __init__(self, settings: LaunchSettings, workload: Workload, on_status=None) -> None:
        self.settings = settings
        self.workload = workload
        self.on_status = on_status or (lambda status, now_s: None)
        self.on_metrics = lambda port: None  # told the metrics port (0 picks a free one)
        self._own_data_dir = settings.data_dir is None
        self.data_dir = settings.data_dir or tempfile.mkdtemp(prefix="shape-broker-")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.results_dir = os.path.join(self.data_dir, "results", f"run-{stamp}-{os.getpid()}")
        self.config = BrokerConfig(self.data_dir)
        self.broker = None
        self.consumers: list = []
        self.producers: list = []
        self.metrics = None
        self.interrupts = Interrupts()
        self._unfinished_ids: set[int] | None = None  # read from the store on an early stop

    def run(self) -> LaunchOutcome:
        self.interrupts = Interrupts.install()
        stop = self.interrupts.stopping
        started_s = time.monotonic()
        final: dict | None = None
        why, code = "completed", EXIT_OK
        try:
            self._start()
            final, why = self._watch(stop)
            code = {"completed": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(why, EXIT_FAILED)
        finally:
            final = self._stop(final)
        wall_s = time.monotonic() - started_s
        report = self._report(final, wall_s, completed=why == "completed")
        return LaunchOutcome(report, code, why, self.data_dir, self.results_dir)

    # ----------------------------------------------------------------- start

    def _start(self) -> None:
        s = self.settings
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.broker = start_broker(self.config, s.storage, s.durability)
        if s.metrics_port is not None:
            from pipeline.metrics import MetricsServer

            socket_path = self.config.socket_path
            self.metrics = MetricsServer.start(s.metrics_port, lambda: broker_status(socket_path))
            self.on_metrics(self.metrics.port)
        for config in self.consumer_configs():
            self.consumers.append(start_consumer(config))
        self.producers = start_producers(self.config.socket_path, self.workload, s.producers, s.replay_speed)

    def consumer_configs(self) -> list[ConsumerConfig]:
        """One consumer per GPU (or `consumers` of them, spread over the GPUs), each serving one
        of the workload's models in turn; CPU consumers where there is no GPU."""
        s = self.settings
        gpus = detect_gpus()
        count = s.consumers or len(gpus) or DEFAULT_CPU_CONSUMERS
        models = self.workload.models
        if count < len(models):
            raise ValueError(f"the workload uses {len(models)} models but only {count} consumers run: "
                             f"each consumer serves one model (raise --consumers)")
        configs = []
        for k in range(count):
            gpu = gpus[k % len(gpus)] if gpus else None
            name = f"gpu{gpu}" if gpu is not None and gpu.isdigit() and count == len(gpus) else (
                f"gpu-{k}" if gpu is not None and count == len(gpus) else f"consumer{k}")
            configs.append(ConsumerConfig(
                self.config.socket_path, self.results_dir, name, model=models[k % len(models)],
                max_batch_items=s.max_batch, max_batch_tokens=s.max_tokens, max_input_len=s.max_input_len,
                engine=s.engine, engine_options=dict(s.engine_options), gpu=gpu))
        return configs

    # ----------------------------------------------------------------- watch

    def _watch(self, stop) -> tuple[dict, str]:
        """Poll the broker until the run is done, interrupted, or a process failed."""
        status: dict = {}
        while True:
            if stop():
                return status, "interrupted"
            failed = self._failure()
            if failed:
                return status, failed
            try:
                status = broker_status(self.config.socket_path)
            except (OSError, TimeoutError) as exc:
                self.broker.join(BROKER_EXIT_WAIT_S)  # a dying broker resets connections first
                return status, self._failure() or f"the broker stopped answering: {exc}"
            self.on_status(status, time.monotonic())
            if self._done(status):
                return status, "completed"
            time.sleep(WATCH_INTERVAL_S)

    def _failure(self) -> str:
        if not self.broker.is_alive():
            return f"the broker exited with status {self.broker.exitcode}"
        for process in self.consumers:
            if not process.is_alive():
                return f"{process.name} exited with status {process.exitcode}"
        for process in self.producers:
            if process.exitcode not in (None, 0):
                return f"{process.name} exited with status {process.exitcode}"
        return ""

    def _done(self, status: dict) -> bool:
        if any(process.exitcode is None for process in self.producers):
            return False
        received = status["items_received"] + status["items_recovered"]
        return received >= len(self.workload) and status["backlog_items"] == 0 and status["pending_items"] == 0

    # ----------------------------------------------------------------- stop

    def _stop(self, final: dict | None) -> dict | None:
        """Stop every child in dependency order; a second Ctrl-C kills them instead, and so
        does a dead broker (producers would wait for it to store their records, in vain; what
        it stored stays in the data directory). Returns the broker's last status."""
        def forced() -> bool:  # a second Ctrl-C, or a dead broker: nobody to hand work to
            return self.interrupts.forcing() or self.broker is None or not self.broker.is_alive()

        for process in self.producers:
            stop_process(process, timeout_s=PRODUCER_STOP_TIMEOUT_S, forced=forced)
        for process in self.consumers:
            stop_process(process, timeout_s=STOP_TIMEOUT_S, forced=forced)
        if not forced():
            fresh = self._fresh_status()
            if fresh is not None:
                final = fresh
                self._unfinished_ids = self._read_unfinished(final)
        if self.metrics is not None:
            self.metrics.close()
        if self.broker is not None:
            stop_process(self.broker, timeout_s=STOP_TIMEOUT_S, forced=self.interrupts.forcing)
        left = remove_leftovers(self.data_dir)
        if left:
            log.warning("removed %d shared-memory objects that stopped processes left: %s", len(left), left)
        return final

    def _read_unfinished(self, final: dict | None) -> set[int] | None:
        """Once producers and consumers are stopped and the broker is still up: the live item
        ids of the segments holding dispatched, unfinished entries. Only those can already
        have a result (a consumer wrote it and died before its completion arrived), and they
        are few: the batches consumers held. None when nothing is unfinished or the broker
        cannot say (the report then counts no overlap)."""
        if not final or not (final.get("backlog_items", 0) + final.get("pending_items", 0)):
            return None
        try:
            paths = dispatched_segments(self.config.socket_path)
        except (OSError, TimeoutError, ProtocolError) as exc:
            log.warning("cannot list the segments of dispatched items (%s): the report counts no overlap", exc)
            return None
        return live_item_ids(paths)

    def _fresh_status(self) -> dict | None:
        """The broker's status now, or None if it cannot answer (the last one read stands)."""
        if self.broker is None or not self.broker.is_alive():
            return None
        try:
            return broker_status(self.config.socket_path)
        except (OSError, TimeoutError, ProtocolError):
            return None

    def _report(self, final: dict | None, wall_s: float, completed: bool) -> dict:
        from pipeline.report import build_report

        results = summarize_results(self.results_dir)
        # A completed run is checked against what the workload holds plus what the broker
        # recovered from an earlier run on this data directory (that also catches items lost
        # before the broker stored them); a stopped one against what the broker received.
        expected = len(self.workload) + (final or {}).get("items_recovered", 0) if completed else None
        kept = self.settings.storage == "disk" and not self._own_data_dir
        return build_report(final or {}, results, wall_s, expected_items=expected, store_kept=kept,
                            unfinished_ids=self._unfinished_ids)

    def cleanup(self) -> None:
        """Remove the temporary data directory (a given one is the user's: it stays)."""
        if self._own_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
