"""A workload's run on a node that serves already (`pipeline.runtime.node`: the batch
service's broker and consumers, shared by every batch): the launcher's run with producers
only.

    launcher = AttachedLauncher(settings, workload, node_dir, requests, answered=..., unqueued=...)
    outcome = launcher.run()     # "completed" once every request is answered and every
                                 # producer handed over

What differs from `Launcher`: no broker or consumer is started or stopped here (the node's
owner does both, and restarts a node that died); the producers register with the node's
broker (its socket, from the node's data directory); the run is done when its owner has
every request answered (`answered()` reaches `requests`), not when the broker has nothing
left, since the broker holds other workloads' items too. A broker that does not answer is
waited for (its node is being restarted); what the producers published stays in their
rings, which the node's broker drains. Once the producers are done, an answer count that
stands still for ATTACHED_STALL_S makes the run ask its owner what is neither answered nor
queued on the node (`unqueued()`: a ring a stopping node removed before its broker stored
it); any such request ends the run, failed, and the next run submits it. A stop (SIGTERM, Ctrl-C) stops the producers gracefully: what they
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


# The most requests a job keeps published and not yet answered on the node (its producers
# wait past it; they can pass it by a feed chunk each): enough to keep the engines fed
# for about a second at 8,000 requests/s (ten watches) and to group a job's prefixes, few enough
# that the node's queue holds seconds of any one job, so a batch that makes way for another
# with a deadline at risk leaves the engines to it within seconds, not after its whole input.
NODE_WINDOW_ITEMS = 8192
# How often a run on a node reads its answers and moves its producers' allowance: the window
# drains in about a second at full rate, so the launcher's own watch (0.5 s) left producers
# waiting up to half of it; a watch reads only the answers written since the last, and asks
# the node's broker for its status only every WATCH_INTERVAL_S (the launcher's
# status_interval_s: every job on the node asks it).
# NOTE: at 0.5 s the window cost a 20,000-request batch 0.4 s of its 3.5 s (a warm server).
ATTACHED_WATCH_INTERVAL_S = 0.1
# How long the answers of a run whose producers are done may stand still before the run
# checks that what is left is still queued on the node: a scan of the node's store, so not
# at every watch; a queued request waits behind other jobs' work, which can take minutes.
ATTACHED_STALL_S = 30.0


class AttachedLauncher(Launcher):
    """See the module's doc. Owner: as `Launcher`'s."""

    watch_interval_s = ATTACHED_WATCH_INTERVAL_S

    def __init__(self, settings: LaunchSettings, workload: Workload, node_dir: str, requests: int,
                 answered: Callable[[], int], unqueued: Callable[[], int], on_status=None, summarize=None,
                 metrics=None) -> None:
        assert settings.data_dir is not None and settings.metrics_port is None, settings
        kwargs = {} if summarize is None else {"summarize": summarize}
        super().__init__(settings, workload, on_status=on_status, metrics=metrics, **kwargs)
        self.node_dir = node_dir
        self.config = broker_config(node_dir, settings.broker, "settings")  # the node's broker
        self.consumer_count = 0
        self.placements = []
        self.requests = requests
        self.answered = answered
        self.unqueued = unqueued
        self._last_answered = -1
        self._still_since_s = 0.0  # when the answer count last moved
        self._lost = ""  # why the run ends: requests neither answered nor queued
        self.clock: Callable[[], float] = time.monotonic  # a test's own
        self._answered_at_start = 0

    def _start(self) -> None:
        self.taken_over = StoreStock()  # the node's store is its broker's to deliver
        self.while_broker_starts()
        self.before_producers(self.node_dir)
        self._answered_at_start = self.answered()
        self._supervise()  # the first allowance, before a producer starts
        if self.interrupts.stopping():
            return  # stopped meanwhile: no producer starts
        self._producers_span_ns[0] = time.monotonic_ns()
        s = self.settings
        self.producers = start_producers(self.config.socket_path, self.workload, s.producers, s.replay_speed,
                                         self.ledger)

    def _done(self, status: BrokerStatus | None) -> bool:
        if not self._producers_finished():
            return False
        answered = self.answered()
        if answered >= self.requests:
            return True
        now_s = self.clock()
        if answered != self._last_answered:
            self._last_answered, self._still_since_s = answered, now_s
        elif now_s - self._still_since_s >= ATTACHED_STALL_S:
            self._still_since_s = now_s
            lost = self.unqueued()
            if lost:
                self._lost = (f"{lost:,} requests are neither answered nor queued on the node (a stopping node "
                              f"removed what it had not stored): the next run submits them")
        return False

    def _failure(self) -> str:
        return self._lost or super()._failure()

    def _supervise(self) -> None:
        """The launcher's supervision of the producers, then their allowance: what this run
        published stays within NODE_WINDOW_ITEMS of what it had answered."""
        super()._supervise()
        answered = self.answered() - self._answered_at_start
        self.ledger.set_allowance(max(0, answered + NODE_WINDOW_ITEMS - self._retired_published))

    def _stop(self, final: BrokerStatus | None, completed: bool) -> BrokerStatus | None:
        """The producers, gracefully (a second Ctrl-C kills them): the node is not this run's."""
        for index, process in enumerate(self.producers):
            stop_process(process, timeout_s=PRODUCER_STOP_TIMEOUT_S,
                         forced=lambda k=index: self.interrupts.forcing() or self._stuck(k))
        return final

    def _fresh_status(self) -> BrokerStatus | None:
        return None  # the node's counters are every workload's: this run's report has none
