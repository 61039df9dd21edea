"""Redis Streams as a durable queue, the peer of `pipeline bench redis`: a redis-server this
benchmark starts and stops, producer processes that XADD items, consumer processes that
XREADGROUP batches in arrival order and XACK them.

The server: Debian's redis-server on a free loopback port (`--bind 127.0.0.1`), its own
directory, AOF on with `appendfsync everysec` (an acknowledged write can be lost for about a
second on a power cut: the pairing of the broker's `process`) or `always` (the AOF fsynced
before a round's replies: the pairing of `power`), no RDB snapshots
(`--save ''`), everything else at Redis's defaults (AOF rewrites included). It dies with
this process (PR_SET_PDEATHSIG) and is killed by its recorded pid on any failure.

An item is one stream entry: `t` its token ids (int32 bytes), `s` its shape signature, `n`
its length, `p` its cacheable prefix's length, `c` its submit time (time.monotonic_ns()), `i`
its index in the workload (the broker's entries carry the same in their headers). Producers pipeline XADD (redis-py with the
hiredis parser, no MULTI), PIPELINE_ITEMS a round trip. Consumers send, in one pipelined
round trip, the XACK of the batch before, INCRBY of the done counters and XREADGROUP
(COUNT = the batch size): a batch is the next COUNT entries in arrival order, whichever
shapes and lengths they have. The consumer decodes each entry's tokens (a numpy view), then
either runs no engine (`work` off: the queue alone, an upper bound for any consumer that must
still hand its batch to an engine) or does what the broker's consumer does with a batch
(`work` on, `ConsumerWork`): the zero-cost sim engine with its prefix cache, each prompt's
digest, and the batch's result lines (pipeline/consumer/results.py's format and writer) in a
results file, written before the batch is acknowledged.

Owner: the `pipeline bench` process; a `RedisServer` is used by one thread.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lab.bench.harness import LAB_INSTALL
from lab.bench.pipelines import (
    FLOOD_CALL_ITEMS,
    FLOOD_PREFIX_TOKENS,
    FLOOD_TOKENS,
    STOP_TIMEOUT_S,
    Phase,
    flood_arrays,
    run_phase,
)
from pipeline.broker.packing import pad_to_tokens
from pipeline.consumer.engines.base import EngineBatch
from pipeline.consumer.engines.sim import SimEngine
from pipeline.consumer.results import STATUS_OK, ResultsFile, result_lines
from pipeline.producer.workload import Workload
from pipeline.runtime.local import CTX, start_child
from pipeline.wire.layouts.descriptors import DESCRIPTOR_ITEM_DTYPE, Descriptor
from pipeline.wire.layouts.segments import prompt_digests

# The server's program: Debian's package puts it in /usr/bin; a PATH lookup finds another.
REDIS_SERVER = "redis-server"
STREAM = "items"
GROUP = "consumers"
DONE_ITEMS_KEY = "done:items"
DONE_TOKENS_KEY = "done:tokens"
# XADDs per pipelined round trip: past a few hundred the round trip is a small share, and a
# round trip's replies stay a few tens of KiB.
PIPELINE_ITEMS = 512
# How long an XREADGROUP waits for entries when the stream is drained, in ms: short, so a
# consumer that was told to stop notices within that.
READ_BLOCK_MS = 50
# How long a new server may take to answer PING.
START_TIMEOUT_S = 20.0
# How long a stopping server may take (it flushes its AOF) before it is killed.
SERVER_STOP_TIMEOUT_S = 60.0
# Free ports are picked by binding port 0 and handing that port to redis-server: another
# process may take it in between, so a start that fails is retried on a new port.
START_ATTEMPTS = 3
# The AOF fsync policies a run may ask for: `everysec` (the peer of the broker's `process`:
# a power cut can lose about the last second), `always` (fsync before the replies of each
# event-loop round go out: the peer of `power`).
APPENDFSYNC_POLICIES = ("everysec", "always")
# prctl(2) option: the signal a process gets when its parent dies (Linux only).
_PR_SET_PDEATHSIG = 1


def redis_missing() -> str | None:
    """Why the Redis side cannot run here (the server or the client is missing), or None."""
    if shutil.which(REDIS_SERVER) is None:
        return f"{REDIS_SERVER} is not on PATH (apt-get install redis-server)"
    try:
        import redis  # noqa: F401
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return f"the redis Python package is not installed ({LAB_INSTALL})"
    if not HIREDIS_AVAILABLE:
        return f"redis-py runs without the hiredis parser ({LAB_INSTALL})"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class RedisServer:
    """A redis-server in `directory` (created; removed at `stop`). A context manager:

        with RedisServer(work_dir / "redis") as server:
            server.client().ping()

    `pid` is recorded in `directory`/redis.pid by this class (not by the server) the moment
    it starts; `stop` kills that pid if the server does not stop gracefully."""

    def __init__(self, directory: Path, appendfsync: str = "everysec") -> None:
        assert appendfsync in APPENDFSYNC_POLICIES, appendfsync
        self.directory = directory
        self.appendfsync = appendfsync
        self.process: subprocess.Popen | None = None
        self.port = 0

    def __enter__(self) -> RedisServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.directory.mkdir(parents=True)
        error = ""
        for _ in range(START_ATTEMPTS):
            self.port = _free_port()
            self.process = subprocess.Popen(
                [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                 "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "", "--daemonize", "no",
                 "--logfile", str(self.directory / "redis.log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                preexec_fn=_die_with_parent)
            (self.directory / "redis.pid").write_text(f"{self.process.pid}\n")
            error = self._wait_ready()
            if not error:
                return
            self._kill()
        raise RuntimeError(f"redis-server did not start in {START_ATTEMPTS} attempts: {error}")

    def _wait_ready(self) -> str:
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = self.directory / "redis.log"
                tail = log.read_text()[-500:] if log.exists() else self.process.stderr.read().decode()[-500:]
                return f"exited with {self.process.returncode}: {tail.strip()}"
            try:
                if self.client().ping():
                    return ""
            except redis.ConnectionError:
                time.sleep(0.02)
        return f"no answer to PING on port {self.port} within {START_TIMEOUT_S:.0f} s"

    @property
    def pid(self) -> int:
        assert self.process is not None, "a server not started"
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM (Redis flushes its AOF and exits), SIGKILL by pid past SERVER_STOP_TIMEOUT_S;
        then the directory goes."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._kill()
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def reset(self) -> None:
        """An empty stream with its consumer group, and the done counters at 0."""
        client = self.client()
        client.delete(STREAM, DONE_ITEMS_KEY, DONE_TOKENS_KEY)
        client.xgroup_create(STREAM, GROUP, id="$", mkstream=True)
        client.close()

    def completed(self) -> tuple[int, int]:
        client = self.client()
        items, tokens = client.mget(DONE_ITEMS_KEY, DONE_TOKENS_KEY)
        client.close()
        return int(items or 0), int(tokens or 0)


class _Adder:
    """XADDs pipelined PIPELINE_ITEMS a round trip (one producer process)."""

    def __init__(self, port: int) -> None:
        import redis

        self.client = redis.Redis(host="127.0.0.1", port=port)
        self.pipe = self.client.pipeline(transaction=False)
        self.queued = 0

    def add(self, tokens: np.ndarray, shape_signature: int, prefix_len: int, index: int) -> None:
        self.pipe.xadd(STREAM, {"t": tokens.tobytes(), "s": shape_signature, "n": tokens.shape[0], "p": prefix_len,
                                "c": time.monotonic_ns(), "i": index})
        self.queued += 1
        if self.queued == PIPELINE_ITEMS:
            self.flush()

    def flush(self) -> None:
        if self.queued:
            self.pipe.execute()
            self.queued = 0

    def close(self) -> None:
        self.flush()
        self.client.close()


def flood_producer(port: int, items: int, seed: int) -> None:
    """A producer process: `items` of pipelines.py's flood items (256 tokens, 8 shapes)."""
    signatures, tokens, _ = flood_arrays(seed, min(items, FLOOD_CALL_ITEMS))
    adder = _Adder(port)
    for k in range(items):
        j = k % signatures.shape[0]
        adder.add(tokens[j * FLOOD_TOKENS:(j + 1) * FLOOD_TOKENS], int(signatures[j]), FLOOD_PREFIX_TOKENS, k)
    adder.close()


def workload_producer(port: int, workload: Workload, index: int, count: int) -> None:
    """A producer process: its share of `workload` (items index, index + count, ...), each
    entry's `i` its index in the workload."""
    adder = _Adder(port)
    for k, item in zip(range(index, len(workload), count), workload.items(index, count)):
        adder.add(item.tokens, item.signature, item.prefix_len, k)
    adder.close()


# The descriptor a Redis batch's result lines are formatted with carries no item rows.
_NO_ITEMS = np.zeros(0, dtype=DESCRIPTOR_ITEM_DTYPE)


class ConsumerWork:
    """What the broker's consumer does with a batch it read, for a Redis batch: run it on a
    zero-cost sim engine (the default prefix cache), digest each prompt, and append the
    batch's result lines (`result_lines`, the broker's consumer's format) to a results file
    through `ResultsFile`, before the batch is acknowledged (`fsync`: on disk first, as the
    broker's consumers do when the broker is at `power`: the pairing of AOF `always`).

    Owner: one Redis consumer process. Not thread-safe. `close()` closes the results file.
    """

    def __init__(self, results_path: str, fsync: bool = False) -> None:
        self.engine = SimEngine()
        self.results = ResultsFile(results_path, fsync=fsync)
        self.batches = 0

    def run(self, entries: list, prompts: list[np.ndarray]) -> None:
        pad_to = pad_to_tokens(max(p.shape[0] for p in prompts))
        prefix_lens = [int(fields[b"p"]) for _, fields in entries]
        result = self.engine.run(EngineBatch(prompts, pad_to, prefix_lens))
        self.batches += 1
        d = Descriptor(self.batches, 0, 0, pad_to, time.monotonic_ns(), _NO_ITEMS)
        lines = result_lines(d, STATUS_OK, [int(fields[b"i"]) for _, fields in entries],
                             [int(fields[b"c"]) for _, fields in entries], [p.shape[0] for p in prompts],
                             result.cached_tokens, result.outputs, [b""] * len(prompts), result.finish_reasons,
                             result.texts, prompt_digests(prompts))
        self.results.write(lines.encode() + b"\n")

    def close(self) -> None:
        self.results.close()


def consumer(port: int, name: str, batch_items: int, stop: Any, record: str | None,
             results_path: str | None = None, fsync_results: bool = False) -> None:
    """A consumer process: read batches of up to `batch_items` entries in arrival order, ack
    each (with the next read) until `stop` is set and the stream gives nothing. `record`: a
    .npy path for the batches it read, as workload indices with -1 after each batch.
    `results_path`: do the broker's consumer's work on each batch (`ConsumerWork`), its
    result lines in that file (fsynced before the ack with `fsync_results`); None: no engine."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    pipe = client.pipeline(transaction=False)
    work = ConsumerWork(results_path, fsync_results) if results_path is not None else None
    ids: list[bytes] = []
    tokens_done = 0
    batches: list[int] = []
    while True:
        if ids:
            pipe.xack(STREAM, GROUP, *ids)
            pipe.incrby(DONE_ITEMS_KEY, len(ids))
            pipe.incrby(DONE_TOKENS_KEY, tokens_done)
        pipe.xreadgroup(GROUP, name, {STREAM: ">"}, count=batch_items, block=READ_BLOCK_MS)
        reply = pipe.execute()[-1]
        if not reply:
            ids, tokens_done = [], 0
            if stop.is_set():
                break
            continue
        entries = reply[0][1]
        ids = [entry_id for entry_id, _ in entries]
        prompts = [np.frombuffer(fields[b"t"], dtype=np.int32) for _, fields in entries]
        tokens_done = sum(p.shape[0] for p in prompts)
        if work is not None:
            work.run(entries, prompts)
        if record is not None:
            batches.extend(int(fields[b"i"]) for _, fields in entries)
            batches.append(-1)
    client.close()
    if work is not None:
        work.close()
    if record is not None:
        np.save(record, np.array(batches, dtype=np.int64))


def recorded_batches(path: str) -> list[list[int]]:
    """The batches a consumer recorded (`consumer`'s `record` file), as index lists."""
    flat = np.load(path)
    cuts = np.flatnonzero(flat == -1)
    starts = np.concatenate([[0], cuts[:-1] + 1]) if cuts.size else np.zeros(0, dtype=np.int64)
    return [flat[a:b].tolist() for a, b in zip(starts, cuts)]


def run_redis(root: Path, targets: Callable[[int], Sequence[tuple[Callable, tuple]]], items: int, consumers: int,
              batch_items: int, record: bool, label: str, work: bool = False,
              appendfsync: str = "everysec") -> tuple[Phase, list[list[list[int]]] | None]:
    """One run through a fresh server in `root`/redis: `consumers` consumer processes, the
    producers `targets(port)` names, until the consumers count `items` done; the phase's
    figures (CPU of the server, consumers and producers) and, with `record`, each consumer's
    batches as workload indices. `work`: the consumers do the broker's consumer's work on
    each batch (`ConsumerWork`, results files in `root`/results). `appendfsync`: the
    server's AOF policy; at `always` the consumers fsync their results before each ack, as
    the broker's consumers do at `power`. Everything it started is stopped on the way out."""
    records = [str(root / f"c{k}.npy") if record else None for k in range(consumers)]
    results = [str(root / "results" / f"c{k}.jsonl") if work else None for k in range(consumers)]
    with RedisServer(root / "redis", appendfsync) as server:
        server.reset()
        stop = CTX.Event()
        workers = [CTX.Process(target=consumer, args=(server.port, f"c{k}", batch_items, stop, records[k], results[k],
                                                              appendfsync == "always"),
                               name=f"redis-consumer-{k}") for k in range(consumers)]
        try:
            for worker in workers:
                start_child(worker)
            serving = {"redis-server": server, **{f"consumer {k}": w for k, w in enumerate(workers)}}
            phase = run_phase(targets(server.port), items, server.completed, serving, label)
        finally:
            stop.set()
            for worker in workers:
                worker.join(STOP_TIMEOUT_S)
                if worker.is_alive():
                    worker.kill()
                    worker.join(5)
    failed = [w.name for w in workers if w.exitcode != 0]
    if failed:
        raise RuntimeError(f"{label}: {', '.join(failed)} exited with a failure")
    if work:
        _check_results(results, items, label)
    batches = [recorded_batches(path) for path in records if path is not None] if record else None
    for path in records:
        if path is not None:
            os.unlink(path)
    return phase, batches


def _check_results(paths: Sequence[str | None], items: int, label: str) -> None:
    """The consumers' results files hold a line per item at least (a redelivered entry would
    add one): the work was done, not only counted."""
    lines = 0
    for path in paths:
        if path is not None and os.path.exists(path):
            with open(path, "rb") as file:
                lines += sum(chunk.count(b"\n") for chunk in iter(lambda: file.read(1 << 20), b""))
    if lines < items:
        raise RuntimeError(f"{label}: the consumers' results files hold {lines:,} lines for {items:,} items")
