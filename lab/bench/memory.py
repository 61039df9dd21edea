"""`pipeline bench memory`: the broker's resident memory as the backlog grows from 10,000 to
10,000,000 queued items, no consumer draining it.

One broker per side and run, fed by one producer in this process (`submit_many`, calls of
SUBMIT_CALL_ITEMS small items: SHAPES shapes, lengths from ITEM_LENGTHS, so several shapes
and length lanes fill); after each step of the backlog, once the producer's ring is drained
(everything stored), the broker's memory is read from /proc/PID/status:

    RssAnon    its heap and other private memory: what it keeps per item, if anything
    RssFile    mapped files: libraries, and the segment pages its mapping holds
    RssShmem   shared memory: the producer's ring (a fixed buffer of the producer's, resident
               in the broker once that much has passed through it) and descriptor rings

The target judges the broker's own memory, RssAnon + RssFile (the ring is the producer's
transport, the same size at any backlog once it has wrapped); total RSS is reported beside it.
The disk tier's items are on disk (page cache, not mapped by the broker); the memory tier's
are in tmpfs, RAM outside the broker's RSS that grows with the backlog (its `store` column).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from lab.bench.harness import BenchContext, Outcome, Target, alternate, fmt_spread, spread, table

# The target: RSS at the deepest backlog within this factor of RSS at the shallowest.
TARGET_RATIO = 1.5
FULL_STEPS = (10_000, 100_000, 1_000_000, 10_000_000)
QUICK_STEPS = (1_000, 10_000, 100_000)
SHAPES = 4
ITEM_LENGTHS = (16, 24, 32, 48)  # tokens: small items, so 10,000,000 fit in about 2 GB
PREFIX_TOKENS = 16
SUBMIT_CALL_ITEMS = 4096
# Every queued item must be stored within this long of its submission (a broker at
# 100,000 items/s stores a 10,000,000-item step in under two minutes).
STORE_TIMEOUT_S = 900.0
# Pause after a step is stored before reading: the broker's loop finishes its turn (flush,
# status) so what is read is the settled backlog, not a frame in flight.
SETTLE_S = 0.5
TIERS = ("disk", "memory")
MIB = 1 << 20


def proc_memory_bytes(pid: int) -> dict[str, int]:
    """The process's RSS and its anonymous, file-backed and shared-memory parts, in bytes
    (/proc/PID/status, Linux)."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in fields:
                out[fields[key]] = int(value.split()[0]) * 1024
    return out


def tree_bytes(path: str) -> int:
    """Bytes the files under `path` occupy (allocated blocks)."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


class _Items:
    """SUBMIT_CALL_ITEMS items, made once and submitted again and again."""

    def __init__(self) -> None:
        from pipeline.producer.signature import signature

        rng = np.random.default_rng(16)
        prefixes = [np.random.default_rng(k).integers(0, 50_000, PREFIX_TOKENS, dtype=np.int32) for k in range(SHAPES)]
        self.signatures = np.array([signature([p]) for p in prefixes], dtype=np.uint64)
        self.shapes = rng.integers(0, SHAPES, size=SUBMIT_CALL_ITEMS)
        self.lengths = rng.choice(np.array(ITEM_LENGTHS), size=SUBMIT_CALL_ITEMS)
        self.tokens = np.concatenate([
            np.concatenate([prefixes[s], rng.integers(0, 50_000, n - PREFIX_TOKENS, dtype=np.int32)])
            for s, n in zip(self.shapes.tolist(), self.lengths.tolist())])

    def submit(self, producer, count: int) -> None:
        while count > 0:
            n = min(count, SUBMIT_CALL_ITEMS)
            producer.submit_many(0, self.signatures[self.shapes[:n]], self.tokens[:int(self.lengths[:n].sum())],
                                 self.lengths[:n], PREFIX_TOKENS)
            count -= n


def _one_run(ctx: BenchContext, tier: str, steps: tuple[int, ...], items: _Items, run: int) -> dict[str, Any]:
    """One broker on `tier`, the backlog grown through `steps`; its memory at each."""
    from pipeline.broker.config import BrokerConfig
    from pipeline.producer.client import BrokerProducer
    from pipeline.runtime.local import start_broker, stop_process
    from pipeline.runtime.processes import memory_tier_dir
    from pipeline.wire.client import broker_status

    root = ctx.work_dir / f"memory-{tier}-{run}"
    config = BrokerConfig(str(root / "data"))
    broker = start_broker(config, storage=tier)
    # After the start: the broker names the data directory's namespace, which the memory tier's is named by.
    store_dir = config.data_dir if tier == "disk" else memory_tier_dir(config.data_dir)
    points: list[dict[str, Any]] = []
    try:
        idle = proc_memory_bytes(broker.pid)
        producer = BrokerProducer(config.socket_path, timeout_s=STORE_TIMEOUT_S)
        queued, start_s = 0, time.monotonic()
        for step in steps:
            items.submit(producer, step - queued)
            queued = step
            producer.wait_stored(STORE_TIMEOUT_S)
            time.sleep(SETTLE_S)
            received = broker_status(config.socket_path).items_received
            if received != step:
                raise RuntimeError(f"the {tier} broker holds {received} items, expected {step}")
            memory = proc_memory_bytes(broker.pid)
            points.append({"backlog": step, **memory, "own": memory["anon"] + memory["file"],
                           "store_bytes": tree_bytes(store_dir), "elapsed_s": round(time.monotonic() - start_s, 1)})
            ctx.log(f"  {tier} run {run + 1}: {step:,} queued: RSS {memory['rss'] / MIB:.0f} MiB "
                    f"(anon {memory['anon'] / MIB:.0f}, file {memory['file'] / MIB:.0f}, "
                    f"shmem {memory['shmem'] / MIB:.0f}), store {points[-1]['store_bytes'] / MIB:.0f} MiB")
        producer.close(timeout_s=STORE_TIMEOUT_S)
    finally:
        stop_process(broker)
        shutil.rmtree(root, ignore_errors=True)
    return {"idle": idle, "points": points}


def _medians(runs: list[dict[str, Any]], steps: tuple[int, ...]) -> list[dict[str, Any]]:
    keys = ("rss", "anon", "file", "shmem", "own", "store_bytes")
    return [{"backlog": step, **{key: spread([run["points"][i][key] for run in runs]) for key in keys}}
            for i, step in enumerate(steps)]


def _judge(tier: str, rows: list[dict[str, Any]]) -> Target:
    first, last = rows[0], rows[-1]
    ratio = last["own"]["median"] / first["own"]["median"]
    total = last["rss"]["median"] / first["rss"]["median"]
    return Target(
        f"{tier} tier: broker RSS at {last['backlog']:,} queued items within {TARGET_RATIO} times its RSS at "
        f"{first['backlog']:,}", ratio <= TARGET_RATIO,
        f"anonymous + file-backed {last['own']['median'] / MIB:.1f} MiB against {first['own']['median'] / MIB:.1f} "
        f"MiB: {ratio:.2f}x; total RSS, with the producer's ring, {total:.2f}x")


def _in_mib(bytes_spread: dict[str, Any]) -> dict[str, Any]:
    return spread([value / MIB for value in bytes_spread["values"]])


def _markdown(steps: tuple[int, ...], tables: dict[str, list[dict[str, Any]]], repeat: int) -> str:
    header = ["tier", "queued items", "RSS anon + file (MiB)", "anon (MiB)", "file (MiB)",
              "shmem: producer ring (MiB)", "total RSS (MiB)", "items stored (MiB)"]
    rows = []
    for tier, medians in tables.items():
        for row in medians:
            rows.append([tier, f"{row['backlog']:,}", *(fmt_spread(_in_mib(row[key]), ",.1f")
                                                         for key in ("own", "anon", "file", "shmem", "rss", "store_bytes"))])
    return "\n".join([
        f"One broker per tier with no consumer; one producer grows the backlog through {', '.join(f'{s:,}' for s in steps)} "
        f"queued items ({SHAPES} shapes, {'/'.join(map(str, ITEM_LENGTHS))} tokens, so several length lanes), and after "
        f"each step, once everything is stored, the broker's memory is read from /proc/PID/status. Medians of {repeat} "
        f"run{'' if repeat == 1 else 's'} per tier (min-max beside them). "
        "The target judges the broker's own memory, anonymous + file-backed "
        "(its heap, libraries and mapped segment pages); shmem is the producer's ring, a fixed buffer resident in the "
        "broker once that much has passed through it, whatever the backlog. `items stored` is the tier's store: "
        "segment files on disk (page cache, not mapped by the broker) for the disk tier, tmpfs (RAM, outside the "
        "broker's RSS, growing with the backlog) for the memory tier.", "",
        table(header, rows), "",
        "What keeps it flat (`pipeline/storage/queues.py`): a lane keeps the offsets of its first "
        "`HOT_ENTRIES_MAX` queued entries in memory and the rest as one record per segment, read back from the file "
        "when dispatch reaches them; a segment's pages are mapped when a peek reads them, not when appended "
        "(`segment.py`)."])


def _plot(tables: dict[str, list[dict[str, Any]]]):
    def draw(path: Path) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figure = Figure(figsize=(7.5, 4.5), dpi=110, layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        for tier, rows in tables.items():
            x = [row["backlog"] for row in rows]
            axes.plot(x, [row["own"]["median"] / MIB for row in rows], marker="o", label=f"{tier}: RSS anon + file")
            axes.plot(x, [row["rss"]["median"] / MIB for row in rows], marker=".", linestyle="--",
                      label=f"{tier}: total RSS (with the producer's ring)")
            if tier == "memory":
                axes.plot(x, [row["store_bytes"]["median"] / MIB for row in rows], marker="s", linestyle=":",
                          label="memory: items in tmpfs (RAM outside the broker)")
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("queued items (no consumer)")
        axes.set_ylabel("MiB")
        axes.set_title("Broker memory against the backlog")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small")
        figure.savefig(path)

    return draw


class MemoryComparison:
    name = "memory"
    title = "Broker memory (RSS) against the backlog: 10,000 to 10,000,000 queued items"

    def run(self, ctx: BenchContext) -> Outcome:
        steps = ctx.size(FULL_STEPS, QUICK_STEPS)
        items = _Items()
        counter = {tier: 0 for tier in TIERS}

        def side(tier: str):
            def one() -> dict[str, Any]:
                counter[tier] += 1
                return _one_run(ctx, tier, steps, items, counter[tier] - 1)
            return one

        runs = alternate([(tier, side(tier)) for tier in TIERS], ctx.repeat)
        tables = {tier: _medians(runs[tier], steps) for tier in TIERS}
        figures = {"steps": list(steps), "shapes": SHAPES, "item_lengths": list(ITEM_LENGTHS), "runs": runs,
                   "medians": tables}
        targets = [_judge("disk", tables["disk"])]
        return Outcome(figures, _markdown(steps, tables, ctx.repeat), targets, _plot(tables))


COMPARISON = MemoryComparison()
