"""The broker keeps serving through bad peers: a producer whose connection drops, a contract
the descriptor ring cannot carry, a record that is not a frame, a second broker on the same
data directory."""

from __future__ import annotations

import base64
import os
import socket

import numpy as np
import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.producer.client import BrokerProducer
from pipeline.runtime.local import start_broker as start_broker_process
from pipeline.runtime.local import start_consumer
from pipeline.runtime.processes import memory_tier_dir, open_storage
from pipeline.wire.errors import ProtocolError
from pipeline.wire.protocol import Connection
from shm.ring import RingWriter
from tests.pipeline.harness import read_results, start_broker, status, stop, wait_until
from tests.runtime.runs import shm_objects_of
from tests.support.contracts import consumer_config

pytestmark = pytest.mark.integration

TOKENS = np.arange(300, dtype=np.int32)


def test_producer_whose_connection_drops_registers_again_and_loses_nothing(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    consumer = start_consumer(consumer_config(tmp_path, socket_path, 0))
    try:
        producer = BrokerProducer(socket_path, capacity_bytes=16 << 20, timeout_s=30)
        for _ in range(50):
            producer.submit(0, 7, TOKENS)
        producer.conn.sock.shutdown(socket.SHUT_RDWR)  # the connection drops; the broker lives
        for _ in range(50):
            producer.submit(0, 7, TOKENS)
        producer.close(timeout_s=30)  # returns only once the broker stored all 100
        wait_until(lambda: status(socket_path).items_completed == 100, 30, "all 100 completed")
    finally:
        stop(consumer)
        stop(broker)


def test_a_producer_registering_while_no_broker_answers_waits_for_one_and_loses_nothing(tmp_path):
    """The first registration retries a broker that is away (no socket file, nobody
    listening) until one answers: a broker killed while `pipeline produce`'s producer
    registered used to fail the whole command. A producer thread starts before any broker;
    the broker starts once it has been refused a few times."""
    import threading

    data = str(tmp_path / "data")
    socket_path = BrokerConfig(data).socket_path
    made: list = []
    thread = threading.Thread(target=lambda: made.append(BrokerProducer(socket_path, capacity_bytes=16 << 20,
                                                                        timeout_s=30, register_timeout_s=60)))
    thread.start()
    thread.join(0.5)  # it is asking a data directory with no broker yet
    assert thread.is_alive() and not made
    broker = start_broker(data)
    consumer = start_consumer(consumer_config(tmp_path, socket_path, 0))
    try:
        thread.join(60)
        assert made, "the producer never registered"
        producer = made[0]
        for _ in range(40):
            producer.submit(0, 7, TOKENS)
        producer.close(timeout_s=30)
        wait_until(lambda: status(socket_path).items_completed == 40, 30, "all 40 completed")
    finally:
        stop(consumer)
        stop(broker)


def test_a_first_registration_gives_up_after_its_timeout_naming_the_socket(tmp_path):
    socket_path = BrokerConfig(str(tmp_path / "data")).socket_path
    with pytest.raises((FileNotFoundError, ConnectionError)) as caught:
        BrokerProducer(socket_path, capacity_bytes=1 << 20, register_timeout_s=0.3)
    assert socket_path in str(caught.value) and "0.3 s" in str(caught.value)


def test_a_producer_whose_goodbye_is_lost_is_forgotten_once_it_removes_its_ring(tmp_path):
    # Its connection drops and it closes before registering again: the broker never hears
    # its goodbye, and the producer process lives on. Unlinking its ring (after the broker
    # stored everything) is its last act, so the broker forgets it and, at its stop, removes
    # the doorbell: nothing of the run is left in /dev/shm.
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    try:
        producer = BrokerProducer(socket_path, capacity_bytes=16 << 20, timeout_s=30)
        producer._closing.set()  # its watcher must not register again: the goodbye is lost
        producer.conn.sock.shutdown(socket.SHUT_RDWR)
        for _ in range(20):
            producer.submit(0, 7, TOKENS)
        producer.close(timeout_s=30)  # the unregister goes nowhere; the ring is unlinked
        wait_until(lambda: status(socket_path).items_received == 20, 30, "all 20 stored")
    finally:
        assert stop(broker) == 0
    assert shm_objects_of(data) == []


def test_contract_larger_than_the_descriptor_ring_is_refused(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    try:
        conn = Connection.connect(socket_path)
        with pytest.raises(ProtocolError, match="descriptor"):
            conn.request({"type": "register_consumer", "model": 0, "max_batch_items": 100_000,
                          "max_batch_tokens": 1 << 30, "max_input_len": 100, "pid": 1})
        conn.close()
        assert status(socket_path).consumers == {}  # and the broker still answers
    finally:
        assert stop(broker) == 0


def test_a_record_that_is_not_a_frame_drops_only_its_producer(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    consumer = start_consumer(consumer_config(tmp_path, socket_path, 0))
    try:
        bad = BrokerProducer(socket_path, capacity_bytes=16 << 20)
        good = BrokerProducer(socket_path, capacity_bytes=16 << 20, timeout_s=30)
        RingWriter.write(bad.ring, b"not a frame at all, just bytes")
        for _ in range(20):
            good.submit(0, 9, TOKENS)
        good.close(timeout_s=30)
        wait_until(lambda: status(socket_path).items_completed == 20, 30, "the good producer's items")
        assert str(bad.producer_id) not in status(socket_path).producers
        bad.ring.close()
        bad.unlink()
    finally:
        stop(consumer)
        assert stop(broker) == 0


def test_second_broker_on_the_same_data_dir_is_refused_before_touching_files(tmp_path):
    config = BrokerConfig(str(tmp_path / "data"))
    first = start_broker_process(config)
    try:
        with pytest.raises(RuntimeError, match="exited at start"):
            start_broker_process(config)
        assert status(config.socket_path).consumers_lost == 0  # the first one still serves
    finally:
        assert stop(first) == 0


def test_memory_tier_refuses_power_durability(tmp_path):
    with pytest.raises(ValueError, match="memory tier is not durable"):
        open_storage(str(tmp_path), "memory", "power")
    with pytest.raises(ValueError, match="storage must be one of"):
        open_storage(str(tmp_path), "tape", "process")


def test_memory_tier_feeds_consumer_processes_and_leaves_nothing(tmp_path):
    """The memory tier keeps segments on tmpfs: consumers read them zero-copy as from disk;
    nothing is written under the data directory, and the tmpfs directory goes with the broker."""
    data = str(tmp_path / "data")
    broker = start_broker(data, storage="memory")
    socket_path = BrokerConfig(data).socket_path
    consumer = start_consumer(consumer_config(tmp_path, socket_path, 0))
    signature = 0x1234
    try:
        with BrokerProducer(socket_path) as producer:
            for k in range(200):
                producer.submit(0, signature, TOKENS[: 50 + k], prefix_len=10, payload=b"%d" % k)
        done = wait_until(lambda: (s := status(socket_path)).items_completed == 200 and s, 60, "completed")
        assert done.tokens_completed == sum(50 + k for k in range(200))
        kept = set(os.listdir(memory_tier_dir(data)))
        store = {"segments", "store.log"}  # the store's records beside it: its log
        assert "segments" in kept and kept <= store
        for name in store:
            assert not os.path.exists(os.path.join(data, name))
    finally:
        stop(consumer)
        assert stop(broker) == 0
    assert not os.path.exists(memory_tier_dir(data))
    rows = read_results(str(tmp_path / "results"))
    assert sorted(int(base64.b64decode(r["payload"])) for r in rows) == list(range(200))


def test_a_producer_whose_ring_cannot_hold_an_item_leaves_nothing(tmp_path):
    """Registration fails after the ring is created (too small for the largest item): the
    producer removes its ring, the broker forgets it, and the broker's stop removes the rest."""
    data = str(tmp_path / "data")
    broker = start_broker(data)
    try:
        with pytest.raises(ValueError, match="cannot hold the largest item"):
            BrokerProducer(BrokerConfig(data).socket_path, capacity_bytes=1 << 16)
    finally:
        assert stop(broker) == 0
    assert shm_objects_of(data) == []
