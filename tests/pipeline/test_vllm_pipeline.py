"""Two `vllm` consumers on a multi-shape workload through the real broker (marked `vllm`):
per consumer, the product's cache-hit tokens (the broker's per-consumer totals, and the
results files) equal vLLM's own `prefix_cache_hits`, and its prompt tokens vLLM's
`prefix_cache_queries`.

The consumers are spawned, not forked as the launcher forks them: this pytest process may
already hold torch's thread pools (tests/consumer/test_vllm_engine.py loads vLLM here), and
a child forked from that must not start them again. Each child writes its engine's counters
to a JSON file as it stops: vLLM's own counters live in that process alone.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.consumer.config import ConsumerConfig
from pipeline.producer.client import BrokerProducer
from pipeline.producer.signature import signature
from tests.pipeline.harness import read_results, start_broker, status, stop, wait_until
from tests.support.tiny_vllm import (
    CACHE_DIR,
    ENGINE_OPTIONS,
    MAX_MODEL_LEN,
    MODEL_DIR,
    TOKEN_HIGH,
    TOKEN_LOW,
    serve_and_record,
)

SHAPES = 8
ITEMS_PER_SHAPE = 6
# Within vLLM's max_model_len (prompt plus at least one output token): nothing refused.
CONTRACT = dict(max_batch_items=8, max_batch_tokens=8 * MAX_MODEL_LEN, max_input_len=MAX_MODEL_LEN - 8)
# Each engine's first start on the CPU takes up to ~20 s (two at once on 2 cores: longer).
RUN_TIMEOUT_S = 240


def _produce(socket_path: str) -> int:
    rng = np.random.default_rng(21)
    client = BrokerProducer(socket_path, capacity_bytes=16 << 20, timeout_s=60)
    count = 0
    for shape in range(SHAPES):
        prefix = rng.integers(TOKEN_LOW, TOKEN_HIGH, int(rng.integers(263, 752)), dtype=np.int32)
        sig = signature([prefix])
        for _ in range(ITEMS_PER_SHAPE):
            suffix = rng.integers(TOKEN_LOW, TOKEN_HIGH, int(rng.integers(5, 40)), dtype=np.int32)
            client.submit(0, sig, np.concatenate([prefix, suffix]), prefix.shape[0], payload=f"{shape}".encode())
            count += 1
    client.close(timeout_s=60)
    return count


@pytest.mark.vllm
def test_two_vllm_consumers_count_what_vllm_counts(tmp_path):
    from tools.tiny_llama import build

    build(MODEL_DIR)
    data = str(tmp_path / "data")
    broker = start_broker(data, heartbeat_timeout_s=60.0)  # an engine's first start must not look dead
    socket_path = BrokerConfig(data).socket_path
    spawn = mp.get_context("spawn")
    stop_path = str(tmp_path / "stop")
    consumers = []
    for k in range(2):
        options = dict(ENGINE_OPTIONS, cache_dir=str(CACHE_DIR / f"c{k}"), cpu_threads=1)
        config = ConsumerConfig(socket_path, str(tmp_path / "results"), f"c{k}", engine="vllm",
                                engine_options=options, **CONTRACT)
        process = spawn.Process(target=serve_and_record, args=(config, stop_path, str(tmp_path / f"c{k}.json")))
        process.start()
        consumers.append(process)
    try:
        # Each engine loads its model before its consumer registers: produce once both are
        # there, or the first could run every batch while the other still loads.
        wait_until(lambda: len(status(socket_path).consumers) == 2, RUN_TIMEOUT_S, "both consumers registered",
                   poll_s=0.5)
        total = _produce(socket_path)
        done = wait_until(lambda: (s := status(socket_path)).items_completed == total and s, RUN_TIMEOUT_S,
                          "every item completed", poll_s=0.5)
    finally:
        Path(stop_path).touch()
        for process in consumers:
            process.join(60)
            if process.is_alive():
                stop(process)
        assert stop(broker) == 0
    assert [p.exitcode for p in consumers] == [0, 0]
    rows = read_results(str(tmp_path / "results"))
    assert len({row["item_id"] for row in rows}) == total and {row["status"] for row in rows} == {"ok"}
    hits = 0
    for k in range(2):
        engine = json.loads((tmp_path / f"c{k}.json").read_text())
        work = done.per_consumer[f"c{k}"].work
        mine = [row for row in rows if row["consumer"] == f"c{k}.jsonl"]
        print(f"\nc{k}: {len(mine)} items, broker {work}, engine {engine}")
        assert work.cache_hit_tokens == sum(row["cached_tokens"] for row in mine) == engine["prefix_cache_hits"]
        assert work.prompt_tokens == sum(row["prompt_tokens"] for row in mine) == engine["prefix_cache_queries"]
        # vLLM's own counters reached the broker, over every request (the engine went idle
        # at the end), and agree with ours.
        assert not work.engine_disagrees and work.engine_checked_prompt_tokens == work.prompt_tokens
        assert work.engine_prefix_cache_hits == engine["prefix_cache_hits"]
        assert {row["finish_reason"] for row in mine} == {"length"} and all("text" in row for row in mine)
        hits += work.cache_hit_tokens
    assert hits > 0
