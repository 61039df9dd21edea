#!/usr/bin/env python3
"""Where the end-to-end pipeline's time goes: the throughput run of `pipeline bench e2e`
(lab/bench/pipelines.py: 2 flood producers, a broker on the disk tier at durability
`process`, 2 zero-cost sim consumers), with three instruments.

    .venv/bin/python tools/profile_pipeline.py                    # 64-item batches, 1 M items
    .venv/bin/python tools/profile_pipeline.py --batch-items 256 --items 250000

- CPU per item of the main methods of the broker and of the consumers: each is wrapped to
  add up `time.thread_time()` (CPU of the calling thread, user + system) over its calls, so
  figures nest (a caller includes its callees) and the wrapper's own cost (about 1 us a call)
  is in them. Per call and per item of the run.
- The cyclic garbage collector's time in the broker and consumers (`gc.callbacks`).
- How many of the five processes are runnable (state R in /proc), sampled every 0.5 ms: the
  share of samples with 0, 1, 2... runnable. On 2 cores, samples with fewer than 2 runnable
  are idle CPU.

The wrappers are installed in this process before the broker and consumers are forked, so
the children inherit them; each child writes its totals to a file as it goes.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lab.bench.pipelines import Phase, Pipeline, PipelineSpec, flood_targets  # noqa: E402  (the run profiled)
from pipeline.broker import consumers, control, dispatch, producers  # noqa: E402
from pipeline.storage import disk, queues  # noqa: E402
from pipeline.consumer import process, reader, session  # noqa: E402
from pipeline.consumer.engines import prefix_cache, sim  # noqa: E402
from pipeline.runtime.local import CTX  # noqa: E402

# (owner, attribute, label): the methods timed.
TIMED = [
    (producers.ProducerSide, "fill", "broker: fill (ingest a turn's frames)"),
    (dispatch.Dispatcher, "ingest", "broker:   Dispatcher.ingest"),
    (dispatch.Dispatcher, "_assign_shape", "broker:     lane assignment"),
    (disk.DiskTier, "append", "broker:     DiskTier.append (encode + write)"),
    (consumers.ConsumerSide, "dispatch", "broker: dispatch"),
    (dispatch.Dispatcher, "next_batch", "broker:   Dispatcher.next_batch"),
    (queues.QueuedTier, "peek_many", "broker:     peek_many"),
    (dispatch.Dispatcher, "commit", "broker:   Dispatcher.commit"),
    (consumers.ConsumerSide, "_send_batch", "broker:   descriptor write"),
    (control.ControlServer, "serve", "broker: control"),
    (dispatch.Dispatcher, "complete_batch", "broker:   Dispatcher.complete_batch"),
    (disk.DiskTier, "_remove", "broker:     tombstones"),
    (process.Consumer, "start_batch", "consumer: start_batch"),
    (reader.SegmentReader, "read_batch", "consumer:   read_batch"),
    (sim.SimEngine, "run", "consumer:   engine"),
    (sim.SimEngine, "_hash_blocks", "consumer:     block hashing"),
    (prefix_cache.PrefixCache, "run", "consumer:     prefix cache"),
    (process.Consumer, "finish_batch", "consumer: finish_batch"),
    (process, "result_lines", "consumer:   result lines"),
    (process.Consumer, "_write", "consumer:   results write"),
    (session.BrokerSession, "send", "consumer: completion messages"),
]


def _install(out_dir: str) -> None:
    """Wrap every TIMED method, and the collector, to add up thread CPU time; each process
    writes its totals to `out_dir/<pid>.json` every 0.5 s of its run."""
    totals: dict[str, list[float]] = {}
    last_dump = [0.0]

    def dump() -> None:
        now = time.monotonic()
        if now - last_dump[0] >= 0.5:
            last_dump[0] = now
            with open(os.path.join(out_dir, f"{os.getpid()}.json"), "w") as file:
                json.dump(totals, file)

    def wrap(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                entry = totals.setdefault(label, [0.0, 0])
                entry[0] += time.thread_time() - start
                entry[1] += 1
                dump()

        setattr(owner, name, timed)

    for owner, name, label in TIMED:
        wrap(owner, name, label)
    gc_started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.thread_time()
            return
        entry = totals.setdefault(f"garbage collector, generation {info['generation']}", [0.0, 0])
        entry[0] += time.thread_time() - gc_started[0]
        entry[1] += 1

    gc.callbacks.append(on_gc)


class _StateSampler:
    """Samples /proc/PID/stat of the run's processes: how many are runnable (R)."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self.counts: collections.Counter[int] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            if len(self.pids) >= 5:
                self.counts[sum(self._runnable(pid) for pid in list(self.pids))] += 1
            time.sleep(0.0005)

    @staticmethod
    def _runnable(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as file:
                return file.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=500_000, help="items per producer")
    parser.add_argument("--batch-items", type=int, default=64)
    args = parser.parse_args()
    out_dir = tempfile.mkdtemp(prefix="profile-pipeline-")
    work = Path(tempfile.mkdtemp(prefix="profile-pipeline-run-"))
    _install(out_dir)
    sampler = _StateSampler()
    start_child = CTX.Process.start

    def start_and_watch(self):  # every process the run forks: broker, consumers, producers
        start_child(self)
        sampler.pids.add(self.pid)

    CTX.Process.start = start_and_watch
    sampler.start()
    try:
        with Pipeline(work / "run", PipelineSpec(batch_items=args.batch_items)) as pipe:
            phase = pipe.run_producers(flood_targets(pipe.socket_path, 2, 2 * args.items), 2 * args.items)
    finally:
        sampler.stop()
        CTX.Process.start = start_child
        shutil.rmtree(work, ignore_errors=True)
    _print(phase, out_dir, sampler, 2 * args.items)
    shutil.rmtree(out_dir, ignore_errors=True)
    return 0


def _print(phase: Phase, out_dir: str, sampler: _StateSampler, items: int) -> None:
    print(f"{phase.items_per_s:,.0f} items/s; CPU us per item: "
          + ", ".join(f"{name} {1e6 * seconds / phase.items:.2f}" for name, seconds in phase.cpu_s.items()))
    merged: dict[str, list[float]] = {}
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name)) as file:
            for label, (seconds, calls) in json.load(file).items():
                entry = merged.setdefault(label, [0.0, 0])
                entry[0] += seconds
                entry[1] += calls
    order = {label: k for k, (_owner, _name, label) in enumerate(TIMED)}
    print(f"{'method (thread CPU; nested; consumers summed)':48s} {'us/item':>8s} {'us/call':>8s} {'calls':>8s}")
    for label, (seconds, calls) in sorted(merged.items(), key=lambda kv: (order.get(kv[0], 99), kv[0])):
        print(f"{label:48s} {1e6 * seconds / items:8.3f} {1e6 * seconds / max(calls, 1):8.1f} {int(calls):8d}")
    samples = sum(sampler.counts.values())
    shares = ", ".join(f"{n}: {100 * c / samples:.0f}%" for n, c in sorted(sampler.counts.items()))
    print(f"runnable processes of 5, share of {samples:,} samples: {shares}")


if __name__ == "__main__":
    sys.exit(main())
