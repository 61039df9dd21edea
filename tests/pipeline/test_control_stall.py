"""A broker that itself does not run for a while (SIGSTOP, a VM pause) judges its consumers by
the time it was running: it wakes up, reads what they sent, and evicts nobody (SPEC §12)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.runtime.local import start_consumer
from tests.pipeline.harness import Workload, read_results, start_broker, start_producer, status, stop, wait_until
from tests.support.contracts import consumer_config

pytestmark = pytest.mark.integration

HEARTBEAT_TIMEOUT_S = 1.0


def test_a_paused_broker_evicts_no_healthy_consumer(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    socket_path = BrokerConfig(data).socket_path
    workload = Workload(items_per_producer=1500, producers=1)
    # Slow engines (about 0.1 s a batch): both consumers hold batches when the broker stops.
    consumers = [start_consumer(consumer_config(tmp_path, socket_path, k, cost_s_per_padded_token=2e-6))
                 for k in range(2)]
    producer = start_producer(socket_path, workload, 0)
    try:
        wait_until(lambda: (c := status(socket_path).consumers) and len(c) == 2
                   and all(row.batches_held > 0 for row in c.values()), 60, "both consumers holding work")
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            time.sleep(3 * HEARTBEAT_TIMEOUT_S)  # the consumers go on heartbeating into its socket
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        producer.join(120)
        assert producer.exitcode == 0
        done = wait_until(lambda: (s := status(socket_path)).items_completed == 1500 and s, 120, "every item")
        assert done.consumers_lost == 0
        assert done.items_returned == 0  # nothing was taken back from anyone
    finally:
        for consumer in consumers:
            stop(consumer)
        stop(broker)
    per_item = Counter(row["item_id"] for row in read_results(str(tmp_path / "results")))
    assert len(per_item) == 1500
    assert max(per_item.values()) == 1  # no duplicate results


def test_a_broker_whose_every_turn_is_slow_still_evicts_a_hung_consumer(tmp_path, monkeypatch):
    """Slow turns (a slow disk) are stalls too, but a consumer that sends nothing at all is
    still declared dead once its silence passes the timeout: the first fix forgave every
    slow turn's gap and never evicted it, so its batches never came back (seen in review).
    Counted in turns, not seconds: each turn is padded to more than the stall gap."""
    from pipeline.broker.service import Broker
    from pipeline.broker.state import lock_run_dir
    from pipeline.runtime.processes import open_storage
    from pipeline.wire.protocol import Connection

    data = str(tmp_path / "data")
    config = BrokerConfig(data, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    opened = open_storage(data, "disk", "process")
    broker = Broker(config, opened.tier, lock_fd=lock_run_dir(config.run_dir), storage_dir=opened.directory)
    hung = Connection.connect(config.socket_path)
    try:
        hung.send({"type": "register_consumer", "model": 0, "max_batch_items": 8, "max_batch_tokens": 4096,
                   "max_input_len": 512, "pid": os.getpid(), "name": "hung"})
        consumers = broker.consumer_side
        for _ in range(20):
            broker.turn()
            if consumers.consumers:
                break
        assert len(consumers.consumers) == 1
        slow = broker.producer_side.fill
        monkeypatch.setattr(broker.producer_side, "fill", lambda *args, **kw: (time.sleep(0.6), slow(*args, **kw))[1])
        turns = 0
        while consumers.consumers and turns < 10:
            broker.turn()
            turns += 1
        assert not consumers.consumers and consumers.consumers_lost == 1  # about 2 turns past the 1 s timeout
        assert broker.stalls >= turns - 1
    finally:
        hung.close()
        broker.close()
