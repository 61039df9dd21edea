"""The producer processes of a run: each feeds its share of a workload into its ring, records
what it published in the shared ledger, then waits until the broker stored all of it
(`feed_processes` for `pipeline produce`; `start_producers` for the launcher, which watches
and restarts them)."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pipeline.producer.workload import WorkItem, Workload
from pipeline.runtime.inventory import ProducerLedger
from pipeline.runtime.local import CTX, STOP_POLL_S, own_process_group, start_child, stop_process
from pipeline.runtime.signals import Interrupts, stop_on_signals
from pipeline.wire.errors import ProducerStoppedError

log = logging.getLogger("pipeline.launch")

# How often a producer waiting for the broker to store its records checks that its parent
# still lives (an orphan leaves its ring for the next broker and exits).
ORPHAN_CHECK_S = 1.0
# A producer reads the ledger's allowance every this many items (a sum over the producers'
# slots), and waits this long between reads while it may not publish: the allowance moves
# at the launcher's watch (every 0.5 s).
ALLOWANCE_CHECK_ITEMS = 64
ALLOWANCE_WAIT_S = 0.02


def _produce_main(socket_path: str, workload: Workload, index: int, count: int,
                  replay_speed: float | None, ledger: ProducerLedger, start_at: int | None) -> None:
    """A producer process: feed its share, then wait until the broker stored all of it,
    however long that takes (a full disk, a broker restart): the launcher decides when to
    give up. SIGTERM stops the feed between submit calls; what went in is still handed over.
    Every frame published is recorded in the ledger (how many items are in the ring). A
    workload with its own loop (`produce`: a batch job's) is handed the feed, its ledger
    slot and where to start (`start_at`, when the launcher starts it again)."""
    parent = os.getppid()
    own_process_group()
    stop = stop_on_signals((signal.SIGTERM,))
    from pipeline.producer.client import BrokerProducer
    from pipeline.producer.feed import DEFAULT_CHUNK_ITEMS, feed

    code = 0
    try:
        try:
            client = BrokerProducer(socket_path, give_up=stop)
        except ProducerStoppedError:
            os._exit(0)  # stopped (its parent gone, or a stop) before it published anything
        ledger.registered(index, client.producer_id)
        client.on_frame = lambda next_seq: ledger.published(index, next_seq)  # a call's frames, one by one

        def submit(items, on_submitted=lambda _count: None) -> None:
            def progress(totals) -> None:
                ledger.published(index, client.next_seq)
                on_submitted(totals.items)

            if ledger.bounded():  # set before the producers start (`attached.py`), or never
                items = _allowed(items, ledger, stop)
            feed(client, items, replay_speed=replay_speed, on_progress=progress,
                 chunk_items=getattr(workload, "feed_chunk_items", DEFAULT_CHUNK_ITEMS))

        try:
            produce = getattr(workload, "produce", None)
            if produce is not None:
                produce(submit, index, count, ledger.slot(index), stop, start_at)
            else:
                submit(itertools.takewhile(lambda _item: not stop(), workload.items(index, count)))
        finally:
            ledger.idle(index)
            ledger.published(index, client.next_seq)
            _hand_over(client, parent)
    except Exception as exc:  # noqa: BLE001 - a child reports any failure by its status
        log.error("producer %d: %s: %s", index, type(exc).__name__, exc)
        code = 1
    os._exit(code)


def _allowed(items: Iterator[WorkItem], ledger: ProducerLedger, stop: Callable[[], bool]) -> Iterator[WorkItem]:
    """`items`, each once the ledger's allowance lets the producers publish more (a run on a
    node bounds what a job keeps queued there: `runtime/attached.py`), or a stop came. The
    count is read every ALLOWANCE_CHECK_ITEMS items; what a producer holds in its chunk not
    yet published is not in it, so the producers can pass the allowance by a chunk each."""
    for position, item in enumerate(items):
        if position % ALLOWANCE_CHECK_ITEMS == 0:
            while not ledger.may_publish() and not stop():
                time.sleep(ALLOWANCE_WAIT_S)
        yield item


def _hand_over(client, parent: int) -> None:
    """Wait until the broker stored everything the producer published, for as long as its
    parent (the launcher, or `produce`) lives; then unregister and remove the ring. An
    orphan (its parent was killed: the broker is stopping too) gives up the wait and leaves
    its ring as it is, with what is not stored, for the next broker on the data directory
    (TimeoutError: the producer fails)."""
    while True:
        try:
            client.wait_stored(timeout_s=ORPHAN_CHECK_S)
        except TimeoutError:
            if os.getppid() == parent:
                continue
            try:
                client.close(timeout_s=0)  # unless all got stored meanwhile, the ring stays
            except TimeoutError:
                raise TimeoutError(f"its parent is gone: what it published and the broker did not store "
                                   f"stays in its ring {client.ring.name} for the next broker on the data "
                                   f"directory") from None
            return
        client.close()
        return


def start_producers(socket_path: str, workload: Workload, count: int, replay_speed: float | None,
                    ledger: ProducerLedger) -> list:
    """`count` producer processes, producer k feeding its share of `workload` (items k,
    k + count, ..., or the workload's own shares) and recording what it does in slot k of
    `ledger`."""
    assert ledger.producers == count, (ledger.producers, count)
    return [start_producer(socket_path, workload, index, count, replay_speed, ledger) for index in range(count)]


def start_producer(socket_path: str, workload: Workload, index: int, count: int, replay_speed: float | None,
                   ledger: ProducerLedger, start_at: int | None = None):
    """Producer `index` of `count`, started (again, from `start_at`, after the launcher
    stopped one on a request it could not make)."""
    process = CTX.Process(target=_produce_main, name=f"producer-{index}",
                          args=(socket_path, workload, index, count, replay_speed, ledger, start_at))
    start_child(process)
    return process


@dataclass(slots=True)
class FeedOutcome:
    failed: int  # producers that exited with an error
    interrupted: bool  # Ctrl-C: the producers stopped feeding and handed over what they had
    forced: bool  # a second Ctrl-C killed producers that were still waiting
    ledger_entries: list[tuple[int, int]]  # (producer id, items published) of each of them


def feed_processes(socket_path: str, workload: Workload, count: int, replay_speed: float | None,
                   on_wait=None, on_stopping=None) -> FeedOutcome:
    """Feed `workload` through `count` producer processes and wait until all of it is stored
    (or Ctrl-C: the producers then stop feeding and hand over what they submitted; a second
    Ctrl-C kills them, and their rings keep what was not stored yet). `on_wait(published)`
    is called every second while producers run (`produce` reports the broker's state), and
    `on_stopping()` once at the first Ctrl-C while producers still run."""
    interrupts = Interrupts.install()
    ledger = ProducerLedger.create(CTX, count)
    processes = start_producers(socket_path, workload, count, replay_speed, ledger)
    next_report_s = time.monotonic() + 1.0
    while any(p.is_alive() for p in processes) and not interrupts.stopping():
        processes[0].join(STOP_POLL_S)  # any of them: the loop checks them all
        if on_wait is not None and time.monotonic() >= next_report_s:
            on_wait(ledger.total_published())
            next_report_s = time.monotonic() + 1.0
    if on_stopping is not None and interrupts.stopping() and any(p.is_alive() for p in processes):
        on_stopping()
    for process in processes:
        # Stopping: a producer still waits for the broker to store what it published, for
        # as long as that takes (a full disk): only a second Ctrl-C kills it.
        stop_process(process, timeout_s=float("inf"), forced=interrupts.forcing)
    failed = sum(1 for p in processes if p.exitcode != 0 and not interrupts.stopping())
    return FeedOutcome(failed, interrupts.stopping(), interrupts.forcing(), ledger.entries())
