"""A consumer cannot complete or read entries it does not hold (SPEC §8), against a real
broker, with two consumers by hand each holding a batch.

Complete: a `complete` for another consumer's batch, for a batch id never handed out, or
for one's own batch a second time (a resend), is refused with an error message naming the
batch, and the refused consumer is disconnected (its own batches go back to dispatch);
the other consumer's batch stays with it, and completing it then works.

Read: the broker writes a batch's descriptor (where its entries are) only into the
descriptor ring of the consumer it dispatched the batch to, so each consumer is told of
its own batches only. What "cannot read" does not mean: a process of the same user can
map another consumer's ring or the segment files themselves (they are 0600 for the user,
not per process; POSIX permissions stop at the uid, and a same-user process could equally
ptrace its peer). Against other users the modes hold (`test_second_user.py`); against the
same user the boundary is the broker's bookkeeping: what a consumer completes must be what
it was given.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.wire.layouts.descriptors import Descriptor, parse_descriptor
from pipeline.wire.protocol import Connection
from pipeline.wire.status import ConsumerWork
from shm.ring import RingReader
from tests.pipeline.harness import Workload, start_broker, start_producer, status, stop, wait_until

pytestmark = pytest.mark.integration

ITEMS = 64
BATCH_ITEMS = 8


@pytest.fixture
def stored(tmp_path):
    """A broker holding ITEMS items of one producer; its socket path."""
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    try:
        producer = start_producer(socket_path, Workload(shapes=2, items_per_producer=ITEMS, producers=1), 0)
        producer.join(60)
        assert producer.exitcode == 0
        yield socket_path
    finally:
        assert stop(broker) == 0


class HandConsumer:
    """A consumer by hand: registered, holding the batches it asked for (their descriptors)."""

    def __init__(self, socket_path: str, name: str, batches: int) -> None:
        self.conn = Connection.connect(socket_path)
        reply = self.conn.request({"type": "register_consumer", "model": 0, "max_batch_items": BATCH_ITEMS,
                                   "max_batch_tokens": 1 << 20, "max_input_len": 1 << 20, "pid": os.getpid(),
                                   "name": name})
        self.ring = RingReader.attach(reply["descriptor_ring"])
        self.conn.send({"type": "request_work", "credit": batches})
        self.held: list[Descriptor] = []
        for _ in range(batches):
            record = self.ring.peek(timeout_s=10)
            self.held.append(parse_descriptor(record.body.copy()))  # a copy: released next
            self.ring.release(record.end)

    def complete(self, batch_id: int, items: int) -> None:
        self.conn.send({"type": "complete", "batch_id": batch_id, "credit": 0,
                        "results": asdict(ConsumerWork(items_ok=items))})

    def close(self) -> None:
        self.ring.close(mark_closed=False)
        self.conn.close()


def items_of(consumer: HandConsumer) -> set[int]:
    return {int(item) for batch in consumer.held for item in batch.items["item_id"]}


def test_each_consumer_is_told_of_its_own_batches_only(stored):
    first, second = HandConsumer(stored, "first", 2), HandConsumer(stored, "second", 2)
    try:
        ids = [{batch.batch_id for batch in c.held} for c in (first, second)]
        assert len(ids[0]) == len(ids[1]) == 2 and not ids[0] & ids[1]
        assert items_of(first) and not items_of(first) & items_of(second)
        assert first.ring.poll() is None and second.ring.poll() is None  # nothing more in either ring
        held = status(stored).consumers
        assert (held["first"].credit, held["second"].credit) == (0, 0)
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("whose", ["another consumer's", "never handed out"])
def test_completing_a_batch_one_does_not_hold_is_refused(stored, whose):
    thief, holder = HandConsumer(stored, "thief", 1), HandConsumer(stored, "holder", 1)
    (own,), (theirs,) = thief.held, holder.held
    target = theirs.batch_id if whose == "another consumer's" else max(own.batch_id, theirs.batch_id) + 1000
    try:
        thief.complete(target, len(theirs.items))
        error = thief.conn.receive(10)
        assert error["type"] == "error"
        assert f"completed batch {target}, which it does not hold" in error["message"]
        after = wait_until(lambda: (s := status(stored)).consumers_lost == 1 and s, 30, "the refusal")
        # Nothing completed; the thief's own batch went back to dispatch, the holder kept its.
        assert after.items_completed == 0 and after.items_returned == len(own.items)
        assert list(after.consumers) == ["holder"] and after.pending_items == len(theirs.items)
        holder.complete(theirs.batch_id, len(theirs.items))
        done = wait_until(lambda: (s := status(stored)).items_completed == len(theirs.items) and s, 30,
                          "the holder's completion")
        assert done.per_consumer["holder"].batches == 1 and done.consumers_lost == 1
    finally:
        thief.close()
        holder.close()


def test_completing_ones_own_batch_twice_is_refused(stored):
    consumer = HandConsumer(stored, "twice", 1)
    (batch,) = consumer.held
    try:
        consumer.complete(batch.batch_id, len(batch.items))
        consumer.complete(batch.batch_id, len(batch.items))  # a resend
        error = consumer.conn.receive(10)
        assert error["type"] == "error" and f"completed batch {batch.batch_id}, which it does not hold" in error["message"]
        after = wait_until(lambda: (s := status(stored)).consumers_lost == 1 and s, 30, "the refusal")
        assert after.items_completed == len(batch.items)  # counted once
    finally:
        consumer.close()
