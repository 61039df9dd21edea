"""Real processes for end-to-end tests: a broker, consumers and producers on one data dir."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from pipeline.broker.config import BrokerConfig
from pipeline.producer.client import BrokerProducer
from pipeline.producer.signature import signature
from lab.reliability.procs import wait_until as _wait_until
from pipeline.runtime.local import CTX, stop_process
from pipeline.runtime.local import start_broker as _start_broker
from pipeline.wire.client import broker_status


@dataclass
class Workload:
    """Items of many shapes and lengths, split between producers. Item k of producer p has
    tokens made from (p, k), so anyone can recompute them; its payload is its shape index
    (the broker numbers producers in registration order, not by p)."""

    shapes: int = 12
    items_per_producer: int = 3000
    producers: int = 2
    seed: int = 0
    components: list = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.components = [rng.integers(0, 50_000, size=int(rng.integers(16, 200)), dtype=np.int32)
                           for _ in range(self.shapes)]
        self.signatures = [signature([c]) for c in self.components]

    def items(self, producer: int):
        """(shape index, tokens, prefix_len) for each item of one producer, in order."""
        rng = np.random.default_rng(1000 + producer)
        for _ in range(self.items_per_producer):
            shape = int(rng.integers(0, self.shapes))
            suffix = rng.integers(0, 50_000, size=max(1, int(rng.lognormal(np.log(200), 0.8))), dtype=np.int32)
            prefix = self.components[shape]
            yield shape, np.concatenate([prefix, suffix]), prefix.shape[0]


def produce(socket_path: str, workload: Workload, producer: int, chunk: int = 97) -> None:
    client = BrokerProducer(socket_path, capacity_bytes=16 << 20, timeout_s=60)
    batch = []
    for shape, tokens, prefix_len in workload.items(producer):
        batch.append((shape, tokens, prefix_len))
        if len(batch) == chunk:
            _submit(client, workload, batch)
            batch = []
    if batch:
        _submit(client, workload, batch)
    client.close(timeout_s=120)


def _submit(client: BrokerProducer, workload: Workload, batch: list) -> None:
    if len(batch) == 1:
        shape, tokens, prefix_len = batch[0]
        client.submit(0, workload.signatures[shape], tokens, prefix_len, payload=f"{shape}".encode())
        return
    client.submit_many(
        0, np.array([workload.signatures[s] for s, _, _ in batch], dtype=np.uint64),
        np.concatenate([t for _, t, _ in batch]), [t.shape[0] for _, t, _ in batch],
        np.array([p for _, _, p in batch]), payloads=[f"{s}".encode() for s, _, _ in batch],
    )


def start_broker(data_dir: str, heartbeat_timeout_s: float = 10.0, durability: str = "process",
                 storage: str = "disk"):
    return _start_broker(BrokerConfig(data_dir, heartbeat_timeout_s=heartbeat_timeout_s), storage, durability)


def start_producer(socket_path: str, workload: Workload, producer: int):
    process = CTX.Process(target=produce, args=(socket_path, workload, producer))
    process.start()
    return process


status = broker_status
stop = stop_process


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    return _wait_until(predicate, timeout_s, what, poll_s)


def read_results(results_dir: str) -> list[dict]:
    rows = []
    for name in sorted(os.listdir(results_dir)):
        with open(os.path.join(results_dir, name)) as file:
            for line in file:
                row = json.loads(line)
                row["consumer"] = name
                rows.append(row)
    return rows


def batches_of(rows: list[dict]) -> dict:
    batches = defaultdict(list)
    for row in rows:
        # dispatch_ns tells apart equal batch ids of two broker runs
        batches[(row["consumer"], row["batch_id"], row["dispatch_ns"])].append(row)
    return batches
