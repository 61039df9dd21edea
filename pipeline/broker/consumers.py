"""The broker's consumer side: registrations (each consumer's contract and descriptor ring),
dispatch (batches into descriptor rings, as far as each consumer's credit goes),
completions, and heartbeats (SPEC §6).

    dispatch: for each consumer with credit: next_batch -> descriptor into its ring
              -> Dispatcher.commit (only after the ring took it)

Owner: the broker loop (one thread); not thread-safe. A consumer that is lost (its
connection ends, or it is silent past the heartbeat timeout) has its batches go back to
dispatch; what it wrote stays, so a redelivered item can have two result lines.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass

import numpy as np

from pipeline.broker.config import BrokerConfig
from pipeline.broker.dispatch import Batch, Dispatcher
from pipeline.broker.ids import ConsumerId, ShapeKey
from pipeline.broker.packing import Contract
from pipeline.broker.pool import is_pool
from pipeline.broker.peers import ConsumerPeer, ConsumerTotals, Peer, consumer_ring_name, object_prefix
from pipeline.broker.start_gate import StartGate
from pipeline.storage.disk import DiskTier
from pipeline.wire.errors import BadInputError, ProtocolError, RingTimeoutError, ShmError
from pipeline.wire.layouts.descriptors import DESCRIPTOR_ITEM_DTYPE, descriptor_size_bytes, write_descriptor
from pipeline.wire.protocol import MAX_CREDIT_BATCHES, check_consumer_name
from pipeline.wire.status import ConsumerWork
from shm.objects import named_objects
from shm.ring import RingWriter, SharedRing

log = logging.getLogger("pipeline.broker")



class ConsumerSide:
    """Every registered consumer, what each holds, and what they did over this broker's
    life (per name: a consumer that reconnects goes on adding to its own totals)."""

    def __init__(self, config: BrokerConfig, namespace: str, generation: int, storage: DiskTier,
                 storage_dir: str, dispatcher: Dispatcher, control) -> None:
        self.config = config
        self._namespace = namespace
        self._generation = generation
        self._storage = storage
        self._storage_dir = storage_dir
        self._dispatcher = dispatcher
        self._control = control  # ControlServer: send, refuse, disconnect, bind, read
        self.consumers: dict[ConsumerId, ConsumerPeer] = {}
        self._next_consumer_id = 0
        self.consumers_lost = 0
        self.totals_by_name: dict[str, ConsumerTotals] = {}
        self.routed = RoutedTotals()
        self._gate = StartGate(config.min_consumers, config.min_consumers_wait_s)
        if self._gate.gating:
            log.info("dispatch waits for %d consumers to register (at most %g s)", config.min_consumers,
                     config.min_consumers_wait_s)

    def remove_stale_rings(self) -> None:
        """Descriptor rings of earlier broker runs (a crash leaves them: the consumers only
        detach): nobody reads them any more."""
        prefix = object_prefix(self._namespace) + "g"
        current = f"/{prefix}{self._generation}-"
        rings, _semaphores = named_objects(prefix)
        for name in rings:
            if not name.startswith(current):
                removed = SharedRing.unlink_leftover(name)
                log.info("removed a descriptor ring of an earlier run: %s", removed)

    # -------------------------------------------------------------- dispatch

    def dispatch(self, now_s: float) -> bool:
        """Hand batches to consumers with credit, round robin, for at most one work slice
        (none before the start gate opens: min_consumers)."""
        if self._gate.gating:
            if not self._gate.is_open(now_s, len(self.consumers)):
                return False
            log.info("dispatch starts: %d consumers registered (min_consumers %d) after %.1f s",
                     self._gate.opened_with, self._gate.min_consumers, now_s - self._gate.started_s)
        deadline = now_s + self.config.work_slice_s
        handed = False
        progress = True
        while progress and time.monotonic() < deadline:
            progress = False
            for consumer in list(self.consumers.values()):
                if consumer.credit > 0 and not consumer.peer.closed and self._hand_one(consumer):
                    handed = progress = True
        return handed

    def served_models(self) -> set[int]:
        """The models some registered consumer serves."""
        return {consumer.contract.model for consumer in self.consumers.values()}

    def hungry(self) -> bool:
        """Whether some consumer may run dry within a few of its batches (`BatchPacing.hungry`),
        so the loop keeps its fill short."""
        if self._gate.gating:
            return False  # nothing can be dispatched yet: fill in whole slices
        return self._dispatcher.pacing.hungry((c.credit, len(c.batches)) for c in self.consumers.values()
                                              if not c.peer.closed)

    def _hand_one(self, consumer: ConsumerPeer) -> bool:
        """The consumer's next batch into its ring; whether one went."""
        # A batch that is not full waits while the consumer has enough to run: the lane may
        # fill it meanwhile (pacing.py).
        full_only = not self._dispatcher.pacing.partial_allowed(len(consumer.batches))
        batch = self._dispatcher.next_batch(consumer.consumer_id, consumer.contract, time.monotonic(), full_only)
        if batch is None:
            return False
        if not self._send_batch(consumer, batch):
            self._dispatcher.abandon(batch)
            if consumer.broken:
                self._control.disconnect(consumer.peer.sock, consumer.broken)
            return False
        self._dispatcher.commit(batch)
        self.routed.add(batch, consumer.contract)
        if batch.switch is not None:
            self._count_switch(consumer, batch)
        if is_pool(batch.lane.shape):  # every chunk starts a shape of its own
            consumer.totals.compulsory_prefix_tokens += self._start_pooled(consumer.name, batch)
        elif batch.switch is not None:
            consumer.totals.compulsory_prefix_tokens += self._dispatcher.first_refs.start(
                consumer.name, batch.lane.shape, int(batch.entries.prefix_lens[0]))
        consumer.batches[batch.batch_id] = batch
        consumer.credit -= 1
        return True

    def _start_pooled(self, name: str, batch: Batch) -> int:
        """The compulsory prefix tokens of a pool batch: each of its shapes starts on the
        consumer's cache (most once: they share nothing, so their prefixes are new)."""
        entries, first_refs = batch.entries, self._dispatcher.first_refs
        signatures, first = np.unique(entries.signatures, return_index=True)
        prefix_lens = entries.prefix_lens[first].tolist()
        return sum(first_refs.start(name, ShapeKey(batch.model, signature), prefix_len)
                   for signature, prefix_len in zip(signatures.tolist(), prefix_lens))

    def _count_switch(self, consumer: ConsumerPeer, batch: Batch) -> None:
        """A consumer started a shape with this batch: its switches, the shapes it served, and
        whether another consumer's cache had that shape's prefix before (a split shape: its
        prefix is computed by both)."""
        totals, name = consumer.totals, consumer.name
        totals.switches[batch.switch] = totals.switches.get(batch.switch, 0) + 1
        shape = batch.lane.shape
        totals.shapes.add_many(np.array([shape.model], dtype=np.uint64), np.array([shape.signature], dtype=np.uint64))
        # The pool's shapes share no prefix to split; the rest ask the caches' references.
        if not is_pool(shape) and self._dispatcher.first_refs.referenced_elsewhere(name, shape):
            totals.split_prefix_tokens += int(batch.entries.prefix_lens[0])

    def _send_batch(self, consumer: ConsumerPeer, batch: Batch) -> bool:
        """Write the batch's descriptor into the consumer's ring; False if the ring is full."""
        # Columns, not rows: assigning a numpy structured row costs about a microsecond.
        entries = batch.entries
        rows = np.zeros(len(entries), dtype=DESCRIPTOR_ITEM_DTYPE)
        rows["lane"], rows["segment_seq"], rows["offset"] = self._storage.entry_locations(entries)
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

    # --------------------------------------------------------- registration

    def register(self, sock: socket.socket, peer: Peer, message: dict) -> None:
        contract = self.config.check_contract(message["model"], message["max_batch_items"],
                                              message["max_batch_tokens"], message["max_input_len"])
        name = message.get("name")
        if name is not None:
            check_consumer_name(name)
            self._check_name_free(name)
        if len(self.consumers) >= self.config.max_consumers:
            raise BadInputError(f"the broker serves at most {self.config.max_consumers} consumers at once "
                                f"(max_consumers), and {len(self.consumers)} are registered")
        consumer_id = ConsumerId(self._next_consumer_id)
        self._next_consumer_id += 1
        ring_name = consumer_ring_name(self._namespace, consumer_id, self._generation)
        try:
            SharedRing.unlink_leftover(ring_name)
            ring = RingWriter.create(ring_name, self.config.descriptor_ring_bytes)
        except (ShmError, OSError) as exc:  # /dev/shm full, say: refuse this one, serve the rest
            self._control.refuse(sock, f"cannot create the descriptor ring {ring_name} of "
                                       f"{self.config.descriptor_ring_bytes} bytes: {exc}")
            return
        name = name or f"consumer-{consumer_id}"
        totals = self.totals_by_name.setdefault(name, ConsumerTotals())
        consumer = ConsumerPeer(peer, consumer_id, contract, ring, name, message["pid"], totals=totals)
        self.consumers[consumer_id] = consumer
        self._control.bind(sock, consumer)
        self._control.send(sock, {"type": "registered", "consumer_id": consumer_id, "descriptor_ring": ring_name,
                                  "data_dir": self._storage_dir,
                                  "heartbeat_timeout_s": self.config.heartbeat_timeout_s,
                                  "durability": self._storage.durability.value})
        log.info("consumer %d (%s) registered: %s", consumer_id, name, contract)

    def _check_name_free(self, name: str) -> None:
        """BadInputError if a connected consumer has this name: two processes would write one
        results file. Its connection is read first: one that a reconnecting consumer closed
        a moment ago is gone by then."""
        for consumer in list(self.consumers.values()):
            if consumer.name == name:
                self._control.read(consumer.peer.sock)
                if not consumer.peer.closed:
                    raise BadInputError(f"consumer name {name!r} is taken by connected consumer "
                                        f"{consumer.consumer_id} (pid {consumer.pid}): each consumer needs "
                                        f"its own name (it names its results file)")

    # ------------------------------------------------------------- messages

    def message(self, consumer: ConsumerPeer, message: dict) -> None:
        kind = message["type"]
        if kind in ("request_work", "complete"):
            if not 0 <= message["credit"] <= MAX_CREDIT_BATCHES - consumer.credit:
                raise ProtocolError(f"{kind}: credit {message['credit']} is negative or takes the consumer's "
                                    f"credit ({consumer.credit}) past {MAX_CREDIT_BATCHES} batches")
            consumer.credit += message["credit"]
        if kind == "complete":
            batch = consumer.batches.get(message["batch_id"])
            if batch is None:
                raise BadInputError(f"consumer {consumer.consumer_id} completed batch {message['batch_id']}, "
                                    f"which it does not hold")
            # Checked before anything changes: a completion whose results are not what a
            # consumer sends refuses the consumer and completes nothing.
            work = ConsumerWork.from_results(message["results"])
            self._keep_damaged(consumer, batch, message.get("corrupt"))
            self._dispatcher.complete_batch(consumer.consumer_id, batch)
            del consumer.batches[message["batch_id"]]
            consumer.totals.add(work)
        elif kind == "goodbye":
            self._control.disconnect(consumer.peer.sock, "goodbye")

    def _keep_damaged(self, consumer: ConsumerPeer, batch: Batch, corrupt: object) -> None:
        """Entries a consumer found damaged (it answered them "corrupt"): their segments are
        kept as evidence, moved to quarantine/ once done instead of deleted, and counted.
        NOTE: without it the damage was tombstoned with the rest, the segment deleted, and
        `verify` said OK (seen in a hostile test run)."""
        if corrupt is None:
            return
        ids = set(batch.entries.item_ids.tolist())
        if (not isinstance(corrupt, list) or len(corrupt) > len(ids)
                or not all(type(item) is int for item in corrupt) or not set(corrupt) <= ids):
            raise ProtocolError(f"complete: 'corrupt' must list item ids of batch {batch.batch_id}, "
                                f"got {corrupt!r:.80}")
        rows = np.isin(batch.entries.item_ids, np.array(corrupt, dtype=np.uint64))
        self._storage.keep_damaged(batch.entries.segments[rows],
                                   f"consumer {consumer.name} found entries that fail their checks")
        log.warning("consumer %s found %d damaged entries in batch %d (items %s): their segments are kept",
                    consumer.name, len(corrupt), batch.batch_id, corrupt[:5])

    def check_heartbeats(self, now_s: float) -> None:
        for consumer in list(self.consumers.values()):
            if now_s - consumer.peer.last_seen_s <= self.config.heartbeat_timeout_s:
                continue
            self._control.read(consumer.peer.sock)  # what it sent and the loop has not read yet
            silent = now_s - consumer.peer.last_seen_s
            if not consumer.peer.closed and silent > self.config.heartbeat_timeout_s:
                self._control.disconnect(consumer.peer.sock, f"no heartbeat for {silent:.1f} s")

    def disconnected(self, consumer: ConsumerPeer, why: str) -> None:
        """Its batches go back to dispatch and its descriptor ring is removed."""
        returned = self._dispatcher.consumer_lost(consumer.consumer_id)
        self.consumers.pop(consumer.consumer_id, None)
        if why != "goodbye":
            self.consumers_lost += 1  # a goodbye is a consumer stopping, not one lost
        consumer.ring.close()
        consumer.ring.unlink()
        level = logging.INFO if why == "goodbye" and not returned else logging.WARNING
        log.log(level, "consumer %d (%s) gone (%s): %d entries back to dispatch", consumer.consumer_id,
                consumer.name, why, returned)


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
