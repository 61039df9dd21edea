"""The node agent of a cluster run: one per node, a Ray actor the driver places on its node.

    agent = ray.remote(NodeAgent).options(num_cpus=0.01, resources={slot_resource: 0.01}).remote(
        "node-a", epoch=1, spec=NodeSpec(settings, models=(0,)))
    agent.start.remote()                          # the node's broker and consumers are up
    agent.submit.remote(1, keys, items)           # items into the node's broker
    agent.poll.remote(1)                          # {"epoch", "rows": [(key, row), ...], ...}
    agent.stop.remote()

The agent spawns the node process (`pipeline.runtime.node`: broker and consumers, as
`pipeline broker start` and `consumer start` run them) and is the node's producer: it
submits what the driver sends through a `BrokerProducer` on the node's broker socket, and
keeps, in memory, which item id is which of the driver's keys. `poll` reads the results
files the node's consumers append to, from where it stopped, and hands back each finished
item's row under its key.

Epoch fencing: the driver gives each incarnation of a node an epoch and sends it with every
call; a call for another epoch is refused, and every reply carries the agent's epoch, so the
driver drops what a node it already declared dead still says (one answered for about 1 s
after its raylet was killed). A row for an item this agent did not submit (one the node's
store kept from an earlier incarnation: the broker delivers it again) is counted in
`discarded` and not handed back: the driver gave that work to the surviving nodes.

Owner: the Ray actor process (calls run one at a time, Ray's default for a sync actor).
"""

from __future__ import annotations

import json
import os
import shutil

from pipeline.runtime.node import NodeHandle, NodeSpec
from pipeline.producer.client import BrokerProducer
from pipeline.producer.feed import feed
from pipeline.producer.workload import WorkItem

# Longest results line read: the consumers' own bound (pipeline/reporting/accounting.py) and more.
MAX_TAIL_LINE_BYTES = 1 << 24


class StaleEpochError(RuntimeError):
    """A call for an epoch this agent is not (the driver fenced this incarnation off)."""


class ResultsTail:
    """New complete lines of the JSON-lines files in a directory, read from where the last
    call stopped (a line without its newline yet waits for the next call). Owner: the agent."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.offsets: dict[str, int] = {}
        self.bad_lines = 0

    def rows(self) -> list[dict]:
        found: list[dict] = []
        names = sorted(os.listdir(self.folder)) if os.path.isdir(self.folder) else []
        for name in names:
            if not name.endswith(".jsonl"):
                continue
            path = os.path.join(self.folder, name)
            start = self.offsets.get(name, 0)
            with open(path, "rb") as file:
                file.seek(start)
                data = file.read()
            end = data.rfind(b"\n") + 1
            self.offsets[name] = start + end
            for line in data[:end].splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None  # a torn line a killed consumer left, terminated at its restart
                if isinstance(row, dict) and isinstance(row.get("item_id"), int):
                    found.append(row)
                else:
                    self.bad_lines += 1
        return found


class _Recording:
    """A producer that remembers the ids of what it submitted, in order (for `feed`)."""

    def __init__(self, producer: BrokerProducer) -> None:
        self.producer = producer
        self.ids: list[int] = []

    def submit_many(self, *args, **kwargs):
        ids = self.producer.submit_many(*args, **kwargs)
        self.ids.extend(int(i) for i in ids)
        return ids

    def declare_shape(self, model: int, chain) -> None:
        self.producer.declare_shape(model, chain)


class NodeAgent:
    """One node's agent (see the module's docstring). Plain class: the driver wraps it with
    `ray.remote`, so this module never imports Ray."""

    def __init__(self, slot: str, epoch: int, spec: NodeSpec) -> None:
        self.slot = slot
        self.epoch = epoch
        self.spec = spec
        self.node: NodeHandle | None = None  # the node process, once started
        self.producer: BrokerProducer | None = None
        self.tail: ResultsTail | None = None
        self.keys: dict[int, int] = {}  # item id -> the driver's key, for items not answered yet
        self.discarded = 0
        self.submitted = 0
        self.answered = 0

    def _check(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise StaleEpochError(f"node {self.slot}: a call for epoch {epoch}, but this agent is epoch {self.epoch}")

    def start(self) -> dict:
        """Start the node process and connect to its broker; where they run."""
        self.node = NodeHandle(self.spec)
        info = self.node.start()
        self.tail = ResultsTail(info["results_dir"])
        self.producer = BrokerProducer(info["socket"])
        return {**info, "slot": self.slot, "epoch": self.epoch, "agent_pid": os.getpid(),
                "host": os.uname().nodename}

    def submit(self, epoch: int, keys: list[int], items: list[WorkItem]) -> int:
        """Submit `items` (key k is items[k]'s) to the node's broker; how many went in."""
        self._check(epoch)
        assert self.producer is not None and len(keys) == len(items)
        recording = _Recording(self.producer)
        feed(recording, items)
        assert len(recording.ids) == len(keys), (len(recording.ids), len(keys))
        self.keys.update(zip(recording.ids, keys))
        self.submitted += len(keys)
        return len(keys)

    def poll(self, epoch: int) -> dict:
        """The rows finished since the last poll, each under its key, and the agent's counts."""
        self._check(epoch)
        assert self.tail is not None
        rows = []
        for row in self.tail.rows():
            key = self.keys.pop(row["item_id"], None)
            if key is None:
                self.discarded += 1
            else:
                rows.append((key, row))
        self.answered += len(rows)
        return {"epoch": self.epoch, "slot": self.slot, "rows": rows, "discarded": self.discarded,
                "outstanding": len(self.keys), "bad_lines": self.tail.bad_lines}

    def stop(self, remove: bool = False) -> dict:
        """Close the producer and stop the node process (it stops consumers, then the broker);
        `remove`: the node's data directory too (a finished run's store holds nothing)."""
        if self.producer is not None:
            try:
                self.producer.close(timeout_s=5.0)
            except TimeoutError:
                pass  # records never stored stay in the ring; the node process removes it
            self.producer = None
        code = self.node.stop() if self.node is not None else None
        if remove and code == 0:
            shutil.rmtree(self.spec.settings.data_dir, ignore_errors=True)
        return {"slot": self.slot, "node_exit": code, "discarded": self.discarded}
