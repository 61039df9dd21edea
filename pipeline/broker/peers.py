"""The broker's view of its connected producers and consumers (state only; the loop in
`pipeline.broker.service` does the I/O).

Names of shared-memory objects are derived from the data directory, so a broker that
restarts on the same directory finds the rings its producers kept writing into.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import xxhash

from pipeline.broker.dispatch import Batch
from pipeline.broker.ids import ConsumerId
from pipeline.broker.packing import Contract
from pipeline.protocol import MessageReader
from shm.ring import RingReader, RingWriter


def namespace_for(data_dir: str) -> str:
    """A short, stable tag for a data directory's shared-memory names (12 hex digits of
    the xxh3 of its real path): a restarted broker derives the same names."""
    return f"{xxhash.xxh3_64_intdigest(os.path.realpath(data_dir).encode()):016x}"[:12]


def object_prefix(namespace: str) -> str:
    """How every shared-memory object (and the memory tier's tmpfs directory) of a data
    directory's runs begins, without the leading slash: what clean-up code searches for."""
    return f"sbrk-{namespace}-"


def doorbell_name(namespace: str) -> str:
    return f"/{object_prefix(namespace)}bell"


def producer_ring_name(namespace: str, producer_id: int) -> str:
    return f"/{object_prefix(namespace)}p{producer_id}"


def consumer_ring_name(namespace: str, consumer_id: int, generation: int) -> str:
    # The generation (the broker's start count) keeps a restarted broker from meeting the
    # ring of a consumer id it handed out before the restart.
    return f"/{object_prefix(namespace)}g{generation}-c{consumer_id}"


@dataclass(slots=True)
class Peer:
    """One control connection. Owner: the broker loop. Not thread-safe."""

    sock: socket.socket
    reader: MessageReader = field(default_factory=MessageReader)
    last_seen_s: float = 0.0
    closed: bool = False


@dataclass(slots=True)
class ProducerPeer:
    """A registered producer: its ring (once it said it is ready) and what is ingested but
    not yet released."""

    peer: Peer | None  # None: a ring found at start whose producer has not registered again
    producer_id: int
    ring_name: str
    ring: RingReader | None = None
    unreleased_end: int | None = None  # release up to here after the next storage flush
    unregistered: bool = False  # said goodbye: drain the ring, then forget it
    frames: int = 0
    items: int = 0


@dataclass(slots=True)
class ConsumerTotals:
    """What a consumer reported doing, summed over its completions (by result status and
    engine counters): the per-consumer part of the run report."""

    batches: int = 0
    values: dict[str, int] = field(default_factory=dict)

    def add(self, results: dict) -> None:
        self.batches += 1
        for key, value in results.items():
            if isinstance(value, int) and not isinstance(value, bool):
                self.values[key] = self.values.get(key, 0) + value


@dataclass(slots=True)
class ConsumerPeer:
    """A registered consumer: its contract, its descriptor ring (the broker creates it),
    how many more batches it asked for, and the batches it holds."""

    peer: Peer
    consumer_id: ConsumerId
    contract: Contract
    ring: RingWriter
    name: str
    pid: int
    credit: int = 0
    broken: str = ""  # why it must be disconnected, once the batch in hand is abandoned
    batches: dict[int, Batch] = field(default_factory=dict)
    totals: ConsumerTotals = field(default_factory=ConsumerTotals)
