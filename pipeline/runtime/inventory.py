"""Taking stock of a stopped run: where every item a launch was responsible for ended up.

Every item a run's producers put into their rings (accepted), and every item an earlier run
left on the same data directory for it (live in the store, or in a ring an earlier producer
left: read by id before the run's broker starts, which takes them over), is at the end in at
least one of these places:

    with a result   a line in one of this run's results files
    in the store    a live (stored, not completed) entry of a segment file
    in a ring       a record of a producer ring the broker never released (not stored yet)

and an item in none of them is lost. The sets are compared by item id, so `lost` can never
be negative and can never hide a missing item behind a duplicate elsewhere (a count-based
check could: see NOTE below).

    earlier = ids of store_stock(data_dir) and ring_stock(...) # before the broker starts
    ledger = ProducerLedger.create(CTX, producers)         # before forking the producers
    ... each producer: ledger.registered(index, producer_id); ledger.published(index, n)
    rings = ring_stock(producer_ring_names(data_dir))      # once nobody reads or writes them
    store = store_stock(data_dir)                          # a full scan: before a run, after a stop
    stock = accounting.take_stock(ledger.entries(), result_ids, store.item_ids, rings.item_ids, earlier)
    stock.lost == 0

NOTE: the count-based identity (received = completed + queued + pending, from the broker's
counters) was the first check; it was rejected for stopped runs because a broker killed
mid-run leaves no final counters, and because a ring record that the broker stored in part
before a crash counts both in the ring and in the store: counts then say `lost -2,780`
where ids say exactly which items are where.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from pipeline.broker.peers import namespace_for, producer_ring_ids, producer_ring_name
from pipeline.broker.storage.inspect import live_items, live_payloads
from pipeline.broker.storage.paths import iter_segments
from pipeline.wire.errors import FrameError, ShmError
from pipeline.wire.layouts import parse_frame
from shm.ring import unreleased_records

# A ledger slot not written yet (its producer has not registered).
UNREGISTERED = -1


class ProducerLedger:
    """How many items each producer process of a run has published into its ring, in memory
    shared across fork: slot k holds producer k's broker-assigned id and its published count.

    Owner: the launcher creates it before forking the producers; producer k writes only its
    own two slots, the launcher only reads. Process-safe under that rule: each slot is one
    aligned 8-byte word, written by one process (one store on x86-64, never torn).
    A producer killed between publishing a frame and recording it leaves the count short by
    that frame: `take_stock` then takes the highest sequence found anywhere as published.
    """

    def __init__(self, slots) -> None:
        self._slots = slots

    @classmethod
    def create(cls, ctx, producers: int) -> ProducerLedger:
        slots = ctx.RawArray("q", 2 * producers)
        for index in range(producers):
            slots[2 * index] = UNREGISTERED
        return cls(slots)

    @property
    def producers(self) -> int:
        return len(self._slots) // 2

    def registered(self, index: int, producer_id: int) -> None:
        self._slots[2 * index] = producer_id

    def published(self, index: int, items: int) -> None:
        self._slots[2 * index + 1] = items

    def entries(self) -> list[tuple[int, int]]:
        """(producer id, items published) of every producer that registered."""
        rows = [(self._slots[2 * k], self._slots[2 * k + 1]) for k in range(self.producers)]
        return [(producer_id, items) for producer_id, items in rows if producer_id != UNREGISTERED]

    def total_published(self) -> int:
        return sum(items for _producer_id, items in self.entries())


def producer_ring_names(data_dir: str) -> list[str]:
    """The producer rings of a data directory's runs that exist now (names for shm_open)."""
    namespace = namespace_for(data_dir)
    return [producer_ring_name(namespace, producer_id) for producer_id in producer_ring_ids(namespace)]


@dataclass(slots=True)
class RingStock:
    """What the producer rings hold that was never released (never stored, or stored only in
    part before a crash): their items' ids, and the rings that could not be read."""

    item_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    models: set[int] = field(default_factory=set)
    rings_holding: list[str] = field(default_factory=list)  # rings with unreleased records
    unreadable: list[str] = field(default_factory=list)  # "name: why"


def ring_stock(names: Iterable[str]) -> RingStock:
    """Read the unreleased records of these rings (nobody may read or write them now)."""
    stock = RingStock()
    parts = []
    for name in names:
        try:
            bodies = unreleased_records(name)
            for position, body in enumerate(bodies):
                frame = parse_frame(np.frombuffer(body, dtype=np.uint8), where=f"ring {name} record {position}")
                parts.append(frame.items["item_id"].copy())
                stock.models.update(np.unique(frame.items["model"]).tolist())
        except (ShmError, FrameError) as exc:
            stock.unreadable.append(f"{name}: {exc}")
            stock.rings_holding.append(name)  # what it holds is unknown: keep it
            continue
        if bodies:
            stock.rings_holding.append(name)
    if parts:
        stock.item_ids = np.unique(np.concatenate(parts))
    return stock


@dataclass(slots=True)
class StoreStock:
    """The live (stored, not completed) entries of a store: their item ids and models."""

    item_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    models: set[int] = field(default_factory=set)


def pending_payloads(storage_dir: str, ring_names: Iterable[str]) -> dict[int, bytes]:
    """The payloads of every item an earlier run left here unfinished, by item id: live in
    the store (`storage_dir`'s segments) or in a producer ring never stored. A job reads its
    own request numbers from them, so that a resumed job submits none of those again (the
    broker delivers them). Unreadable rings are skipped: `ring_stock` names them."""
    found = live_payloads([f.path for f in iter_segments(storage_dir)]) if os.path.isdir(storage_dir) else {}
    for name in ring_names:
        try:
            for position, body in enumerate(unreleased_records(name)):
                frame = parse_frame(np.frombuffer(body, dtype=np.uint8), where=f"ring {name} record {position}")
                for i, item in enumerate(frame.items["item_id"].tolist()):
                    found[int(item)] = frame.item_payload(i)
        except (ShmError, FrameError):
            continue
    return found


def store_stock(storage_dir: str) -> StoreStock:
    """Every live entry of a store's segment files (a full scan, with the code recovery
    uses): for a run that stopped before it completed, and for what an earlier run left
    before a launch starts its broker."""
    if not os.path.isdir(storage_dir):
        return StoreStock()
    ids, models = live_items([found.path for found in iter_segments(storage_dir)])
    return StoreStock(np.fromiter(ids, dtype=np.uint64, count=len(ids)), models)
