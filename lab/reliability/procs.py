"""The product run as a user runs it, for the kill campaigns: the `pipeline` commands, the
stages of one data directory (`pipeline broker start`, `pipeline consumer start`,
`pipeline produce`), the processes to kill, and waiting on them.

Owner: one campaign (one thread); the stages it starts are its own, stopped by `close`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import psutil

from pipeline.broker.config import BrokerConfig
from pipeline.runtime import daemon
from pipeline.wire.client import broker_status
from pipeline.wire.errors import ProtocolError
from pipeline.wire.status import BrokerStatus

# The checkout the commands run from (`python -m pipeline` finds the package there).
ROOT = Path(__file__).resolve().parents[2]
# A command of a campaign that runs longer than this is a hang: the campaign fails on it.
COMMAND_TIMEOUT_S = 300.0
# How often a wait polls: fine enough for restart and redelivery figures in tens of ms.
POLL_S = 0.01
# A status request gives up this soon: a broker being killed or restarted does not answer.
STATUS_TIMEOUT_S = 0.5
T = TypeVar("T")


def pipeline(*args: str, env: dict[str, str] | None = None, timeout_s: float = COMMAND_TIMEOUT_S,
             check: bool = True) -> subprocess.CompletedProcess:
    """`python -m pipeline ARGS`, its output captured; RuntimeError naming the command and
    its last words when it fails and `check`."""
    done = subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT, env={**os.environ, **(env or {})})
    if check and done.returncode != 0:
        raise RuntimeError(f"pipeline {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()[-1500:]}")
    return done


def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m pipeline ARGS` in the background (stderr kept for its last words)."""
    return subprocess.Popen([sys.executable, "-m", "pipeline", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, **(env or {})})


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")


def gone(pid: int) -> bool:
    """The process is dead (a zombie counts: it runs nothing and holds no lock)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill(pid: int, signum: int = signal.SIGKILL) -> int:
    """Send `signum`; returns time.monotonic_ns() at the send. After SIGKILL, waits until the
    process is gone."""
    at_ns = time.monotonic_ns()
    os.kill(pid, signum)
    if signum == signal.SIGKILL:
        wait_until(lambda: gone(pid), COMMAND_TIMEOUT_S, f"pid {pid} to die")
    return at_ns


def write_workload(path: str, items: int, seed: int, key: str, shapes: int = 4,
                   length: int | None = None) -> str:
    """A workload file of the product's own format: `items` items over `shapes` shared
    prefixes, suffixes of `length` tokens (or 8 to 300, seeded), each payload `KEY-N` (the
    checker's key: unique within the file, and apart from other files' with another KEY)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, 30_000, size=int(rng.integers(16, 96))).tolist() for _ in range(shapes)]
    with open(path, "w") as file:
        for n in range(items):
            size = length if length is not None else int(rng.integers(8, 300))
            line = {"model": 0, "components": [prefixes[int(rng.integers(0, shapes))]],
                    "suffix": rng.integers(1, 30_000, size=size).tolist(), "payload": f"{key}-{n}"}
            file.write(json.dumps(line, separators=(",", ":")) + "\n")
    return path


@dataclass
class Stages:
    """The stages of one data directory, started with the stage commands as a user would,
    each in the background (`--detach`), and what the campaign needs to judge them: the
    broker's pid and status, each consumer's pid, restart timings."""

    data_dir: str
    consumers: tuple[str, ...] = ("c0", "c1")
    durability: str = "process"
    heartbeat_timeout_s: float = 1.0
    credit: int = 4  # batches each consumer holds ahead, fixed: the duplicate bound's factor
    max_batch: int = 16
    batch_cost_s: float = 0.02  # the sim engine's time per batch: a run lasts long enough to be hit
    broker_settings: tuple[str, ...] = ()
    started: list[str] = field(default_factory=list)

    @property
    def socket_path(self) -> str:
        return BrokerConfig(self.data_dir).socket_path

    @property
    def run_dir(self) -> str:
        return BrokerConfig(self.data_dir).run_dir

    @property
    def in_flight_bound(self) -> int:
        """Items every consumer together may hold at a fault: what one fault may deliver twice
        (its credit of batches, and the batch in hand)."""
        return len(self.consumers) * (self.credit + 1) * self.max_batch

    def status(self) -> BrokerStatus | None:
        try:
            return broker_status(self.socket_path, timeout_s=STATUS_TIMEOUT_S)
        except (OSError, TimeoutError, ProtocolError):
            return None

    def broker_pid(self) -> int | None:
        return daemon.read_pid(os.path.join(self.run_dir, "broker.pid"))

    def consumer_pid(self, name: str) -> int | None:
        return daemon.read_pid(os.path.join(self.run_dir, f"consumer-{name}.pid"))

    def start_broker(self, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`pipeline broker start --detach`: returns once it serves (or its exit, unchecked:
        a broker armed with a crash point may die before it serves)."""
        args = ["broker", "start", "--data-dir", self.data_dir, "--durability", self.durability, "--detach",
                "--set", f"heartbeat_timeout_s={self.heartbeat_timeout_s}"]
        for pair in self.broker_settings:
            args += ["--set", pair]
        return pipeline(*args, env=env, check=False)

    def start_consumer(self, name: str) -> None:
        pipeline("consumer", "start", "--data-dir", self.data_dir, "--name", name, "--detach",
                 "--max-batch", str(self.max_batch), "--set", f"credit={self.credit}",
                 "--engine-options", f"cost_s_per_batch={self.batch_cost_s}")

    def start(self) -> None:
        done = self.start_broker()
        if done.returncode != 0:
            raise RuntimeError(f"the broker did not start: {done.stderr.strip()[-1500:]}")
        for name in self.consumers:
            self.start_consumer(name)

    def close(self) -> None:
        """Stop every stage (consumers first: they finish their batch in hand)."""
        for name in self.consumers:
            pid = self.consumer_pid(name)
            if pid is not None and not gone(pid):
                os.kill(pid, signal.SIGCONT)  # a paused one cannot stop
        pipeline("consumer", "stop", "--data-dir", self.data_dir, "--timeout-s", "10", check=False)
        pipeline("broker", "stop", "--data-dir", self.data_dir, "--timeout-s", "10", check=False)
