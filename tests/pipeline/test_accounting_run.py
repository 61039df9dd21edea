"""Accounting against a real broker and store: a consumer that wrote results and died before
its completion reached the broker leaves items that are both unfinished (back in the store)
and with a result. Taken stock of by id, those items count once: nothing is lost."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.reporting.accounting import reconcile, summarize_results, take_stock
from pipeline.runtime.inventory import store_stock
from pipeline.wire.layouts.descriptors import parse_descriptor
from pipeline.wire.protocol import Connection
from shm.ring import RingReader
from tests.pipeline.harness import Workload, start_broker, start_producer, status, stop, wait_until

pytestmark = pytest.mark.integration


def test_results_of_a_consumer_that_died_before_completing_count_once(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    try:
        producer = start_producer(socket_path, Workload(shapes=2, items_per_producer=60, producers=1), 0)
        producer.join(60)
        assert producer.exitcode == 0
        conn = Connection.connect(socket_path)  # a consumer, by hand
        reply = conn.request({"type": "register_consumer", "model": 0, "max_batch_items": 8,
                              "max_batch_tokens": 1 << 20, "max_input_len": 1 << 20, "pid": os.getpid(),
                              "name": "ghost"})
        ring = RingReader.attach(reply["descriptor_ring"])
        conn.send({"type": "request_work", "credit": 1})
        held = parse_descriptor(ring.peek(timeout_s=10).body).items["item_id"].tolist()
        results = tmp_path / "results"
        results.mkdir()
        (results / "ghost.jsonl").write_text("".join(
            json.dumps({"item_id": item, "status": "ok", "prompt_tokens": 1, "cached_tokens": 0}) + "\n"
            for item in held))
        ring.close(mark_closed=False)
        conn.close()  # gone before reporting the completion: its batch goes back to the queue
        final = wait_until(lambda: (s := status(socket_path)).consumers_lost == 1 and s, 30, "the loss")
        assert final.backlog_items == 60 and final.pending_items == 0
    finally:
        assert stop(broker) == 0
    summary = summarize_results(str(results))
    store = store_stock(data).item_ids
    assert set(held) <= set(store.tolist()) and store.size == 60  # back in the store, and with results
    none = np.zeros(0, dtype=np.uint64)
    stock = take_stock([(0, 60)], np.array(held, dtype=np.uint64), store, none, none)
    accounted = reconcile(summary, final, stock)
    assert (accounted["items_with_results"], accounted["items_in_store"]) == (len(held), 60 - len(held))
    assert accounted["lost"] == 0 and accounted["items_unfinished"] == 60 - len(held) > 0
