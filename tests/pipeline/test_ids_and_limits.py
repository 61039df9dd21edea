"""Ids that end up in names and fields. Model ids end up in segment directory names
(m{model:05d}): every edge checks them, so an item for a model the broker does not serve is
refused before it is stored, never stored and then skipped at restart (seen: model
123456 was acknowledged, stored under segments/m123456/, and skipped without a word when the
broker restarted). Producer ids end up in item ids: one is never handed out twice."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.broker.peers import namespace_for, producer_ring_name
from pipeline.producer.client import BrokerProducer
from pipeline.producer.producer import ProducerLimits
from pipeline.runtime.local import remove_leftovers
from pipeline.wire.errors import ConfigError, ModelIdError, ProducerRefusedError, ProtocolError
from pipeline.wire.layouts.names import DEFAULT_MAX_MODELS, MODEL_ID_LIMIT
from tests.pipeline.harness import start_broker, status, stop, wait_until
from tests.runtime.runs import shm_objects_of

pytestmark = pytest.mark.integration

TOKENS = np.arange(50, dtype=np.int32)


def test_producer_limits_hold_model_ids_a_segment_name_holds(tmp_path):
    assert ProducerLimits(max_models=MODEL_ID_LIMIT).max_models == MODEL_ID_LIMIT
    with pytest.raises(ModelIdError, match=f"max_models {MODEL_ID_LIMIT + 1} must be in"):
        ProducerLimits(max_models=MODEL_ID_LIMIT + 1)
    assert BrokerConfig(str(tmp_path), max_models=MODEL_ID_LIMIT).max_models == MODEL_ID_LIMIT
    with pytest.raises(ConfigError, match="max_models"):
        BrokerConfig(str(tmp_path), max_models=MODEL_ID_LIMIT + 1)


def test_an_item_for_a_model_the_broker_does_not_serve_is_refused_not_stored(tmp_path):
    """A producer allowed more models than the broker serves submits an item for model
    2,000: the broker refuses the frame and the producer, stores nothing of it, and the
    producer learns why instead of waiting forever; after a restart nothing was skipped."""
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    try:
        producer = BrokerProducer(socket_path, capacity_bytes=16 << 20, limits=ProducerLimits(max_models=5000))
        producer.submit(DEFAULT_MAX_MODELS - 1, 7, TOKENS)  # the highest model served: stored
        producer.wait_stored(timeout_s=30)
        producer.submit(2000, 7, TOKENS)
        with pytest.raises(ProducerRefusedError, match="model 2000; this broker serves models 0..1023"):
            producer.close(timeout_s=30)
        assert status(socket_path).items_received == 1
    finally:
        assert stop(broker) == 0
    again = start_broker(data)
    try:
        restarted = status(socket_path)
        assert restarted.items_recovered == 1 and restarted.store_damage.get("strays", 0) == 0
    finally:
        assert stop(again) == 0
    # The refused producer's ring stays for inspection, with the refused record in it.
    assert [name for name in shm_objects_of(data) if not name.startswith("sem.")] == [
        producer_ring_name(namespace_for(data), 0)[1:]]
    remove_leftovers(data)


@pytest.mark.parametrize("what", ["deleted", "garbled"])
def test_a_lost_state_file_never_hands_out_a_producer_id_again(tmp_path, what):
    """broker-state.json holds the next producer id. Lost (or garbled) with live work in the
    store, a new broker handed out id 0 again: the new producer's items 0, 1, ... matched
    the stored ones and were skipped as already stored, while `produce` said all stored."""
    data = str(tmp_path / "data")
    socket_path = BrokerConfig(data).socket_path
    broker = start_broker(data)
    try:
        with BrokerProducer(socket_path, capacity_bytes=16 << 20) as producer:
            for _ in range(30):
                producer.submit(0, 7, TOKENS)
    finally:
        assert stop(broker) == 0
    state = tmp_path / "data" / "broker-state.json"
    if what == "deleted":
        state.unlink()
    else:
        state.write_text("{not json")
    again = start_broker(data)
    try:
        with BrokerProducer(socket_path, capacity_bytes=16 << 20) as producer:
            assert producer.producer_id == 1
            for _ in range(30):
                producer.submit(0, 7, TOKENS)
        after = status(socket_path)
        assert (after.items_recovered, after.items_received, after.backlog_items) == (30, 30, 60)
    finally:
        assert stop(again) == 0
    if what == "garbled":
        assert [p.name for p in (tmp_path / "data").glob("broker-state.json.damaged-*")]


def test_producer_ids_are_handed_out_up_to_the_last_an_item_id_holds(tmp_path):
    """An item id holds 24 bits of its producer id: the last one is handed out, the next
    registration is refused with the reason; a state file past the limit (or absurd) is
    kept aside as damaged, not trusted (10**20 made the start spin forever)."""
    import json

    from pipeline.wire.layouts.frames import MAX_PRODUCER_ID

    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    state = data / "broker-state.json"
    state.write_text(json.dumps({"next_producer_id": MAX_PRODUCER_ID, "generation": 3}))
    socket_path = BrokerConfig(str(data)).socket_path
    broker = start_broker(str(data))
    try:
        last = BrokerProducer(socket_path, capacity_bytes=1 << 20, limits=ProducerLimits(max_item_tokens=1000))
        assert last.producer_id == MAX_PRODUCER_ID
        last.close()
        with pytest.raises(ProtocolError, match="every producer id of this data directory is used"):
            BrokerProducer(socket_path, capacity_bytes=1 << 20, limits=ProducerLimits(max_item_tokens=1000))
    finally:
        assert stop(broker) == 0
    state.write_text(json.dumps({"next_producer_id": 10**20, "generation": 1}))
    again = start_broker(str(data))
    try:
        with BrokerProducer(socket_path, capacity_bytes=1 << 20, limits=ProducerLimits(max_item_tokens=1000)) as p:
            assert p.producer_id == 0  # nothing stored: the store holds no producer's work
    finally:
        assert stop(again) == 0
    assert list(data.glob("broker-state.json.damaged-*"))


def test_damage_a_consumer_finds_keeps_its_segment_as_evidence(tmp_path):
    """A byte of a stored entry flipped while the broker runs: the consumer's checksum check
    answers it "corrupt", and the completion names it, so its segment is kept (never
    deleted with the rest), the damage counted in status, and `verify` fails. Before, the
    segment was tombstoned and deleted and `verify` said OK."""
    import glob

    from pipeline.storage.inspect import verify
    from pipeline.storage.scan import scan_segment
    from pipeline.runtime.local import start_consumer
    from tests.pipeline.harness import read_results
    from tests.support.contracts import consumer_config

    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    try:
        with BrokerProducer(socket_path, capacity_bytes=16 << 20) as producer:
            for _ in range(20):
                producer.submit(0, 7, TOKENS)
        (path,) = glob.glob(f"{data}/segments/*/*/*.seg")
        offset = int(scan_segment(path).offsets[3])
        with open(path, "r+b") as file:  # a token of entry 3, through the page cache the broker maps
            file.seek(offset + 64 + 8)
            byte = file.read(1)
            file.seek(offset + 64 + 8)
            file.write(bytes([byte[0] ^ 0xFF]))
        consumer = start_consumer(consumer_config(tmp_path, socket_path, 0))
        try:
            done = wait_until(lambda: (s := status(socket_path)).items_completed == 20 and s, 60, "all done")
        finally:
            stop(consumer)
        assert done.store_damage["entries_damaged_at_read"] == 1
        rows = read_results(str(tmp_path / "results"))
        assert sorted(row["status"] for row in rows).count("corrupt") == 1
    finally:
        assert stop(broker) == 0
    kept = glob.glob(f"{data}/segments/*/*/*.seg") + glob.glob(f"{data}/quarantine/**/*.seg", recursive=True)
    assert kept and not verify(data).ok
