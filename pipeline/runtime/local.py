"""Start and stop the pipeline's processes on this machine (the launcher, benchmarks and
end-to-end tests use these).

Processes are forked from the caller, so they share its imports and start in milliseconds.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

from pipeline.broker.config import BrokerConfig
from pipeline.broker.peers import OBJECT_PREFIX_START
from pipeline.storage.diskio import disk_reserve_bytes
from pipeline.consumer.config import ConsumerConfig
from pipeline.producer.producer import DEFAULT_RING_CAPACITY_BYTES
from pipeline.runtime.cleanup import apply_cleanup, held_broker_lock, plan_cleanup
from pipeline.runtime.daemon import StageFiles, stage_process
from pipeline.runtime.datadir import hold_for_launch, release_launch
from pipeline.runtime.processes import serve_broker, serve_consumer
from pipeline.wire.errors import DataDirError, DataDirInUseError, LiveRunError, ShmSpaceError
from shm.objects import DEV_SHM, RAISE_HINT, SEMAPHORE_FOOTPRINT_BYTES, mapped_only_by, shm_space, unlink_if_same
from shm.ring_layout import ring_footprint_bytes

log = logging.getLogger("pipeline")

CTX = mp.get_context("fork")
# How long to wait for a new broker's socket to answer.
BROKER_START_TIMEOUT_S = 30.0


# prctl(2) option: the signal a process gets when its parent dies (Linux only).
_PR_SET_PDEATHSIG = 1


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The pid of the process that forked this one through `start_child` (set in the parent just
# before the fork, so the child finds it in its copy of memory): a child whose parent is no
# longer it was orphaned before it could ask for PR_SET_PDEATHSIG. NOTE: comparing with 1
# was rejected: under a subreaper (a container's init, systemd --user) orphans get its pid.
_forked_by = 0


def start_child(process) -> None:
    """`process.start()` with SIGINT and SIGTERM blocked across the fork: the child starts
    with them blocked (delivered once it unblocks them in `own_process_group`), so neither
    runs the parent's Python handlers in the child."""
    global _forked_by
    _forked_by = os.getpid()
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
        parent = os.getppid()
        if (parent != _forked_by) if _forked_by else (parent == 1):  # the parent died before prctl
            os._exit(1)


def stop_with_parent() -> Callable[[], None]:
    """A `preexec_fn` for a command this process starts (subprocess): the child gets SIGTERM
    (a graceful stop) when this process dies, however it dies, and exits at once where this
    process died before it asked. prctl is looked up here, before the fork: the child of a
    threaded process calls nothing that may take a lock another thread held.
    NOTE: the signal comes when the *thread* that started the child ends: start commands
    from a thread that lives as long as the process (the scheduler's)."""
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:
                os._exit(1)
    return preexec


def _broker_main(config: BrokerConfig, storage: str, durability: str, ready, metrics_port: int | None) -> None:
    own_process_group()
    os._exit(serve_broker(config, storage, durability, on_ready=lambda: ready.send("ready"),
                          metrics_port=metrics_port))


def _consumer_main(config: ConsumerConfig) -> None:
    own_process_group()
    os._exit(serve_consumer(config))


@dataclass(slots=True)
class BrokerStart:
    """A broker forked and not yet serving (`fork_broker`): its process, and the pipe it says
    it serves on."""

    process: object
    ready: object
    data_dir: str


def fork_broker(config: BrokerConfig, storage: str = "disk", durability: str = "process",
                metrics_port: int | None = None) -> BrokerStart:
    """Fork a broker; `await_broker` waits until it serves. The caller may work meanwhile
    (the broker's recovery runs beside it)."""
    ready, child_end = CTX.Pipe(duplex=False)
    process = CTX.Process(target=_broker_main, args=(config, storage, durability, child_end, metrics_port),
                          name="broker")
    start_child(process)
    child_end.close()
    return BrokerStart(process, ready, config.data_dir)


def await_broker(start: BrokerStart):
    """The broker's process once it says it serves (recovered and caught up). A broker that
    cannot start (another one runs on the data directory, say) raises RuntimeError."""
    process, ready = start.process, start.ready
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
    raise TimeoutError(f"the broker did not start on {start.data_dir} within {BROKER_START_TIMEOUT_S} s")


def start_broker(config: BrokerConfig, storage: str = "disk", durability: str = "process",
                 metrics_port: int | None = None):
    """Fork a broker and wait until it serves (`fork_broker`, `await_broker`)."""
    return await_broker(fork_broker(config, storage, durability, metrics_port))


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
    _kill_group_left(process.pid)
    return process.exitcode


def _kill_group_left(pid: int | None) -> None:
    """Kill what is left of a stopped child's process group: the processes it started (a
    vllm consumer's engine core and workers) outlive it when it was killed, holding memory
    (a GPU's) that the next engine needs. Children run in their own groups, led by their pid
    (`own_process_group`); a group that is gone is nothing to do.

    What only they map in /dev/shm is removed once they are killed (vLLM's message queues
    and semaphores, hundreds of MiB: their creator was the killed child, and the resource
    tracker that would remove them is in the group too); the pipeline's own objects are
    left to the cleanup, which judges them by what they hold."""
    if pid is None:
        return
    members = _group_members(pid)
    if not members:
        return
    held = mapped_only_by(members, OBJECT_PREFIX_START)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for path, inode in held:
        if unlink_if_same(path, inode):
            log.info("removed %s, which only the killed processes of group %d used", path, pid)


def _group_members(pgid: int) -> set[int]:
    members = set()
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                members.add(process.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def remove_leftovers(data_dir: str, keep_rings: Iterable[str] = frozenset()) -> list[str]:
    """Remove what stopped processes of `data_dir`'s runs left: in /dev/shm its rings,
    semaphores and memory tier, in run/ stale pid files and a dead socket; every producer
    ring's unstored records are discarded but those of the rings named in `keep_rings`
    (names as for shm_open), which stay with their semaphores for the next broker. It is
    `pipeline tools cleanup`'s plan (pipeline/runtime/cleanup.py), so nothing of a live run
    goes: nothing at all while a broker holds the data directory's lock (a warning says so),
    and never what a live process maps (a `pipeline produce` waiting for a broker, a staged
    consumer). For the process that stopped the data directory's broker (a launcher, a
    node, a benchmark). Returns the names (the path, for a file) of what it removed."""
    kept = frozenset("/" + name.lstrip("/") for name in keep_rings)
    try:
        with held_broker_lock(data_dir, "nothing of it is removed"):
            plan = plan_cleanup(data_dir, discard_unstored=True, keep_rings=kept)
            removed = apply_cleanup(plan)
    except LiveRunError as exc:
        log.warning("%s", exc)
        return []
    except DataDirError as exc:  # not (or no longer) a data directory: nothing of a run to remove
        log.info("nothing removed: %s", exc)
        return []
    for found in plan.keep:
        if found.name and found.name.rsplit(".", 1)[0] not in kept:  # a kept ring, or its NAME.d, NAME.s
            log.warning("left in %s: %s %s: %s", DEV_SHM, found.kind, found.path, found.why)
    return [found.name or found.path for found in removed]


# ---------------------------------------------------------------------- what a run needs

# The memory tier's store lives on /dev/shm too, and stops growing while less than its
# reserve would stay free there (`disk_reserve_bytes`: 2% of /dev/shm, 1 to 256 MiB). Room
# it needs above that: the default demo, hundreds of lanes, finished on an 8 MiB disk that
# held its 1 MiB reserve and 5 MB of results besides (tests/runtime/test_disk_full.py);
# below it the store spends the run paused for space.
MEMORY_TIER_WORKING_BYTES = 8 << 20
_MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class ShmNeeds:
    """What a run creates in /dev/shm: a ring per producer and per consumer, the broker's
    doorbell (none for producers that join a running broker), and the memory tier's store."""

    producers: int
    consumers: int = 0
    descriptor_ring_bytes: int = 0
    memory_tier: bool = False
    doorbells: int = 1
    producer_ring_bytes: int = DEFAULT_RING_CAPACITY_BYTES

    def producer_bytes(self) -> int:
        return ring_footprint_bytes(self.producer_ring_bytes)

    def store_bytes(self, shm_total_bytes: int) -> int:
        return disk_reserve_bytes(shm_total_bytes) + MEMORY_TIER_WORKING_BYTES if self.memory_tier else 0

    def total_bytes(self, shm_total_bytes: int, producers: int | None = None) -> int:
        producers = self.producers if producers is None else producers
        return (producers * self.producer_bytes() + self.consumers * ring_footprint_bytes(self.descriptor_ring_bytes)
                + self.doorbells * SEMAPHORE_FOOTPRINT_BYTES + self.store_bytes(shm_total_bytes))


def check_shm_space(needs: ShmNeeds) -> None:
    """Refuse a run that /dev/shm cannot hold, before anything starts (ShmSpaceError: what it
    needs, what is free, what to raise, or how many producers would fit). Every object is
    reserved whole at its creation, so a run that passes gets no SIGBUS from a short
    /dev/shm; one that fills meanwhile still gets ShmSpaceError at the creation."""
    free, total = shm_space()
    need = needs.total_bytes(total)
    if need <= free:
        return
    parts = [f"{needs.producers} producer rings of {needs.producer_bytes() / _MIB:.1f} MiB"]
    if needs.consumers:
        parts.append(f"{needs.consumers} consumer descriptor rings of "
                     f"{ring_footprint_bytes(needs.descriptor_ring_bytes) / _MIB:.1f} MiB")
    if needs.memory_tier:
        parts.append(f"the memory tier's store (at least {needs.store_bytes(total) / _MIB:.1f} MiB, the 2% of "
                     f"/dev/shm it leaves free included)")
    if needs.doorbells:
        parts.append("the doorbell")
    size_mib = -(-(total - free + need) // _MIB)
    fits = max((k for k in range(needs.producers) if needs.total_bytes(total, k) <= free), default=0)
    lower = f", or lower --producers to {fits}" if fits else ""
    raise ShmSpaceError(f"{DEV_SHM} has {free / _MIB:.1f} MiB free of {total / _MIB:.1f} MiB, and this run needs "
                        f"{need / _MIB:.1f} MiB there ({', '.join(parts)}): raise it to at least "
                        f"{size_mib} MiB ({RAISE_HINT.replace('...', f'{size_mib}m')}){lower}")


def claim_data_dir(data_dir: str, needs: ShmNeeds) -> int:
    """Before a launcher starts anything: hold `data_dir` for its run (`hold_for_launch`),
    refuse it if a broker already serves it (a staged one: a launch starts its own), and
    check that /dev/shm holds what the run needs. The lock's descriptor (`release_launch`
    ends the hold); DataDirInUseError or ShmSpaceError, with nothing started or removed."""
    fd = hold_for_launch(data_dir)
    try:
        _await_orphan_broker(data_dir)
        with held_broker_lock(data_dir, f"a launch starts a broker of its own; feed that one with `pipeline produce "
                                        f"FILE --data-dir {data_dir}`, or stop it first (`pipeline broker stop "
                                        f"--data-dir {data_dir}`)", error=DataDirInUseError):
            pass
        check_shm_space(needs)
    except BaseException:
        release_launch(fd)
        raise
    return fd


# How long a launch waits for the broker of a killed launcher's run to stop (it got SIGTERM
# when its launcher died; its graceful stop closes the store): the launcher's own bound on a
# broker's stop, so a rerun right after a kill -9 takes over instead of being refused.
ORPHAN_BROKER_WAIT_S = 30.0


def _await_orphan_broker(data_dir: str) -> None:
    """While a broker holds `data_dir`'s broker lock that no stage pid file names (so a
    launcher's, and this process holds the launch lock: that launcher is gone), wait for it
    to stop, up to ORPHAN_BROKER_WAIT_S; a staged broker (`pipeline broker start`) is not
    waited for. What is left then is refused by the caller's check of the lock."""
    stage = StageFiles.of(BrokerConfig(data_dir).run_dir, "broker")
    deadline = time.monotonic() + ORPHAN_BROKER_WAIT_S
    while stage_process(stage.pid_path) is None and time.monotonic() < deadline:
        try:
            with held_broker_lock(data_dir, "", error=DataDirInUseError):
                return
        except DataDirInUseError:
            time.sleep(STOP_POLL_S)


def exit_text(code: int) -> str:
    """A child's exit code in words: "exit status 1", "killed by SIGABRT"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def process_status(pid: int) -> str:
    """A process's state in words ("stopped" for a SIGSTOPped one), for messages."""
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"
