"""The broker's loop in this process against a simulated clock: a broker that did not run
for a while (SIGSTOP, a VM pause, a slow disk) reads what its consumers sent meanwhile before
judging them, so it evicts the silent one and nobody else; a broker whose every turn is slow
still evicts a hung consumer. No process and no sleep: the clock moves when the test says
(tests/pipeline/test_control_stall.py runs the same with real processes, as a campaign)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import pipeline.broker.consumers
import pipeline.broker.control
import pipeline.broker.producers
import pipeline.broker.service
import numpy as np

from pipeline.broker.config import BrokerConfig
from pipeline.broker.service import Broker
from pipeline.broker.state import lock_run_dir
from pipeline.producer.producer import Producer, ProducerLimits
from pipeline.runtime.processes import open_storage
from pipeline.wire.protocol import Connection
from shm.ring import RingWriter
from tests.support.clock import SimulatedTime, simulate_time

HEARTBEAT_TIMEOUT_S = 1.0
# Turns a registration takes at most (each turn reads what the socket holds).
REGISTER_TURNS = 20


@pytest.fixture
def clocked(tmp_path, monkeypatch, request) -> Iterator[tuple[Broker, SimulatedTime]]:
    """A broker on a disk tier in this process, its loop's clock simulated (more settings:
    parametrized indirectly)."""
    clock = simulate_time(monkeypatch, pipeline.broker.service, pipeline.broker.consumers, pipeline.broker.control,
                          pipeline.broker.producers)
    settings = getattr(request, "param", {})
    config = BrokerConfig(str(tmp_path / "data"), heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, **settings)
    opened = open_storage(config.data_dir, "disk", "process")
    broker = Broker(config, opened.tier, lock_fd=lock_run_dir(config.run_dir), storage_dir=opened.directory)
    try:
        yield broker, clock
    finally:
        broker.close()


def register(broker: Broker, name: str) -> Connection:
    conn = Connection.connect(broker.config.socket_path)
    conn.send({"type": "register_consumer", "model": 0, "max_batch_items": 8, "max_batch_tokens": 4096,
               "max_input_len": 512, "pid": os.getpid(), "name": name})
    known = len(broker.consumer_side.consumers)
    for _ in range(REGISTER_TURNS):
        broker.turn()
        if len(broker.consumer_side.consumers) > known:
            assert conn.receive(5)["type"] == "registered"
            return conn
    raise AssertionError(f"{name} did not register in {REGISTER_TURNS} turns")


def names(broker: Broker) -> set[str]:
    return {consumer.name for consumer in broker.consumer_side.consumers.values()}


def test_a_paused_broker_reads_what_was_sent_meanwhile_and_evicts_only_the_silent_consumer(clocked):
    broker, clock = clocked
    healthy, silent = register(broker, "healthy"), register(broker, "silent")
    try:
        clock.advance(0.3)
        broker.turn()
        clock.advance(3 * HEARTBEAT_TIMEOUT_S)  # the broker does not run: a pause
        healthy.send({"type": "heartbeat"})  # sent while it was paused: waiting in its socket
        broker.turn()
        assert broker.stalls == 1 and broker.stalled_s >= 3 * HEARTBEAT_TIMEOUT_S
        assert names(broker) == {"healthy"} and broker.consumer_side.consumers_lost == 1
        for _ in range(10):  # heartbeating on, running on time: it stays, and no more stalls
            clock.advance(broker.config.stall_gap_s / 2)
            healthy.send({"type": "heartbeat"})
            broker.turn()
        assert names(broker) == {"healthy"} and broker.stalls == 1
    finally:
        healthy.close()
        silent.close()


def test_a_broker_whose_every_turn_is_slow_still_evicts_a_hung_consumer(clocked, monkeypatch):
    """Slow turns (a slow disk) are stalls too, but a consumer that sends nothing at all is
    still declared dead once its silence passes the timeout (forgiving every slow turn's gap
    would never evict it, and its batches would never come back). Counted in turns: each is
    more than the stall gap."""
    broker, clock = clocked
    hung = register(broker, "hung")
    try:
        fill = broker.producer_side.fill
        monkeypatch.setattr(broker.producer_side, "fill", lambda *args, **kw: (clock.advance(0.6), fill(*args, **kw))[1])
        turns = 0
        while broker.consumer_side.consumers and turns < 10:
            broker.turn()
            turns += 1
        assert not broker.consumer_side.consumers and broker.consumer_side.consumers_lost == 1
        assert turns <= 3  # its silence passes the 1 s timeout in the second turn of 0.6 s
        assert broker.stalls >= turns - 1
    finally:
        hung.close()


def register_producer(broker: Broker) -> tuple[Connection, Producer]:
    """A producer registered by hand (the broker runs in this thread), its ring made."""
    conn = Connection.connect(broker.config.socket_path)
    conn.send({"type": "register_producer", "pid": os.getpid(), "producer_id": -1})
    for _ in range(REGISTER_TURNS):
        broker.turn()
        if broker.producer_side.producers:
            break
    reply = conn.receive(5)
    ring = RingWriter.create(reply["ring"], 1 << 20, doorbell=reply["doorbell"], reattach=True)
    producer = Producer(ring, reply["producer_id"], limits=ProducerLimits(max_item_tokens=64), timeout_s=1.0)
    conn.send({"type": "producer_ready", "ring": reply["ring"]})
    for _ in range(REGISTER_TURNS):
        broker.turn()
        if all(peer.ring is not None for peer in broker.producer_side.producers.values()):
            return conn, producer
    raise AssertionError("the producer's ring was not attached")


def send_shapes(producer: Producer, first: int, frames: int, per_frame: int = 10) -> None:
    """`frames` frames of `per_frame` items, each item a shape of its own."""
    for frame in range(frames):
        start = first + frame * per_frame
        signatures = np.arange(start, start + per_frame, dtype=np.uint64)
        producer.submit_many(0, signatures, np.ones(8 * per_frame, dtype=np.int32), np.full(per_frame, 8), 0)


def turns(broker: Broker, count: int = 5) -> None:
    for _ in range(count):
        broker.turn()


@pytest.mark.parametrize("clocked", [{"max_live_shapes": 35}], indirect=True)
def test_live_shapes_of_a_model_no_consumer_serves_do_not_hold_the_rings(clocked):
    """Past the bound with no consumer for the model: everything is read (a model nobody
    serves would otherwise hold every other model's producers); once one serves it, the
    rings wait and what comes next stays in them."""
    broker, _clock = clocked
    conn, producer = register_producer(broker)
    consumer = None
    try:
        send_shapes(producer, first=1, frames=5)
        turns(broker)
        assert broker.dispatcher.counters().items_received == 50 and broker.producer_side.shape_hold_episodes == 0
        consumer = register(broker, "c0")  # no credit asked: nothing is dispatched, nothing finishes
        send_shapes(producer, first=100, frames=2)
        turns(broker)
        assert broker.dispatcher.counters().items_received == 50 and broker.producer_side.shape_hold_episodes == 1
    finally:
        for held in (conn, consumer):
            if held is not None:
                held.close()
        producer.close()


@pytest.mark.parametrize("clocked", [{"max_live_shapes": 15}], indirect=True)
def test_the_bound_is_checked_before_each_frame(clocked):
    """Frames of ten new shapes each: 0 and 10 live are below 15, so two frames are read in
    the same turn and the third waits: one frame past the bound at most."""
    broker, _clock = clocked
    conn, producer = register_producer(broker)
    consumer = register(broker, "c0")
    try:
        send_shapes(producer, first=1, frames=3)
        turns(broker)
        assert broker.dispatcher.counters().items_received == 20 and broker.dispatcher.live_shapes({0}) == 20
    finally:
        conn.close()
        consumer.close()
        producer.close()
