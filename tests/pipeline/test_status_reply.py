"""The status a real broker sends: versioned, with tokens_returned counted when a consumer
dies holding batches; and a consumer's `results` held to the record's counters."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest

from pipeline.broker.service import BrokerConfig
from pipeline.wire.client import broker_progress
from pipeline.wire.layouts.descriptors import Descriptor, parse_descriptor
from pipeline.wire.protocol import Connection
from pipeline.wire.status import STATUS_VERSION, BrokerStatus, ConsumerWork
from shm.ring import RingReader
from tests.pipeline.harness import Workload, start_broker, start_producer, status, stop, wait_until

pytestmark = pytest.mark.integration

# Items the producer stores before a consumer comes, and the contract's batch size.
ITEMS = 60
BATCH_ITEMS = 8


def stored_workload(tmp_path):
    """A broker holding ITEMS items, and its socket path."""
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    try:
        producer = start_producer(socket_path, Workload(shapes=2, items_per_producer=ITEMS, producers=1), 0)
        producer.join(60)
        assert producer.exitcode == 0
    except BaseException:
        stop(broker)
        raise
    return broker, socket_path


def consumer_holding(socket_path: str, batches: int) -> tuple[Connection, RingReader, list[Descriptor]]:
    """A consumer, by hand, that asked for `batches` batches and holds them (their items)."""
    conn = Connection.connect(socket_path)
    reply = conn.request({"type": "register_consumer", "model": 0, "max_batch_items": BATCH_ITEMS,
                          "max_batch_tokens": 1 << 20, "max_input_len": 1 << 20, "pid": os.getpid(),
                          "name": "holder"})
    ring = RingReader.attach(reply["descriptor_ring"])
    conn.send({"type": "request_work", "credit": batches})
    held = [parse_descriptor(ring.peek(timeout_s=10).body) for _ in range(batches)]
    return conn, ring, held


def test_tokens_returned_counts_what_a_consumer_that_died_held(tmp_path):
    broker, socket_path = stored_workload(tmp_path)
    try:
        asker = Connection.connect(socket_path)
        reply = asker.request({"type": "status"})  # the record in its wire form, and its version
        asker.close()
        assert reply["version"] == STATUS_VERSION
        assert BrokerStatus.from_wire(reply["counters"], version=STATUS_VERSION).backlog_items == ITEMS
        conn, ring, held = consumer_holding(socket_path, batches=2)
        items = sum(len(d.items) for d in held)
        tokens = sum(int(d.items["length"].sum()) for d in held)
        ring.close(mark_closed=False)
        conn.close()  # dies holding both batches: they go back to their queue
        final = wait_until(lambda: (s := status(socket_path)).consumers_lost == 1 and s, 30, "the loss")
    finally:
        assert stop(broker) == 0
    assert len(held) == 2 and 0 < items < ITEMS and tokens > items  # batches of a lane, not always full
    assert (final.items_returned, final.tokens_returned) == (items, tokens)
    assert (final.items_routed, final.tokens_routed) == (items, tokens)
    assert final.backlog_items == ITEMS and final.pending_items == 0 and final.items_completed == 0


def test_progress_is_the_status_counters_a_poller_needs(tmp_path):
    broker, socket_path = stored_workload(tmp_path)
    try:
        conn, ring, held = consumer_holding(socket_path, batches=1)
        (descriptor,) = held
        conn.send({"type": "complete", "batch_id": descriptor.batch_id, "credit": 0,
                   "results": asdict(ConsumerWork(items_ok=len(descriptor.items)))})
        done = wait_until(lambda: (p := broker_progress(socket_path)).items_completed and p, 30, "the completion")
        full = status(socket_path)
        ring.close(mark_closed=False)
        conn.close()
    finally:
        assert stop(broker) == 0
    assert done.items_completed == len(descriptor.items) == full.items_completed
    assert (done.items_received, done.items_recovered, done.tokens_completed) == (
        full.items_received, full.items_recovered, full.tokens_completed) == (ITEMS, 0, int(descriptor.items["length"].sum()))


def test_results_with_a_counter_the_record_lacks_refuse_the_consumer(tmp_path):
    broker, socket_path = stored_workload(tmp_path)
    try:
        conn, ring, (batch,) = consumer_holding(socket_path, batches=1)
        results = asdict(ConsumerWork(items_ok=len(batch.items))) | {"evicted_blocks": 3}  # an engine's extra
        conn.send({"type": "complete", "batch_id": batch.batch_id, "results": results, "credit": 0})
        error = conn.receive(10)
        ring.close(mark_closed=False)
        conn.close()
        after = wait_until(lambda: (s := status(socket_path)).consumers == {} and s, 30, "the refusal")
    finally:
        assert stop(broker) == 0
    assert error["type"] == "error" and "complete: results: unknown field 'evicted_blocks'" in error["message"]
    assert after.peers_refused == 1
    assert after.per_consumer["holder"].batches == 0 and after.per_consumer["holder"].work == ConsumerWork()
    # Nothing of the batch was completed: it went back to dispatch with the refused consumer.
    assert after.items_completed == 0 and after.items_returned == len(batch.items)


def test_the_broker_sums_each_consumers_busy_time_exactly(tmp_path):
    broker, socket_path = stored_workload(tmp_path)
    try:
        conn, ring, held = consumer_holding(socket_path, batches=2)
        for batch, busy_ns in zip(held, (1_500_000_001, 250_000_000)):
            results = asdict(ConsumerWork(items_ok=len(batch.items), busy_ns=busy_ns))
            conn.send({"type": "complete", "batch_id": batch.batch_id, "results": results, "credit": 0})
        after = wait_until(lambda: (s := status(socket_path)).per_consumer["holder"].batches == 2 and s, 30,
                           "both completions")
        ring.close(mark_closed=False)
        conn.close()
    finally:
        assert stop(broker) == 0
    work = after.per_consumer["holder"].work
    assert work.busy_ns == 1_750_000_001 and work.busy_s == 1.750000001  # nanoseconds: summed without rounding


def test_each_consumers_switches_and_shapes_reach_the_status(tmp_path):
    """Two shapes through one real consumer: its row counts its switches and shapes."""
    import numpy as np

    from pipeline.consumer.config import ConsumerConfig
    from pipeline.producer.client import BrokerProducer
    from pipeline.runtime.local import start_consumer

    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    consumer = start_consumer(ConsumerConfig(socket_path, str(tmp_path / "results"), "c0"))
    try:
        with BrokerProducer(socket_path, capacity_bytes=4 << 20, timeout_s=30) as client:
            for shape in (11, 12):
                client.submit_many(0, shape, np.arange(400, dtype=np.int32), [100] * 4, 0)
        done = wait_until(lambda: (s := status(socket_path)).items_completed == 8 and s, 60, "every item completed")
    finally:
        stop(consumer)
        assert stop(broker) == 0
    row = done.per_consumer["c0"]
    assert row.shapes_served == 2 and sum(row.switches.values()) == 2 and row.switches.get("initial") == 1
    assert row.split_prefix_tokens == 0  # one consumer: nothing split
    assert row.compulsory_prefix_tokens == done.compulsory_prefix_tokens == 0 and done.split_cost_tokens == 0


def test_a_shape_two_consumers_started_counts_its_prefix_once_as_split(tmp_path):
    import numpy as np

    from pipeline.consumer.config import ConsumerConfig
    from pipeline.producer.client import BrokerProducer
    from pipeline.runtime.local import start_consumer

    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    consumers = [start_consumer(ConsumerConfig(socket_path, str(tmp_path / "results"), f"c{k}", max_batch_items=2,
                                               engine_options={"cost_s_per_batch": 0.01})) for k in range(2)]
    try:
        wait_until(lambda: len(status(socket_path).consumers) == 2, 60, "both consumers registered")
        with BrokerProducer(socket_path, capacity_bytes=4 << 20, timeout_s=30) as client:
            client.submit_many(0, 21, np.arange(64 * 100, dtype=np.int32), [100] * 64, 50)
        done = wait_until(lambda: (s := status(socket_path)).items_completed == 64 and s, 60, "every item completed")
    finally:
        for consumer in consumers:
            stop(consumer)
        assert stop(broker) == 0
    rows = [done.per_consumer[f"c{k}"] for k in range(2)]
    started = sum(1 for row in rows if row.shapes_served)
    assert started == 2  # 32 batches of 10 ms: both consumers get some
    assert sorted(row.split_prefix_tokens for row in rows) == [0, 50]  # the second to start paid it
    # Each consumer's cache paid the 50 prefix tokens once; one cache for the model, once.
    assert [row.compulsory_prefix_tokens for row in rows] == [50, 50] and done.compulsory_prefix_tokens == 50
    assert done.split_cost_tokens == 50
