"""A node's pipeline without producers: its broker and consumers, in an ordinary process
(`python -m pipeline.runtime.node DATA_DIR`) that serves until it is stopped, for whoever
submits to its broker: a cluster run's node agent (`pipeline.cluster.agent`), the batch
service (`pipeline serve`: every batch's job on one node).

    owner ──NodeHandle.start──► node process ──fork──► broker + consumers (1 per GPU, else CPU ones)
        stdin: the pickled NodeSpec          stdout: one JSON line once the broker serves:
                                               {"socket", "results_dir", "node_pid", "pids", ...}
    NodeHandle.stop()           SIGTERM; the node says {"stopped": status} and exits

NOTE: the owner runs threads of its own (a Ray worker, the service's HTTP server); forking
there (what `pipeline.runtime.local` does to start a broker) is unsafe, so the owner only
spawns this process (fork + exec, as `pipeline broker start` is started), and this process,
which has no threads yet, forks the broker and consumers the way the launcher does, on the
node's own data directory. The broker's socket and its shared-memory objects are the node's.

It stops (consumers first, then the broker, then what they left in /dev/shm) on SIGTERM,
when a child dies, and when its owner is gone: an owner killed with kill -9 (a node agent
with its raylet, a server) leaves no broker or consumer running, and its store for the next
node on the data directory.

Owner: the `NodeHandle` that started it; one node per data directory (`_lock_node`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

from pipeline.producer.workload import WorkItem, Workload
from pipeline.runtime.datadir import NODE_LOCK_NAME
from pipeline.runtime.launcher import STOP_TIMEOUT_S, Launcher
from pipeline.runtime.local import remove_leftovers, start_broker, start_consumer, stop_process
from pipeline.runtime.settings import LaunchSettings
from pipeline.wire.errors import NodeStartError
from pipeline.wire.textfiles import printable

# How often the node process checks its parent and children.
WATCH_S = 0.2
# How long the node's broker may take to start (its recovery of the store an earlier node left).
NODE_START_TIMEOUT_S = 120.0
# How long the node process may take to stop its consumers and broker before it is killed.
NODE_STOP_TIMEOUT_S = 40.0
# The spec on stdin is a pickled NodeSpec: anything longer is not one.
MAX_SPEC_BYTES = 1 << 20
EXIT_OWNER_GONE = 3
EXIT_CHILD_DIED = 4


@dataclass(slots=True, frozen=True)
class NodeSpec:
    """What a node runs: the launch settings (data_dir: the node's own directory) and the
    model ids its consumers serve."""

    settings: LaunchSettings
    models: tuple[int, ...]


def _no_item(_k: int) -> WorkItem:
    raise AssertionError("a node's items come from its owner's producers, not from a workload")


class NodeHandle:
    """A node process this process started (`start`), stopped by `stop`. Owner: one thread."""

    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        self.node_pid: int | None = None  # the node process (not our child: see `main`)
        self.info: dict = {}  # its ready line: socket, results_dir, pids, consumers
        self._stdout = None  # its report pipe: the ready line, then the stopped line
        self._process: psutil.Process | None = None

    def start(self) -> dict:
        """Spawn the node process and wait until its broker serves; its ready line.
        NodeStartError where it did not start within NODE_START_TIMEOUT_S (it is stopped)."""
        data_dir = self.spec.settings.data_dir
        assert self.node_pid is None and data_dir is not None
        os.makedirs(data_dir, mode=0o700, exist_ok=True)
        spawned = subprocess.Popen([sys.executable, "-m", "pipeline.runtime.node", data_dir],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        spawned.stdin.write(pickle.dumps(self.spec))
        spawned.stdin.close()
        self._stdout = spawned.stdout
        line = self._line(NODE_START_TIMEOUT_S)
        status = spawned.poll()  # the first process exits at once; the node process is its child
        if not line.startswith(b"{"):
            # Its session: the node (perhaps still waiting for an earlier node's lock; what it
            # forked stops as its parent dies, `own_process_group`).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(spawned.pid, signal.SIGKILL)
            spawned.wait()
            self._stdout.close()
            raise NodeStartError(f"the node's broker did not start on {printable(data_dir)} within "
                                 f"{NODE_START_TIMEOUT_S:g} s (node process status {status})")
        spawned.wait()
        self.info = json.loads(line)
        self.node_pid = self.info["node_pid"]
        try:
            self._process = psutil.Process(self.node_pid)  # its start time: a recycled pid is not it
        except psutil.Error:
            self._process = None
        return self.info

    def alive(self) -> bool:
        """Whether the node process still serves (a node whose broker or consumer died stops)."""
        return self._process is not None and _alive(self._process)

    def _line(self, timeout_s: float) -> bytes:
        """The node process's next line on its stdout, or b"" (it ended, or said nothing in time)."""
        ready, _, _ = select.select([self._stdout], [], [], timeout_s)
        return self._stdout.readline() if ready else b""

    def stop(self) -> int | None:
        """SIGTERM, then the node's own stop (consumers finish their batches, the broker closes
        its files); killed after NODE_STOP_TIMEOUT_S. Its exit status; None where it was
        killed or had gone."""
        if self.node_pid is None:
            return None
        code = None
        if self.alive():
            with contextlib.suppress(psutil.Error):
                self._process.terminate()
            line = self._line(NODE_STOP_TIMEOUT_S)
            code = json.loads(line)["stopped"] if line.startswith(b'{"stopped"') else None
            if code is None:
                with contextlib.suppress(psutil.Error):
                    self._process.kill()
        self._stdout.close()
        self.node_pid, self._process = None, None
        return code


def node_launcher(spec: NodeSpec) -> Launcher:
    """The launcher of the node's settings, used for its broker and consumer configurations
    only (its producers are its owner's): one consumer per GPU, or the settings' count."""
    return Launcher(spec.settings, Workload("cluster node", 0, _no_item, total_tokens=0, models=spec.models))


def _lock_node(data_dir: str) -> int:
    """Wait for, then hold, the node's lock: an earlier node process on this data directory
    (its owner was lost, the node came back) may still be stopping, and its last step
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


def serve_node(spec: NodeSpec, owner_pid: int, out) -> int:
    """Start the node's broker and consumers, say where they are on `out`, watch them and
    the owner, and say how it stopped on `out` (the owner waits for that line)."""
    owner = psutil.Process(owner_pid)
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
        if not _alive(owner):
            code = EXIT_OWNER_GONE
            break
        if not broker.is_alive() or not all(c.is_alive() for c in consumers):
            code = EXIT_CHILD_DIED
            break
        time.sleep(WATCH_S)
    for process in consumers:
        stop_process(process, timeout_s=STOP_TIMEOUT_S)
    stop_process(broker, timeout_s=STOP_TIMEOUT_S)
    remove_leftovers(launcher.data_dir)  # a killed owner's producer ring, among others
    try:
        out.write(json.dumps({"stopped": code}) + "\n")
        out.flush()
    except OSError:
        pass  # the owner is gone: nobody reads it
    return code


def main(argv: list[str]) -> int:
    """`python -m pipeline.runtime.node DATA_DIR`: the spec on stdin; DATA_DIR names the
    process (for `ps` and for tests that look for what is left) and must match the spec's.

    NOTE: it forks once and the first process exits: Ray kills a worker's child processes
    when the worker exits (seen: a node process SIGKILLed with its agent's raylet left its
    producer ring and doorbell in /dev/shm), so the node process must not be its owner's
    child; it watches the owner by pid instead, and cleans up when the owner is gone."""
    raw = sys.stdin.buffer.read(MAX_SPEC_BYTES + 1)
    spec = pickle.loads(raw)  # our own owner's bytes, on a pipe only it holds
    assert isinstance(spec, NodeSpec) and spec.settings.data_dir == argv[0], (argv, spec)
    owner_pid = os.getppid()
    if os.fork() != 0:  # no threads here yet: a plain fork, as `pipeline.runtime.local` does
        os._exit(0)
    # The report pipe keeps its own descriptor; what the broker, the consumers and their
    # engines print (vLLM logs to stdout) goes to stderr: nobody reads the pipe between the
    # ready and the stopped line, and a full pipe would block whoever writes to it.
    report = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return serve_node(spec, owner_pid, report)


if __name__ == "__main__":
    # The module's own names, not __main__'s: the pickled spec is a pipeline.runtime.node.NodeSpec.
    from pipeline.runtime.node import main as node_main

    sys.exit(node_main(sys.argv[1:]))
