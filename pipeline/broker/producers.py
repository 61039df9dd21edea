"""The broker's producer side: registrations, the producer rings, and the fill that stores
what the rings hold (SPEC §5).

    fill: take frames from producer rings -> Dispatcher.ingest -> storage flush -> release
          the ring records (an item leaves its ring only once stored)

A frame of many new shapes (a segment file each) is stored a few lane groups at a time
(INGEST_STEP_GROUPS), and while a consumer runs short of batches a fill lasts at most
its hungry slice (pacing.py), so dispatch runs between the slices; the rest of the frame is stored
at the next turns before any other frame is read.

Owner: the broker loop (one thread); not thread-safe. A full disk is backpressure: the
record that did not fit stays in its ring, the rings are not read, and what the frame
stored in part is retried every turn until the disk has room. After a restart `catch_up`
stores everything the rings of an earlier run hold before anyone is served.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Collection

import psutil

from pipeline.broker.config import BrokerConfig
from pipeline.broker.dispatch import Dispatcher, IngestReport
from pipeline.broker.peers import Peer, ProducerPeer, producer_ring_ids, producer_ring_name
from pipeline.broker.state import BrokerState
from pipeline.storage.disk import DiskTier
from pipeline.wire.errors import BadInputError, DiskFullError, FrameError, ProtocolError, ShmError
from pipeline.wire.layouts.frames import MAX_PRODUCER_ID, parse_frame
from shm.ring import RingReader, SharedRing

log = logging.getLogger("pipeline.broker")

# A disk that stays nearly full refuses one frame after another: said once per this.
DISK_FULL_LOG_INTERVAL_S = 30.0
# Lane groups a frame stores between looks at the clock: a group is one lane's items, and a
# new shape's first group creates its segment file (0.2-0.3 ms on a 2-core machine), so 8
# groups stay within about 2 ms; a frame of one shape (the common bulk case) is 1-2 groups.
INGEST_STEP_GROUPS = 8


class ProducerSide:
    """Every producer the broker reads: registered ones, and rings an earlier run left
    whose producers have not registered again (adopted at start)."""

    def __init__(self, config: BrokerConfig, state: BrokerState, namespace: str, storage: DiskTier,
                 dispatcher: Dispatcher, control, doorbell_name: str) -> None:
        self.config = config
        self._state = state
        self._namespace = namespace
        self._storage = storage
        self._dispatcher = dispatcher
        self._control = control  # ControlServer: send, refuse, disconnect, bind
        self._doorbell_name = doorbell_name
        self.producers: dict[int, ProducerPeer] = {}
        self._refused: dict[int, str] = {}  # wrote a record that is not a frame
        # Items stored from ring records an earlier run left (see catch_up): work taken
        # over, like recovery's, which a launcher's accounting must expect.
        self.items_adopted = 0
        self.disk_full_episodes = 0  # frames a full disk held back
        self._disk_full_logged_s = -DISK_FULL_LOG_INTERVAL_S
        self.disk_full_since_s: float | None = None
        # The record whose frame the dispatcher is still storing (a full disk held it back,
        # or it is stored in slices): its producer, start and end positions in the ring.
        self._held_back: tuple[ProducerPeer, int, int] | None = None
        self.shape_hold_episodes = 0  # times the rings waited for live shapes to finish
        self._shapes_full = False
        self._served_models: Collection[int] | None = None  # this fill's (None: never held)

    def catch_up(self) -> None:
        """After a restart, before serving anyone: attach every producer ring this data
        directory's producers left, ingest all they hold, flush and release it.

        Why first: recovery knows which (producer, seq) are stored by the live entries it
        found. If a consumer completed one of those (its segment then deleted) before its
        unreleased ring record was read again, that record would look unstored and be
        stored twice. Rings whose writer is dead are unlinked once drained. What the rings
        held is counted as received and also as adopted (`items_adopted`): work an earlier
        run accepted that this broker took over, as recovery's items are."""
        # The rings that exist, not every id ever handed out: a data directory that saw
        # millions of producer registrations must not start in minutes (nor a state file
        # saying 10**20 spin forever).
        for producer_id in producer_ring_ids(self._namespace):
            name = producer_ring_name(self._namespace, producer_id)
            try:
                ring = RingReader.attach(name)
            except ShmError:
                continue  # gone (its producer finished and unlinked it), or not ours
            self.producers[producer_id] = ProducerPeer(None, producer_id, name, ring, adopted_until=ring.write_pos)
        while self.fill(time.monotonic(), catching_up=True):
            pass
        self.finish_unregistered()  # rings of dead writers, once drained (not if the disk is full)
        if self.producers:
            log.info("caught up with %d producer rings", len(self.producers))

    # ------------------------------------------------------------------ fill

    def fill(self, now_s: float, catching_up: bool = False, hungry: bool = False,
             served_models: Collection[int] = ()) -> bool:
        """Ingest frames from every producer ring for at most one work slice (a frame stored in
        slices: shorter when `hungry`, a consumer running short of batches: pacing.py); then
        flush the storage and release what it stored. Returns whether anything was ingested, or a frame is still
        being stored in slices (the loop then must not sleep). While the live shapes of
        `served_models` (those with a consumer) number `max_live_shapes`, no record is read."""
        deadline = now_s + self.config.work_slice_s
        # A frame stored in slices stops at this one; whole frames (a few lane groups: the
        # bulk case) still fill the work slice, as many turns cost the broker CPU per item.
        slice_end = now_s + self._dispatcher.pacing.fill_slice_s(self.config.work_slice_s, hungry)
        step = None if catching_up else INGEST_STEP_GROUPS  # catching up serves nobody meanwhile
        ingested = self._continue_held_back(slice_end, step)
        self._served_models = None if catching_up else served_models  # catching up is never held
        for producer in list(self.producers.values()):
            if producer.ring is None or self.disk_full_since_s is not None or self._held_back is not None:
                continue
            ingested = self._fill_from(producer, deadline, slice_end, step) or ingested
        if ingested or self._storage.needs_flush:
            # A frame a full disk cut short may have left appends to flush even when no
            # record was ingested whole; the dispatcher serves nothing before a flush.
            self._dispatcher.flush()  # then, only then, release the records (SPEC §5)
        if ingested:
            for producer in self.producers.values():
                if producer.ring is not None and producer.unreleased_end is not None:
                    producer.ring.release(producer.unreleased_end)
                    producer.unreleased_end = None
        if not catching_up:
            self.finish_unregistered()
        return ingested or (self._held_back is not None and self.disk_full_since_s is None)

    def _live_shapes_full(self) -> bool:
        """Whether the live shapes of the served models reached `max_live_shapes`: the rings
        wait (backpressure on the producers) until some finish; logged once an episode. A
        model no consumer serves is not counted: its shapes would hold every other model."""
        if self._served_models is None:
            return False
        live = self._dispatcher.live_shapes(self._served_models)
        full = live >= self.config.max_live_shapes
        if full and not self._shapes_full:
            self.shape_hold_episodes += 1
            log.info("%d live shapes (max_live_shapes): the producers' rings wait until some finish", live)
        self._shapes_full = full
        return full

    def _fill_from(self, producer: ProducerPeer, deadline_s: float, slice_end_s: float, step: int | None) -> bool:
        """Ingest `producer`'s frames until its ring is empty, the slice ends, the disk is
        full, a frame is left part stored, or a record is bad; whether anything was ingested."""
        ingested = False
        while time.monotonic() < deadline_s and not self._live_shapes_full():
            try:
                record = producer.ring.poll()
                if record is None:
                    break
                frame = parse_frame(record.body, where=f"ring {producer.ring_name} position {record.start}",
                                    producer_id=producer.producer_id)
                report = self._dispatcher.ingest(frame, time.monotonic(), step)
                if report is None:
                    report = self._store_until(slice_end_s, step)
                if report is None:  # the rest of the frame at the next turns
                    self._held_back = (producer, record.start, record.end)
                    break
            except (FrameError, BadInputError, ShmError) as exc:
                log.error("producer %d: %s; disconnecting it", producer.producer_id, exc)
                self._drop(producer, f"bad frame: {exc}")
                break
            except DiskFullError as exc:
                # Backpressure: the record stays in its ring, the rings are not read,
                # consumers are still served; the frame's remaining groups are retried
                # every turn until the disk has room.
                self._log_disk_full(exc)
                self.disk_full_since_s = time.monotonic()
                self._held_back = (producer, record.start, record.end)
                break
            producer.unreleased_end = record.end
            producer.frames += 1
            producer.items += frame.items.shape[0]
            if record.start < producer.adopted_until:
                self.items_adopted += report.items
            ingested = True
        return ingested

    def _log_disk_full(self, exc: DiskFullError) -> None:
        """At most one line per DISK_FULL_LOG_INTERVAL_S: a disk that stays nearly full
        fills again with every frame, and said so every second (52 lines in 50 s)."""
        self.disk_full_episodes += 1
        now_s = time.monotonic()
        if now_s - self._disk_full_logged_s >= DISK_FULL_LOG_INTERVAL_S:
            self._disk_full_logged_s = now_s
            log.error("disk full (%d times so far), applying backpressure: %s", self.disk_full_episodes, exc)

    def _store_until(self, deadline_s: float, step: int | None) -> IngestReport | None:
        """Store more of the part-stored frame, `step` groups at a time, until it is all
        stored (its report) or the slice ends (None). DiskFullError as in ingest."""
        while True:
            report = self._dispatcher.store_more(step)
            if report is not None or time.monotonic() >= deadline_s:
                return report

    def _continue_held_back(self, deadline_s: float, step: int | None) -> bool:
        """Store more of the frame the dispatcher holds: after a full disk, all of what it held
        back; else (stored in slices) until the slice ends. True once it is all stored (its
        record is released with this turn's)."""
        if self._held_back is None:
            return False
        disk_full = self.disk_full_since_s is not None
        try:
            if not self._dispatcher.storing:
                report = None
            elif disk_full:
                report = self._dispatcher.retry_pending_appends()
            else:
                report = self._store_until(deadline_s, step)
                if report is None:
                    return False  # more at the next turn
        except DiskFullError as exc:
            if not disk_full:
                self._log_disk_full(exc)
                self.disk_full_since_s = time.monotonic()
            return False
        producer, start, end = self._held_back
        self._held_back = None
        if report is not None:
            producer.frames += 1
            producer.items += report.items + report.duplicates
            if start < producer.adopted_until:
                self.items_adopted += report.items
        if disk_full:
            self.disk_full_since_s = None
            log.info("disk has room again: ingest resumes")
        producer.unreleased_end = end
        return True

    def finish_unregistered(self) -> None:
        """Forget producers that said goodbye, whose process died, or that closed their ring
        (a goodbye lost with a dropped connection), once everything they published is
        stored. A producer whose connection merely dropped keeps its ring: it reconnects and
        registers again."""
        for producer in list(self.producers.values()):
            gone = producer.peer is None and (_writer_dead(producer) or _writer_closed(producer))
            if (producer.unregistered or gone) and self._drained(producer):
                self._forget(producer)

    def _drained(self, producer: ProducerPeer) -> bool:
        ring = producer.ring
        held = self._held_back is not None and self._held_back[0] is producer
        return ring is None or (ring.cursor == ring.write_pos and producer.unreleased_end is None and not held)

    # --------------------------------------------------------- registration

    def register(self, sock: socket.socket, peer: Peer, message: dict) -> None:
        producer_id = self._producer_id_for(sock, message["producer_id"])
        if producer_id is None:
            return  # refused: the new id could not be recorded
        known = self.producers.get(producer_id)
        if known is not None and known.peer is not None:
            raise BadInputError(f"producer {producer_id} is already connected")
        ring_name = producer_ring_name(self._namespace, producer_id)
        if known is not None:  # its ring was adopted at start: bind the connection to it
            producer = known
            producer.peer = peer
        else:
            producer = self.producers[producer_id] = ProducerPeer(peer, producer_id, ring_name)
        self._control.bind(sock, producer)
        highest = self._storage.highest_seq(producer_id)
        self._control.send(sock, {"type": "registered_producer", "producer_id": producer_id, "ring": ring_name,
                                  "doorbell": self._doorbell_name,
                                  "next_seq": -1 if highest is None else highest + 1})

    def _producer_id_for(self, sock: socket.socket, asked: int) -> int | None:
        """The id a registering producer gets: a new one for -1 (recorded in the state file
        first), else the one it had, if this broker handed it out and did not refuse it."""
        if asked not in self.producers and len(self.producers) >= self.config.max_producers:
            raise BadInputError(f"the broker serves at most {self.config.max_producers} producers at once "
                                f"(max_producers), and {len(self.producers)} are registered or draining")
        if asked < 0:
            producer_id = self._state.next_producer_id
            if producer_id > MAX_PRODUCER_ID:  # item ids hold 24 bits of it (layouts.ITEM_ID_SEQ_BITS)
                raise BadInputError(f"every producer id of this data directory is used ({MAX_PRODUCER_ID + 1:,} "
                                    f"handed out): a new producer needs a new data directory")
            self._state.next_producer_id += 1
            try:
                self._state.save()
            except OSError as exc:  # a full disk, say: refuse this producer, serve the rest
                self._control.refuse(sock, f"cannot record a new producer id in {self._state.path}: {exc}")
                return None
            return producer_id
        if asked >= self._state.next_producer_id:
            raise BadInputError(f"producer id {asked} was never handed out by this broker")
        if asked in self._refused:
            raise BadInputError(f"producer {asked} is refused: {self._refused[asked]}")
        return asked

    def message(self, producer: ProducerPeer, message: dict) -> None:
        if message["type"] == "unregister_producer":
            producer.unregistered = True
            return
        if message["ring"] != producer.ring_name:
            raise ProtocolError(f"producer {producer.producer_id}: ring {message['ring']!r} is not "
                                f"{producer.ring_name!r}")
        if producer.ring is not None:
            return  # adopted at start (catch-up); nothing to attach
        try:
            producer.ring = RingReader.attach(producer.ring_name)
        except ShmError as exc:
            raise BadInputError(f"producer {producer.producer_id}: ring {producer.ring_name}: {exc}") from exc

    def _drop(self, producer: ProducerPeer, why: str) -> None:
        """A producer wrote a record that is not a valid frame: stop reading its ring (what
        came before is stored), leave the ring for an operator to inspect, disconnect it."""
        self.producers.pop(producer.producer_id, None)
        self._refused[producer.producer_id] = why
        if producer.ring is not None:
            producer.ring.close(mark_closed=False)
        if producer.peer is not None:
            self._control.refuse(producer.peer.sock, why)

    def _forget(self, producer: ProducerPeer) -> None:
        assert self._drained(producer), producer.producer_id
        self.producers.pop(producer.producer_id, None)
        connected = producer.peer is not None and not producer.peer.closed
        if producer.ring is not None:
            producer.ring.close(mark_closed=False)
            if not connected and not producer.unregistered:
                # The producer died: it cannot unlink its ring any more, so the broker
                # cleans it up once everything in it is stored.
                SharedRing.unlink_leftover(producer.ring_name)
        if connected:
            self._control.disconnect(producer.peer.sock, "unregistered and drained")

    def disconnected(self, producer: ProducerPeer, why: str) -> None:
        producer.peer = None  # it may register again; its ring stays until drained and dead
        if producer.ring is None:  # it never said its ring was ready: nothing to drain
            self.producers.pop(producer.producer_id, None)
        log.info("producer %d disconnected (%s)", producer.producer_id, why)

    def close(self) -> bool:
        """Forget producers that need nothing of a next broker, close every ring; whether
        any producer was left (its ring names the doorbell, which must then stay)."""
        # Producers that said goodbye (or died) with everything stored: forget them now
        # rather than at a next turn that will not come, so the doorbell is removed when no
        # producer can still ring it.
        self.finish_unregistered()
        left = bool(self.producers)
        self.close_rings()
        return left

    def close_rings(self) -> None:
        for producer in list(self.producers.values()):
            if producer.ring is not None:
                producer.ring.close(mark_closed=False)
        self.producers.clear()


def _writer_closed(producer: ProducerPeer) -> bool:
    """Its writer marked the ring closed (in the ring's own header, so no other ring of the
    same name is mistaken for it): a producer does that only once the broker stored
    everything it published, as it leaves (its goodbye may have been lost with a dropped
    connection). A writer that attaches again clears the mark."""
    return producer.ring is not None and producer.ring.writer_closed


def _writer_dead(producer: ProducerPeer) -> bool:
    return producer.ring is None or not psutil.pid_exists(producer.ring.writer_pid)
