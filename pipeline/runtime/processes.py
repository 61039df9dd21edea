"""Entry points of the broker and consumer processes.

    serve_broker(BrokerConfig(data_dir), storage="disk", durability="process")
    serve_consumer(ConsumerConfig(socket_path, results_dir, name, ...))

Each installs SIGTERM/SIGINT handlers for a graceful stop, runs its loop, and returns an
exit status: 0 after a graceful stop, 2 after a fatal error (named in the log).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from pipeline.broker.service import Broker, BrokerConfig, lock_run_dir
from pipeline.broker.storage.base import StorageTier
from pipeline.consumer.process import Consumer, ConsumerConfig
from pipeline.errors import DurabilityError, PipelineError, ShapeGuardError
from pipeline.runtime.signals import stop_on_signals

log = logging.getLogger("pipeline")

EXIT_OK = 0
EXIT_FATAL = 2


def open_storage(data_dir: str, storage: str, durability: str) -> StorageTier:
    """The storage tier named by `storage` ("disk" or "memory"), recovered if on disk."""
    from pipeline.broker.storage.disk import DiskTier
    from pipeline.broker.storage.segment import Durability

    if storage == "memory":
        # NOTE: consumer processes read token ids from segment files (descriptors name the
        # file and offset), so the memory tier serves only in-process consumers for now.
        raise ValueError("the memory tier cannot feed consumer processes yet: use storage 'disk'")
    if storage != "disk":
        raise ValueError(f"storage must be 'disk' or 'memory', got {storage!r}")
    return DiskTier.open(data_dir, Durability(durability))


def serve_broker(config: BrokerConfig, storage: str = "disk", durability: str = "process",
                 on_ready: Callable[[], None] | None = None) -> int:
    """Run a broker until SIGTERM/SIGINT. `on_ready` is called once it serves (after
    recovery and the catch-up turn)."""
    stop = stop_on_signals()
    os.makedirs(config.data_dir, mode=0o700, exist_ok=True)
    try:
        lock_fd = lock_run_dir(config.run_dir)  # before recovery touches any file
        tier = open_storage(config.data_dir, storage, durability)
        broker = Broker(config, tier, lock_fd=lock_fd)
    except (PipelineError, ValueError) as exc:
        log.critical("the broker cannot start: %s", exc)
        return EXIT_FATAL
    log.info("broker %d serving %s (%s, %s)", os.getpid(), config.socket_path, storage, durability)
    if on_ready is not None:
        on_ready()
    try:
        broker.run(stop)
    except (ShapeGuardError, DurabilityError) as exc:
        log.critical("FATAL, stopping the broker: %s", exc)
        return EXIT_FATAL
    finally:
        broker.close()
    return EXIT_OK


def serve_consumer(config: ConsumerConfig) -> int:
    stop = stop_on_signals()
    consumer = Consumer(config)
    try:
        consumer.run(stop)
    except PipelineError as exc:
        log.critical("FATAL, stopping consumer %s: %s", config.name, exc)
        return EXIT_FATAL
    return EXIT_OK
