"""The process plumbing the end-to-end comparisons share (`e2e`, `redis`, `scaling`): a
broker and its zero-cost sim consumers on a scratch data directory, producer processes that
flood it (or pace items at a fixed rate, or feed a generated workload), the wait until the
broker counts every item completed, each process's CPU time over a phase, and the stop and
clean-up (processes, the data directory, the memory tier and the shared-memory objects
named for it in /dev/shm).

    with Pipeline(ctx.work_dir / "run", PipelineSpec(storage="memory")) as pipe:
        phase = pipe.run_producers([(flood, (pipe.socket_path, 100_000, 0))], 100_000)
        phase.items_per_s, phase.cpu_s

The flood workload: 256-token items over 8 shapes (a 128-token
shared prefix each), `submit_many` in calls of 4,096 items.

Owner: the `pipeline bench` process; a `Pipeline` is used by one thread.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from pipeline.broker.config import BrokerConfig
from pipeline.consumer.config import ConsumerConfig
from pipeline.producer.client import BrokerProducer
from pipeline.producer.feed import feed
from pipeline.producer.signature import signature
from pipeline.producer.workload import Workload
from pipeline.runtime.local import CTX, remove_leftovers, start_broker, start_child, start_consumer, stop_process
from pipeline.runtime.processes import memory_tier_dir
from pipeline.wire.client import broker_progress

# The flood workload: 256-token items, 8 shapes whose first 128
# tokens are the shape's shared prefix, 4,096 items per submit_many call.
FLOOD_TOKENS = 256
FLOOD_SHAPES = 8
FLOOD_PREFIX_TOKENS = 128
FLOOD_CALL_ITEMS = 4096
# Token ids below this (a 50 k vocabulary).
FLOOD_VOCAB = 50_000
# The consumers' contract beside their item count: 65,536 tokens a batch (256 items of 256
# tokens fill it exactly), prompts up to 8,192 tokens.
CONTRACT_TOKENS = 65_536
CONTRACT_MAX_INPUT_LEN = 8192
# How often the wait for completion asks the broker and samples CPU times.
POLL_S = 0.05
# A phase that has not completed in this long is stuck, not slow (the slowest full-size
# phase, 1 M items at durability power, takes under a minute here).
PHASE_TIMEOUT_S = 900.0
# How long a producer may wait for the broker to store its last records at close.
PRODUCER_CLOSE_TIMEOUT_S = 300.0
# How long a process may take to stop gracefully before it is killed.
STOP_TIMEOUT_S = 20.0
# How long a paced producer sleeps at least between submits (below this a sleep is a spin).
PACE_MIN_SLEEP_S = 0.0005


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    """One pipeline's settings: the broker's storage tier and durability, its consumers, and
    their contract (items a batch; tokens and input length fixed above)."""

    storage: str = "disk"
    durability: str = "process"
    consumers: int = 2
    batch_items: int = 64
    engine_options: dict = field(default_factory=dict)
    sync_interval_s: float | None = None  # the broker's (durability `process`: periodic syncfs)

    @property
    def label(self) -> str:
        sync = "" if self.sync_interval_s is None else f", syncfs every {self.sync_interval_s:g} s"
        return f"{self.storage}/{self.durability}{sync}, {self.batch_items}-item"


@dataclass(slots=True)
class Phase:
    """One phase's figures: items and tokens completed in `seconds` (producers' start to the
    broker counting the last one completed), and each process's CPU seconds (user + system)
    over it: "broker", "consumer K", "producer K"."""

    items: int
    tokens: int
    seconds: float
    cpu_s: dict[str, float]

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def figures(self) -> dict[str, Any]:
        """JSON-able: rates, and CPU as cores used (CPU seconds / wall seconds) and us per item."""
        return {"items": self.items, "tokens": self.tokens, "seconds": self.seconds,
                "items_per_s": self.items_per_s, "tokens_per_s": self.tokens_per_s,
                "cores": cores_by_role(self.cpu_s, self.seconds),
                "cpu_us_per_item": {name: 1e6 * s / self.items for name, s in self.cpu_s.items()}}


def cores_by_role(cpu_s: dict[str, float], seconds: float) -> dict[str, float]:
    """CPU seconds per process name summed by role (the name before a space: "broker",
    "consumer", "producer"), over wall seconds: how many cores each role kept busy."""
    assert seconds > 0, seconds
    roles: dict[str, float] = {}
    for name, used in cpu_s.items():
        role = name.split(" ", 1)[0]
        roles[role] = roles.get(role, 0.0) + used
    out = {role: used / seconds for role, used in sorted(roles.items())}
    out["all"] = sum(cpu_s.values()) / seconds
    return out


def percentiles_ms(waits_ms: Sequence[float]) -> dict[str, float]:
    """p50, p99 and max of latencies in ms (numpy's linear interpolation)."""
    if not len(waits_ms):
        raise ValueError("latency percentiles of no items")
    values = np.asarray(waits_ms, dtype=np.float64)
    return {"items": int(values.shape[0]), "p50_ms": float(np.percentile(values, 50)),
            "p99_ms": float(np.percentile(values, 99)), "max_ms": float(values.max())}


def padding_efficiency(batches: Iterable[Sequence[int]]) -> float:
    """Real tokens / padded tokens over batches given as their items' lengths, a batch's
    padded tokens being its items times its longest item (what a padded batch computes)."""
    real = padded = 0
    for lengths in batches:
        if len(lengths):
            real += sum(lengths)
            padded += len(lengths) * max(lengths)
    if not padded:
        raise ValueError("padding efficiency of no batches")
    return real / padded


def scaled(s: dict[str, Any], factor: float) -> dict[str, Any]:
    """A `harness.spread` with every figure times `factor` (for a table in other units)."""
    return {key: ([v * factor for v in value] if key == "values" else value * factor) for key, value in s.items()}


def flood_arrays(seed: int, count: int = FLOOD_CALL_ITEMS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`count` items of the flood workload (one submit call's worth by default): each
    item's shape signature (uint64), the tokens back to back (int32) and each item's shape
    index. Item k of a smaller `count` is item k of the default's."""
    rng = np.random.default_rng(seed)
    prefixes = [np.random.default_rng(k).integers(0, FLOOD_VOCAB, size=FLOOD_PREFIX_TOKENS, dtype=np.int32)
                for k in range(FLOOD_SHAPES)]
    signatures = np.array([signature([p]) for p in prefixes], dtype=np.uint64)
    shapes = rng.integers(0, FLOOD_SHAPES, size=FLOOD_CALL_ITEMS)[:count]
    suffix = FLOOD_TOKENS - FLOOD_PREFIX_TOKENS
    rows = np.empty((count, FLOOD_TOKENS), dtype=np.int32)
    rows[:, :FLOOD_PREFIX_TOKENS] = np.stack(prefixes)[shapes]
    rows[:, FLOOD_PREFIX_TOKENS:] = rng.integers(0, FLOOD_VOCAB, size=(FLOOD_CALL_ITEMS, suffix), dtype=np.int32)[:count]
    tokens = rows.reshape(-1)
    return signatures[shapes], tokens, shapes


def flood(socket_path: str, items: int, seed: int) -> None:
    """A producer process: `items` flood items as fast as the broker takes them."""
    signatures, tokens, _ = flood_arrays(seed, min(items, FLOOD_CALL_ITEMS))
    lengths = np.full(FLOOD_CALL_ITEMS, FLOOD_TOKENS)
    producer = BrokerProducer(socket_path, timeout_s=PHASE_TIMEOUT_S)
    sent = 0
    while sent < items:
        n = min(FLOOD_CALL_ITEMS, items - sent)
        producer.submit_many(0, signatures[:n], tokens[: n * FLOOD_TOKENS], lengths[:n], FLOOD_PREFIX_TOKENS)
        sent += n
    producer.close(timeout_s=PRODUCER_CLOSE_TIMEOUT_S)


def paced(socket_path: str, items: int, rate_per_s: float, seed: int) -> None:
    """A producer process: `items` flood items at `rate_per_s`, each sent when due (those due
    together in one call), so latency is measured at that load, not behind a backlog."""
    signatures, tokens, _ = flood_arrays(seed, min(items, FLOOD_CALL_ITEMS))
    lengths = np.full(FLOOD_CALL_ITEMS, FLOOD_TOKENS)
    producer = BrokerProducer(socket_path, timeout_s=PHASE_TIMEOUT_S)
    start = time.monotonic()
    sent = 0
    while sent < items:
        due = min(items, int((time.monotonic() - start) * rate_per_s) + 1)
        n = min(due - sent, FLOOD_CALL_ITEMS)
        if n > 0:
            k = sent % signatures.shape[0]
            n = min(n, signatures.shape[0] - k)
            producer.submit_many(0, signatures[k:k + n], tokens[k * FLOOD_TOKENS:(k + n) * FLOOD_TOKENS],
                                 lengths[:n], FLOOD_PREFIX_TOKENS)
            sent += n
        else:
            time.sleep(max(PACE_MIN_SLEEP_S, (sent + 1) / rate_per_s - (time.monotonic() - start)))
    producer.close(timeout_s=PRODUCER_CLOSE_TIMEOUT_S)


def feed_share(socket_path: str, workload: Workload, index: int, count: int) -> None:
    """A producer process: its share (`Workload.items(index, count)`) of a workload, as fast
    as the broker takes it."""
    with BrokerProducer(socket_path, timeout_s=PHASE_TIMEOUT_S) as producer:
        feed(producer, workload.items(index, count))


class Pipeline:
    """A broker with `spec.consumers` sim consumers (zero cost) on `root`/data, results in
    `root`/results. A context manager: on exit every process it started is stopped (killed
    if it does not stop), and `root`, the memory tier and the shared-memory objects named for
    the data directory are removed."""

    def __init__(self, root: Path, spec: PipelineSpec) -> None:
        self.root, self.spec = root, spec
        self.data_dir = str(root / "data")
        self.results_dir = str(root / "results")
        self.broker = None
        self.consumers: list = []
        root.mkdir(parents=True)

    def __enter__(self) -> Pipeline:
        try:
            config = BrokerConfig(self.data_dir, sync_interval_s=self.spec.sync_interval_s)
            self.socket_path = config.socket_path
            self.broker = start_broker(config, self.spec.storage, self.spec.durability)
            self.consumers = [start_consumer(ConsumerConfig(
                self.socket_path, self.results_dir, f"c{k}", max_batch_items=self.spec.batch_items,
                max_batch_tokens=CONTRACT_TOKENS, max_input_len=CONTRACT_MAX_INPUT_LEN,
                engine_options=dict(self.spec.engine_options))) for k in range(self.spec.consumers)]
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        # The consumers stop together (each SIGTERM once: a second one is a forceful stop),
        # then the broker, as the launcher orders it.
        for consumer in self.consumers:
            if consumer.is_alive():
                os.kill(consumer.pid, signal.SIGTERM)
        for consumer in self.consumers:
            consumer.join(STOP_TIMEOUT_S)
            stop_process(consumer, timeout_s=0)  # killed if still alive
        if self.broker is not None:
            stop_process(self.broker, timeout_s=STOP_TIMEOUT_S)
        remove_leftovers(self.data_dir)
        shutil.rmtree(memory_tier_dir(self.data_dir), ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def completed(self) -> tuple[int, int]:
        """Items and tokens the broker has counted completed.
        NOTE: the `progress` request, not a status: polled every POLL_S, a status (built,
        encoded, decoded and validated, a few KiB) took 3% of the broker's throughput from
        the run it measured (500,000 flood items, 256-item batches, with a 20 ms poll:
        123,116-128,245 items/s against 127,572-132,467 polling every 500 ms), where Redis's
        side asks an MGET of two keys."""
        progress = broker_progress(self.socket_path)
        return progress.items_completed, progress.tokens_completed

    def run_producers(self, targets: Sequence[tuple[Callable, tuple]], items: int) -> Phase:
        """Start one producer process per (function, arguments) and wait until the broker
        counts `items` more completed; the phase's figures."""
        named = {"broker": self.broker, **{f"consumer {k}": c for k, c in enumerate(self.consumers)}}
        return run_phase(targets, items, self.completed, named, self.spec.label)

    def results(self, keep: Callable[[dict], bool] = lambda row: True) -> dict[str, list[dict]]:
        """Each consumer's results lines (parsed, in file order) that `keep` accepts."""
        out: dict[str, list[dict]] = {}
        for name in sorted(os.listdir(self.results_dir)) if os.path.isdir(self.results_dir) else []:
            with open(os.path.join(self.results_dir, name)) as file:
                out[name.rsplit(".", 1)[0]] = [row for row in map(json.loads, file) if keep(row)]
        return out


def run_phase(targets: Sequence[tuple[Callable, tuple]], items: int, completed: Callable[[], tuple[int, int]],
              serving: dict[str, Any], label: str) -> Phase:
    """Fork one producer process per (function, arguments) and wait until `completed()`
    (items and tokens done so far) says `items` more are done; the phase's figures, with the
    CPU time of the producers and of the `serving` processes (name -> an object with `pid`
    and `is_alive()`) over it. RuntimeError if any of them exits early or the phase runs past
    PHASE_TIMEOUT_S; the producers are killed on the way out if still alive."""
    base_items, base_tokens = completed()
    watched = {name: psutil.Process(p.pid) for name, p in serving.items()}
    before = cpu_seconds(watched, {})
    producers = [CTX.Process(target=fn, args=args, name=f"bench-producer-{k}") for k, (fn, args) in
                 enumerate(targets)]
    started = time.monotonic()
    try:
        for producer in producers:
            start_child(producer)
        watched.update({f"producer {k}": psutil.Process(p.pid) for k, p in enumerate(producers)})
        cpu: dict[str, float] = {}
        while (done := completed())[0] < base_items + items:
            cpu_seconds(watched, cpu)
            failed = [p.name for p in producers if p.exitcode not in (None, 0)]
            failed += [name for name, p in serving.items() if not p.is_alive()]
            if failed or time.monotonic() > started + PHASE_TIMEOUT_S:
                why = f"{', '.join(failed)} exited" if failed else f"timed out after {PHASE_TIMEOUT_S:.0f} s"
                raise RuntimeError(f"{label}: {why} with {done[0] - base_items:,} of {items:,} items completed")
            time.sleep(POLL_S)
        seconds = time.monotonic() - started
        cpu_seconds(watched, cpu)
        for producer in producers:
            producer.join(PRODUCER_CLOSE_TIMEOUT_S)
    finally:
        for producer in producers:
            if producer.is_alive():
                producer.kill()
                producer.join(5)
    cpu = {name: used - before.get(name, 0.0) for name, used in cpu.items()}
    return Phase(done[0] - base_items, done[1] - base_tokens, seconds, cpu)


def cpu_seconds(processes: dict[str, psutil.Process], into: dict[str, float]) -> dict[str, float]:
    """Record each live process's CPU time (user + system, its reaped children's included:
    redis-server's AOF rewrites run in a forked child) in `into`; the last reading before a
    process exits stays. Returns `into`."""
    for name, process in processes.items():
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        into[name] = times.user + times.system + times.children_user + times.children_system
    return into


def latencies_ms(rows: Iterable[dict]) -> list[float]:
    """Each results line's `done_ns - submit_ns` in ms: the producer's submit to the
    consumer's result written, on the machine's one monotonic clock."""
    return [(row["done_ns"] - row["submit_ns"]) / 1e6 for row in rows]


def flood_targets(socket_path: str, producers: int, items: int) -> list[tuple[Callable, tuple]]:
    """`producers` flood producers sharing `items` (the first ones take the remainder)."""
    share, extra = divmod(items, producers)
    return [(flood, (socket_path, share + (k < extra), k)) for k in range(producers)]
