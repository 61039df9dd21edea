"""lab/bench/redis_peer.py and redis_streams.py: the batch figures against direct
computations, the broker's batches read off results lines, and the Redis side with a real
redis-server (skipped, saying why, where the server or redis-py with hiredis is missing)."""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest

from pipeline.analysis.reuse import CacheReplay
from lab.bench.redis_peer import BLOCK_TOKENS, batch_figures, broker_batches, tokens_label, workload_prompts
from lab.bench.redis_streams import (
    RedisServer,
    flood_producer,
    recorded_batches,
    redis_missing,
    run_redis,
    workload_producer,
)
from pipeline.producer.demos import demo_workload
from pipeline.wire.layouts.segments import prompt_digest

needs_redis = pytest.mark.skipif(redis_missing() is not None, reason=f"Redis side: {redis_missing()}")


def test_batch_figures_padding_budget_and_reuse_per_consumer():
    workload = demo_workload(40, seed=1)
    lengths, prompts = workload_prompts(workload)
    assert lengths.tolist() == [item.length for item in workload.items()]
    batches = [[[0, 1, 2], [5]], [[3, 4], list(range(6, 40))]]
    got = batch_figures(batches, lengths, prompts, [1 << 20, 64], budget_tokens=2000)
    flat = [b for consumer in batches for b in consumer]
    real = sum(int(lengths[b].sum()) for b in flat)
    padded = [len(b) * int(lengths[b].max()) for b in flat]
    assert got["batches"] == 4 and got["mean_items"] == 10.0
    assert got["padding_efficiency"] == pytest.approx(real / sum(padded))
    assert got["over_budget_share"] == pytest.approx(np.mean([p > 2000 for p in padded]))
    for size in (1 << 20, 64):
        replay = CacheReplay(BLOCK_TOKENS, [size // BLOCK_TOKENS] * 2)
        replay.feed(0, [prompts[i] for i in (0, 1, 2, 5)])
        replay.feed(1, [prompts[i] for i in [3, 4, *range(6, 40)]])
        assert got["reuse"][str(size)] == replay.reuse
    assert got["reuse"][str(1 << 20)] >= got["reuse"]["64"]


def _row(batch_id: int, index: int, prompt: int, cached: int) -> dict:
    return {"batch_id": batch_id, "payload": base64.b64encode(f"demo-{index}".encode()).decode(),
            "prompt_tokens": prompt, "cached_tokens": cached}


def test_broker_batches_group_consecutive_lines_of_a_batch():
    results = {"c0": [_row(7, 0, 10, 0), _row(7, 2, 10, 4), _row(9, 1, 5, 0)], "c1": [_row(8, 3, 20, 16)]}
    batches, cached, prompt = broker_batches(results)
    assert batches == [[[0, 2], [1]], [[3]]] and (cached, prompt) == (20, 45)


def test_tokens_label():
    assert [tokens_label(n) for n in (1 << 20, 16_384, 1000, 3 << 20)] == ["1 Mi", "16 Ki", "1,000", "3 Mi"]


def test_recorded_batches_round_trip(tmp_path):
    path = str(tmp_path / "c.npy")
    np.save(path, np.array([4, 5, -1, 6, -1], dtype=np.int64))
    assert recorded_batches(path) == [[4, 5], [6]]
    np.save(path, np.zeros(0, dtype=np.int64))
    assert recorded_batches(path) == []


@pytest.mark.campaign
@needs_redis
def test_a_server_starts_answers_and_is_gone_after(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        pid = server.pid
        assert server.client().ping() and server.is_alive()
        assert server.client().config_get("appendfsync") == {"appendfsync": "everysec"}
        assert (tmp_path / "redis" / "redis.pid").read_text().strip() == str(pid)
        server.reset()
        assert server.completed() == (0, 0)
    assert not server.is_alive() and not (tmp_path / "redis").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.campaign
@needs_redis
def test_run_redis_counts_every_item_and_records_each_once(tmp_path):
    phase, none = run_redis(tmp_path / "a", lambda port: [(flood_producer, (port, 300, k)) for k in range(2)],
                            600, 2, 64, False, "flood")
    assert none is None and (phase.items, phase.tokens) == (600, 600 * 256)
    assert {"redis-server", "consumer 0", "consumer 1", "producer 0", "producer 1"} == set(phase.cpu_s)
    workload = demo_workload(300, seed=2)
    phase, batches = run_redis(tmp_path / "b", lambda port: [(workload_producer, (port, workload, k, 2))
                                                             for k in range(2)], 300, 2, 16, True, "workload")
    assert phase.tokens == workload.total_tokens and len(batches) == 2
    assert sorted(i for consumer in batches for b in consumer for i in b) == list(range(300))
    assert all(1 <= len(b) <= 16 for consumer in batches for b in consumer)
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


@pytest.mark.campaign
@needs_redis
def test_redis_consumers_doing_the_brokers_consumer_work_write_a_checked_line_per_item(tmp_path):
    workload = demo_workload(200, seed=3)
    phase, _ = run_redis(tmp_path / "w", lambda port: [(workload_producer, (port, workload, k, 2)) for k in range(2)],
                         200, 2, 32, False, "work", work=True)
    assert (phase.items, phase.tokens) == (200, workload.total_tokens)
    rows = [json.loads(line) for k in range(2) if (tmp_path / "w" / "results" / f"c{k}.jsonl").exists()
            for line in (tmp_path / "w" / "results" / f"c{k}.jsonl").read_text().splitlines()]
    items = list(workload.items())
    assert sorted(row["item_id"] for row in rows) == list(range(200))
    for row in rows:
        item = items[row["item_id"]]
        assert row["status"] == "ok" and row["prompt_tokens"] == item.length
        assert row["prompt_xxh3"] == prompt_digest(item.tokens) and len(row["output"]) == row["output_tokens"]
        assert 0 <= row["cached_tokens"] < item.length and row["pad_to_tokens"] >= item.length
    assert sum(row["cached_tokens"] for row in rows) > 0  # shapes repeat: the sim's cache served some


def test_the_aof_always_peers_consumers_fsync_their_results_as_the_brokers_do_at_power(tmp_path):
    from lab.bench.redis_streams import ConsumerWork
    from pipeline.wire import fileops
    from tests.support.recording_io import Recording

    prompts = [np.arange(1, 40, dtype=np.int32), np.arange(5, 70, dtype=np.int32)]
    entries = [(b"1-0", {b"p": b"0", b"i": b"0", b"c": b"0"}), (b"1-1", {b"p": b"0", b"i": b"1", b"c": b"0"})]
    for fsync in (False, True):
        path = str(tmp_path / f"{fsync}.jsonl")
        work = ConsumerWork(path, fsync=fsync)
        layer = Recording()
        previous = fileops.install(layer)
        try:
            work.run(entries, prompts)
        finally:
            fileops.install(previous)
            work.close()
        assert layer.fsynced == ([path] if fsync else [])
