#!/usr/bin/env python3
"""fdatasyncs per group commit of the broker's store at durability `power`, by kind of file,
and the in-process items/s of the same loop, for one or more source trees side by side in one
run (a tree: a checkout of this repository, e.g. `git worktree add --detach /tmp/before REV`).

    .venv/bin/python tools/group_commit_fsyncs.py /tmp/before . --rounds 3

Each round runs every tree once, in turn, in a child process with that tree first on its path:
a Dispatcher over a DiskTier at `power`; each turn ingests a frame of ITEMS items into each of
LANES shapes, flushes (a group commit), dispatches and completes everything dispatchable, and
flushes again. A counting `pipeline.wire.fileops` layer counts the fdatasyncs by file kind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

LANES = 8
ITEMS = 32  # per shape per turn

CHILD = r'''
import collections, json, os, sys, tempfile, time
import numpy as np
try:
    from tests.support.frames import make_frame
except ImportError:  # a tree from before the test frames moved to tests/support/
    from broker_frames import make_frame
from pipeline.broker.dispatch import Dispatcher
from pipeline.broker.ids import ConsumerId
from pipeline.broker.packing import Contract
try:
    from pipeline.storage import DiskTier, Durability
except ImportError:  # a tree from before the store had a folder of its own
    from pipeline.broker.storage import DiskTier, Durability
from pipeline.wire import fileops

turns, lanes, items = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

class Counting(fileops.FileIO):
    def __init__(self):
        self.paths, self.counts = {}, collections.Counter()
    def open(self, path, flags, mode):
        fd = super().open(path, flags, mode)
        self.paths[fd] = os.path.basename(path)
        return fd
    def fdatasync(self, fd):
        name = self.paths.get(fd, "?")
        self.counts["store log" if name.startswith("store.log") else "segment journal" if name.endswith(".journal")
                    else "segment" if ".seg" in name else name.split(".")[0]] += 1
        super().fdatasync(fd)

layer = Counting()
fileops.install(layer)
tier = DiskTier.open(tempfile.mkdtemp(dir=sys.argv[4]), Durability.POWER)
dispatcher = Dispatcher(tier)
contract = Contract(model=0, max_batch_items=64, max_batch_tokens=1 << 20, max_input_len=8192)
flushes = completed = 0
started = time.perf_counter()
for turn in range(turns):
    for k in range(lanes):
        dispatcher.ingest(make_frame(k + 1, turn * items, [(0, 0xA0 + k)] * items, [200] * items), float(turn))
    tier.flush()
    while (batch := dispatcher.next_batch(ConsumerId(1), contract, float(turn))) is not None:
        dispatcher.commit(batch)
        dispatcher.complete_batch(ConsumerId(1), batch)
        completed += len(batch.entries)
    tier.flush()
    flushes += 2
elapsed = time.perf_counter() - started
tier.close()
print(json.dumps({"items_per_s": completed / elapsed, "flushes": flushes, "fdatasyncs": dict(layer.counts)}))
'''


def run_tree(tree: str, turns: int, work: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.path.join(tree, "tests", "broker")]))
    out = subprocess.run([sys.executable, "-c", CHILD, str(turns), str(LANES), str(ITEMS), work], env=env, cwd=tree,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--work", default="/tmp")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            runs[tree].append(run_tree(os.path.abspath(tree), args.turns, args.work))
    print(f"{LANES} shapes x {ITEMS} items a turn, {args.turns} turns (two group commits a turn), "
          f"{args.rounds} rounds; median items/s")
    for tree, results in runs.items():
        first = results[0]
        per_commit = {kind: round(n / first["flushes"], 2) for kind, n in sorted(first["fdatasyncs"].items())}
        total = round(sum(first["fdatasyncs"].values()) / first["flushes"], 2)
        rate = statistics.median(r["items_per_s"] for r in results)
        print(f"{tree}: {total} fdatasyncs per group commit {per_commit}; {rate:,.0f} items/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
