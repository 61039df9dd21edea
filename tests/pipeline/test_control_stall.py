"""A broker that itself does not run for a while (SIGSTOP, a VM pause) judges its consumers by
the time it was running: it wakes up, reads what they sent, and evicts nobody (SPEC §12).
Real processes and a real pause, so a campaign; tests/broker/test_broker_loop.py drives the
same loop in process against a simulated clock, with a slow turn's case too."""

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


@pytest.mark.campaign
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
