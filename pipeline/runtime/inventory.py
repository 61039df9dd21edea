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
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from pipeline.broker.peers import namespace_for, producer_ring_ids, producer_ring_name
from pipeline.storage.inspect import live_items, live_payload_tails, live_payloads
from pipeline.storage.paths import iter_segments
from pipeline.reporting.accounting import summarize_results
from pipeline.wire.errors import FrameError, ShmError
from pipeline.wire.layouts.frames import Frame, parse_frame
from pipeline.wire.status import BrokerStatus
from shm.ring_layout import unreleased_records

# A ledger slot not written yet (its producer has not registered).
UNREGISTERED = -1


class ProducerLedger:
    """What each producer process of a run is doing, in memory shared across fork: slot k
    holds producer k's broker-assigned id, how many items it has published into its ring,
    and, for a workload whose producers run foreign code (a batch job's chat template and
    tokenizer), which request it is making and since when (`busy`), and from which request
    a producer started again in its place would go on (`resume_at`: everything before it
    is published or answered).

    Owner: the launcher creates it before forking the producers; producer k writes only its
    own words, the launcher only reads (and resets a slot before it starts a producer again
    in it). Process-safe under that rule: each word is one aligned 8-byte word, written by
    one process (one store on x86-64, never torn). `busy` writes the request and CPU clock
    first and the time last, and `idle` clears the time, so a reader that sees a time sees
    its request.
    A producer killed between publishing a frame and recording it leaves the count short by
    that frame: `take_stock` then takes the highest sequence found anywhere as published.
    """

    # producer id, published, busy since (monotonic ns, 0: idle), busy at, resume at, busy ns in
    # all, the producer's CPU clock when it got busy (ns, read at most every
    # CPU_CLOCK_READ_INTERVAL_NS: `LedgerSlot.busy`; `prompttime`)
    _WORDS = 7

    def __init__(self, slots) -> None:
        """`slots`: _WORDS words a producer, then the allowance (`set_allowance`)."""
        self._slots = slots

    @classmethod
    def create(cls, ctx, producers: int) -> ProducerLedger:
        ledger = cls(ctx.RawArray("q", cls._WORDS * producers + 1))
        for index in range(producers):
            ledger.reset(index)
        ledger.set_allowance(-1)
        return ledger

    def set_allowance(self, items: int) -> None:
        """The producers may publish while the slots' published items (`total_published`)
        are fewer than `items` (-1: no bound); the launcher's word, the producers read it
        (`may_publish`)."""
        self._slots[len(self._slots) - 1] = items

    def bounded(self) -> bool:
        """Whether an allowance is set (`set_allowance`): only then do producers read it."""
        return self._slots[len(self._slots) - 1] >= 0

    def may_publish(self) -> bool:
        allowance = self._slots[len(self._slots) - 1]
        return allowance < 0 or self.total_published() < allowance

    def reset(self, index: int) -> None:
        """Slot `index` as before its producer started (the launcher, before a restart)."""
        base = self._WORDS * index
        self._slots[base:base + self._WORDS] = [UNREGISTERED, 0, 0, 0, -1, 0, 0]

    @property
    def producers(self) -> int:
        return (len(self._slots) - 1) // self._WORDS

    def registered(self, index: int, producer_id: int) -> None:
        self._slots[self._WORDS * index] = producer_id

    def published(self, index: int, items: int) -> None:
        self._slots[self._WORDS * index + 1] = items

    def busy(self, index: int, position: int, since_ns: int, cpu_ns: int) -> None:
        """Producer `index` started request `position` at `since_ns` (monotonic), its CPU
        clock then at least `cpu_ns` (`LedgerSlot.busy`)."""
        self._slots[self._WORDS * index + 3] = position
        self._slots[self._WORDS * index + 6] = cpu_ns
        self._slots[self._WORDS * index + 2] = since_ns

    def idle(self, index: int) -> None:
        since = self._slots[self._WORDS * index + 2]
        if since:
            self._slots[self._WORDS * index + 5] += time.monotonic_ns() - since
        self._slots[self._WORDS * index + 2] = 0

    def busy_ns(self, index: int) -> int:
        """How long producer `index` has been busy in all (its finished requests)."""
        return self._slots[self._WORDS * index + 5]

    def resume_at(self, index: int, position: int) -> None:
        self._slots[self._WORDS * index + 4] = position

    def busy_with(self, index: int) -> tuple[int, int] | None:
        """(since, monotonic ns; the request) producer `index` is making, or None."""
        since = self._slots[self._WORDS * index + 2]
        return (since, self._slots[self._WORDS * index + 3]) if since else None

    def busy_cpu_from(self, index: int) -> int:
        """Producer `index`'s CPU clock (ns) when it started the request it is on."""
        return self._slots[self._WORDS * index + 6]

    def resume_position(self, index: int) -> int | None:
        position = self._slots[self._WORDS * index + 4]
        return None if position < 0 else position

    def slot(self, index: int) -> LedgerSlot:
        return LedgerSlot(self, index)

    def entries(self) -> list[tuple[int, int]]:
        """(producer id, items published) of every producer that registered."""
        rows = [(self._slots[self._WORDS * k], self._slots[self._WORDS * k + 1]) for k in range(self.producers)]
        return [(producer_id, items) for producer_id, items in rows if producer_id != UNREGISTERED]

    def total_published_by(self, index: int) -> int:
        return self._slots[self._WORDS * index + 1]

    def total_published(self) -> int:
        return sum(items for _producer_id, items in self.entries())


# How often a producer reads its process's CPU clock, at most, when it stamps a request's
# start. The clock sums every thread of the process in the kernel: in a producer under load a
# read took 113 us (cProfile of a 200,000-request job's producer; the whole request about 150
# us), where the monotonic clock costs 0.06 us; read every 10 ms it still took 3% of the
# producer's samples (py-spy). Between reads the last one stands for the request's start: a
# request is charged at most the CPU its process used in this interval before it started
# (20 ms, against a time limit of at least 1 s), never less than it took.
CPU_CLOCK_READ_INTERVAL_NS = 20_000_000


@dataclass(slots=True)
class LedgerSlot:
    """One producer's view of its own slot (what a workload's `produce` is handed); owned
    by that producer's process. The clocks are the process's own (tests give their own)."""

    ledger: ProducerLedger
    index: int
    monotonic_ns: Callable[[], int] = time.monotonic_ns
    cpu_clock_ns: Callable[[], int] = time.process_time_ns
    cpu_ns: int = 0  # the CPU clock when last read
    cpu_read_at_ns: int | None = None  # the monotonic clock then

    def busy(self, position: int) -> None:
        now_ns = self.monotonic_ns()
        if self.cpu_read_at_ns is None or now_ns - self.cpu_read_at_ns >= CPU_CLOCK_READ_INTERVAL_NS:
            self.cpu_ns, self.cpu_read_at_ns = self.cpu_clock_ns(), now_ns
        self.ledger.busy(self.index, position, now_ns, self.cpu_ns)

    def idle(self) -> None:
        self.ledger.idle(self.index)

    def resume_at(self, position: int) -> None:
        self.ledger.resume_at(self.index, position)


def run_is_done(status: BrokerStatus, published: int) -> bool:
    """Every item this run's producers published is received, and the broker holds nothing
    unfinished. Received here is what this run's own rings gave: the items recovered from
    the store and adopted from an earlier run's rings are work taken over, not published by
    this run, and counting them would end a resumed run with as many records still unread
    in its producers' rings (the stop then stores them and the job has them unanswered)."""
    return status.items_received - status.items_adopted >= published and status.items_unfinished == 0


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


def pending_payloads(storage_dir: str, ring_names: Iterable[str]) -> Iterator[tuple[int, bytes]]:
    """(item id, payload) of every item an earlier run left here unfinished: live in the
    store (`storage_dir`'s segments) or in a producer ring never stored, one segment or ring
    at a time (an item in both is given twice). A job reads its own request numbers from
    them, so that a resumed job submits none of those again (the broker delivers them).
    Unreadable rings are skipped: `ring_stock` names them."""
    if os.path.isdir(storage_dir):
        yield from live_payloads([f.path for f in iter_segments(storage_dir)])
    for frame in _unreleased_frames(ring_names):
        for i, item in enumerate(frame.items["item_id"].tolist()):
            yield int(item), frame.item_payload(i)


def pending_payload_tails(storage_dir: str, ring_names: Iterable[str], size: int) -> Iterator[np.ndarray]:
    """What `pending_payloads` gives, as the last `size` bytes of each payload at least that
    long (rows of a uint8 array), a segment or ring record at a time: the store's gathered
    as columns (`live_payload_tails`), so a job reads a stopped run's store of millions of
    items without a Python step per item."""
    if os.path.isdir(storage_dir):
        for _ids, tails in live_payload_tails([f.path for f in iter_segments(storage_dir)], size):
            yield tails
    for frame in _unreleased_frames(ring_names):
        found = [frame.item_payload(i) for i in range(frame.items.shape[0])]
        yield np.frombuffer(b"".join(p[-size:] for p in found if len(p) >= size), dtype=np.uint8).reshape(-1, size)


def _unreleased_frames(ring_names: Iterable[str]) -> Iterator[Frame]:
    """The frames producer rings hold unreleased, a ring at a time, each ring up to its first
    record that is not a whole frame; unreadable rings are skipped (`ring_stock` names them)."""
    for name in ring_names:
        try:
            bodies = unreleased_records(name)
        except ShmError:
            continue
        for position, body in enumerate(bodies):
            try:
                yield parse_frame(np.frombuffer(body, dtype=np.uint8), where=f"ring {name} record {position}")
            except FrameError:
                break


def store_stock(storage_dir: str) -> StoreStock:
    """Every live entry of a store's segment files (a full scan, with the code recovery
    uses): for a run that stopped before it completed, and for what an earlier run left
    before a launch starts its broker."""
    if not os.path.isdir(storage_dir):
        return StoreStock()
    ids, models = live_items([found.path for found in iter_segments(storage_dir)])
    return StoreStock(np.fromiter(ids, dtype=np.uint64, count=len(ids)), models)


def results_of_earlier_runs(results_dir: str, taken_over: np.ndarray) -> np.ndarray:
    """The taken-over items that already have a result in an earlier run's files, beside
    `results_dir` (their consumer wrote it and the broker died before the completion
    arrived): they run again here, duplicates across runs that this run's report counts.
    Read only when something is taken over: a finished run's results are never read again."""
    earlier = os.path.dirname(results_dir)
    found: set[int] = set()
    for name in sorted(os.listdir(earlier)) if os.path.isdir(earlier) else []:
        if name.startswith("run-") and os.path.join(earlier, name) != results_dir:
            found |= summarize_results(os.path.join(earlier, name)).item_ids
    return np.intersect1d(taken_over, np.fromiter(found, dtype=np.uint64, count=len(found)))
