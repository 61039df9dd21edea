"""The broker process: one single-owner loop that wires producer rings, the dispatcher, the
storage tier, consumer descriptor rings and the control socket (SPEC §6).

One turn of the loop:

    1. fill:     take frames from producer rings -> Dispatcher.ingest -> storage.flush()
                 -> release the ring records (an item leaves its ring only once stored)
    2. dispatch: for each consumer with credit: next_batch -> descriptor into its ring
                 -> Dispatcher.commit (only after the ring took it)
    3. control:  serve the Unix socket (registrations, heartbeats, completions, goodbyes)
    4. every tick_interval_s: lane maintenance and the heartbeat check

Steps 1 and 2 each stop after `work_slice_s` (10 ms) of work so step 3 always runs: a fill
of thousands of batches must never get a healthy consumer declared dead (SPEC §6), and
credit a completion returns in step 3 is used within a slice.

The loop sleeps in `select` on the control socket and a self-pipe; a small thread turns
doorbell rings (a POSIX semaphore, which select cannot watch) into bytes on that pipe. The
thread owns no state: everything else happens in the loop.

Fatal errors stop the broker with a message: ShapeGuardError (a chunk of the wrong shape:
a poisoned cache is worse than a restart) and DurabilityError (a failed fsync).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass

import numpy as np
import psutil

from pipeline.broker.dispatch import Batch, Dispatcher
from pipeline.broker.ids import ConsumerId
from pipeline.broker.packing import Contract
from pipeline.broker.peers import (
    ConsumerPeer,
    ConsumerTotals,
    Peer,
    ProducerPeer,
    consumer_ring_name,
    doorbell_name,
    namespace_for,
    object_prefix,
    producer_ring_name,
)
from pipeline.broker.storage.base import StorageTier
from pipeline.errors import (
    BadInputError,
    DiskFullError,
    FrameError,
    PipelineError,
    ProtocolError,
    RingTimeoutError,
    ShmError,
)
from pipeline.layouts import (
    DESCRIPTOR_ITEM_DTYPE,
    descriptor_size_bytes,
    parse_frame,
    write_descriptor,
)
from pipeline.protocol import encode
from shm.objects import Doorbell, ObjectExistsError
from shm.ring import RingReader, RingWriter, SharedRing, max_body_bytes

log = logging.getLogger("pipeline.broker")

RUN_DIR = "run"
SOCKET_NAME = "broker.sock"
LOCK_NAME = "broker.lock"
STATE_NAME = "broker-state.json"
# SPEC §6: the loop yields at least every 100 ms of fill (or dispatch) work. 10 ms, because
# dispatch waits for the fill, and credit a completion returns waits for the next dispatch:
# with 100 ms, quick consumers sat idle while the broker ingested alone (one process of five
# runnable for most of a run's first second, tools/profile_pipeline.py). tools/bench_pipeline
# workload, alternating: 179 k against 142-170 k items/s at 64-item batches, 246-258 k
# against 241-247 k at 256. One frame (about 10 ms at 4,096 items) is the unit of work anyway.
# NOTE: it costs some fill on shallow streams with quick consumers (the demo's mean batch
# fill 0.21 against 0.25, the Mooncake trace's 0.22 against 0.24; shape switches unchanged).
# Together with letting partial batches through whenever another shape waits, it took the
# demo to 86-96 shape switches instead of 16: that rule was rejected (Dispatcher.next_batch).
WORK_SLICE_S = 0.01
# Lane maintenance and heartbeat checks run this often; the lane policy's idle time (5 s)
# and a heartbeat timeout of seconds both want far finer steps than that.
TICK_INTERVAL_S = 0.1
# A consumer silent this long is dead: its pending entries go back to dispatch. Consumers
# heartbeat at a quarter of it, so three lost heartbeats in a row are tolerated.
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
# A consumer's descriptor ring: a 64-item descriptor is 2 KiB, so 1 MiB holds hundreds of
# batches, far more than any credit a consumer asks for.
DESCRIPTOR_RING_BYTES = 1 << 20
# How long select may sleep when nothing is pending: bounds how late a tick runs.
IDLE_WAIT_S = 0.05
# A batch that is not full goes only to a consumer holding fewer batches than this (one
# running, three waiting: the fixed credit consumers had before their window). A quick
# consumer's window (consumer/credit.py) reaches 64 batches, and filling it with partial
# batches of shallow lanes took the demo's mean batch fill from 0.25 to 0.14-0.16 while they
# only waited in its ring. 2 starved consumers of deep queues whenever the current shape's
# lane ran short (tools/bench_pipeline.py: 139 k and 225 k items/s against 165 k and 242 k).
PARTIAL_BATCHES_AHEAD = 4
# Shapes listed one by one in status (the rest summed as "other"): enough for a terminal
# table and a metrics label set that stays small however many shapes a run has.
STATUS_TOP_SHAPES = 16


@dataclass(slots=True)
class BrokerConfig:
    data_dir: str
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    work_slice_s: float = WORK_SLICE_S
    tick_interval_s: float = TICK_INTERVAL_S
    descriptor_ring_bytes: int = DESCRIPTOR_RING_BYTES
    max_models: int = 1024

    @property
    def run_dir(self) -> str:
        return os.path.join(self.data_dir, RUN_DIR)

    @property
    def socket_path(self) -> str:
        return os.path.join(self.run_dir, SOCKET_NAME)


class BrokerState:
    """The few numbers the broker keeps across restarts (a JSON file, replaced atomically):
    the next producer id and the start count. Owner: the broker process."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.next_producer_id = 0
        self.generation = 0
        if os.path.exists(path):
            with open(path) as file:
                saved = json.load(file)
            self.next_producer_id = int(saved["next_producer_id"])
            self.generation = int(saved["generation"])

    def save(self) -> None:
        temporary = self.path + ".tmp"
        with open(temporary, "w") as file:
            json.dump({"next_producer_id": self.next_producer_id, "generation": self.generation}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.path)


class Broker:
    """The broker's single-owner loop. Owner: the broker process's main thread; only the
    doorbell watcher thread runs beside it, and it touches nothing but a pipe.

    `run(stop)` serves until `stop()` is true; `close()` releases the socket, rings and
    storage (the data directory stays: it is the durable store).
    """

    def __init__(self, config: BrokerConfig, storage: StorageTier, lock_fd: int | None = None,
                 storage_dir: str | None = None) -> None:
        """`lock_fd`: the run directory's lock (`lock_run_dir`) when the caller took it before
        opening the storage, as it must for the disk tier: recovery changes files.
        `storage_dir`: where the segment files live when not in the data directory (the
        memory tier keeps them on tmpfs); consumers are told to read from there."""
        self.config = config
        self.storage_dir = os.path.realpath(storage_dir or config.data_dir)
        self._lock_fd = lock_fd if lock_fd is not None else lock_run_dir(config.run_dir)
        self.state = BrokerState(os.path.join(config.data_dir, STATE_NAME))
        self.state.generation += 1
        try:
            self.state.save()
        except OSError as exc:  # a full disk must not keep the broker from draining it
            log.warning("could not save %s (%s); going on with generation %d", self.state.path, exc,
                        self.state.generation)
        self.namespace = namespace_for(config.data_dir)
        self.storage = storage
        self.dispatcher = Dispatcher(storage)
        recovered = self.dispatcher.recover(time.monotonic())  # before any ingest (disk tier)
        if recovered:
            log.info("recovered %d live items from %s", recovered, config.data_dir)
        self.producers: dict[int, ProducerPeer] = {}
        self.doorbell = _open_doorbell(doorbell_name(self.namespace))
        self.consumers: dict[ConsumerId, ConsumerPeer] = {}
        self._peers_by_sock: dict[socket.socket, object] = {}
        self._next_consumer_id = 0
        self._selector = selectors.DefaultSelector()
        self._listener = _listen(config.socket_path)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch_doorbell, name="doorbell", daemon=True)
        self._watcher.start()
        self._next_tick_s = 0.0
        self.disk_full_since_s: float | None = None
        self._held_back: tuple[ProducerPeer, int] | None = None  # the record a full disk kept
        self.consumers_lost = 0
        # Per consumer name, over this broker's life: a consumer that reconnects goes on
        # adding to its own totals (the run report's per-consumer part).
        self._totals_by_name: dict[str, ConsumerTotals] = {}
        self.routed = RoutedTotals()
        self.started_s = time.monotonic()
        self._refused_producers: dict[int, str] = {}  # wrote a record that is not a frame
        self._remove_stale_consumer_rings()
        self._catch_up()

    # ------------------------------------------------------------------ loop

    def run(self, stop) -> None:
        """Serve until `stop()` returns true."""
        while not stop():
            self.turn()

    def turn(self) -> None:
        now = time.monotonic()
        busy = self._fill(now)
        busy = self._dispatch(time.monotonic()) or busy
        self._serve_control(0.0 if busy else IDLE_WAIT_S)
        now = time.monotonic()
        if now >= self._next_tick_s:
            self.dispatcher.tick(now)
            self._check_heartbeats(now)
            self._next_tick_s = now + self.config.tick_interval_s

    def _catch_up(self) -> None:
        """After a restart, before serving anyone: attach every producer ring this data
        directory's producers left, ingest all they hold, flush and release it.

        Why first: recovery knows which (producer, seq) are stored by the live entries it
        found. If a consumer completed one of those (its segment then deleted) before its
        unreleased ring record was read again, that record would look unstored and be
        stored twice. Rings whose writer is dead are unlinked once drained."""
        for producer_id in range(self.state.next_producer_id):
            name = producer_ring_name(self.namespace, producer_id)
            try:
                ring = RingReader.attach(name)
            except ShmError:
                continue  # gone (its producer finished and unlinked it), or not ours
            self.producers[producer_id] = ProducerPeer(None, producer_id, name, ring)
        while self._fill(time.monotonic(), catching_up=True):
            pass
        self._finish_unregistered()  # rings of dead writers, once drained (not if the disk is full)
        if self.producers:
            log.info("caught up with %d producer rings", len(self.producers))

    def _remove_stale_consumer_rings(self) -> None:
        """Descriptor rings of earlier broker runs (a crash leaves them: the consumers only
        detach): nobody reads them any more."""
        prefix = object_prefix(self.namespace) + "g"
        current = f"{prefix}{self.state.generation}-"
        for entry in os.listdir("/dev/shm"):
            name = entry[4:] if entry.startswith("sem.") else entry
            if name.startswith(prefix) and not name.startswith(current) and not entry.startswith("sem."):
                removed = SharedRing.unlink_leftover(f"/{name}")
                log.info("removed a descriptor ring of an earlier run: %s", removed)

    def _watch_doorbell(self) -> None:
        while not self._stopping.is_set():
            if self.doorbell.wait(0.5):
                try:
                    os.write(self._wake_write, b"!")
                except BlockingIOError:
                    pass  # the pipe is full: the loop is awake already

    # ------------------------------------------------------------------ fill

    def _fill(self, now_s: float, catching_up: bool = False) -> bool:
        """Ingest frames from every producer ring for at most one work slice; then flush the
        storage and release what it stored. Returns whether anything was ingested."""
        deadline = now_s + self.config.work_slice_s
        ingested = self._retry_held_back()
        for producer in list(self.producers.values()):
            if producer.ring is None or self.disk_full_since_s is not None:
                continue
            while time.monotonic() < deadline:
                try:
                    record = producer.ring.poll()
                    if record is None:
                        break
                    frame = parse_frame(record.body, where=f"ring {producer.ring_name} position {record.start}")
                    self.dispatcher.ingest(frame, time.monotonic())
                except (FrameError, BadInputError, ShmError) as exc:
                    log.error("producer %d: %s; disconnecting it", producer.producer_id, exc)
                    self._drop_producer(producer, f"bad frame: {exc}")
                    break
                except DiskFullError as exc:
                    # Backpressure: the record stays in its ring, the rings are not read,
                    # consumers are still served; the frame's remaining groups are retried
                    # every turn until the disk has room.
                    log.error("disk full, applying backpressure: %s", exc)
                    self.disk_full_since_s = time.monotonic()
                    self._held_back = (producer, record.end)
                    break
                producer.unreleased_end = record.end
                producer.frames += 1
                producer.items += frame.items.shape[0]
                ingested = True
        if ingested or self.storage.needs_flush:
            # A frame a full disk cut short may have left appends to flush even when no
            # record was ingested whole; the dispatcher serves nothing before a flush.
            self.dispatcher.flush()  # then, only then, release the records (SPEC §5)
        if ingested:
            for producer in self.producers.values():
                if producer.ring is not None and producer.unreleased_end is not None:
                    producer.ring.release(producer.unreleased_end)
                    producer.unreleased_end = None
        if not catching_up:
            self._finish_unregistered()
        return ingested

    def _retry_held_back(self) -> bool:
        """After a full disk: store what it held back; True once it is all stored (its
        record is released with this turn's)."""
        if self._held_back is None:
            return False
        try:
            self.dispatcher.retry_pending_appends()
        except DiskFullError:
            return False
        producer, end = self._held_back
        self._held_back = None
        self.disk_full_since_s = None
        log.info("disk has room again: ingest resumes")
        producer.unreleased_end = end
        return True

    def _finish_unregistered(self) -> None:
        """Forget producers that said goodbye, whose process died, or that closed their ring
        (a goodbye lost with a dropped connection), once everything they published is
        stored. A producer whose connection merely dropped keeps its ring: it reconnects and
        registers again."""
        for producer in list(self.producers.values()):
            gone = producer.peer is None and (self._writer_dead(producer) or self._writer_closed(producer))
            if (producer.unregistered or gone) and self._drained(producer):
                self._forget_producer(producer)

    def _drained(self, producer: ProducerPeer) -> bool:
        ring = producer.ring
        held = self._held_back is not None and self._held_back[0] is producer
        return ring is None or (ring.cursor == ring.write_pos and producer.unreleased_end is None and not held)

    @staticmethod
    def _writer_closed(producer: ProducerPeer) -> bool:
        """Its writer marked the ring closed (in the ring's own header, so no other ring of
        the same name is mistaken for it): a producer does that only once the broker stored
        everything it published, as it leaves (its goodbye may have been lost with a
        dropped connection). A writer that attaches again clears the mark."""
        return producer.ring is not None and producer.ring.writer_closed

    @staticmethod
    def _writer_dead(producer: ProducerPeer) -> bool:
        return producer.ring is None or not psutil.pid_exists(producer.ring.writer_pid)

    # -------------------------------------------------------------- dispatch

    def _dispatch(self, now_s: float) -> bool:
        """Hand batches to consumers with credit, round robin, for at most one work slice."""
        deadline = now_s + self.config.work_slice_s
        handed = False
        progress = True
        while progress and time.monotonic() < deadline:
            progress = False
            for consumer in list(self.consumers.values()):
                if consumer.credit <= 0 or consumer.peer.closed:
                    continue
                # A batch that is not full waits while the consumer has enough to run: the
                # lane may fill it meanwhile (Nagle's rule for batches).
                full_only = len(consumer.batches) >= PARTIAL_BATCHES_AHEAD
                batch = self.dispatcher.next_batch(consumer.consumer_id, consumer.contract, time.monotonic(), full_only)
                if batch is None:
                    continue
                if not self._send_batch(consumer, batch):
                    self.dispatcher.abandon(batch)
                    if consumer.broken:
                        self._disconnect(consumer.peer.sock, consumer.broken)
                    continue
                self.dispatcher.commit(batch)
                self.routed.add(batch, consumer.contract)
                consumer.batches[batch.batch_id] = batch
                consumer.credit -= 1
                handed = progress = True
        return handed

    def _send_batch(self, consumer: ConsumerPeer, batch: Batch) -> bool:
        """Write the batch's descriptor into the consumer's ring; False if the ring is full."""
        # Columns, not rows: assigning a numpy structured row costs about a microsecond.
        entries = batch.entries
        rows = np.zeros(len(entries), dtype=DESCRIPTOR_ITEM_DTYPE)
        rows["lane"], rows["segment_seq"], rows["offset"] = self.storage.entry_locations(entries)
        rows["length"] = entries.lengths
        rows["item_id"] = entries.item_ids
        size = descriptor_size_bytes(rows.shape[0])
        try:
            at = consumer.ring.reserve(size, timeout_s=0)
        except RingTimeoutError:
            return False
        except ShmError as exc:  # registration bounds batches, so this is a ring gone wrong
            log.error("consumer %d: descriptor ring: %s", consumer.consumer_id, exc)
            consumer.broken = f"descriptor ring: {exc}"
            return False
        write_descriptor(consumer.ring.buf, at, batch.batch_id, batch.signature, batch.model,
                         batch.pad_to_tokens, time.monotonic_ns(), rows)
        consumer.ring.commit()
        return True

    # --------------------------------------------------------------- control

    def _serve_control(self, timeout_s: float) -> None:
        for key, _mask in self._selector.select(timeout_s):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj == self._wake_read:
                try:
                    os.read(self._wake_read, 4096)
                except BlockingIOError:
                    pass
            else:
                self._read_peer(key.fileobj)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        peer = Peer(sock, last_seen_s=time.monotonic())
        self._peers_by_sock[sock] = peer
        self._selector.register(sock, selectors.EVENT_READ, None)

    def _read_peer(self, sock: socket.socket) -> None:
        owner = self._peers_by_sock.get(sock)
        if owner is None:
            return
        peer = _peer_of(owner)
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as exc:  # every socket error, not only EOF, is a disconnect (SPEC §6)
            self._disconnect(sock, f"socket error: {exc}")
            return
        if not data:
            self._disconnect(sock, "end of file")
            return
        peer.last_seen_s = time.monotonic()
        try:
            for message in peer.reader.feed(data):
                self._handle(sock, message)
                if peer.closed:
                    return
        except (ProtocolError, BadInputError) as exc:
            self._refuse(sock, str(exc))

    def _handle(self, sock: socket.socket, message: dict) -> None:
        owner = self._peers_by_sock[sock]
        kind = message["type"]
        if kind == "heartbeat":
            return
        if kind == "status":
            self._send(sock, {"type": "status_reply", "counters": self.status()})
        elif kind == "dispatched_segments":
            self._send(sock, {"type": "dispatched_segments_reply", "paths": self.storage.dispatched_segment_paths()})
        elif kind == "register_consumer" and isinstance(owner, Peer):
            self._register_consumer(sock, owner, message)
        elif kind == "register_producer" and isinstance(owner, Peer):
            self._register_producer(sock, owner, message)
        elif isinstance(owner, ConsumerPeer) and kind in ("request_work", "complete", "goodbye"):
            self._consumer_message(owner, message)
        elif isinstance(owner, ProducerPeer) and kind in ("producer_ready", "unregister_producer"):
            self._producer_message(owner, message)
        else:
            raise ProtocolError(f"message {kind!r} is not expected from this peer now")

    def _send(self, sock: socket.socket, message: dict) -> None:
        try:
            sock.sendall(encode(message))
        except (BlockingIOError, OSError) as exc:
            self._disconnect(sock, f"send failed: {exc}")

    def _refuse(self, sock: socket.socket, why: str) -> None:
        log.warning("refusing a peer: %s", why)
        self._send(sock, {"type": "error", "message": why})
        self._disconnect(sock, why)

    # ------------------------------------------------------------- consumers

    def _register_consumer(self, sock: socket.socket, peer: Peer, message: dict) -> None:
        contract = Contract(message["model"], message["max_batch_items"], message["max_batch_tokens"],
                            message["max_input_len"])
        if contract.model >= self.config.max_models:
            raise BadInputError(f"model {contract.model} is unknown (models are 0..{self.config.max_models - 1})")
        largest = descriptor_size_bytes(contract.max_batch_items)
        if largest > max_body_bytes(self.config.descriptor_ring_bytes):
            raise BadInputError(
                f"max_batch_items {contract.max_batch_items} needs {largest}-byte descriptors; the "
                f"descriptor ring takes at most {max_body_bytes(self.config.descriptor_ring_bytes)}"
            )
        consumer_id = ConsumerId(self._next_consumer_id)
        self._next_consumer_id += 1
        ring_name = consumer_ring_name(self.namespace, consumer_id, self.state.generation)
        SharedRing.unlink_leftover(ring_name)
        ring = RingWriter.create(ring_name, self.config.descriptor_ring_bytes)
        name = str(message.get("name") or f"consumer-{consumer_id}")
        totals = self._totals_by_name.setdefault(name, ConsumerTotals())
        consumer = ConsumerPeer(peer, consumer_id, contract, ring, name, message["pid"], totals=totals)
        self.consumers[consumer_id] = consumer
        self._peers_by_sock[sock] = consumer
        self._send(sock, {"type": "registered", "consumer_id": consumer_id, "descriptor_ring": ring_name,
                          "data_dir": self.storage_dir,
                          "heartbeat_timeout_s": self.config.heartbeat_timeout_s})
        log.info("consumer %d (%s) registered: %s", consumer_id, name, contract)

    def _consumer_message(self, consumer: ConsumerPeer, message: dict) -> None:
        kind = message["type"]
        if kind in ("request_work", "complete"):
            if message["credit"] < 0:
                raise ProtocolError(f"{kind}: credit {message['credit']} is negative")
            consumer.credit += message["credit"]
        if kind == "complete":
            batch = consumer.batches.get(message["batch_id"])
            if batch is None:
                raise BadInputError(f"consumer {consumer.consumer_id} completed batch {message['batch_id']}, "
                                    f"which it does not hold")
            self.dispatcher.complete_batch(consumer.consumer_id, batch)
            del consumer.batches[message["batch_id"]]
            consumer.totals.add(message["results"])
        elif kind == "goodbye":
            self._disconnect(consumer.peer.sock, "goodbye")

    def _check_heartbeats(self, now_s: float) -> None:
        for consumer in list(self.consumers.values()):
            silent = now_s - consumer.peer.last_seen_s
            if silent > self.config.heartbeat_timeout_s:
                self._disconnect(consumer.peer.sock, f"no heartbeat for {silent:.1f} s")

    def _drop_consumer(self, consumer: ConsumerPeer, why: str) -> None:
        returned = self.dispatcher.consumer_lost(consumer.consumer_id)
        self.consumers.pop(consumer.consumer_id, None)
        if why != "goodbye":
            self.consumers_lost += 1  # a goodbye is a consumer stopping, not one lost
        consumer.ring.close()
        consumer.ring.unlink()
        level = logging.INFO if why == "goodbye" and not returned else logging.WARNING
        log.log(level, "consumer %d (%s) gone (%s): %d entries back to dispatch", consumer.consumer_id,
                consumer.name, why, returned)

    # ------------------------------------------------------------- producers

    def _register_producer(self, sock: socket.socket, peer: Peer, message: dict) -> None:
        producer_id = message["producer_id"]
        if producer_id < 0:
            producer_id = self.state.next_producer_id
            self.state.next_producer_id += 1
            try:
                self.state.save()
            except OSError as exc:  # a full disk, say: refuse this producer, serve the rest
                self._refuse(sock, f"cannot record a new producer id in {self.state.path}: {exc}")
                return
        elif producer_id >= self.state.next_producer_id:
            raise BadInputError(f"producer id {producer_id} was never handed out by this broker")
        if producer_id in self._refused_producers:
            raise BadInputError(f"producer {producer_id} is refused: {self._refused_producers[producer_id]}")
        known = self.producers.get(producer_id)
        if known is not None and known.peer is not None:
            raise BadInputError(f"producer {producer_id} is already connected")
        ring_name = producer_ring_name(self.namespace, producer_id)
        if known is not None:  # its ring was adopted at start: bind the connection to it
            producer = known
            producer.peer = peer
        else:
            producer = self.producers[producer_id] = ProducerPeer(peer, producer_id, ring_name)
        self._peers_by_sock[sock] = producer
        highest = self.storage.highest_seq(producer_id)
        self._send(sock, {"type": "registered_producer", "producer_id": producer_id, "ring": ring_name,
                          "doorbell": self.doorbell.name, "next_seq": -1 if highest is None else highest + 1})

    def _producer_message(self, producer: ProducerPeer, message: dict) -> None:
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

    def _drop_producer(self, producer: ProducerPeer, why: str) -> None:
        """A producer wrote a record that is not a valid frame: stop reading its ring (what
        came before is stored), leave the ring for an operator to inspect, disconnect it."""
        self.producers.pop(producer.producer_id, None)
        self._refused_producers[producer.producer_id] = why
        if producer.ring is not None:
            producer.ring.close(mark_closed=False)
        if producer.peer is not None:
            self._refuse(producer.peer.sock, why)

    def _forget_producer(self, producer: ProducerPeer) -> None:
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
            self._disconnect(producer.peer.sock, "unregistered and drained")

    # ------------------------------------------------------------- lifecycle

    def _disconnect(self, sock: socket.socket, why: str) -> None:
        owner = self._peers_by_sock.pop(sock, None)
        if owner is None:
            return
        peer = _peer_of(owner)
        peer.closed = True
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
        if isinstance(owner, ConsumerPeer):
            self._drop_consumer(owner, why)
        elif isinstance(owner, ProducerPeer):
            owner.peer = None  # it may register again; its ring stays until drained and dead
            if owner.ring is None:  # it never said its ring was ready: nothing to drain
                self.producers.pop(owner.producer_id, None)
            log.info("producer %d disconnected (%s)", owner.producer_id, why)

    def status(self) -> dict:
        """Counters for `pipeline status`, the launcher's progress and report, and the
        metrics endpoint. Cost: O(shapes + lanes ever opened), a few ms at 100,000 lanes."""
        counters = self.dispatcher.counters()
        shapes = self.dispatcher.shape_summaries()
        connected = {c.name: c for c in self.consumers.values()}
        lanes = counters.lanes
        return {
            "items_received": counters.items_received,
            "tokens_received": counters.tokens_received,
            "items_routed": counters.items_routed,
            "tokens_routed": counters.tokens_routed,
            "items_completed": counters.items_completed,
            "tokens_completed": counters.tokens_completed,
            "items_returned": counters.items_returned,
            "items_recovered": counters.items_recovered,
            "tokens_recovered": counters.tokens_recovered,
            "duplicate_items": counters.duplicate_items,
            "duplicate_completions": counters.duplicate_completions,
            "backlog_items": self.storage.queued_items(),
            "backlog_tokens": sum(s.queued_tokens for s in shapes),
            "pending_items": self.storage.pending_items(),
            "shapes": counters.shapes,
            "lanes_in_use": counters.lanes_in_use,
            "lanes": {"opened": lanes.new_lanes, "reused": lanes.reuses, "force_fits": lanes.force_fits,
                      "raises": lanes.raises, "quiesced": lanes.quiesced, "released": lanes.released,
                      "revived": lanes.revived, "restored": lanes.restored, "max_in_use": lanes.max_in_use},
            "switches": counters.switches,
            "batches_routed": self.routed.batches,
            "padded_tokens_routed": self.routed.padded_tokens,
            "batch_fill_sum": self.routed.fill_sum,
            "top_shapes": _top_shapes(shapes, STATUS_TOP_SHAPES),
            "consumers": {c.name: {"id": c.consumer_id, "pid": c.pid, "credit": c.credit,
                                   "batches_held": len(c.batches), "model": c.contract.model,
                                   "max_batch_items": c.contract.max_batch_items,
                                   "max_batch_tokens": c.contract.max_batch_tokens,
                                   "max_input_len": c.contract.max_input_len} for c in connected.values()},
            "per_consumer": {name: {"connected": name in connected, "batches": totals.batches, **totals.values}
                             for name, totals in self._totals_by_name.items()},
            "uptime_s": time.monotonic() - self.started_s,
            "pid": os.getpid(),
            "generation": self.state.generation,
            "producers": {str(p.producer_id): {"frames": p.frames, "items": p.items}
                          for p in self.producers.values()},
            "consumers_lost": self.consumers_lost,
            "disk_full": self.disk_full_since_s is not None,
        }

    def close(self) -> None:
        self._stopping.set()
        self._watcher.join(timeout=2)
        for sock in list(self._peers_by_sock):
            self._disconnect(sock, "broker stopping")
        # Producers that said goodbye (or died) with everything stored need nothing of a next
        # broker: forget them now rather than at a next turn that will not come, so the
        # doorbell is removed when no producer can still ring it.
        self._finish_unregistered()
        self.producers_connected_at_close = bool(self.producers)
        for producer in list(self.producers.values()):
            if producer.ring is not None:
                producer.ring.close(mark_closed=False)
        self.producers.clear()
        self._selector.close()
        self._listener.close()
        os.unlink(self.config.socket_path)
        os.close(self._wake_read)
        os.close(self._wake_write)
        self.doorbell.close()
        if not self.producers_connected_at_close:
            # No producer ring names it any more; a producer that outlives a crash keeps it.
            self.doorbell.unlink()
        self.storage.close()
        os.close(self._lock_fd)


@dataclass(slots=True)
class RoutedTotals:
    """What the broker handed to consumers: batches, padded tokens, and the sum of each
    batch's fill (its binding share of the contract: max(items / max_batch_items, padded
    tokens / max_batch_tokens)), for the report's padding efficiency and mean batch fill."""

    batches: int = 0
    padded_tokens: int = 0
    fill_sum: float = 0.0

    def add(self, batch: Batch, contract: Contract) -> None:
        padded = batch.padded_tokens
        self.batches += 1
        self.padded_tokens += padded
        # At most 1: a lone item longer than the token budget (the stall exception) is a full
        # batch, not 300% of one.
        self.fill_sum += min(1.0, max(len(batch.entries) / contract.max_batch_items,
                                      padded / contract.max_batch_tokens))


def _top_shapes(shapes: list, top: int) -> list[dict]:
    """The `top` shapes by queued tokens, then one "other" row summing the rest: bounded
    output (and bounded metric labels) whatever the number of shapes."""
    rows = [{"model": s.model, "signature": f"{s.signature:016x}", "lanes": s.lanes,
             "queued_items": s.queued_items, "queued_tokens": s.queued_tokens, "pending_items": s.pending_items}
            for s in shapes[:top]]
    rest = shapes[top:]
    if rest:
        rows.append({"model": -1, "signature": "other", "lanes": sum(s.lanes for s in rest),
                     "queued_items": sum(s.queued_items for s in rest),
                     "queued_tokens": sum(s.queued_tokens for s in rest),
                     "pending_items": sum(s.pending_items for s in rest)})
    return rows


def _peer_of(owner: Peer | ProducerPeer | ConsumerPeer) -> Peer:
    """The connection of a socket's owner: a bare Peer until it registers."""
    return owner if isinstance(owner, Peer) else owner.peer


def lock_run_dir(run_dir: str) -> int:
    """One broker per data directory: an exclusive lock held for the broker's lifetime.
    Take it before opening the storage: recovery changes files a running broker uses."""
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(run_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise PipelineError(f"another broker is running on {os.path.dirname(run_dir)}") from exc
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _open_doorbell(name: str) -> Doorbell:
    """The data directory's doorbell: created, or reopened after a crash (producers' rings
    name it in their headers, so it must keep its name across broker restarts)."""
    try:
        return Doorbell.create(name)
    except ObjectExistsError:
        bell = Doorbell.attach(name)
        bell.is_creator = True
        return bell


def _listen(path: str) -> socket.socket:
    if os.path.exists(path):
        os.unlink(path)  # a stale socket of a crashed broker; the lock says none is running
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file is created owner-only (0600)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    sock.setblocking(False)
    return sock
