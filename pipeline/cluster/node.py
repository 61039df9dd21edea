"""One node's pipeline for a cluster run: the node's broker and consumers, in an ordinary
process that the node agent starts (`python -m pipeline.cluster.node DATA_DIR`).

    agent ──Popen──► node process ──fork──► broker (1) + consumers (1 per GPU, else CPU ones)
        stdin: the pickled NodeSpec         stdout: one JSON line once the broker serves:
                                              {"socket", "results_dir", "pids"}

NOTE: the agent is a Ray worker, which runs threads of its own; forking there (what
`pipeline.runtime.local` does to start a broker) is unsafe, so the agent only spawns this
process (fork + exec, as `pipeline broker start` is started), and this process, which has
no threads yet, forks the broker and consumers the way the launcher does, on the node's own
data directory. The broker's socket and its shared-memory objects are the node's.

It stops (consumers first, then the broker, then what they left in /dev/shm) on SIGTERM,
when a child dies, and when its agent is gone: a node agent killed with its raylet
(`remove_node(..., allow_graceful=False)`) leaves no broker or consumer running.

Owner: the node agent (`pipeline.cluster.agent`) that started it; one per data directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass

import psutil

from pipeline.producer.workload import WorkItem, Workload
from pipeline.runtime.launcher import STOP_TIMEOUT_S, Launcher
from pipeline.runtime.local import remove_leftovers, start_broker, start_consumer, stop_process
from pipeline.runtime.settings import LaunchSettings

# How often the node process checks its parent and children.
WATCH_S = 0.2
# The spec on stdin is a pickled NodeSpec: anything longer is not one.
MAX_SPEC_BYTES = 1 << 20
EXIT_AGENT_GONE = 3
# Held by the node process for its whole life (see _lock_node).
NODE_LOCK_NAME = "cluster-node.lock"
EXIT_CHILD_DIED = 4


@dataclass(slots=True, frozen=True)
class NodeSpec:
    """What a node runs: the launch settings (data_dir: the node's own directory) and the
    model ids its consumers serve."""

    settings: LaunchSettings
    models: tuple[int, ...]


def _no_item(_k: int) -> WorkItem:
    raise AssertionError("a node's items come from its agent's producer, not from a workload")


def node_launcher(spec: NodeSpec) -> Launcher:
    """The launcher of the node's settings, used for its broker and consumer configurations
    only (its producers are the agent's): one consumer per GPU, or the settings' count."""
    return Launcher(spec.settings, Workload("cluster node", 0, _no_item, total_tokens=0, models=spec.models))


def _lock_node(data_dir: str) -> int:
    """Wait for, then hold, the node's lock: an earlier node process on this data directory
    (its agent was lost, the node came back) may still be stopping, and its last step
    removes the data directory's shared-memory objects, which would be this broker's.
    NOTE: the broker's own run-directory lock is not enough: it is released when the old
    broker exits, before the old node process removes what was left."""
    fd = os.open(os.path.join(data_dir, NODE_LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def serve_node(spec: NodeSpec, agent_pid: int, out) -> int:
    """Start the node's broker and consumers, say where they are on `out`, watch them and
    the agent, and say how it stopped on `out` (the agent waits for that line)."""
    agent = psutil.Process(agent_pid)
    stopping = []
    signal.signal(signal.SIGTERM, lambda _s, _f: stopping.append(True))
    signal.signal(signal.SIGINT, lambda _s, _f: stopping.append(True))
    launcher = node_launcher(spec)
    os.makedirs(launcher.data_dir, mode=0o700, exist_ok=True)
    _lock_node(launcher.data_dir)  # held until this process exits (its fd is never closed)
    broker = start_broker(launcher.config, spec.settings.storage, spec.settings.durability)
    consumers = [start_consumer(config) for config in launcher.consumer_configs()]
    out.write(json.dumps({"socket": launcher.config.socket_path, "results_dir": launcher.results_dir,
                          "node_pid": os.getpid(), "pids": [broker.pid, *(c.pid for c in consumers)],
                          "consumers": len(consumers)}) + "\n")
    out.flush()
    code = 0
    while not stopping:
        if not _alive(agent):
            code = EXIT_AGENT_GONE
            break
        if not broker.is_alive() or not all(c.is_alive() for c in consumers):
            code = EXIT_CHILD_DIED
            break
        time.sleep(WATCH_S)
    for process in consumers:
        stop_process(process, timeout_s=STOP_TIMEOUT_S)
    stop_process(broker, timeout_s=STOP_TIMEOUT_S)
    remove_leftovers(launcher.data_dir)  # a killed agent's producer ring, among others
    try:
        out.write(json.dumps({"stopped": code}) + "\n")
        out.flush()
    except OSError:
        pass  # the agent is gone: nobody reads it
    return code


def main(argv: list[str]) -> int:
    """`python -m pipeline.cluster.node DATA_DIR`: the spec on stdin; DATA_DIR names the
    process (for `ps` and for tests that look for what is left) and must match the spec's.

    NOTE: it forks once and the first process exits: Ray kills a worker's child processes
    when the worker exits (seen: a node process SIGKILLed with its agent's raylet left its
    producer ring and doorbell in /dev/shm), so the node process must not be the agent's
    child; it watches the agent by pid instead, and cleans up when the agent is gone."""
    raw = sys.stdin.buffer.read(MAX_SPEC_BYTES + 1)
    spec = pickle.loads(raw)  # our own agent's bytes, on a pipe only it holds
    assert isinstance(spec, NodeSpec) and spec.settings.data_dir == argv[0], (argv, spec)
    agent_pid = os.getppid()
    if os.fork() != 0:  # no threads here yet: a plain fork, as `pipeline.runtime.local` does
        os._exit(0)
    return serve_node(spec, agent_pid, sys.stdout)


if __name__ == "__main__":
    # The module's own names, not __main__'s: the pickled spec is a pipeline.cluster.node.NodeSpec.
    from pipeline.cluster.node import main as node_main

    sys.exit(node_main(sys.argv[1:]))
