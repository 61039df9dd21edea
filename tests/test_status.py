"""The status record: its wire form round trip, the keys version 1 pins, and what a client
refuses (another version, a field missing, unknown or of the wrong type)."""

from __future__ import annotations

import copy
import json
from dataclasses import fields

import pytest

from pipeline.wire.errors import ProtocolError
from pipeline.wire.status import (
    STATUS_VERSION,
    BrokerStatus,
    ConnectedConsumer,
    ConsumerTotalsRow,
    ConsumerWork,
    LaneEvents,
    ProducerRow,
    TopShape,
)

# The wire keys (version 1's: what brokers sent before the record, plus tokens_returned;
# version 2 added the engine check fields to WORK_KEYS, version 3 busy_ns). A change here is
# a new STATUS_VERSION.
V1_KEYS = {
    "items_received", "tokens_received", "items_routed", "tokens_routed", "items_completed", "tokens_completed",
    "items_returned", "tokens_returned", "items_recovered", "tokens_recovered", "items_adopted", "duplicate_items",
    "backlog_items", "backlog_tokens", "pending_items", "shapes", "lanes_in_use", "lanes",
    "switches", "batches_routed", "padded_tokens_routed", "batch_fill_sum", "top_shapes", "consumers",
    "per_consumer", "uptime_s", "pid", "generation", "producers", "consumers_lost", "disk_full", "store_damage",
    "peers_refused", "peers_shed", "stalls", "stalled_s",
    # STATUS_VERSION 5: compulsory misses against one cache for the model, the lineage file's limit
    "compulsory_prefix_tokens", "compulsory_uncounted_starts", "lineage_chains_unrecorded",
    # STATUS_VERSION 6: the run's distinct shapes beside the live ones
    "shapes_seen",
    # STATUS_VERSION 7: the periodic syncs of durability `process` (sync_interval_s)
    "periodic_syncs", "periodic_sync_failures", "periodic_sync_max_s",
    # STATUS_VERSION 8: the solitary pool
    "pool_items", "pool_shapes",
}
LANE_KEYS = {"opened", "reused", "force_fits", "raises", "quiesced", "released", "revived", "restored", "max_in_use"}
CONSUMER_KEYS = {"id", "pid", "credit", "batches_held", "model", "max_batch_items", "max_batch_tokens",
                 "max_input_len"}
# What pipeline.consumer.process `run_batch` reports once its corrupt item ids are popped.
WORK_KEYS = {"items_ok", "items_too_long", "items_corrupt", "items_error", "items_cancelled", "prompt_tokens", "padded_tokens", "cacheable_tokens",
             "cache_hit_tokens", "cacheable_hit_tokens", "compulsory_miss_tokens", "output_tokens",
             "engine_prefix_cache_queries", "engine_prefix_cache_hits", "engine_checked_prompt_tokens",
             "engine_checked_cache_hit_tokens", "busy_ns"}


def work(base: int) -> ConsumerWork:
    return ConsumerWork(**{f.name: base + k for k, f in enumerate(fields(ConsumerWork))})


# A status with a row of every kind and no field at its default.
FULL = BrokerStatus(
    **{f.name: 10 + k for k, f in enumerate(fields(BrokerStatus)) if f.type == "int"},
    batch_fill_sum=63.25, uptime_s=0.5, stalled_s=1.5, disk_full=True,
    lanes=LaneEvents(**{f.name: k + 1 for k, f in enumerate(fields(LaneEvents))}),
    switches={"initial": 1, "drained": 19}, store_damage={"entries_damaged": 2},
    top_shapes=(TopShape(model=0, signature="1a35f69c347a5143", lanes=44, queued_items=3, queued_tokens=900,
                         pending_items=1),
                TopShape(model=-1, signature="other", lanes=190, queued_items=0, queued_tokens=0, pending_items=0)),
    consumers={"c0": ConnectedConsumer(consumer_id=1, pid=6273, credit=2, batches_held=1, model=0,
                                       max_batch_items=64, max_batch_tokens=65536, max_input_len=8192)},
    per_consumer={"c0": ConsumerTotalsRow(connected=True, batches=461, work=work(100)),
                  "c1": ConsumerTotalsRow(connected=False, batches=0, work=ConsumerWork())},
    producers={"3": ProducerRow(frames=5, items=50)},
)


def read(wire: dict) -> BrokerStatus:
    return BrokerStatus.from_wire(wire, version=STATUS_VERSION)


def test_the_wire_form_round_trips_through_json():
    wire = FULL.to_wire()
    assert read(json.loads(json.dumps(wire))) == FULL
    assert read(BrokerStatus().to_wire()) == BrokerStatus()


def test_the_wire_form_keeps_the_keys_brokers_sent_plus_tokens_returned():
    wire = FULL.to_wire()
    assert set(wire) == V1_KEYS
    assert set(wire["lanes"]) == LANE_KEYS
    assert set(wire["consumers"]["c0"]) == CONSUMER_KEYS and wire["consumers"]["c0"]["id"] == 1
    assert set(wire["per_consumer"]["c0"]) == {"connected", "batches", "switches", "shapes_served", "split_prefix_tokens",
                                              "compulsory_prefix_tokens"} | WORK_KEYS  # the work inline
    assert wire["top_shapes"][1] == {"model": -1, "signature": "other", "lanes": 190, "queued_items": 0,
                                     "queued_tokens": 0, "pending_items": 0}
    assert wire["producers"] == {"3": {"frames": 5, "items": 50}}
    assert {f.name for f in fields(ConsumerWork)} == WORK_KEYS


@pytest.mark.parametrize("version", [STATUS_VERSION + 1, 0, None, str(STATUS_VERSION), True, 1.0])
def test_another_version_is_refused_naming_it(version):
    with pytest.raises(ProtocolError, match=f"version {version!r} is not {STATUS_VERSION}"):
        BrokerStatus.from_wire(FULL.to_wire(), version=version)


def test_a_missing_field_is_refused_naming_it():
    wire = FULL.to_wire()
    del wire["tokens_returned"]  # a broker before tokens_returned, still claiming version 1
    with pytest.raises(ProtocolError, match="counters: field 'tokens_returned' is missing"):
        read(wire)
    wire = FULL.to_wire()
    del wire["per_consumer"]["c0"]["cacheable_hit_tokens"]
    with pytest.raises(ProtocolError, match=r"counters.per_consumer\['c0'\]: field 'cacheable_hit_tokens' is missing"):
        read(wire)
    wire = FULL.to_wire()
    del wire["consumers"]["c0"]["id"]
    with pytest.raises(ProtocolError, match=r"counters.consumers\['c0'\]: field 'id' is missing"):
        read(wire)


@pytest.mark.parametrize("path, value, named", [
    (["items_received"], "4000", "counters.items_received must be int, got '4000'"),
    (["items_received"], True, "counters.items_received must be int, got True"),
    (["items_received"], 1.5, "counters.items_received must be int, got 1.5"),
    (["disk_full"], 0, "counters.disk_full must be bool, got 0"),
    (["uptime_s"], "0.5", "counters.uptime_s must be int or float, got '0.5'"),
    (["switches"], [], "counters.switches must be dict, got a list of 0"),
    (["switches", "drained"], "19", r"counters.switches\['drained'\] must be int"),
    (["top_shapes"], {}, "counters.top_shapes must be list, got a dict of 0"),
    (["top_shapes", 0, "signature"], 7, r"counters.top_shapes\[0\].signature must be str, got 7"),
    (["lanes", "opened"], None, "counters.lanes.opened must be int, got None"),
    (["per_consumer", "c0"], [1], r"counters.per_consumer\['c0'\] must be dict, got a list of 1"),
    (["per_consumer", "c0", "items_ok"], -1.0, r"counters.per_consumer\['c0'\].items_ok must be int"),
    (["producers", "3", "frames"], "5", r"counters.producers\['3'\].frames must be int"),
])
def test_an_ill_typed_field_is_refused_naming_it(path, value, named):
    wire = copy.deepcopy(FULL.to_wire())
    holder = wire
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    with pytest.raises(ProtocolError, match=named):
        read(wire)


def test_an_unknown_field_is_refused_naming_it():
    with pytest.raises(ProtocolError, match="counters: unknown field 'tokens_dropped'"):
        read(FULL.to_wire() | {"tokens_dropped": 0})
    wire = FULL.to_wire()
    wire["per_consumer"]["c0"]["evicted_blocks"] = 3
    with pytest.raises(ProtocolError, match=r"per_consumer\['c0'\]: unknown field 'evicted_blocks'"):
        read(wire)
    with pytest.raises(ProtocolError, match="counters must be dict, got a list of 0"):
        read([])


def test_a_consumers_results_are_exactly_its_work_counters():
    results = {name: 3 for name in WORK_KEYS}
    assert ConsumerWork.from_results(results) == ConsumerWork(**results)
    for bad, named in [(results | {"items_stale": 1}, "results: unknown field 'items_stale'"),
                       (results | {"items_ok": "3"}, "results.items_ok must be int, got '3'"),
                       (results | {"items_ok": True}, "results.items_ok must be int, got True"),
                       ({k: v for k, v in results.items() if k != "output_tokens"},
                        "results: field 'output_tokens' is missing")]:
        with pytest.raises(ProtocolError, match=f"complete: {named}"):
            ConsumerWork.from_results(bad)


def test_derived_figures():
    status = BrokerStatus(items_received=30, items_recovered=5, tokens_received=300, tokens_recovered=50,
                          backlog_items=4, pending_items=2, switches={"initial": 1, "drained": 4},
                          batches_routed=4, batch_fill_sum=3.0, tokens_routed=90, padded_tokens_routed=100)
    assert (status.items_received_all, status.tokens_received_all) == (35, 350)
    assert status.items_unfinished == 6 and status.shape_switches == 5
    assert status.mean_batch_fill == 0.75 and status.routed_padding_efficiency == 0.9
    assert BrokerStatus().mean_batch_fill is None and BrokerStatus().routed_padding_efficiency is None
    row = ConsumerWork(prompt_tokens=90, padded_tokens=100, cacheable_tokens=500, cacheable_hit_tokens=300,
                       compulsory_miss_tokens=100)
    assert row.padding_efficiency == 0.9 and row.cache_hit_rate == 0.75
    assert ConsumerWork(cacheable_tokens=10, compulsory_miss_tokens=10).cache_hit_rate is None
    assert work(1) + work(2) == ConsumerWork(**{f.name: 3 + 2 * k for k, f in enumerate(fields(ConsumerWork))})
