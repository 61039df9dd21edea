"""The whole pipeline as real processes: 2 producers -> broker (disk tier) -> 2 consumers.

Checks accounting (received = completed, difference zero), shape purity and the contract of
every batch, and a result for every item; then the failure cases: kill -9 of a consumer
mid-batch, kill -9 of the broker and a restart, a consumer that stops heartbeating
(SIGSTOP), bad registrations and completions, and a huge backlog that must not make a
healthy consumer look dead.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.broker.peers import namespace_for
from pipeline.consumer.config import ConsumerConfig
from pipeline.producer.client import BrokerProducer
from pipeline.reporting.accounting import reconcile, summarize_results, take_stock
from pipeline.runtime.inventory import store_stock
from pipeline.runtime.local import start_consumer
from pipeline.wire.errors import ProtocolError
from pipeline.wire.protocol import Connection
from tests.pipeline.harness import Workload, read_results, start_broker, start_producer, status, stop, wait_until
from tests.support.contracts import CONTRACTS, check_run, consumer_config

pytestmark = pytest.mark.integration


def test_full_run_two_producers_two_consumers(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    workload = Workload()
    consumers = [start_consumer(consumer_config(tmp_path, socket_path, k)) for k in range(2)]
    producers = [start_producer(socket_path, workload, p) for p in range(2)]
    try:
        for producer in producers:
            producer.join(120)
            assert producer.exitcode == 0
        total = workload.producers * workload.items_per_producer
        done = wait_until(lambda: (s := status(socket_path)).items_completed == total and s,
                          120, "every item completed")
        assert done.items_received == total and done.tokens_received == done.tokens_completed
        assert done.backlog_items == 0 and done.pending_items == 0
    finally:
        for consumer in consumers:
            stop(consumer)
        assert stop(broker) == 0
    per_item = check_run(read_results(str(tmp_path / "results")), workload, total)
    assert max(per_item.values()) == 1  # nothing failed, so nothing was redelivered
    summary = summarize_results(str(tmp_path / "results"))
    results = np.fromiter(summary.item_ids, dtype=np.uint64)
    # The two producers registered first and second on a fresh data directory: ids 0 and 1.
    ledger = [(p, workload.items_per_producer) for p in range(workload.producers)]
    none = np.zeros(0, dtype=np.uint64)
    stock = take_stock(ledger, results, store_stock(data).item_ids, none, taken_over=none)
    accounted = reconcile(summary, done, stock)
    assert accounted["lost"] == 0 and accounted["duplicates"] == 0 and accounted["items_unfinished"] == 0
    assert accounted["items_received"] == accounted["items_completed"] == total
    assert accounted["tokens_received"] == accounted["tokens_routed"] == accounted["tokens_completed"]
    namespace = namespace_for(data)
    assert [n for n in os.listdir("/dev/shm") if namespace in n] == []  # no ring, no doorbell left


def test_consumer_killed_mid_batch_is_redelivered(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    workload = Workload(items_per_producer=1500)
    # A slow engine so a batch is in flight when the kill lands.
    slow = consumer_config(tmp_path, socket_path, 0, cost_s_per_padded_token=2e-6)
    victim = start_consumer(slow)
    producers = [start_producer(socket_path, workload, p) for p in range(2)]
    try:
        wait_until(lambda: status(socket_path).items_completed > 200, 60, "some progress")
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        survivor = start_consumer(consumer_config(tmp_path, socket_path, 1))
        for producer in producers:
            producer.join(120)
        total = workload.producers * workload.items_per_producer
        wait_until(lambda: status(socket_path).items_completed == total, 120, "every item completed")
        stop(survivor)
    finally:
        assert stop(broker) == 0
    per_item = check_run(read_results(str(tmp_path / "results")), workload, total)
    duplicates = sum(n - 1 for n in per_item.values())
    assert duplicates <= 2 * CONTRACTS[0]["max_batch_items"]  # at most the batches it held


def test_broker_killed_and_restarted_loses_nothing(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    workload = Workload(items_per_producer=2500)
    consumers = [start_consumer(consumer_config(tmp_path, socket_path, k)) for k in range(2)]
    producers = [start_producer(socket_path, workload, p) for p in range(2)]
    total = workload.producers * workload.items_per_producer
    try:
        wait_until(lambda: status(socket_path).items_received > 500, 60, "ingest under way")
        os.kill(broker.pid, signal.SIGKILL)
        broker.join(10)
        broker = start_broker(data)
        for producer in producers:
            producer.join(120)
            assert producer.exitcode == 0
        wait_until(lambda: status(socket_path).backlog_items == 0
                   and status(socket_path).pending_items == 0, 120, "the store drained")
    finally:
        for consumer in consumers:
            stop(consumer)
        stop(broker)
    per_item = check_run(read_results(str(tmp_path / "results")), workload, total)
    assert len(per_item) == total  # nothing lost; duplicates allowed (redelivery), counted


def test_silent_consumer_is_declared_dead_and_its_late_completion_refused(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data, heartbeat_timeout_s=1.0)
    socket_path = BrokerConfig(data).socket_path
    workload = Workload(items_per_producer=800, producers=1)
    sleeper = start_consumer(consumer_config(tmp_path, socket_path, 0, cost_s_per_padded_token=5e-6))
    producer = start_producer(socket_path, workload, 0)
    try:
        wait_until(lambda: status(socket_path).items_routed > 0, 60, "a batch handed out")
        os.kill(sleeper.pid, signal.SIGSTOP)
        wait_until(lambda: status(socket_path).consumers_lost == 1, 30, "the silent consumer declared dead")
        other = start_consumer(consumer_config(tmp_path, socket_path, 1))
        producer.join(120)
        wait_until(lambda: status(socket_path).items_completed == 800, 120, "every item completed")
        os.kill(sleeper.pid, signal.SIGCONT)  # it wakes up and reports a batch it no longer holds
        time.sleep(0.5)
        assert status(socket_path).items_completed == 800
        stop(other)
        stop(sleeper)
    finally:
        stop(broker)
    check_run(read_results(str(tmp_path / "results")), workload, 800)


def test_bad_registrations_and_completions_get_clear_errors(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    try:
        good = Connection.connect(socket_path)
        good.request({"type": "register_consumer", "model": 0, "max_batch_items": 8,
                      "max_batch_tokens": 4096, "max_input_len": 512, "pid": 1})
        for bad, match in [
            (dict(max_batch_items=0), "max_batch_items"),
            (dict(max_batch_tokens=-5), "max_batch_tokens"),
            (dict(model=99_999), "unknown"),
        ]:
            conn = Connection.connect(socket_path)
            message = {"type": "register_consumer", "model": 0, "max_batch_items": 8,
                       "max_batch_tokens": 4096, "max_input_len": 512, "pid": 1, **bad}
            with pytest.raises(ProtocolError, match=match):
                conn.request(message)
            conn.close()
        good.send({"type": "complete", "batch_id": 12345, "results": {}, "credit": 1})
        assert good.receive(5)["type"] == "error"
        assert status(socket_path).consumers_lost == 1  # the bad one was disconnected
    finally:
        assert stop(broker) == 0


@pytest.mark.campaign  # 120,000 items through real processes: 40 s of the README's tests
def test_huge_backlog_never_makes_a_healthy_consumer_look_dead(tmp_path):
    # 120,000 small items ingested as fast as the producer writes them, and a consumer that
    # takes one item per batch: without the work slices (10 ms), fill and dispatch would hold
    # the loop for seconds, far past the 1 s heartbeat timeout.
    data = str(tmp_path / "data")
    broker = start_broker(data, heartbeat_timeout_s=1.0)
    socket_path = BrokerConfig(data).socket_path
    workload = Workload(shapes=3, items_per_producer=60_000)
    config = ConsumerConfig(socket_path, str(tmp_path / "results"), "c0", max_batch_items=1,
                            max_batch_tokens=1 << 20, max_input_len=1 << 20, credit=64)
    consumer = start_consumer(config)
    producers = [start_producer(socket_path, workload, p) for p in range(2)]
    try:
        for producer in producers:
            producer.join(300)
            assert producer.exitcode == 0
        wait_until(lambda: status(socket_path).items_completed > 2000, 120, "the consumer making progress")
        assert status(socket_path).consumers_lost == 0
    finally:
        stop(consumer)
        stop(broker)


def _die_after_submitting(socket_path: str, workload: Workload) -> None:
    from pipeline.producer.client import BrokerProducer
    from tests.pipeline.harness import _submit

    client = BrokerProducer(socket_path, capacity_bytes=16 << 20, timeout_s=60)
    _submit(client, workload, list(workload.items(0)))
    os.kill(os.getpid(), signal.SIGKILL)  # no goodbye, no unlink


def test_producer_that_dies_leaves_its_items_safe_and_its_ring_cleaned_up(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    workload = Workload(items_per_producer=400, producers=1)
    consumer = start_consumer(consumer_config(tmp_path, socket_path, 0))
    from tests.pipeline.harness import CTX

    dying = CTX.Process(target=_die_after_submitting, args=(socket_path, workload))
    dying.start()
    dying.join(60)
    assert dying.exitcode == -signal.SIGKILL
    try:
        wait_until(lambda: status(socket_path).items_completed == 400, 60, "its items completed")
        ring = f"sbrk-{namespace_for(data)}-p0"
        wait_until(lambda: ring not in os.listdir("/dev/shm"), 10, "its ring unlinked")
    finally:
        stop(consumer)
        stop(broker)
    check_run(read_results(str(tmp_path / "results")), workload, 400)


def test_an_engine_batch_longer_than_the_heartbeat_timeout_is_not_a_dead_consumer(tmp_path):
    # Each batch (4 items of 100 tokens) takes 3 s in the sim's cost model (a slow GPU
    # prefill), three times the broker's 1 s heartbeat timeout (its least): heartbeats come
    # from their own thread, so the consumer is never declared dead and nothing is redelivered.
    data = str(tmp_path / "data")
    broker = start_broker(data, heartbeat_timeout_s=1.0)
    socket_path = BrokerConfig(data).socket_path
    config = ConsumerConfig(socket_path, str(tmp_path / "results"), "c0", max_batch_items=4,
                            max_batch_tokens=1 << 20, max_input_len=1 << 20,
                            engine_options={"cost_s_per_padded_token": 3.0 / 400})
    consumer = start_consumer(config)
    try:
        with BrokerProducer(socket_path, capacity_bytes=4 << 20, timeout_s=30) as client:
            client.submit_many(0, 5, np.arange(800, dtype=np.int32) % 1000, [100] * 8)
        done = wait_until(lambda: (s := status(socket_path)).items_completed == 8 and s, 120, "every item completed")
        assert done.consumers_lost == 0 and done.items_returned == 0 and done.items_routed == 8
        assert done.batches_routed == 2  # two batches of 3 s each
    finally:
        stop(consumer)
        stop(broker)
