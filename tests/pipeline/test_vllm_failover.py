"""`vllm` consumers through the real broker when one dies, and against arrival order (marked
`vllm`):

- failover: two consumers on a multi-shape backlog; one is killed with SIGKILL while it
  holds a batch it is running. The survivor completes what came back; by item id nothing is
  lost, and any item answered twice is one of the batch the killed consumer held (its
  results written, its completion never sent). The survivor's cache hits are vLLM's own.
- order: the same items through the broker's shape-sticky dispatch, and in arrival order
  (round-robin across shapes, what a plain FIFO queue hands out) straight through an
  engine of the same settings: vLLM's own prefix-cache hit rate is higher under sticky.

Consumers are spawned and record their engine's counters as they stop
(tests/pipeline/test_vllm_pipeline.py says why). Every item is produced before any consumer
starts, so what the broker dispatches does not depend on how fast the engines start.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import psutil
import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.engines import EngineBatch, make_engine
from pipeline.producer.client import BrokerProducer
from pipeline.producer.signature import signature
from tests.pipeline.harness import start_broker, status, stop, wait_until
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
ITEMS_PER_SHAPE = 8
# 192 generated tokens a prompt in the failover test: a batch runs for 192 decode steps
# (about a second here; with 48 it was tens of milliseconds), so the kill lands in the
# engine, not in the milliseconds between a completion and the next batch.
FAILOVER_MAX_TOKENS = 192
# 4 items a batch: each shape is two batches or more, so both consumers get batches and the
# killed one has finished some before it dies. max_input_len leaves room for the generated
# tokens within vLLM's max_model_len (the longest prompt is 790 tokens): nothing refused.
CONTRACT = dict(max_batch_items=4, max_batch_tokens=4 * MAX_MODEL_LEN,
                max_input_len=MAX_MODEL_LEN - FAILOVER_MAX_TOKENS)
# One batch at a time per consumer: a batch held is the one being run (none queued behind
# it in the ring), so "holds a batch and completed one" means "killed while running one".
CREDIT = 1
# Longer than the test can ever wait (RUN_TIMEOUT_S): a failover within the run can only
# come from the broker seeing the killed consumer's socket close, never from a missed
# heartbeat. It also keeps an engine's first start (seconds, no heartbeat lost) from
# looking dead.
HEARTBEAT_TIMEOUT_S = 600.0
# Each engine's first start on the CPU takes up to ~20 s (two at once on 2 cores: longer);
# the whole run is about 20 s once vLLM's caches are warm.
RUN_TIMEOUT_S = 240
assert RUN_TIMEOUT_S < HEARTBEAT_TIMEOUT_S
# How often the kill waits look at the broker's status: a status request costs ~1 ms.
POLL_S = 0.02


def _items(seed: int) -> list[tuple[int, np.ndarray, int]]:
    """(shape, prompt, prefix length) in arrival order: round-robin across SHAPES shapes of
    263 to 751-token prefixes (a few of them fit the 2 MiB KV cache, not all), each item a
    5 to 39-token suffix."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(TOKEN_LOW, TOKEN_HIGH, int(n), dtype=np.int32) for n in rng.integers(263, 752, SHAPES)]
    items = []
    for _ in range(ITEMS_PER_SHAPE):
        for shape, prefix in enumerate(prefixes):
            suffix = rng.integers(TOKEN_LOW, TOKEN_HIGH, int(rng.integers(5, 40)), dtype=np.int32)
            items.append((shape, np.concatenate([prefix, suffix]), len(prefix)))
    return items


def _produce(socket_path: str, items: list[tuple[int, np.ndarray, int]]) -> list[int]:
    """Submit `items` in order; their item ids."""
    client = BrokerProducer(socket_path, capacity_bytes=16 << 20, timeout_s=60)
    ids = [int(client.submit(0, signature([prompt[:prefix_len]]), prompt, prefix_len, payload=f"{shape}".encode()))
           for shape, prompt, prefix_len in items]
    client.close(timeout_s=60)
    return ids


def _start_consumers(tmp_path: Path, socket_path: str, names: list[str], options: dict) -> dict[str, mp.Process]:
    spawn = mp.get_context("spawn")
    processes = {}
    for name in names:
        config = ConsumerConfig(socket_path, str(tmp_path / "results"), name, engine="vllm", credit=CREDIT,
                                engine_options=dict(options, cache_dir=str(CACHE_DIR / name), cpu_threads=1),
                                **CONTRACT)
        processes[name] = spawn.Process(target=serve_and_record,
                                        args=(config, str(tmp_path / "stop"), str(tmp_path / f"{name}.json")))
        processes[name].start()
    return processes


def _stop_all(tmp_path: Path, processes: dict[str, mp.Process], broker) -> None:
    (tmp_path / "stop").touch()
    for process in processes.values():
        process.join(60)
        if process.is_alive():
            stop(process)
    assert stop(broker) == 0


def _read_rows(results_dir: Path) -> tuple[dict[str, list[dict]], int]:
    """Each consumer's result lines, in file order, and the count of lines that do not parse
    (a consumer killed in the middle of its write leaves one torn line)."""
    rows: dict[str, list[dict]] = {}
    torn = 0
    for path in sorted(results_dir.iterdir()):
        rows[path.stem] = []
        for line in path.read_text().splitlines():
            try:
                rows[path.stem].append(json.loads(line))
            except json.JSONDecodeError:
                torn += 1
    return rows, torn


def _batches(rows: list[dict]) -> list[list[dict]]:
    """A results file's batches in the order they were written (one broker run: batch ids
    are unique)."""
    batches: dict[int, list[dict]] = {}
    for row in rows:
        batches.setdefault(row["batch_id"], []).append(row)
    return list(batches.values())


@pytest.mark.vllm
def test_a_consumer_killed_mid_batch_loses_nothing_and_the_survivor_counts_what_vllm_counts(tmp_path):
    from tools.tiny_llama import build

    build(MODEL_DIR)
    data = str(tmp_path / "data")
    broker = start_broker(data, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    socket_path = BrokerConfig(data).socket_path
    ids = _produce(socket_path, _items(seed=31))
    options = dict(ENGINE_OPTIONS, max_tokens=FAILOVER_MAX_TOKENS)
    processes = _start_consumers(tmp_path, socket_path, ["victim"], options)
    try:
        # The survivor starts once the victim holds its first batch: the survivor's import
        # and engine start then come after the victim's, and the backlog (16+ batches)
        # outlasts the victim's first batch.
        wait_until(lambda: "victim" in status(socket_path).consumers, RUN_TIMEOUT_S, "the victim registered",
                   poll_s=POLL_S)
        processes.update(_start_consumers(tmp_path, socket_path, ["survivor"], options))

        def running_its_second_batch():
            s = status(socket_path)
            assert s.items_completed < len(ids), "the survivor ran everything before the victim finished a batch"
            held = s.consumers.get("victim")
            done = s.per_consumer.get("victim")
            return held is not None and held.batches_held == 1 and done.batches >= 1 and s

        at_kill = wait_until(running_its_second_batch, RUN_TIMEOUT_S, "the victim running a batch", poll_s=POLL_S)
        engine_processes = psutil.Process(processes["victim"].pid).children(recursive=True)  # vLLM's engine core
        os.kill(processes["victim"].pid, signal.SIGKILL)
        processes["victim"].join(30)
        for process in engine_processes:  # as a launcher kills a killed consumer's process group
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        lost = wait_until(lambda: (s := status(socket_path)).consumers_lost == 1 and s, RUN_TIMEOUT_S,
                          "the broker noticing the kill", poll_s=POLL_S)
        done = wait_until(lambda: (s := status(socket_path)).items_completed == len(ids) and s, RUN_TIMEOUT_S,
                          "every item completed", poll_s=0.5)
    finally:
        _stop_all(tmp_path, processes, broker)
    assert processes["victim"].exitcode == -signal.SIGKILL and processes["survivor"].exitcode == 0
    assert "victim" not in lost.consumers and not lost.per_consumer["victim"].connected
    print(f"\nat the kill: {at_kill.per_consumer['victim']}; held {at_kill.consumers['victim']}"
          f"\nafter: returned {done.items_returned}, routed {done.items_routed}, completed {done.items_completed}")

    rows, torn = _read_rows(tmp_path / "results")
    assert torn <= 1 and {row["status"] for r in rows.values() for row in r} == {"ok"}
    # What the broker recorded as completed, by consumer, is a prefix of its file: the
    # victim's completed batches, then at most the one it held (written, completion unsent).
    victim_batches = _batches(rows["victim"])
    completed = done.per_consumer["victim"].batches
    assert completed >= 1 and completed <= len(victim_batches) <= completed + CREDIT
    victim_completed = [row for batch in victim_batches[:completed] for row in batch]
    victim_unsent = [row for batch in victim_batches[completed:] for row in batch]
    assert done.per_consumer["victim"].work.items_ok == len(victim_completed)
    print(f"the victim's file: {completed} completed batches, then {len(victim_unsent)} items written and never "
          f"reported complete, {torn} torn lines")
    # Nothing lost, nothing answered twice but the held batch's items.
    answered = defaultdict(int)
    for row in victim_completed + victim_unsent + rows["survivor"]:
        answered[row["item_id"]] += 1
    assert sorted(answered) == sorted(ids)
    twice = sorted(item for item, n in answered.items() if n > 1)
    assert twice == sorted(row["item_id"] for row in victim_unsent) and max(answered.values()) <= 2
    assert len(rows["survivor"]) == len(ids) - len(victim_completed)
    # The held batch's items came back and went out again; each item completed once.
    assert 0 < done.items_returned <= CONTRACT["max_batch_items"]
    assert len(victim_unsent) in (0, done.items_returned)
    assert done.items_routed == len(ids) + done.items_returned
    assert done.items_completed == len(ids) and done.pending_items == done.backlog_items == 0
    # The survivor's cache hits are vLLM's own count, by the broker and by its results file.
    engine = json.loads((tmp_path / "survivor.json").read_text())
    work = done.per_consumer["survivor"].work
    assert work.items_ok == len(rows["survivor"])
    assert work.cache_hit_tokens == sum(row["cached_tokens"] for row in rows["survivor"]) \
        == engine["prefix_cache_hits"] > 0
    assert work.prompt_tokens == sum(row["prompt_tokens"] for row in rows["survivor"]) \
        == engine["prefix_cache_queries"]


@pytest.fixture
def restored_environment():
    """An engine made in this process points TMPDIR and VLLM_CACHE_ROOT into its cache_dir:
    they must not outlive the test (as tests/consumer/test_vllm_engine.py's fixture)."""
    environ, tempdir = dict(os.environ), tempfile.tempdir
    yield
    os.environ.clear()
    os.environ.update(environ)
    tempfile.tempdir = tempdir


@pytest.mark.vllm
def test_sticky_dispatch_gets_vllm_more_cache_hits_than_arrival_order(tmp_path, restored_environment):
    """ENGINE_OPTIONS' 2 MiB KV cache holds 2,048 tokens: two to seven of the 263 to
    751-token prefixes, never all eight. In arrival order each 4-item batch brings four
    other shapes, which evict the last batch's prefixes before they come round again."""
    from tools.tiny_llama import build

    build(MODEL_DIR)
    items = _items(seed=41)
    data = str(tmp_path / "data")
    broker = start_broker(data, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    socket_path = BrokerConfig(data).socket_path
    ids = _produce(socket_path, items)
    processes = _start_consumers(tmp_path, socket_path, ["sticky"], ENGINE_OPTIONS)
    try:
        wait_until(lambda: status(socket_path).items_completed == len(ids), RUN_TIMEOUT_S, "every item completed",
                   poll_s=0.5)
    finally:
        _stop_all(tmp_path, processes, broker)
    assert processes["sticky"].exitcode == 0
    sticky = json.loads((tmp_path / "sticky.json").read_text())

    engine = make_engine("vllm", **dict(ENGINE_OPTIONS, cache_dir=str(CACHE_DIR / "arrival")))
    try:
        size = CONTRACT["max_batch_items"]
        for start in range(0, len(items), size):
            chunk = items[start:start + size]
            result = engine.run(EngineBatch([p for _, p, _ in chunk], max(len(p) for _, p, _ in chunk),
                                            [n for _, _, n in chunk]))
            assert result.errors is None
        arrival = dict(engine.counters.extra)
    finally:
        engine.close()
    print(f"\nsticky: {sticky}\narrival order: {arrival}")
    assert sticky["prefix_cache_queries"] == arrival["prefix_cache_queries"] == sum(len(p) for _, p, _ in items)
    sticky_rate = sticky["prefix_cache_hits"] / sticky["prefix_cache_queries"]
    arrival_rate = arrival["prefix_cache_hits"] / arrival["prefix_cache_queries"]
    assert sticky_rate > arrival_rate
