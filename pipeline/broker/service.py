"""The broker process: one single-owner loop that wires producer rings, the dispatcher, the
storage tier, consumer descriptor rings and the control socket (SPEC §6). Each part has its
own owner, in its own module:

    config.py        BrokerConfig and the limits it is checked against
    state.py         the run directory's lock and the state file (next producer id, starts)
    wakeup.py        the doorbell producers ring, as bytes on a pipe the loop selects on
    control.py       the socket: connections, whole messages, refusing bad peers
    producers.py     producer registrations and rings, and the fill that stores them
    consumers.py     consumer registrations, dispatch into descriptor rings, completions
    store_health.py  what recovery found and what was quarantined, logged and counted

One turn of the loop (`Broker.turn`):

    1. fill:     ProducerSide.fill (an item leaves its ring only once stored)
    2. dispatch: ConsumerSide.dispatch (a batch is committed only after its ring took it)
    3. control:  ControlServer.serve (registrations, heartbeats, completions, goodbyes)
    4. every tick_interval_s: lane maintenance, the heartbeat check, closing connections
                 that never registered

Steps 1 and 2 each stop after `work_slice_s` (10 ms) of work so step 3 always runs: a fill
of thousands of batches must never get a healthy consumer declared dead (SPEC §6), and
credit a completion returns in step 3 is used within a slice. While a consumer runs short of
batches (ConsumerSide.hungry) the fill stops after 2 ms instead, a frame of many new shapes
stored over several turns (producers.py), so dispatch is not starved by ingest.

A gap between turns far longer than a turn can take (STALL_GAP_S) is the broker's own stall
(SIGSTOP, a VM pause): it is counted and logged, and the broker reads what its peers sent
meanwhile before judging them; a consumer is read once more before it is declared dead, so a
healthy one's queued heartbeats always count and a hung one's silence still does.

Fatal errors stop the broker with a message: ShapeGuardError (a chunk of the wrong shape:
a poisoned cache is worse than a restart) and DurabilityError (a failed fsync).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

from pipeline.broker.config import BrokerConfig
from pipeline.broker.consumers import ConsumerSide
from pipeline.broker.control import ControlServer, Owner
from pipeline.broker.dispatch import Dispatcher
from pipeline.broker.peers import ConsumerPeer, Peer, ProducerPeer, doorbell_name, namespace_for, producer_ring_ids
from pipeline.broker.periodic_sync import PeriodicSync
from pipeline.broker.producers import ProducerSide
from pipeline.broker.state import STATE_NAME, BrokerState, lock_run_dir
from pipeline.storage import Durability
from pipeline.storage.disk import DiskTier
from pipeline.broker.store_health import log_quarantined, log_recovery, note_store_was_kept, store_damage
from pipeline.broker.wakeup import Wakeup
from pipeline.wire.errors import ProtocolError, ShmError
from pipeline.wire.shapes import POOL_SIGNATURE
from pipeline.wire.status import (
    POOL_SHAPE,
    STATUS_VERSION,
    BrokerStatus,
    ConnectedConsumer,
    ConsumerTotalsRow,
    LaneEvents,
    ProducerRow,
    TopShape,
)

log = logging.getLogger("pipeline.broker")

# A broker whose every turn is slow (a slow disk) would log every turn: once per this.
STALL_LOG_INTERVAL_S = 10.0
# How long select may sleep when nothing is pending: bounds how late a tick runs.
IDLE_WAIT_S = 0.05
# Lane maintenance ticks due shapes this many at a time, and stops once a turn has spent
# TICK_BUDGET_S on it; the next turns tick the rest, dispatching between (every shape of a
# 7,829-shape backlog goes idle within a moment). A shape's tick can cost a file: a released
# lane seals its segment, and a finished one is deleted (unlink took 2-3 ms a file here).
# NOTE: a fixed 256 shapes a turn (no clock) took 0.3-0.8 s a turn with 100,000 one-item
# shapes, 382 turns over 50 ms and 17 loop stalls (a run of `pipeline launch`).
TICK_SHAPES_PER_CALL = 8
TICK_BUDGET_S = 0.005
# Shapes listed one by one in status (the rest summed as "other"): enough for a terminal
# table and a metrics label set that stays small however many shapes a run has.
STATUS_TOP_SHAPES = 16


class Broker:
    """The broker's single-owner loop. Owner: the broker process's main thread; beside it
    run only the doorbell watcher thread (wakeup.py), which touches nothing but a pipe, and
    with `sync_interval_s` the periodic sync thread (periodic_sync.py), which touches nothing
    but a directory descriptor of its own.

    `run(stop)` serves until `stop()` is true; `close()` releases the socket, rings and
    storage (the data directory stays: it is the durable store).
    """

    def __init__(self, config: BrokerConfig, storage: DiskTier, lock_fd: int | None = None,
                 storage_dir: str | None = None) -> None:
        """`lock_fd`: the run directory's lock (`lock_run_dir`) when the caller took it before
        opening the storage, as it must for the disk tier: recovery changes files.
        `storage_dir`: where the segment files live when not in the data directory (on
        tmpfs); consumers are told to read from there.

        Start-up, in order: the state file (one more generation), recovery (before any
        ingest), the periodic sync (`sync_interval_s`), the producer id floor, the doorbell, the socket, then the catch-up with the
        rings an earlier run left, before anyone is served. If a step fails, what it opened
        is released (last first) before the error goes on; the storage, and a lock the
        caller passed, stay the caller's to close."""
        self._opened: list[Callable[[], None]] = []  # how to undo each start-up step, in order
        try:
            self._start(config, storage, lock_fd, storage_dir)
        except BaseException:
            self._release_partial()
            raise
        self._opened.clear()

    def _start(self, config: BrokerConfig, storage: DiskTier, lock_fd: int | None,
               storage_dir: str | None) -> None:
        self.config = config
        self.storage = storage
        self.storage_dir = os.path.realpath(storage_dir or config.data_dir)
        self._lock_fd = lock_fd if lock_fd is not None else lock_run_dir(config.run_dir)
        if lock_fd is None:
            self._opened.append(lambda: os.close(self._lock_fd))
        self.state = self._next_generation()
        self.namespace = namespace_for(config.data_dir)
        policy, lanes = config.dispatch_policy()
        self.dispatcher = Dispatcher(storage, lane_config=lanes, max_models=config.max_models, policy=policy,
                                     pool_max_items=config.pool_items, pool_min_shapes=config.pool_min_shapes)
        self.dispatcher.recover(time.monotonic())  # before any ingest (disk tier)
        durable = self.storage_dir == os.path.realpath(config.data_dir)
        note_store_was_kept(storage, self.state, config.data_dir, durable, ran_before=self.state.generation > 1)
        self.periodic_sync: PeriodicSync | None = None
        if config.sync_interval_s is not None:
            if durable and storage.durability is Durability.PROCESS:
                self.periodic_sync = PeriodicSync(config.data_dir, config.sync_interval_s)
                self._opened.append(self.periodic_sync.close)
            else:
                log.warning("sync_interval_s %g s has no effect here: %s", config.sync_interval_s,
                            "durability power syncs before it acknowledges" if durable
                            else "the memory tier's files live in RAM")
        log_recovery(storage)
        self.state.keep_ids_above([*storage.stored_producers(), *producer_ring_ids(self.namespace)])
        self.wakeup = Wakeup(doorbell_name(self.namespace))
        self._opened.append(lambda: self.wakeup.close(unlink_doorbell=self.wakeup.doorbell_created))
        self.control = ControlServer(config, self, self.wakeup.fileno(), self.wakeup.drain)
        self._opened += [self.control.close]
        self.consumer_side = ConsumerSide(config, self.namespace, self.state.generation, storage,
                                          self.storage_dir, self.dispatcher, self.control)
        self.producer_side = ProducerSide(config, self.state, self.namespace, storage, self.dispatcher,
                                          self.control, self.wakeup.doorbell_name)
        self._opened.append(self.producer_side.close_rings)
        self.stalls = 0  # gaps in the loop of at least stall_gap_s (the broker did not run)
        self.stalled_s = 0.0  # their sum
        self._clock_s = time.monotonic()  # the loop's last look at the clock (_notice_stall)
        self._stall_logged_s = -STALL_LOG_INTERVAL_S
        self._next_tick_s = 0.0
        self._ticks_left = False  # due shapes the last tick had no room for
        self.started_s = time.monotonic()
        self.consumer_side.remove_stale_rings()
        self.producer_side.catch_up()

    def _next_generation(self) -> BrokerState:
        state = BrokerState(os.path.join(self.config.data_dir, STATE_NAME))
        state.generation += 1
        if not state.save_or_warn():  # a full disk must not keep the broker from draining it
            log.warning("going on with generation %d", state.generation)
        return state

    def _release_partial(self) -> None:
        """After `_start` failed: undo what it opened, last first, each step on its own (one
        failing must not keep the others from running)."""
        for step in reversed(self._opened):
            try:
                step()
            except (OSError, ShmError) as exc:
                log.warning("while releasing a broker that failed to start: %s", exc)
        self._opened.clear()

    # ------------------------------------------------------------------ loop

    def run(self, stop: Callable[[], bool]) -> None:
        """Serve until `stop()` returns true."""
        self._clock_s = time.monotonic()  # start-up (recovery, catch-up) was no stall
        while not stop():
            self.turn()

    def turn(self) -> None:
        busy = self.producer_side.fill(time.monotonic(), hungry=self.consumer_side.hungry(),
                                       served_models=self.consumer_side.served_models())
        busy = self.consumer_side.dispatch(time.monotonic()) or busy or self._ticks_left
        self.control.serve(0.0 if busy else IDLE_WAIT_S)
        now = time.monotonic()
        if self._notice_stall(now):
            # A select interrupted by SIGSTOP/SIGCONT returns nothing once its timeout has
            # passed (PEP 475): read what the peers sent meanwhile before judging anyone.
            self.control.serve(0.0)
            now = time.monotonic()
        if now >= self._next_tick_s or self._ticks_left:
            # Lanes may age across a stall: quiescing early is harmless.
            self._ticks_left = self._tick_lanes(now)
        if now >= self._next_tick_s:
            log_quarantined(self.storage)
            self.consumer_side.check_heartbeats(now)
            self.control.expire_unregistered(now)
            self._next_tick_s = now + self.config.tick_interval_s

    def _tick_lanes(self, now_s: float) -> bool:
        """Lane maintenance for at most TICK_BUDGET_S (at least one call); whether due shapes
        are left for the next turns."""
        deadline = time.monotonic() + TICK_BUDGET_S
        while True:
            left = self.dispatcher.tick(now_s, TICK_SHAPES_PER_CALL)
            if not left or time.monotonic() >= deadline:
                return left

    def _notice_stall(self, now_s: float) -> bool:
        """Whether the loop stalled since its last look at the clock (one look a turn, so
        every moment of the loop is in one gap): a gap of at least `stall_gap_s` (paused,
        starved of CPU, blocked on a disk). The caller then reads what peers sent during it
        before judging anyone: a healthy consumer's heartbeats are waiting in its socket, a
        hung one's are not. Counted, and logged at most once per STALL_LOG_INTERVAL_S.
        NOTE: moving every peer's last activity forward by the gap (the first fix) was
        rejected in review: when every turn is that slow, a hung consumer was never evicted
        (its silence forgiven turn after turn) and its batches never came back."""
        gap_s = now_s - self._clock_s
        self._clock_s = now_s
        if gap_s < self.config.stall_gap_s:
            return False
        self.stalls += 1
        self.stalled_s += gap_s
        if now_s - self._stall_logged_s >= STALL_LOG_INTERVAL_S:
            self._stall_logged_s = now_s
            log.warning("the broker's loop did not run for %.1f s (paused, starved of CPU or blocked on a disk; "
                        "%d such stalls, %.1f s in all): reading what its peers sent meanwhile before judging "
                        "them", gap_s, self.stalls, self.stalled_s)
        return True

    # ------------------------------------------------------- control routing

    def handle(self, sock: socket.socket, owner: Owner, message: dict) -> None:
        """One whole message from a connection, to the side that owns it (ControlServer's
        Handler)."""
        kind = message["type"]
        if kind == "heartbeat":
            return
        if kind == "status":
            self.control.send(sock, {"type": "status_reply", "version": STATUS_VERSION,
                                     "counters": self.status().to_wire()})
        elif kind == "progress":
            self.control.send(sock, {"type": "progress_reply", **self.dispatcher.progress()})
        elif kind == "register_consumer" and isinstance(owner, Peer):
            self.consumer_side.register(sock, owner, message)
        elif kind == "register_producer" and isinstance(owner, Peer):
            self.producer_side.register(sock, owner, message)
        elif isinstance(owner, ConsumerPeer) and kind in ("request_work", "complete", "goodbye"):
            self.consumer_side.message(owner, message)
        elif isinstance(owner, ProducerPeer) and kind in ("producer_ready", "unregister_producer"):
            self.producer_side.message(owner, message)
        else:
            raise ProtocolError(f"message {kind!r} is not expected from this peer now")

    def disconnected(self, owner: Owner, why: str) -> None:
        if isinstance(owner, ConsumerPeer):
            self.consumer_side.disconnected(owner, why)
        elif isinstance(owner, ProducerPeer):
            self.producer_side.disconnected(owner, why)

    # ---------------------------------------------------------------- status

    def status(self) -> BrokerStatus:
        """Counters for `pipeline status`, the launcher's progress and report, and the
        metrics endpoint. Cost: O(shapes + lanes ever opened), a few ms at 100,000 lanes."""
        counters = self.dispatcher.counters()
        shapes = self.dispatcher.shape_summaries()
        connected = {c.name: c for c in self.consumer_side.consumers.values()}
        lanes = counters.lanes
        sync = self.periodic_sync
        return BrokerStatus(
            items_received=counters.items_received,
            tokens_received=counters.tokens_received,
            items_routed=counters.items_routed,
            tokens_routed=counters.tokens_routed,
            items_completed=counters.items_completed,
            tokens_completed=counters.tokens_completed,
            items_returned=counters.items_returned,
            tokens_returned=counters.tokens_returned,
            items_recovered=counters.items_recovered,
            tokens_recovered=counters.tokens_recovered,
            items_adopted=self.producer_side.items_adopted,
            duplicate_items=counters.duplicate_items,
            backlog_items=self.storage.queued_items(),
            backlog_tokens=sum(s.queued_tokens for s in shapes),
            pending_items=self.storage.pending_items(),
            shapes=counters.shapes,
            shapes_seen=counters.shapes_seen,
            lanes_in_use=counters.lanes_in_use,
            pool_items=self.dispatcher.pool.counters.items,
            pool_shapes=self.dispatcher.pool.counters.shapes,
            periodic_syncs=sync.syncs if sync is not None else 0,
            periodic_sync_failures=sync.failures if sync is not None else 0,
            periodic_sync_max_s=sync.max_sync_s if sync is not None else 0.0,
            lanes=LaneEvents(opened=lanes.new_lanes, reused=lanes.reuses, force_fits=lanes.force_fits,
                             raises=lanes.raises, quiesced=lanes.quiesced, released=lanes.released,
                             revived=lanes.revived, restored=lanes.restored, max_in_use=lanes.max_in_use),
            switches=counters.switches,
            batches_routed=self.consumer_side.routed.batches,
            padded_tokens_routed=self.consumer_side.routed.padded_tokens,
            batch_fill_sum=self.consumer_side.routed.fill_sum,
            top_shapes=tuple(TopShape(**row) for row in _top_shapes(shapes, STATUS_TOP_SHAPES)),
            consumers={c.name: ConnectedConsumer(consumer_id=c.consumer_id, pid=c.pid, credit=c.credit,
                                                 batches_held=len(c.batches), model=c.contract.model,
                                                 max_batch_items=c.contract.max_batch_items,
                                                 max_batch_tokens=c.contract.max_batch_tokens,
                                                 max_input_len=c.contract.max_input_len) for c in connected.values()},
            per_consumer={name: ConsumerTotalsRow(connected=name in connected, batches=totals.batches, work=totals.work,
                                                  switches=dict(totals.switches), shapes_served=totals.shapes.count,
                                                  split_prefix_tokens=totals.split_prefix_tokens,
                                                  compulsory_prefix_tokens=totals.compulsory_prefix_tokens)
                          for name, totals in self.consumer_side.totals_by_name.items()},
            uptime_s=time.monotonic() - self.started_s,
            pid=os.getpid(),
            generation=self.state.generation,
            producers={str(p.producer_id): ProducerRow(frames=p.frames, items=p.items)
                       for p in self.producer_side.producers.values()},
            consumers_lost=self.consumer_side.consumers_lost,
            disk_full=self.producer_side.disk_full_since_s is not None,
            store_damage=store_damage(self.storage),
            compulsory_prefix_tokens=self.dispatcher.first_refs.model_total,
            compulsory_uncounted_starts=self.dispatcher.first_refs.overflows,
            lineage_chains_unrecorded=self.storage.chains_unrecorded,
            peers_refused=self.control.peers_refused,
            peers_shed=self.control.peers_shed,
            stalls=self.stalls,
            stalled_s=self.stalled_s,
        )

    def close(self) -> None:
        self.control.disconnect_all("broker stopping")
        producers_left = self.producer_side.close()
        self.control.close()
        # No producer ring names the doorbell any more; one a producer outlives a crash with stays.
        self.wakeup.close(unlink_doorbell=not producers_left)
        self.storage.close()
        if self.periodic_sync is not None:
            self.periodic_sync.close()  # its last syncfs covers what closing the storage wrote
        os.close(self._lock_fd)


def _top_shapes(shapes: list, top: int) -> list[dict]:
    """The `top` shapes by queued tokens, then one "other" row summing the rest: bounded
    output (and bounded metric labels) whatever the number of shapes."""
    rows = [{"model": s.model, "signature": POOL_SHAPE if s.signature == POOL_SIGNATURE else f"{s.signature:016x}",
             "lanes": s.lanes, "queued_items": s.queued_items, "queued_tokens": s.queued_tokens, "pending_items": s.pending_items}
            for s in shapes[:top]]
    rest = shapes[top:]
    if rest:
        rows.append({"model": -1, "signature": "other", "lanes": sum(s.lanes for s in rest),
                     "queued_items": sum(s.queued_items for s in rest),
                     "queued_tokens": sum(s.queued_tokens for s in rest),
                     "pending_items": sum(s.pending_items for s in rest)})
    return rows
