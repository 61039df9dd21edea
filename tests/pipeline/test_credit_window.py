"""A consumer's credit window against a real broker: the broker holds as many batches for it
as its batch times ask for (pipeline/consumer/credit.py), never more.

The windows are made deterministic by the horizon, not by timing: with 10 s of work to keep
queued, any batch quicker than 150 ms asks for the maximum; with 1 us, any batch asks for
the minimum.
"""

from __future__ import annotations

import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.broker.pacing import PARTIAL_BATCHES_AHEAD
from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.credit import INITIAL_CREDIT, MAX_CREDIT, MIN_CREDIT
from pipeline.runtime.local import CTX, start_consumer
from tests.pipeline.harness import Workload, start_broker, start_producer, status, stop, wait_until

pytestmark = pytest.mark.integration


def _windows_seen(tmp_path, ahead_s: float, **bounds: int) -> tuple[list[int], int]:
    """Run a stored backlog through one consumer; the broker's view of its window (credit
    left + batches held) at every status poll once a few batches completed, and the total."""
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    workload = Workload(shapes=3, items_per_producer=4000, producers=1)
    consumer = None
    try:
        producer = start_producer(socket_path, workload, 0)
        producer.join(120)
        assert producer.exitcode == 0
        config = ConsumerConfig(socket_path, str(tmp_path / "results"), "c0", max_batch_items=4,
                                max_batch_tokens=1 << 20, max_input_len=1 << 20, ahead_s=ahead_s, **bounds)
        consumer = start_consumer(config)
        seen = []
        while (counters := status(socket_path)).items_completed < 4000:
            held = counters.consumers.get("c0")
            if held is not None and counters.items_completed >= 40:
                seen.append(held.credit + held.batches_held)
        wait_until(lambda: status(socket_path).consumers["c0"].batches_held == 0, 30, "last completion")
        return seen, status(socket_path).items_completed
    finally:
        if consumer is not None:
            stop(consumer)
        assert stop(broker) == 0


def test_quick_batches_open_the_window_to_its_maximum(tmp_path):
    seen, completed = _windows_seen(tmp_path, ahead_s=10.0)
    assert completed == 4000
    assert max(seen) > INITIAL_CREDIT  # it grew past what the first request asked for
    assert max(seen) <= MAX_CREDIT


def test_configured_bounds_hold_the_window(tmp_path):
    # The same quick batches as above with the maximum set to 6: it is reached and never passed.
    seen, completed = _windows_seen(tmp_path, ahead_s=10.0, credit_min_batches=3, credit_max_batches=6)
    assert completed == 4000
    assert max(seen) == 6


def test_slow_batches_keep_the_window_at_its_minimum(tmp_path):
    seen, completed = _windows_seen(tmp_path, ahead_s=1e-6)
    assert completed == 4000
    assert seen and max(seen) <= MIN_CREDIT


def test_partial_batches_wait_while_the_consumer_has_enough(tmp_path):
    # A slow consumer with a wide window, fed one item at a time into one lane that never
    # fills a 64-item batch: the broker holds at most PARTIAL_BATCHES_AHEAD partial batches
    # for it, and the items that arrive meanwhile join the next batch instead.
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    consumer = None
    try:
        config = ConsumerConfig(socket_path, str(tmp_path / "results"), "c0", max_batch_items=64,
                                max_batch_tokens=1 << 20, max_input_len=1 << 20, ahead_s=10.0,
                                engine_options={"cost_s_per_padded_token": 0.0002})  # ~25 ms a batch
        consumer = start_consumer(config)
        wait_until(lambda: "c0" in status(socket_path).consumers, 30, "the consumer")
        producer = CTX.Process(target=_trickle, args=(socket_path, 60))
        producer.start()
        held, window = [], []
        while (counters := status(socket_path)).items_completed < 60:
            c0 = counters.consumers["c0"]
            # While items keep arriving (every 3 ms); once the lane has been idle for
            # PARTIAL_WAIT_S, a partial batch goes out beyond the bound (nothing will fill it).
            if producer.is_alive():
                held.append(c0.batches_held)
            window.append(c0.batches_held + c0.credit)
        producer.join(30)
        assert held and max(held) <= PARTIAL_BATCHES_AHEAD
        assert max(window) > PARTIAL_BATCHES_AHEAD  # the window alone would have allowed more
        assert status(socket_path).batches_routed < 60  # items joined batches while waiting
    finally:
        if consumer is not None:
            stop(consumer)
        assert stop(broker) == 0


def _trickle(socket_path: str, items: int) -> None:
    import time

    import numpy as np

    from pipeline.producer.client import BrokerProducer
    from pipeline.producer.signature import signature

    prefix = np.arange(16, dtype=np.int32)
    producer = BrokerProducer(socket_path, timeout_s=30)
    for k in range(items):
        producer.submit(0, signature([prefix]), np.concatenate([prefix, np.full(84, k, dtype=np.int32)]), 16)
        time.sleep(0.003)
    producer.close(timeout_s=30)
