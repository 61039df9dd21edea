"""Per-item generation parameters through the real processes: producer -> broker (which
never reads them) -> sim consumer, and each item's result shaped by its own parameters
with the producer's payload given back without the envelope; a malformed envelope (a
producer that is not ours) is that item's error result, not a crashed consumer."""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.storage.diskio import Durability
from pipeline.storage.paths import make_dirs, segment_path
from pipeline.storage.segment import SegmentFile, SegmentKeys, encode_entries, scan_segment
from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.process import CORRUPT_KEY, Consumer
from pipeline.consumer.reader import SegmentReader
from pipeline.producer.client import BrokerProducer
from pipeline.runtime.local import start_consumer
from pipeline.wire.generation import GENERATION_MAGIC, GenerationParams
from pipeline.wire.layouts.descriptors import (
    DESCRIPTOR_ITEM_DTYPE,
    descriptor_size_bytes,
    parse_descriptor,
    write_descriptor,
)
from tests.pipeline.harness import read_results, start_broker, status, stop, wait_until
from tests.support.segments import SIG, data_dir_of, make_items, shared_log

pytestmark = pytest.mark.integration

# The sim engine's output tokens where an item names none (SimConfig's default).
SIM_DEFAULT_OUTPUT_TOKENS = 4


def test_each_item_is_generated_by_its_own_parameters_and_gets_its_payload_back(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    consumer = start_consumer(ConsumerConfig(socket_path, str(tmp_path / "results"), "c0"))
    rng = np.random.default_rng(3)
    expected: dict[int, tuple[int, bytes]] = {}
    try:
        with BrokerProducer(socket_path, capacity_bytes=4 << 20, timeout_s=30) as client:
            for k in range(40):  # one at a time: max_tokens 1..8, or none
                params = GenerationParams(max_tokens=k % 9, seed=k) if k % 9 else None
                payload = f"req-{k}".encode() if k % 3 else GENERATION_MAGIC + b"-like payload"
                tokens = rng.integers(0, 1000, 30, dtype=np.int32)
                item = client.submit(0, 7, tokens, 10, payload=payload, params=params)
                expected[int(item)] = (k % 9 or SIM_DEFAULT_OUTPUT_TOKENS, payload)
            lengths = [20] * 10  # and in one call, a list of parameters beside the payloads
            params_list = [GenerationParams(max_tokens=11) if i % 2 else None for i in range(10)]
            ids = client.submit_many(0, 7, rng.integers(0, 1000, 200, dtype=np.int32), lengths, 5,
                                     payloads=[b"many-%d" % i for i in range(10)], params=params_list)
            for i, item in enumerate(ids.tolist()):
                expected[item] = (11 if i % 2 else SIM_DEFAULT_OUTPUT_TOKENS, b"many-%d" % i)
        wait_until(lambda: status(socket_path).items_completed == len(expected), 60, "every item completed")
    finally:
        stop(consumer)
        assert stop(broker) == 0
    rows = {row["item_id"]: row for row in read_results(str(tmp_path / "results"))}
    assert set(rows) == set(expected)
    for item, (output_tokens, payload) in expected.items():
        row = rows[item]
        assert row["status"] == "ok" and row["finish_reason"] == "length"
        assert row["output_tokens"] == len(row["output"]) == output_tokens
        assert base64.b64decode(row["payload"]) == payload


def test_a_malformed_envelope_is_that_items_error_and_the_others_run(tmp_path):
    frame = make_items(4, seed=5)
    items, payloads, pstarts = frame[0], frame[3], frame[4]
    # Entry 1's payload begins with the envelope's magic and then nothing valid: what a
    # producer that writes rings by hand, not through encode_payload, could store.
    assert int(items["payload_len"][1]) >= 4, "the stored payload must hold the magic"
    payloads[pstarts[1]:pstarts[1] + 4] = np.frombuffer(GENERATION_MAGIC, dtype=np.uint8)
    path = segment_path(str(tmp_path), 2, SIG, 0, 0)
    make_dirs(os.path.dirname(path))
    segment = SegmentFile.create(path, SegmentKeys(2, SIG, 0, 0), Durability.PROCESS, shared_log(data_dir_of(path)))
    segment.append(encode_entries(*frame, indices=np.arange(4), producer_id=1))
    segment.close()
    offsets = scan_segment(path).offsets
    rows = np.zeros(4, dtype=DESCRIPTOR_ITEM_DTYPE)
    rows["offset"], rows["length"], rows["item_id"] = offsets, items["length"], items["item_id"]
    buf = np.zeros(descriptor_size_bytes(4), dtype=np.uint8)
    write_descriptor(buf, 0, batch_id=3, signature=SIG, model=2, pad_to_tokens=400, dispatch_ns=1, items=rows)
    consumer = Consumer(ConsumerConfig("unused.sock", str(tmp_path / "results"), "gpu0", model=2))
    consumer._reader = SegmentReader(str(tmp_path))
    summary = consumer.run_batch(parse_descriptor(buf))
    consumer._results.close()
    consumer._reader.close()
    lines = {row["item_id"]: row for row in map(json.loads, open(consumer.results_path))}
    assert summary["items_error"] == 1 and summary["items_ok"] == 3 and summary.pop(CORRUPT_KEY) == []
    bad = lines[int(items["item_id"][1])]
    assert bad["status"] == "error" and "generation envelope" in bad["error"]
    assert all(lines[int(i)]["status"] == "ok" for k, i in enumerate(items["item_id"]) if k != 1)
