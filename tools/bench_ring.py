#!/usr/bin/env python3
"""Ring throughput between two processes, against multiprocessing.Queue in the same run.

    .venv/bin/python tools/bench_ring.py            # full run (about a minute)
    .venv/bin/python tools/bench_ring.py --quick    # a few seconds, for a smoke check

For each item size (1, 256 and 2048 tokens) a writer process submits items through a
`Producer` into a shared-memory ring and a reader process takes them out:

- ring, batch:  `Producer.submit_many`, frames of up to 4,096 items; the reader parses each
  frame (`parse_frame`: zero-copy views, every size cross-checked) and releases it;
- ring, batch + reader copy: as above, and the reader also copies every token out of the
  ring (what the broker does when it appends to a segment), so nothing is merely viewed;
- ring, single: `Producer.submit` once per item; the reader checks each record's frame
  header (magic, version, item count, sizes) and releases records 256 at a time;
- mp.Queue, batched: `put` of a list of 4,096 (int32 array, metadata) items per call;
- mp.Queue, single: one `put` per item.

Elapsed time runs from the writer's first submit to the reader holding the last item
(one system-wide monotonic clock). GB/s counts token bytes only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import uuid
from dataclasses import dataclass

import numpy as np

from pipeline.producer import Producer
from pipeline.wire.layouts.frames import FRAME_HEADER_STRUCT, FRAME_MAGIC, FRAME_VERSION, frame_size_bytes, parse_frame
from shm.ring import RingReader, RingWriter

SIGNATURE = 0x1234_5678_9ABC_DEF0
# Items per submit_many call and per batched Queue put: one full frame.
BATCH_ITEMS = 4096
# Releasing every record costs a shared store and a semaphore check; the broker releases
# after storing a group, so the single-item reader releases in groups too.
RELEASE_EVERY = 256


@dataclass
class Case:
    transport: str  # "ring" or "queue"
    mode: str  # "batch", "batch+copy" or "single"
    tokens: int
    items: int


def _writer(case: Case, name: str, queue, start_pipe) -> None:
    rng = np.random.default_rng(1)
    one = rng.integers(0, 50_000, size=case.tokens, dtype=np.int32)
    flat = np.tile(one, BATCH_ITEMS)
    lengths = np.full(BATCH_ITEMS, case.tokens)
    producer = Producer(RingWriter.attach(name), producer_id=1) if case.transport == "ring" else None
    start_pipe.send(time.monotonic())
    sent = 0
    if case.transport == "ring" and case.mode != "single":
        while sent < case.items:
            n = min(BATCH_ITEMS, case.items - sent)
            producer.submit_many(0, SIGNATURE, flat[: n * case.tokens], lengths[:n])
            sent += n
    elif case.transport == "ring":
        for _ in range(case.items):
            producer.submit(0, SIGNATURE, one)
    elif case.mode == "batch":
        # Distinct arrays: pickle memoizes a repeated object, which would send one copy.
        batch = [(flat[i * case.tokens:(i + 1) * case.tokens].copy(), 0, SIGNATURE) for i in range(BATCH_ITEMS)]
        while sent < case.items:
            n = min(BATCH_ITEMS, case.items - sent)
            queue.put(batch[:n])
            sent += n
    else:
        for _ in range(case.items):
            queue.put((one, 0, SIGNATURE))  # a new pickle each put: nothing is memoized
    if producer is not None:
        producer.close()


def _read_ring(case: Case, reader: RingReader) -> None:
    got = 0
    sink = np.empty(BATCH_ITEMS * case.tokens, dtype=np.int32)
    since_release = 0
    while got < case.items:
        record = reader.peek(timeout_s=10.0)
        if record is None:
            raise SystemExit(f"reader: nothing for 10 s after {got} items")
        if case.mode == "single":
            magic, version, _hs, _pid, count, tokens, payload, _chains = FRAME_HEADER_STRUCT.unpack_from(
                record.body, 0)
            if magic != FRAME_MAGIC or version != FRAME_VERSION or count != 1 or tokens != case.tokens:
                raise SystemExit(f"reader: bad frame header at item {got}")
            if frame_size_bytes(count, tokens, payload) != record.body.shape[0]:
                raise SystemExit(f"reader: frame size mismatch at item {got}")
            got += 1
            since_release += 1
            if since_release == RELEASE_EVERY or got == case.items:
                reader.release(record.end)
                since_release = 0
            continue
        frame = parse_frame(record.body)
        count = frame.items.shape[0]
        if case.mode == "batch+copy":
            np.copyto(sink[: frame.tokens.shape[0]], frame.tokens)
        got += count
        reader.release(record.end)


def _read_queue(case: Case, queue) -> None:
    got = 0
    while got < case.items:
        message = queue.get(timeout=10.0)
        got += len(message) if case.mode == "batch" else 1


def run_case(case: Case, capacity_bytes: int) -> float:
    """Run one case; return items per second."""
    ctx = mp.get_context("fork")
    name = f"/sbrk-bench-{uuid.uuid4().hex[:8]}"
    reader = RingReader.create(name, capacity_bytes) if case.transport == "ring" else None
    queue = ctx.Queue() if case.transport == "queue" else None
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_writer, args=(case, name, queue, send))
    try:
        proc.start()
        started = recv.recv()
        if reader is not None:
            _read_ring(case, reader)
        else:
            _read_queue(case, queue)
        elapsed = time.monotonic() - started
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
        if reader is not None:
            reader.close()
            reader.unlink()
    return case.items / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small counts: a smoke run, not a measurement")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the best is reported")
    parser.add_argument("--capacity-mib", type=int, default=64)
    args = parser.parse_args(argv)
    scale = 0.05 if args.quick else 1.0
    repeat = 1 if args.quick else args.repeat
    # Item counts sized so each ring case runs for roughly a second on a 2-core machine.
    counts = {1: 8_000_000, 256: 6_000_000, 2048: 1_000_000}
    single_counts = {1: 1_000_000, 256: 1_000_000, 2048: 300_000}
    queue_counts = {1: 1_000_000, 256: 600_000, 2048: 150_000}
    queue_single_counts = {1: 200_000, 256: 150_000, 2048: 60_000}
    print(f"machine: {os.cpu_count()} cpus, python {sys.version.split()[0]}, numpy {np.__version__}")
    print(f"ring capacity {args.capacity_mib} MiB, batch {BATCH_ITEMS} items, best of {repeat}")
    header = f"{'tokens':>6}  {'transport':<24} {'items/s':>14} {'GB/s':>8}"
    print(header)
    print("-" * len(header))
    results: dict[tuple[int, str], float] = {}
    for tokens in (1, 256, 2048):
        cases = [
            ("ring, batch", Case("ring", "batch", tokens, counts[tokens])),
            ("ring, batch + reader copy", Case("ring", "batch+copy", tokens, counts[tokens])),
            ("ring, single", Case("ring", "single", tokens, single_counts[tokens])),
            ("mp.Queue, batched", Case("queue", "batch", tokens, queue_counts[tokens])),
            ("mp.Queue, single", Case("queue", "single", tokens, queue_single_counts[tokens])),
        ]
        for label, case in cases:
            case.items = max(BATCH_ITEMS, int(case.items * scale))
            rate = max(run_case(case, args.capacity_mib << 20) for _ in range(repeat))
            results[(tokens, label)] = rate
            gbps = rate * tokens * 4 / 1e9
            print(f"{tokens:>6}  {label:<24} {rate:>14,.0f} {gbps:>8.2f}", flush=True)
    print()
    for tokens in (1, 256, 2048):
        ratio = results[(tokens, "ring, batch")] / results[(tokens, "mp.Queue, batched")]
        single_ratio = results[(tokens, "ring, single")] / results[(tokens, "mp.Queue, single")]
        print(f"{tokens:>6} tokens: ring batch / Queue batched = {ratio:.1f}x, "
              f"ring single / Queue single = {single_ratio:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
