"""Helpers for tests that run the `pipeline` command and its processes."""

from __future__ import annotations

import os
import socket
import time

from pipeline.broker.peers import namespace_for


def shm_objects_of(data_dir: str) -> list[str]:
    """Shared-memory objects and semaphores named for a data directory's runs."""
    tag = f"sbrk-{namespace_for(data_dir)}"
    return [name for name in os.listdir("/dev/shm") if tag in name]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out waiting for {what}")
