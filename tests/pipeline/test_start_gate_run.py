"""The start gate with real processes: with min_consumers = 2 a broker holding a backlog hands
nothing to its first consumer until the second registers; with a short wait it starts with
the one it has."""

from __future__ import annotations

import time

import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.runtime.local import start_broker, start_consumer
from tests.pipeline.harness import Workload, read_results, start_producer, status, stop, wait_until
from tests.support.contracts import check_run, consumer_config

pytestmark = pytest.mark.integration

WORKLOAD = Workload(items_per_producer=400)
TOTAL = WORKLOAD.producers * WORKLOAD.items_per_producer


def _backlog_in(socket_path: str) -> None:
    producers = [start_producer(socket_path, WORKLOAD, p) for p in range(WORKLOAD.producers)]
    for producer in producers:
        producer.join(120)
        assert producer.exitcode == 0
    wait_until(lambda: status(socket_path).items_received == TOTAL, 60, "every item received")


def test_nothing_is_dispatched_until_the_second_consumer_registers(tmp_path):
    config = BrokerConfig(str(tmp_path / "data"), min_consumers=2, min_consumers_wait_s=3600.0)
    broker = start_broker(config)
    consumers = []
    try:
        _backlog_in(config.socket_path)
        consumers.append(start_consumer(consumer_config(tmp_path, config.socket_path, 0)))
        wait_until(lambda: len(status(config.socket_path).consumers) == 1, 60, "the first consumer registered")
        # NOTE: a pause, not a bound: an open gate routes the first batch within a few
        # milliseconds of the registration, so a broken one shows here on any machine.
        time.sleep(0.5)
        held = status(config.socket_path)
        assert (held.items_routed, held.batches_routed, held.items_completed) == (0, 0, 0)
        consumers.append(start_consumer(consumer_config(tmp_path, config.socket_path, 1)))
        wait_until(lambda: status(config.socket_path).items_completed == TOTAL, 120, "every item completed")
    finally:
        for consumer in consumers:
            stop(consumer)
        assert stop(broker) == 0
    assert max(check_run(read_results(str(tmp_path / "results")), WORKLOAD, TOTAL).values()) == 1


def test_after_the_wait_the_consumers_there_get_the_work(tmp_path):
    config = BrokerConfig(str(tmp_path / "data"), min_consumers=2, min_consumers_wait_s=0.2)
    broker = start_broker(config)
    consumer = None
    try:
        consumer = start_consumer(consumer_config(tmp_path, config.socket_path, 0))
        _backlog_in(config.socket_path)
        wait_until(lambda: status(config.socket_path).items_completed == TOTAL, 120, "every item completed alone")
    finally:
        if consumer is not None:
            stop(consumer)
        assert stop(broker) == 0
    assert max(check_run(read_results(str(tmp_path / "results")), WORKLOAD, TOTAL).values()) == 1
