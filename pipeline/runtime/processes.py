"""Entry points of the broker and consumer processes.

    serve_broker(BrokerConfig(data_dir), storage="disk", durability="process")
    serve_consumer(ConsumerConfig(socket_path, results_dir, name, ...))

Each installs SIGTERM/SIGINT handlers for a graceful stop, runs its loop, and returns an
exit status: 0 after a graceful stop, 2 after a fatal error (named in the log).

Storage tiers for a broker process (SPEC §5):
- `disk`: segment files under the data directory, durable (`process` or `power`).
- `memory`: the same segment files on tmpfs (`/dev/shm`), in RAM and gone when the broker
  stops or restarts. NOTE: the in-process MemoryTier (token ids on the broker's heap) was
  rejected for consumer processes: they read token ids zero-copy from mapped files, and a
  heap tier would have to copy every token into the descriptor ring. tmpfs keeps the zero-copy
  path and the one segment format, and costs no disk I/O.
"""

from __future__ import annotations

import gc
import logging
import os
import resource
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from pipeline.broker.config import BrokerConfig
from pipeline.broker.peers import ensure_namespace, namespace_for, object_prefix
from pipeline.broker.service import Broker
from pipeline.broker.state import lock_run_dir
from pipeline.storage.disk import DiskTier
from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.process import Consumer
from pipeline.runtime.datadir import owner_only_umask, prepare_data_dir
from pipeline.runtime.signals import stop_on_signals
from pipeline.wire.dirpin import DirPin, moved_message
from pipeline.wire.errors import ConfigError, DataDirMovedError, DurabilityError, PipelineError, ShapeGuardError
from pipeline.wire.layouts.names import BROKER_STATE_NAME
from pipeline.wire.protocol import DURABILITY_LEVELS

log = logging.getLogger("pipeline")

EXIT_OK = 0
EXIT_FATAL = 2
# Allocations between two young-generation collections (Python's default is 700). A loop
# turn makes about a thousand short-lived objects per 256-item batch (refs, lists, small
# arrays), so the default collected every batch and promoted live ones into full collections.
GC_YOUNG_THRESHOLD = 50_000
STORAGE_KINDS = ("disk", "memory")
# Where the memory tier keeps its segment files: tmpfs on Linux, so pages stay in RAM.
MEMORY_TIER_ROOT = "/dev/shm"


@dataclass(slots=True)
class OpenedStorage:
    """A storage tier and the directory its segment files live in (consumers read there).
    `volatile`: the directory is removed when the broker stops (the memory tier)."""

    tier: DiskTier
    directory: str
    volatile: bool


def memory_tier_dir(data_dir: str) -> str:
    """The memory tier's directory for a data directory (stable, so a leftover of a killed
    broker is found and removed at the next start)."""
    return os.path.join(MEMORY_TIER_ROOT, object_prefix(namespace_for(data_dir)) + "memory")


# Descriptors a broker holds besides its segment files and its peers' connections: the
# listener, the wake pipe, the lock, state, store log and log files, metrics, a few in-process
# read mappings (DiskTier.READ_MAPS_MAX, each a descriptor).
BROKER_FD_HEADROOM = 96
# Descriptors an open segment file holds: its own and the one Python's mmap keeps (a dup).
# Counted short, a broker at `ulimit -n 1024` runs out of descriptors (EMFILE) mid-run.
FDS_PER_OPEN_SEGMENT = 2
# Fewer open segment files than this and a sticky shape's lanes thrash the cache: a broker
# whose descriptor limit leaves less refuses to start, saying so, rather than fail later.
MIN_OPEN_SEGMENT_FILES = 16
# The soft limit a broker asks for where the hard one is unlimited.
_RAISED_UNLIMITED = 1 << 16


def open_files_budget(config: BrokerConfig) -> int:
    """How many segment files the broker may keep open: its soft descriptor limit (raised to
    the hard one first: a broker's own limit is its to raise), less what its peers at their
    limits and its own files need, two descriptors a segment, at most the store's default.
    ConfigError when that leaves fewer than MIN_OPEN_SEGMENT_FILES."""
    from pipeline.storage.segments import DEFAULT_OPEN_FILES_MAX

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        wanted = _RAISED_UNLIMITED if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
            soft = max(soft, wanted)
        except (OSError, ValueError):
            pass
    peers, need = broker_descriptors(config)
    if soft < need:
        raise descriptor_limit_error(soft, config)
    return min(DEFAULT_OPEN_FILES_MAX, (soft - BROKER_FD_HEADROOM - peers) // FDS_PER_OPEN_SEGMENT)


def broker_descriptors(config: BrokerConfig) -> tuple[int, int]:
    """(the descriptors a broker's peers hold at their limits, the fewest a broker needs)."""
    peers = config.max_consumers + config.max_producers + config.max_unregistered_peers
    return peers, BROKER_FD_HEADROOM + peers + MIN_OPEN_SEGMENT_FILES * FDS_PER_OPEN_SEGMENT


def descriptor_limit_error(limit: int, config: BrokerConfig) -> ConfigError:
    peers, need = broker_descriptors(config)
    return ConfigError(f"the descriptor limit (ulimit -n) is {limit}: a broker needs at least {need} ({peers} for "
                       f"its peers at their limits, {MIN_OPEN_SEGMENT_FILES} segment files); raise it (ulimit -n "
                       f"{max(need, 1024)})")


def check_descriptor_limit(config: BrokerConfig) -> None:
    """ConfigError, before anything starts, where the most a broker may raise its descriptor
    limit to (the hard limit) is less than it needs (`open_files_budget`)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    most = max(soft, _RAISED_UNLIMITED) if hard == resource.RLIM_INFINITY else hard
    if most < broker_descriptors(config)[1]:
        raise descriptor_limit_error(most, config)


def open_storage(data_dir: str, storage: str, durability: str, open_files_max: int | None = None) -> OpenedStorage:
    """The storage tier named by `storage` ("disk" or "memory"), recovered if on disk.
    `open_files_max`: segment files kept open at once (default: the store's)."""
    from pipeline.storage.diskio import Durability

    if storage not in STORAGE_KINDS:
        raise ValueError(f"storage must be one of {', '.join(STORAGE_KINDS)}, got {storage!r}")
    if durability not in DURABILITY_LEVELS:
        raise ValueError(f"durability must be one of {', '.join(DURABILITY_LEVELS)}, got {durability!r}")
    options = {} if open_files_max is None else {"open_files_max": open_files_max}
    if storage == "disk":
        return OpenedStorage(DiskTier.open(data_dir, Durability(durability), **options), data_dir, volatile=False)
    if durability == "power":
        raise ValueError("durability 'power' needs the disk tier: the memory tier is not durable")
    directory = memory_tier_dir(data_dir)
    if os.path.exists(directory):
        # Not durable by contract: what a killed broker left in RAM is not served again.
        log.warning("removing the memory tier of an earlier broker at %s", directory)
        shutil.rmtree(directory)
    os.makedirs(directory, mode=0o700)
    return OpenedStorage(DiskTier.open(directory, Durability.PROCESS, **options), directory, volatile=True)


def serve_broker(config: BrokerConfig, storage: str = "disk", durability: str = "process",
                 on_ready: Callable[[], None] | None = None, metrics_port: int | None = None,
                 metrics_token_file: str | None = None) -> int:
    """Run a broker until SIGTERM/SIGINT. `on_ready` is called once it serves (after
    recovery and the catch-up turn). `metrics_port`: serve Prometheus metrics there (to
    requests with the token in `metrics_token_file`, if given; else to this user only)."""
    stop = stop_on_signals()
    owner_only_umask()
    try:
        prepare_data_dir(config.data_dir)  # owner-only, or refused (another user could change it)
        pin = DirPin.take(config.data_dir)
        lock_fd = lock_run_dir(config.run_dir)  # before recovery touches any file
        ensure_namespace(config.data_dir, ran_before=os.path.exists(os.path.join(config.data_dir, BROKER_STATE_NAME)))
        opened = open_storage(config.data_dir, storage, durability, open_files_budget(config))
        broker = Broker(config, opened.tier, lock_fd=lock_fd, storage_dir=opened.directory)
    except (PipelineError, ValueError, OSError) as exc:
        log.critical("the broker cannot start: %s", exc)
        return EXIT_FATAL
    try:
        metrics = _start_metrics(metrics_port, metrics_token_file, config.socket_path)
    except (PipelineError, OSError) as exc:  # a metrics port in use, a token file refused
        log.critical("the broker cannot start: %s", exc)
        _close_broker(broker, opened)
        return EXIT_FATAL
    log.info("broker %d serving %s (%s, %s)", os.getpid(), config.socket_path, storage, durability)
    if on_ready is not None:
        on_ready()
    quiet_gc()
    fatal = False
    try:
        broker.run(stop)
    except (ShapeGuardError, DurabilityError, DataDirMovedError) as exc:
        log.critical("FATAL, stopping the broker: %s", exc)
        fatal = True
        return EXIT_FATAL
    finally:
        if metrics is not None:
            metrics.close()
        # A data directory that moved is left as a kill leaves it (closing writes and
        # removes by path): the next broker on it recovers it once it is back.
        moved = pin.moved()
        if not moved:
            _close_broker(broker, opened)
        elif not fatal:
            log.warning("stopping without closing its files: %s", moved_message(config.data_dir, moved))
    return EXIT_OK


def quiet_gc() -> None:
    """Before a process loop: take everything start-up made (imported modules, recovered
    state) out of the cyclic collector's sight (gc.freeze), and collect young objects after
    GC_YOUNG_THRESHOLD allocations. Reference counting still frees everything at once; only
    the search for cycles, which the loops do not make, runs less.

    NOTE: measured in the broker with the flood workload of `pipeline bench e2e`: the collector took
    0.29 us per item (8% of the broker's CPU), half of it in five full collections that each
    walked every object numpy and the imports had made.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)


def _close_broker(broker: Broker, opened: OpenedStorage) -> None:
    left = broker.storage.queued_items() + broker.storage.pending_items()
    broker.close()
    if opened.volatile:
        if left:
            log.warning("the memory tier drops %d items that were not completed", left)
        shutil.rmtree(opened.directory, ignore_errors=True)


def _start_metrics(port: int | None, token_file: str | None, socket_path: str):
    """A Prometheus endpoint whose scrapes ask this broker for its status over its own socket,
    so the HTTP thread never touches the loop's state."""
    if port is None:
        return None
    from pipeline.reporting.metrics_endpoint import MetricsServer
    from pipeline.wire.client import broker_status

    server = MetricsServer.start(port, lambda: broker_status(socket_path), token_file=token_file)
    log.info("metrics on http://127.0.0.1:%d/metrics", server.port)
    return server


def serve_consumer(config: ConsumerConfig) -> int:
    stop = stop_on_signals()
    owner_only_umask()
    # The tracker's report of what it unlinks names what an engine killed at its end left:
    # expected, not the user's to act on.
    sys.warnoptions.append("ignore:resource_tracker:UserWarning")
    try:
        consumer = Consumer(config)  # opening its results file can fail (ResultsFileError)
        quiet_gc()
        consumer.run(stop)
    except PipelineError as exc:
        log.critical("FATAL, stopping consumer %s: %s", config.name, exc)
        return EXIT_FATAL
    finally:
        _stop_resource_tracker()
    return EXIT_OK


def _stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker if this process started one, and wait for it:
    an engine's processes (vLLM's engine core and workers, spawned with this process's
    tracker) register their shared memory and semaphores there, and the tracker unlinks
    what they left once no process holds it. The consumer's process group is killed as it
    ends, the tracker with it, before it would get to that. NOTE: `_stop` is private
    (CPython 3.8 to 3.13 have it); a tracker this process did not start is left alone."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    stop = getattr(tracker, "_stop", None)
    pid = getattr(tracker, "_pid", None)
    try:
        ours = pid is not None and psutil.Process(pid).ppid() == os.getpid()
    except psutil.Error:
        ours = False
    if stop is None or not ours:
        return
    try:
        stop()
    except (ChildProcessError, OSError) as exc:
        log.warning("stopping multiprocessing's resource tracker: %s", exc)
