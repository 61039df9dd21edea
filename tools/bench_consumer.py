#!/usr/bin/env python3
"""A consumer in isolation: CPU per item of `Consumer.run_batch` over real descriptors.

    .venv/bin/python tools/bench_consumer.py                 # 200,000 items, about 10 s
    .venv/bin/python tools/bench_consumer.py --profile 25    # and cProfile's top 25
    .venv/bin/python tools/bench_consumer.py --engine-only   # the sim engine's share alone
    .venv/bin/python tools/bench_consumer.py --batch-items 256   # the redis comparison's batches

The workload is `pipeline bench e2e`'s flood (lab/bench/pipelines.py): 256-token items of
8 shapes (a 128-token prefix per shape, 128 random tokens after it), no payload. They are stored in real segment files
(one per shape, as the broker's disk tier writes them) and handed to one consumer as 64-item
descriptors, a run of batches per shape as sticky draining gives, on the default sim engine
(1 Mi tokens of prefix cache, 16-token blocks, zero cost). The results file is written and
flushed per batch, as in a run. Nothing else runs, so this is the consumer's own cost,
without the CPU-cache pressure of the five processes of an end-to-end run.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.storage.diskio import Durability  # noqa: E402
from pipeline.storage.paths import make_dirs, segment_path  # noqa: E402
from pipeline.storage.segment import SegmentFile, SegmentKeys, encode_entries, scan_segment  # noqa: E402
from pipeline.storage.storelog import StoreLog
from pipeline.consumer.config import ConsumerConfig  # noqa: E402
from pipeline.consumer.engines import EngineBatch  # noqa: E402
from pipeline.consumer.process import Consumer  # noqa: E402
from pipeline.consumer.reader import SegmentReader  # noqa: E402
from pipeline.producer.signature import signature  # noqa: E402
from pipeline.wire.layouts.descriptors import (  # noqa: E402
    DESCRIPTOR_ITEM_DTYPE,
    descriptor_size_bytes,
    parse_descriptor,
    write_descriptor,
)
from pipeline.wire.layouts.frames import ITEM_HEADER_DTYPE  # noqa: E402

TOKENS = 256
PREFIX_TOKENS = 128
SHAPES = 8
BATCH_ITEMS = 64  # the default contract; `pipeline bench redis` runs 256 (--batch-items)
# Batches of one shape in a row: sticky draining takes a shape's lane a few batches at a time.
RUN_BATCHES = 4
MODEL = 0


def _store(data_dir: str, items_per_shape: int) -> list[tuple[int, np.ndarray]]:
    """One segment per shape holding its items; (signature, descriptor item rows) per shape."""
    rng = np.random.default_rng(1)
    shapes = []
    log = StoreLog.open(data_dir, durable=False)
    for shape in range(SHAPES):
        prefix = np.random.default_rng(shape).integers(0, 50_000, size=PREFIX_TOKENS, dtype=np.int32)
        sig = signature([prefix])
        items = np.zeros(items_per_shape, dtype=ITEM_HEADER_DTYPE)
        items["item_id"] = shape * items_per_shape + np.arange(items_per_shape)
        items["seq"], items["signature"], items["model"] = np.arange(items_per_shape), sig, MODEL
        items["length"], items["prefix_len"], items["submit_ns"] = TOKENS, PREFIX_TOKENS, time.monotonic_ns()
        suffixes = rng.integers(0, 50_000, size=(items_per_shape, TOKENS - PREFIX_TOKENS), dtype=np.int32)
        tokens = np.concatenate([np.broadcast_to(prefix, (items_per_shape, PREFIX_TOKENS)), suffixes], axis=1).ravel()
        token_starts = np.arange(items_per_shape + 1, dtype=np.int64) * TOKENS
        path = segment_path(data_dir, MODEL, sig, 0, 0)
        make_dirs(os.path.dirname(path))
        segment = SegmentFile.create(path, SegmentKeys(MODEL, sig, 0, 0), Durability.PROCESS, log, max_bytes=1 << 34)
        segment.append(encode_entries(items, tokens, token_starts, np.zeros(0, np.uint8), np.zeros(items_per_shape + 1, np.int64),
                                      indices=np.arange(items_per_shape), producer_id=1))
        segment.close()
        rows = np.zeros(items_per_shape, dtype=DESCRIPTOR_ITEM_DTYPE)
        rows["offset"], rows["length"], rows["item_id"] = scan_segment(path).offsets, TOKENS, items["item_id"]
        shapes.append((sig, rows))
    return shapes


def _descriptors(shapes: list[tuple[int, np.ndarray]], batch_items: int) -> list[np.ndarray]:
    """Descriptor records, RUN_BATCHES batches of one shape after another, round robin."""
    out, batch_id = [], 0
    per_shape = shapes[0][1].shape[0]
    for first in range(0, per_shape, batch_items * RUN_BATCHES):
        for sig, rows in shapes:
            for start in range(first, min(first + batch_items * RUN_BATCHES, per_shape), batch_items):
                part = rows[start:start + batch_items]
                buf = np.zeros(descriptor_size_bytes(part.shape[0]), dtype=np.uint8)
                write_descriptor(buf, 0, batch_id, sig, MODEL, TOKENS, time.monotonic_ns(), part)
                out.append(buf)
                batch_id += 1
    return out


def _run(consumer: Consumer, records: list[np.ndarray], engine_only: bool) -> float:
    """CPU seconds to run every record through the consumer (or only its engine)."""
    if engine_only:
        batches = []
        for record in records:
            d = parse_descriptor(record)
            got = consumer._reader.read_batch(d.model, d.signature, d.items)
            batches.append(EngineBatch(got.tokens, d.pad_to_tokens, got.prefix_lens))
        started = time.process_time()
        for batch in batches:
            consumer.engine.run(batch)
        return time.process_time() - started
    started = time.process_time()
    for record in records:
        consumer.run_batch(parse_descriptor(record))
    return time.process_time() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--warm-items", type=int, default=100_000,
                        help="items run first, untimed, so the prefix cache is full and evicting")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile the timed run; print top N")
    parser.add_argument("--batch-items", type=int, default=BATCH_ITEMS, help="items a descriptor")
    parser.add_argument("--engine-only", action="store_true", help="time only engine.run (batches read beforehand)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-consumer-")
    try:
        total = args.items + args.warm_items
        batch = args.batch_items
        per_shape = -(-total // (SHAPES * batch)) * batch
        records = _descriptors(_store(root, per_shape), batch)
        warm = args.warm_items // batch
        consumer = Consumer(ConsumerConfig("unused.sock", os.path.join(root, "results"), "c0"))
        consumer._reader = SegmentReader(root)
        _run(consumer, records[:warm], args.engine_only)
        timed = records[warm:warm + args.items // batch]
        profiler = cProfile.Profile() if args.profile else None
        if profiler:
            profiler.enable()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds = _run(consumer, timed, args.engine_only)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        if profiler:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        items = len(timed) * batch
        what = "engine.run" if args.engine_only else "run_batch"
        print(f"{what}: {items} items, {seconds:.2f} s CPU, {1e6 * seconds / items:.2f} us per item,"
              f" {faults / items:.2f} page faults per item"
              f" (cache hit tokens {consumer.engine.counters.cache_hit_tokens},"
              f" evicted blocks {consumer.engine.counters.extra['evicted_blocks']})")
        consumer._results.close()
        consumer._reader.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
