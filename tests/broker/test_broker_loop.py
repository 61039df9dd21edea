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
from pipeline.broker.config import BrokerConfig
from pipeline.broker.service import Broker
from pipeline.broker.state import lock_run_dir
from pipeline.runtime.processes import open_storage
from pipeline.wire.protocol import Connection
from tests.support.clock import SimulatedTime, simulate_time

HEARTBEAT_TIMEOUT_S = 1.0
# Turns a registration takes at most (each turn reads what the socket holds).
REGISTER_TURNS = 20


@pytest.fixture
def clocked(tmp_path, monkeypatch) -> Iterator[tuple[Broker, SimulatedTime]]:
    """A broker on a disk tier in this process, its loop's clock simulated."""
    clock = simulate_time(monkeypatch, pipeline.broker.service, pipeline.broker.consumers, pipeline.broker.control,
                          pipeline.broker.producers)
    config = BrokerConfig(str(tmp_path / "data"), heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
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
