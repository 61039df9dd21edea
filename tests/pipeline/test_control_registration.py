"""What the broker checks where the outside world enters: its configuration (the socket path
fits a Unix socket address), a consumer's contract, name and credit, how many consumers and
producers it serves at once, and that a broker failing to start leaves nothing behind. Each
limit is tested at it and one past it."""

from __future__ import annotations

import os
import threading

import pytest

from pipeline.broker.config import MAX_CONTRACT_NUMBER, MAX_SOCKET_PATH_BYTES, MIN_HEARTBEAT_TIMEOUT_S, BrokerConfig
from pipeline.broker.service import Broker
from pipeline.broker.state import lock_run_dir
from pipeline.runtime.local import start_broker as start_broker_process
from pipeline.runtime.processes import open_storage
from pipeline.wire.errors import ConfigError, ContractError, ProtocolError
from pipeline.wire.layouts.descriptors import descriptor_size_bytes
from pipeline.wire.protocol import MAX_CONSUMER_NAME_LENGTH, MAX_CREDIT_BATCHES, Connection
from shm.ring_layout import max_body_bytes
from tests.pipeline.harness import status, stop
from tests.runtime.runs import shm_objects_of

pytestmark = pytest.mark.integration

CONTRACT = {"model": 0, "max_batch_items": 8, "max_batch_tokens": 4096, "max_input_len": 512}


def register(socket_path: str, **fields) -> Connection:
    """A consumer registration; ProtocolError with the broker's reason if refused."""
    conn = Connection.connect(socket_path)
    try:
        conn.request({"type": "register_consumer", **CONTRACT, "pid": os.getpid(), **fields})
    except BaseException:
        conn.close()
        raise
    return conn


def test_check_contract_at_and_past_each_limit():
    config = BrokerConfig("/tmp/data", max_models=10)
    assert config.check_contract(9, 1, 1, 1).model == 9
    with pytest.raises(ContractError, match="model 10 is unknown.*max_models is 10"):
        config.check_contract(10, 1, 1, 1)
    room = max_body_bytes(config.descriptor_ring_bytes)
    fits = max(n for n in range(1, 20_000) if descriptor_size_bytes(n) <= room)
    assert config.check_contract(0, fits, 1, 1).max_batch_items == fits
    with pytest.raises(ContractError, match=f"max_batch_items {fits + 1} needs .*at most {fits} items a batch"):
        config.check_contract(0, fits + 1, 1, 1)
    assert config.check_contract(0, 1, MAX_CONTRACT_NUMBER, MAX_CONTRACT_NUMBER).max_input_len == MAX_CONTRACT_NUMBER
    for args, match in [((0, 1, MAX_CONTRACT_NUMBER + 1, 1), "max_batch_tokens 4294967296 exceeds 4294967295"),
                        ((0, 1, 1, MAX_CONTRACT_NUMBER + 1), "max_input_len 4294967296 exceeds"),
                        ((0, 0, 1, 1), "max_batch_items must be >= 1, got 0"),
                        ((-1, 1, 1, 1), "model must be >= 0, got -1"),
                        ((0, 1, True, 1), "max_batch_tokens must be an integer, got True"),
                        ((0, 1, 1, 2.5), "max_input_len must be an integer, got 2.5")]:
        with pytest.raises(ContractError, match=match):
            config.check_contract(*args)


def test_the_config_is_checked_on_construction():
    assert BrokerConfig("/tmp/data", heartbeat_timeout_s=MIN_HEARTBEAT_TIMEOUT_S).heartbeat_timeout_s == 1.0
    for bad in (0.999, 0.0, -1.0, float("nan"), float("inf"), "10"):
        with pytest.raises(ConfigError, match="heartbeat timeout"):
            BrokerConfig("/tmp/data", heartbeat_timeout_s=bad)
    for name, bad in [("max_consumers", 0), ("max_producers", -1), ("max_models", 2**32 + 1),
                      ("max_buffered_bytes", 1.5), ("unregistered_timeout_s", float("nan"))]:
        with pytest.raises(ConfigError, match=name):
            BrokerConfig("/tmp/data", **{name: bad})


def test_a_socket_path_too_long_is_refused_before_anything_is_created(tmp_path):
    tail = len(os.sep + os.path.join("run", "broker.sock"))
    at_limit = str(tmp_path / ("d" * (MAX_SOCKET_PATH_BYTES - tail - len(str(tmp_path)) - 1)))
    config = BrokerConfig(at_limit)
    assert len(config.socket_path) == MAX_SOCKET_PATH_BYTES
    past = at_limit + "x"
    with pytest.raises(ConfigError, match=f"is {MAX_SOCKET_PATH_BYTES + 1} bytes long, and a Unix socket path "
                                          f"holds at most {MAX_SOCKET_PATH_BYTES}: give --data-dir a path of "
                                          f"at most {len(at_limit)} bytes"):
        BrokerConfig(past)
    assert not os.path.exists(past)
    broker = start_broker_process(config)  # a path at the limit binds and serves
    try:
        assert status(config.socket_path).consumers == {}
    finally:
        assert stop(broker) == 0
    assert shm_objects_of(at_limit) == []


def test_a_broker_that_fails_to_start_releases_what_it_opened(tmp_path):
    data = str(tmp_path / "data")
    config = BrokerConfig(data)
    os.makedirs(os.path.join(config.socket_path, "in-the-way"))  # bind cannot replace a directory
    lock_fd = lock_run_dir(config.run_dir)
    opened = open_storage(data, "disk", "process")
    descriptors = sorted(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    with pytest.raises(OSError):
        Broker(config, opened.tier, lock_fd=lock_fd, storage_dir=opened.directory)
    assert sorted(os.listdir("/proc/self/fd")) == descriptors  # selector, pipe, socket closed
    assert threading.active_count() == threads
    assert shm_objects_of(data) == []  # the doorbell it had created is gone
    opened.tier.close()
    os.close(lock_fd)  # the caller's lock stays the caller's


def test_consumer_names_are_checked_at_registration(tmp_path):
    config = BrokerConfig(str(tmp_path / "data"))
    broker = start_broker_process(config)
    try:
        longest = register(config.socket_path, name="n" * MAX_CONSUMER_NAME_LENGTH)
        for bad, match in [("n" * (MAX_CONSUMER_NAME_LENGTH + 1), "has 65 characters"),
                           ("../../etc/cron.d/x", "must be letters"), (".hidden", "not starting with '.'"),
                           ("", "has 0 characters"), (7, "must be a string")]:
            with pytest.raises(ProtocolError, match=match):
                register(config.socket_path, name=bad)
        first = register(config.socket_path, name="gpu0")
        with pytest.raises(ProtocolError, match="'gpu0' is taken by connected consumer"):
            register(config.socket_path, name="gpu0")
        first.send({"type": "goodbye"})
        first.close()
        again = register(config.socket_path, name="gpu0")  # free once its holder is gone
        assert set(status(config.socket_path).consumers) == {"n" * MAX_CONSUMER_NAME_LENGTH, "gpu0"}
        again.close()
        longest.close()
    finally:
        assert stop(broker) == 0


def test_consumers_are_served_up_to_the_limit(tmp_path):
    config = BrokerConfig(str(tmp_path / "data"), max_consumers=2)
    broker = start_broker_process(config)
    try:
        held = [register(config.socket_path, name=f"c{k}") for k in range(2)]
        with pytest.raises(ProtocolError, match="at most 2 consumers at once"):
            register(config.socket_path, name="c2")
        held[0].send({"type": "goodbye"})
        held[0].close()
        held[0] = register(config.socket_path, name="c2")  # room again
        assert len(status(config.socket_path).consumers) == 2
        for conn in held:
            conn.close()
    finally:
        assert stop(broker) == 0


def test_producers_are_served_up_to_the_limit(tmp_path):
    config = BrokerConfig(str(tmp_path / "data"), max_producers=2)
    broker = start_broker_process(config)
    message = {"type": "register_producer", "pid": os.getpid(), "producer_id": -1}
    try:
        held = [Connection.connect(config.socket_path) for _ in range(2)]
        assert [conn.request(message)["producer_id"] for conn in held] == [0, 1]
        refused = Connection.connect(config.socket_path)
        with pytest.raises(ProtocolError, match="at most 2 producers at once"):
            refused.request(message)
        refused.close()
        held[0].close()  # it never made a ring: the broker forgets it at once
        status(config.socket_path)
        held[0] = Connection.connect(config.socket_path)
        assert held[0].request(message)["producer_id"] == 2  # the refusal used up no id
        for conn in held:
            conn.close()
    finally:
        assert stop(broker) == 0


def test_a_consumer_may_ask_for_credit_up_to_the_limit(tmp_path):
    config = BrokerConfig(str(tmp_path / "data"))
    broker = start_broker_process(config)
    try:
        conn = register(config.socket_path, name="greedy")
        conn.send({"type": "request_work", "credit": MAX_CREDIT_BATCHES})
        assert status(config.socket_path).consumers["greedy"].credit == MAX_CREDIT_BATCHES
        conn.send({"type": "request_work", "credit": 1})
        refusal = conn.receive(5.0)
        assert refusal["type"] == "error" and f"past {MAX_CREDIT_BATCHES} batches" in refusal["message"]
        conn.close()
        assert status(config.socket_path).consumers == {}
    finally:
        assert stop(broker) == 0


def test_a_producer_whose_registration_fails_half_way_raises_that_error(tmp_path, monkeypatch):
    # The broker answered the registration, then the connection broke before producer_ready
    # went out: the ring is removed and the error is the broken pipe itself, once the
    # producer's asking again (a broker restarting looks the same) runs out of time.
    from pipeline.broker.config import BrokerConfig
    from pipeline.producer.client import BrokerProducer
    from pipeline.wire.protocol import Connection
    from tests.pipeline.harness import start_broker, stop

    data = str(tmp_path / "data")
    broker = start_broker(data)
    real_send = Connection.send

    def send(self, message):
        if message["type"] == "producer_ready":
            raise BrokenPipeError(32, "Broken pipe")
        real_send(self, message)

    monkeypatch.setattr(Connection, "send", send)
    try:
        with pytest.raises(BrokenPipeError):
            BrokerProducer(BrokerConfig(data).socket_path, register_timeout_s=1.0)
    finally:
        monkeypatch.undo()
        assert stop(broker) == 0
