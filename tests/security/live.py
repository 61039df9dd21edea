"""A live run to inspect: a detached broker and consumer (the stage commands), and a producer
in the test's own process, all under one umask, on a data directory whose parent every user
may enter (so that only the data directory's own modes keep another user out).

While it runs it holds everything a run makes: the data directory tree (run/ with the lock,
pid and log files and the socket, the segments of items no consumer serves, results), the
producer ring, the consumer's descriptor ring, their semaphores and the doorbell in
/dev/shm, and with `storage="memory"` the memory tier's directory there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from pipeline.broker.config import BrokerConfig
from pipeline.broker.peers import namespace_for, object_prefix
from pipeline.producer.client import BrokerProducer
from pipeline.producer.signature import signature
from pipeline.wire.client import broker_status
from shm.objects import DEV_SHM
from tests.pipeline.harness import wait_until
from tests.support.repo import ROOT

# A hang guard for one command (each takes about a second).
COMMAND_TIMEOUT_S = 120
# Items for model 0 (the consumer serves it: results) and for model 1 (nobody serves it:
# they stay live in the segment files while the run lasts).
SERVED_ITEMS = 40
UNSERVED_ITEMS = 30


def pipeline(*args: str, umask: int = -1) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, cwd=ROOT, umask=umask)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done


@dataclass
class LiveRun:
    data_dir: str
    storage: str
    producer: BrokerProducer

    @property
    def socket_path(self) -> str:
        return BrokerConfig(self.data_dir).socket_path

    @property
    def prefix(self) -> str:
        return object_prefix(namespace_for(self.data_dir))

    def shm_paths(self) -> list[str]:
        """Every file and directory in /dev/shm named for this data directory (objects,
        semaphores, the memory tier's directory and what is in it)."""
        found = []
        for name in sorted(os.listdir(DEV_SHM)):
            if name.startswith(self.prefix) or name.startswith("sem." + self.prefix):
                found.extend(tree(os.path.join(DEV_SHM, name)))
        return found

    def data_paths(self) -> list[str]:
        return tree(self.data_dir)


def tree(root: str) -> list[str]:
    """`root` and everything under it (not following links)."""
    found = [root]
    for dirpath, dirnames, filenames in os.walk(root):
        found.extend(os.path.join(dirpath, name) for name in dirnames + filenames)
    return found


def submit(producer: BrokerProducer, model: int, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 30_000, size=32, dtype=np.int32)
    shape = signature([prefix])
    for k in range(count):
        tokens = np.concatenate([prefix, rng.integers(0, 30_000, size=8 + k, dtype=np.int32)])
        producer.submit(model, shape, tokens, prefix_len=prefix.shape[0], payload=f"m{model}-{k}".encode())


@contextmanager
def umask_of(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@contextmanager
def live_run(mask: int, storage: str = "disk") -> Iterator[LiveRun]:
    """A run under umask `mask`, serving, with SERVED_ITEMS completed and UNSERVED_ITEMS
    stored; stopped and removed after the block."""
    base = tempfile.mkdtemp(prefix="sbrk-security-", dir="/tmp")
    os.chmod(base, 0o755)  # others may enter it: only the data directory's modes keep them out
    data = os.path.join(base, "data")
    producer = None
    try:
        pipeline("broker", "start", "--data-dir", data, "--storage", storage, "--detach", umask=mask)
        pipeline("consumer", "start", "--data-dir", data, "--name", "c0", "--detach", umask=mask)
        with umask_of(mask):  # the producer library in a process of the caller's umask
            producer = BrokerProducer(BrokerConfig(data).socket_path, capacity_bytes=4 << 20, timeout_s=60)
            submit(producer, 0, SERVED_ITEMS, seed=1)
            submit(producer, 1, UNSERVED_ITEMS, seed=2)
            producer.wait_stored(timeout_s=60)
        run = LiveRun(data, storage, producer)
        wait_until(lambda: broker_status(run.socket_path).items_completed == SERVED_ITEMS, 60,
                   "the served items completed")
        yield run
    finally:
        stop_run(data, producer)
        shutil.rmtree(base, ignore_errors=True)


def stop_run(data: str, producer: BrokerProducer | None) -> None:
    """Stop what `live_run` started, each step whatever the one before did, then remove what
    a failed step left in /dev/shm (the cleanup command's code), so no test leaks objects."""
    from pipeline.runtime.cleanup import apply_cleanup, held_run_lock, plan_cleanup

    try:
        if producer is not None:
            producer.close(timeout_s=30)
    finally:
        for stage in ("consumer", "broker"):
            subprocess.run([sys.executable, "-m", "pipeline", stage, "stop", "--data-dir", data],
                           capture_output=True, timeout=COMMAND_TIMEOUT_S, cwd=ROOT)
        if os.path.isdir(data):
            with held_run_lock(data):
                apply_cleanup(plan_cleanup(data, discard_unstored=True))
