"""A workload's run on a node that serves already (`pipeline.runtime.node`: the batch
service's broker and consumers, shared by every batch): the launcher's run with producers
only.

    launcher = AttachedLauncher(settings, workload, node_dir, done=lambda: job_answered_all())
    outcome = launcher.run()     # "completed" once `done()` and every producer handed over

What differs from `Launcher`: no broker or consumer is started or stopped here (the node's
owner does both, and restarts a node that died); the producers register with the node's
broker (its socket, from the node's data directory); the run is done when the owner says
so (`done`: a batch job has every request answered), not when the broker has nothing left,
since the broker holds other workloads' items too. A broker that does not answer is waited
for (its node is being restarted); what the producers published stays in their rings, which
the node's broker drains. A stop (SIGTERM, Ctrl-C) stops the producers gracefully: what they
published is handed over, and stays in the node's store for the next run.

The data directory (`settings.data_dir`) is the workload's own: its lock, its files. The
store, the results files and the producers' rings are the node's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pipeline.producer.workload import Workload
from pipeline.runtime.inventory import StoreStock
from pipeline.runtime.launcher import PRODUCER_STOP_TIMEOUT_S, Launcher
from pipeline.runtime.local import stop_process
from pipeline.runtime.producer_processes import start_producers
from pipeline.runtime.settings import LaunchSettings
from pipeline.runtime.tables import broker_config
from pipeline.wire.status import BrokerStatus


class AttachedLauncher(Launcher):
    """See the module's doc. Owner: as `Launcher`'s."""

    def __init__(self, settings: LaunchSettings, workload: Workload, node_dir: str, done: Callable[[], bool],
                 on_status=None, summarize=None, metrics=None) -> None:
        assert settings.data_dir is not None and settings.metrics_port is None, settings
        kwargs = {} if summarize is None else {"summarize": summarize}
        super().__init__(settings, workload, on_status=on_status, metrics=metrics, **kwargs)
        self.node_dir = node_dir
        self.config = broker_config(node_dir, settings.broker, "settings")  # the node's broker
        self.consumer_count = 0
        self.placements = []
        self.done_when = done

    def _start(self) -> None:
        self.taken_over = StoreStock()  # the node's store is its broker's to deliver
        self.while_broker_starts()
        self.before_producers(self.node_dir)
        if self.interrupts.stopping():
            return  # stopped meanwhile: no producer starts
        self._producers_span_ns[0] = time.monotonic_ns()
        s = self.settings
        self.producers = start_producers(self.config.socket_path, self.workload, s.producers, s.replay_speed,
                                         self.ledger)

    def _done(self, status: BrokerStatus | None) -> bool:
        return self._producers_finished() and self.done_when()

    def _stop(self, final: BrokerStatus | None, completed: bool) -> BrokerStatus | None:
        """The producers, gracefully (a second Ctrl-C kills them): the node is not this run's."""
        for index, process in enumerate(self.producers):
            stop_process(process, timeout_s=PRODUCER_STOP_TIMEOUT_S,
                         forced=lambda k=index: self.interrupts.forcing() or self._stuck(k))
        return final

    def _fresh_status(self) -> BrokerStatus | None:
        return None  # the node's counters are every workload's: this run's report has none
