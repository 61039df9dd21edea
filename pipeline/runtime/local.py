"""Start and stop the pipeline's processes on this machine (the launcher, benchmarks and
end-to-end tests use these).

Processes are forked from the caller, so they share its imports and start in milliseconds.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable

from pipeline.broker.config import BrokerConfig
from pipeline.broker.peers import namespace_for, object_prefix
from pipeline.consumer.process import ConsumerConfig
from pipeline.runtime.processes import serve_broker, serve_consumer
from shm.objects import named_objects, unlink_quietly

CTX = mp.get_context("fork")
# How long to wait for a new broker's socket to answer.
BROKER_START_TIMEOUT_S = 30.0


# prctl(2) option: the signal a process gets when its parent dies (Linux only).
_PR_SET_PDEATHSIG = 1


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def start_child(process) -> None:
    """`process.start()` with SIGINT and SIGTERM blocked across the fork: the child starts
    with them blocked (delivered once it unblocks them in `own_process_group`), so neither
    runs the parent's Python handlers in the child."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def own_process_group() -> None:
    """First thing in a child forked by `start_child`: the default actions for SIGINT and
    SIGTERM (until the child installs its own), its own process group, so a Ctrl-C reaches
    only the launcher, which stops its children in order (producers, consumers, then the
    broker); and SIGTERM (a graceful stop) if the launcher dies without stopping them.
    NOTE: letting Ctrl-C reach every process at once was rejected: the broker would stop
    while producers still wait for it to store their last records."""
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:  # the parent died before prctl: nobody will stop us
            os._exit(1)


def _broker_main(config: BrokerConfig, storage: str, durability: str, ready, metrics_port: int | None) -> None:
    own_process_group()
    os._exit(serve_broker(config, storage, durability, on_ready=lambda: ready.send("ready"),
                          metrics_port=metrics_port))


def _consumer_main(config: ConsumerConfig) -> None:
    own_process_group()
    os._exit(serve_consumer(config))


def start_broker(config: BrokerConfig, storage: str = "disk", durability: str = "process",
                 metrics_port: int | None = None):
    """Fork a broker and wait until it says it serves (recovered and caught up). A broker
    that cannot start (another one runs on the data directory, say) raises RuntimeError."""
    ready, child_end = CTX.Pipe(duplex=False)
    process = CTX.Process(target=_broker_main, args=(config, storage, durability, child_end, metrics_port),
                          name="broker")
    start_child(process)
    child_end.close()
    deadline = time.monotonic() + BROKER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready.poll(0.02):
            try:
                ready.recv()
                return process
            except EOFError:
                pass  # it exited before it was ready
        if not process.is_alive() or ready.closed:
            process.join(1)
            raise RuntimeError(f"the broker exited at start with status {process.exitcode}")
    process.kill()
    raise TimeoutError(f"the broker did not start on {config.data_dir} within {BROKER_START_TIMEOUT_S} s")


def start_consumer(config: ConsumerConfig):
    process = CTX.Process(target=_consumer_main, args=(config,), name=f"consumer-{config.name}")
    start_child(process)
    return process


# How often a stop checks whether it must turn forceful.
STOP_POLL_S = 0.05


def stop_process(process, sig: int = signal.SIGTERM, timeout_s: float = 20.0,
                 forced: Callable[[], bool] | None = None) -> int | None:
    """Ask a process to stop (SIGTERM: graceful), then kill it if it does not within
    `timeout_s`, or as soon as `forced()` turns true (a second Ctrl-C); its status."""
    if process.is_alive():
        os.kill(process.pid, sig)
    deadline = time.monotonic() + timeout_s
    while process.is_alive() and time.monotonic() < deadline and not (forced is not None and forced()):
        process.join(STOP_POLL_S)
    if process.is_alive():
        process.kill()
        process.join(5)
    return process.exitcode


def remove_leftovers(data_dir: str, keep_rings: set[str] = frozenset()) -> list[str]:
    """Unlink the shared-memory objects and semaphores named for `data_dir`'s runs: what a
    killed broker, producer or consumer could not remove, except the rings named in
    `keep_rings` (names as for shm_open) and their semaphores. Only for a caller that owns
    every process of the data directory (the launcher, after stopping them all)."""
    kept = {"/" + name.lstrip("/") for name in keep_rings}
    # Not the tmpfs store's directory (its broker removes it); not a ring that holds unstored
    # records, nor its semaphores (NAME.d, NAME.s); not another user's object under our name.
    shared, semaphores = named_objects(object_prefix(namespace_for(data_dir)))
    removed = [name for name in shared if name not in kept and unlink_quietly([name], [])]
    removed += [name for name in semaphores if name.rsplit(".", 1)[0] not in kept and unlink_quietly([], [name])]
    return removed
