"""Start and stop the pipeline's processes on this machine (the launcher, benchmarks and
end-to-end tests use these).

Processes are forked from the caller, so they share its imports and start in milliseconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from pipeline.broker.service import BrokerConfig
from pipeline.consumer.process import ConsumerConfig
from pipeline.protocol import Connection
from pipeline.runtime.processes import serve_broker, serve_consumer

CTX = mp.get_context("fork")
# How long to wait for a new broker's socket to answer.
BROKER_START_TIMEOUT_S = 30.0


def _broker_main(config: BrokerConfig, storage: str, durability: str, ready) -> None:
    os._exit(serve_broker(config, storage, durability, on_ready=lambda: ready.send("ready")))


def _consumer_main(config: ConsumerConfig) -> None:
    os._exit(serve_consumer(config))


def start_broker(config: BrokerConfig, storage: str = "disk", durability: str = "process"):
    """Fork a broker and wait until it says it serves (recovered and caught up). A broker
    that cannot start (another one runs on the data directory, say) raises RuntimeError."""
    ready, child_end = CTX.Pipe(duplex=False)
    process = CTX.Process(target=_broker_main, args=(config, storage, durability, child_end), name="broker")
    process.start()
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
    process.start()
    return process


def broker_status(socket_path: str, timeout_s: float = 5.0) -> dict:
    """The broker's counters (the `status` request)."""
    conn = Connection.connect(socket_path, timeout_s)
    try:
        return conn.request({"type": "status"}, timeout_s)["counters"]
    finally:
        conn.close()


def stop_process(process, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None:
    """Ask a process to stop (SIGTERM: graceful), then kill it if it does not; its status."""
    if process.is_alive():
        os.kill(process.pid, sig)
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join(5)
    return process.exitcode
