"""Helpers for tests that run the `pipeline` command and its processes."""

from __future__ import annotations

import os
import socket

from pipeline.broker.peers import namespace_for, object_prefix
from tests.pipeline.harness import wait_until as wait_for

__all__ = ["free_port", "shm_objects_of", "wait_for"]


def shm_objects_of(data_dir: str) -> list[str]:
    """Shared-memory objects and semaphores named for a data directory's runs."""
    tag = object_prefix(namespace_for(data_dir))
    return [name for name in os.listdir("/dev/shm") if tag in name]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
