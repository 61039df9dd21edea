"""Shape lineage survives a broker crash: a real broker stores items of shapes whose chains a
producer declared, is killed with SIGKILL, and restarts with the producer gone for good (it
finished: it never declares anything again). The recovered backlog is then served in prefix
order (the chains came back from the store log's LINEAGE records); with the log rewritten
without them before the restart it is served most tokens first, which is what they change."""

from __future__ import annotations

import base64
import os
import signal

import numpy as np
import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.storage.storelog import StoreLog, read_store_log
from pipeline.consumer.config import ConsumerConfig
from pipeline.producer.client import BrokerProducer
from pipeline.producer.signature import chain, signature
from pipeline.runtime.local import CTX, start_consumer
from tests.pipeline.harness import batches_of, read_results, start_broker, status, stop, wait_until

pytestmark = pytest.mark.integration

RNG = np.random.default_rng(15)
SYSTEM, FEWSHOT, TURN, OTHER = (RNG.integers(0, 50_000, size=64, dtype=np.int32) for _ in range(4))
# name -> (components, items, suffix tokens): "system" has the most tokens, "other" more than
# "fewshot" and "turn" (which extend "system"), so most-tokens order puts "other" second.
SHAPES = {"system": ([SYSTEM], 8, 900), "fewshot": ([SYSTEM, FEWSHOT], 8, 20),
          "turn": ([SYSTEM, FEWSHOT, TURN], 8, 10), "other": ([OTHER], 8, 500)}


def produce(socket_path: str) -> None:
    client = BrokerProducer(socket_path, capacity_bytes=4 << 20, timeout_s=60)
    for name, (components, items, suffix) in SHAPES.items():
        client.declare_shape(0, chain(components))
        prompt = np.concatenate([*components, np.full(suffix, 7, dtype=np.int32)])
        for _ in range(items):
            client.submit(0, signature(components), prompt, sum(len(c) for c in components), payload=name.encode())
    client.close(timeout_s=60)  # waits until the broker stored everything


@pytest.mark.parametrize("durability, keep_chains, order", [
    ("power", True, ["system", "turn", "fewshot", "other"]),  # below "system" first, most tokens first
    ("process", False, ["system", "other", "turn", "fewshot"]),
])
def test_the_recovered_backlog_keeps_its_prefix_order_after_kill_9(tmp_path, durability, keep_chains, order):
    data = str(tmp_path / "data")
    socket_path = BrokerConfig(data).socket_path
    broker = start_broker(data, durability=durability)
    consumer = None
    try:
        producer = CTX.Process(target=produce, args=(socket_path,))
        producer.start()
        producer.join(60)
        assert producer.exitcode == 0 and status(socket_path).items_received == 32
        os.kill(broker.pid, signal.SIGKILL)
        broker.join(10)
        if not keep_chains:  # every record but the chains'
            StoreLog.write_fresh(data, read_store_log(data), None, False, np.zeros((0, 4), dtype=np.uint64)).close()
        broker = start_broker(data, durability=durability)
        consumer = start_consumer(ConsumerConfig(socket_path, str(tmp_path / "results"), "c0", max_batch_items=8,
                                                 max_batch_tokens=65_536, max_input_len=8192))
        wait_until(lambda: status(socket_path).items_completed == 32, 60, "the recovered backlog served")
    finally:
        if consumer is not None:
            stop(consumer)
        stop(broker)
    batches = sorted(batches_of(read_results(str(tmp_path / "results"))).values(), key=lambda b: b[0]["dispatch_ns"])
    served = [base64.b64decode(batch[0]["payload"]).decode() for batch in batches]
    assert [name for k, name in enumerate(served) if k == 0 or served[k - 1] != name] == order
