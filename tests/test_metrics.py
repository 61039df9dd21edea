"""Prometheus metrics: the exposition of statuses, and a real endpoint over a real broker.
The endpoint's access and bounds: tests/test_metrics_endpoint.py."""

from __future__ import annotations

import copy
import os
import threading
import time
import urllib.request
from dataclasses import replace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.broker.config import BrokerConfig
from pipeline.broker.peers import namespace_for
from pipeline.broker.service import STATUS_TOP_SHAPES
from pipeline.producer.client import BrokerProducer
from pipeline.producer.signature import signature
from pipeline.reporting.metrics import (
    CONSUMER_COUNTERS,
    COUNTERS,
    GAUGES,
    LANE_EVENTS,
    StatusCollector,
    render,
)
from pipeline.reporting.metrics_endpoint import MetricsServer
from pipeline.runtime.local import start_broker, stop_process
from pipeline.wire.client import broker_status
from pipeline.wire.errors import ProtocolError
from pipeline.wire.status import BrokerStatus, TopShape
from tests.support.statuses import SAMPLE, SAMPLE_WIRE, status_of

P = "shape_broker_"
# Shapes submitted in the end-to-end test: more than the status's top rows, so "other" appears.
REAL_SHAPES = STATUS_TOP_SHAPES + 4
# Items per shape in the end-to-end test.
ITEMS_PER_SHAPE = 3
# How long request threads of the HTTP server (daemons, never joined by it) may take to end.
THREAD_EXIT_TIMEOUT_S = 5.0


def samples(text: str) -> dict[str, dict[tuple, float]]:
    """Parsed exposition: sample name -> {sorted (label, value) pairs: value}."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def scalar(parsed: dict, name: str) -> float:
    (value,) = parsed[P + name].values()
    return value


def by_label(parsed: dict, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: value for labels, value in parsed.get(P + name, {}).items()}


def scrape_collector(fetch) -> dict:
    registry = CollectorRegistry()
    registry.register(StatusCollector(fetch))
    return samples(generate_latest(registry).decode())


def test_sample_status_gives_every_counter_and_gauge():
    status = replace(SAMPLE, items_recovered=7, tokens_recovered=700,  # recovered count as received
                     items_adopted=3, peers_refused=4, peers_shed=5, stalls=1,
                     store_damage={"entries_damaged": 2, "segments_missing": 1, "torn_tails": 0})
    parsed = samples(render(status))
    assert by_label(parsed, "store_damage", "kind") == {"entries_damaged": 2, "segments_missing": 1, "torn_tails": 0}
    assert scalar(parsed, "up") == 1
    for export in COUNTERS:
        if not export.label:
            assert scalar(parsed, export.name + "_total") == export.read(status), export.name
    assert scalar(parsed, "items_received_total") == 4007
    assert scalar(parsed, "tokens_received_total") == 1580568 + 700
    for export in GAUGES:
        if not export.label:
            assert scalar(parsed, export.name) == export.read(status), export.name
    assert by_label(parsed, "shape_switches_total", "reason") == {"initial": 1, "drained": 19, "starvation": 0}
    assert by_label(parsed, "lane_events_total", "event") == {e: getattr(status.lanes, e) for e in LANE_EVENTS}
    assert scalar(parsed, "lanes_max_in_use") == 923
    assert scalar(parsed, "consumers_connected") == 2
    assert scalar(parsed, "disk_full") == 0
    assert scalar(parsed, "uptime_seconds") == pytest.approx(0.63)
    assert scalar(parsed, "padding_efficiency_ratio") == pytest.approx(1580568 / 1615456)
    assert scalar(parsed, "batch_fill_mean_ratio") == pytest.approx(63.1478271484375 / 924)


def test_sample_status_per_shape_rows_keep_their_labels():
    parsed = samples(render(SAMPLE))
    lanes = {(dict(k)["model"], dict(k)["shape"]): v for k, v in parsed[P + "shape_lanes"].items()}
    assert lanes == {("0", "1a35f69c347a5143"): 44, ("0", "1ae547ad907fc925"): 47, ("all", "other"): 190}
    for name in ("shape_queued_items", "shape_queued_tokens", "shape_pending_items"):
        assert set(parsed[P + name]) == set(parsed[P + "shape_lanes"]), name


def test_sample_status_per_consumer_counters_and_cache_hit_ratio():
    parsed = samples(render(SAMPLE))
    for export in CONSUMER_COUNTERS:
        expected = {name: export.read(row) for name, row in SAMPLE.per_consumer.items()}
        assert by_label(parsed, f"consumer_{export.name}_total", "consumer") == expected, export.name
    assert by_label(parsed, "consumer_items_ok_total", "consumer") == {"c0": 2072, "c1": 1928}
    assert by_label(parsed, "consumer_connected", "consumer") == {"c0": 1, "c1": 1}
    # c0: 238096 / (240416 - 2320): every hit a perfect order could get
    assert by_label(parsed, "consumer_cache_hit_ratio", "consumer") == {"c0": 1.0, "c1": 1.0}


def test_busy_time_in_seconds_and_prefix_reuse_per_consumer_and_in_total():
    parsed = samples(render(SAMPLE))
    # busy_ns on the wire, seconds in the metric (Prometheus' base unit)
    assert by_label(parsed, "consumer_busy_seconds_total", "consumer") == {"c0": 1.25, "c1": 1.5}
    assert by_label(parsed, "consumer_prefix_reuse_ratio", "consumer") == {
        "c0": pytest.approx(238096 / 826855), "c1": pytest.approx(218496 / 753713)}
    assert scalar(parsed, "prefix_reuse_ratio") == pytest.approx((238096 + 218496) / (826855 + 753713))
    nothing = samples(render(replace(SAMPLE, per_consumer={})))
    assert P + "prefix_reuse_ratio" not in nothing  # no prompt token yet: no ratio


def test_cache_hit_ratio_counts_only_reachable_hits_and_skips_a_zero_denominator():
    status = copy.deepcopy(SAMPLE_WIRE)
    status["per_consumer"]["c0"].update(cacheable_tokens=1000, compulsory_miss_tokens=200, cacheable_hit_tokens=600)
    status["per_consumer"]["c1"].update(cacheable_tokens=300, compulsory_miss_tokens=300, cacheable_hit_tokens=0)
    status["per_consumer"]["c1"]["connected"] = False
    parsed = samples(render(status_of(status)))
    assert by_label(parsed, "consumer_cache_hit_ratio", "consumer") == {"c0": 0.75}
    assert by_label(parsed, "consumer_connected", "consumer") == {"c0": 1, "c1": 0}


def test_no_consumers_and_nothing_routed():
    status = replace(SAMPLE, consumers={}, per_consumer={}, batches_routed=0, batch_fill_sum=0.0, tokens_routed=0,
                     padded_tokens_routed=0, disk_full=True)
    parsed = samples(render(status))
    assert scalar(parsed, "consumers_connected") == 0
    assert not [name for name in parsed if name.startswith(P + "consumer_")]
    assert scalar(parsed, "padding_efficiency_ratio") == 1.0  # no padding wasted yet
    assert P + "batch_fill_mean_ratio" not in parsed  # a mean of no batches is no number
    assert scalar(parsed, "disk_full") == 1


def test_many_shapes_give_at_most_top_rows_plus_other():
    top = [TopShape(model=k % 3, signature=f"{k:016x}", lanes=1, queued_items=k, queued_tokens=10 * k,
                    pending_items=0) for k in range(STATUS_TOP_SHAPES)]
    top.append(TopShape(model=-1, signature="other", lanes=900, queued_items=5000, queued_tokens=50_000,
                        pending_items=3))
    status = replace(SAMPLE, top_shapes=tuple(top))
    parsed = samples(render(status))
    queued = {dict(k)["shape"]: (dict(k)["model"], v) for k, v in parsed[P + "shape_queued_items"].items()}
    assert len(queued) == STATUS_TOP_SHAPES + 1
    assert queued["other"] == ("all", 5000)
    assert queued[f"{5:016x}"] == ("2", 5)
    assert by_label(parsed, "shape_pending_items", "shape")["other"] == 3


def test_a_broker_that_did_nothing_reads_as_zero():
    parsed = samples(render(BrokerStatus()))
    assert scalar(parsed, "up") == 1
    assert scalar(parsed, "items_received_total") == 0
    assert scalar(parsed, "backlog_tokens") == 0
    assert by_label(parsed, "lane_events_total", "event") == dict.fromkeys(LANE_EVENTS, 0)
    assert P + "shape_lanes" not in parsed


@pytest.mark.parametrize("error", [FileNotFoundError("no socket"), ConnectionRefusedError(), TimeoutError(),
                                   ProtocolError("broker refused status")])
def test_broker_unreachable_gives_only_up_zero(error):
    def fetch() -> BrokerStatus:
        raise error

    assert scrape_collector(fetch) == {P + "up": {(): 0.0}}


def test_a_bug_in_fetch_is_not_read_as_broker_down():
    with pytest.raises(KeyError):
        scrape_collector(lambda: {}["counters"])


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return samples(response.read().decode())


def submit_shapes(socket_path: str) -> int:
    """ITEMS_PER_SHAPE items of each of REAL_SHAPES shapes; the number of tokens submitted."""
    producer = BrokerProducer(socket_path, capacity_bytes=16 << 20, timeout_s=10)
    tokens = 0
    try:
        for shape in range(REAL_SHAPES):
            prefix = np.full(8, shape, dtype=np.int32)
            for k in range(ITEMS_PER_SHAPE):
                item = np.concatenate([prefix, np.arange(10 + k, dtype=np.int32)])
                producer.submit(0, signature([prefix]), item, prefix.shape[0], payload=b"")
                tokens += item.shape[0]
    finally:
        producer.close(timeout_s=10)  # returns once the broker stored everything
    return tokens


def wait_for_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    deadline = time.monotonic() + THREAD_EXIT_TIMEOUT_S
    while time.monotonic() < deadline:
        left = [t for t in threading.enumerate() if t not in before]
        if not left:
            return []
        time.sleep(0.01)
    return left


@pytest.mark.integration
def test_endpoint_over_a_real_broker(tmp_path):
    threads_before = set(threading.enumerate())
    data = str(tmp_path / "data")
    config = BrokerConfig(data, pool_max_items=0)  # shapes of their own: labels bounded however many
    broker = start_broker(config, "disk", "process")
    server = None
    try:
        tokens = submit_shapes(config.socket_path)
        server = MetricsServer.start(0, lambda: broker_status(config.socket_path))
        assert server.port > 0
        parsed = scrape(server.port)
        items = REAL_SHAPES * ITEMS_PER_SHAPE
        assert scalar(parsed, "up") == 1
        assert scalar(parsed, "items_received_total") == items
        assert scalar(parsed, "tokens_received_total") == tokens
        assert scalar(parsed, "backlog_items") == items  # no consumer: everything waits
        assert scalar(parsed, "shapes") == REAL_SHAPES
        queued = by_label(parsed, "shape_queued_items", "shape")
        assert len(queued) == STATUS_TOP_SHAPES + 1 and sum(queued.values()) == items
        assert queued["other"] == (REAL_SHAPES - STATUS_TOP_SHAPES) * ITEMS_PER_SHAPE
        assert stop_process(broker) == 0
        assert scrape(server.port) == {P + "up": {(): 0.0}}
    finally:
        if server is not None:
            server.close()
        stop_process(broker)
    assert [n for n in os.listdir("/dev/shm") if namespace_for(data) in n] == []
    assert wait_for_threads(threads_before) == []


def test_two_servers_on_free_ports_close_cleanly():
    threads_before = set(threading.enumerate())
    with MetricsServer.start(0, lambda: SAMPLE) as first, MetricsServer.start(0, lambda: BrokerStatus()) as second:
        assert first.port != second.port
        assert scalar(scrape(first.port), "items_received_total") == 4000
        assert scalar(scrape(second.port), "items_received_total") == 0
    first.close()  # a second close is harmless
    assert wait_for_threads(threads_before) == []
    with pytest.raises(OSError):
        scrape(first.port)
