#!/usr/bin/env python3
"""A soak of the whole product under faults: workloads fed one after
another through the stage commands for --duration-s while the broker, consumers and
producers are killed, paused and cut off, the broker stops at named crash points and the
disk fills; then `pipeline tools check` on every item, and the figures.

    nice -n 19 .venv/bin/python tools/soak.py [--duration-s 600] [--seed 0] [--json FILE] [--no-tmpfs]

As root the data directory is on a 256 MiB tmpfs mounted for the run (else on the
temporary directory's file system). See lab/reliability/soak.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab.reliability.soak import judged_redeliveries, soak  # noqa: E402
from tools.kill_campaign import HEARTBEAT_TIMEOUT_S, table  # noqa: E402


def _judge(redelivery: list[dict]) -> bool:
    """Print and return the redelivery rule's verdict (`judged_redeliveries`)."""
    latencies, skipped = judged_redeliveries(redelivery)
    met = bool(latencies) and all(latency <= HEARTBEAT_TIMEOUT_S + 1.0 for latency in latencies)
    worst = f"{max(latencies) * 1e3:,.0f} ms" if latencies else "-"
    print(f"redelivery judged on {len(latencies)} of {len(redelivery)} consumer losses (max {worst}; not "
          f"measurable: " + ", ".join(f"{n} {why}" for why, n in skipped.items()) + ")")
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="Write the outcome (each fault's figures) to this file.")
    parser.add_argument("--no-tmpfs", action="store_true", help="Never mount a tmpfs, even as root.")
    parser.add_argument("--judge", metavar="FILE", help="Judge the redeliveries of a soak's --json file again; no run.")
    args = parser.parse_args()
    if args.judge:
        with open(args.judge) as file:
            return 0 if _judge(json.load(file)["redelivery"]) else 1
    work = tempfile.mkdtemp(prefix="sbrk-soak-")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = None
    try:
        out, extra = soak(work, args.duration_s, args.seed, use_tmpfs=not args.no_tmpfs)
    finally:
        # A failed soak's data directory (copied off its tmpfs) is the evidence: kept.
        if out is not None and out.passed:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept the data directory of a failed or stopped soak: {work}", file=sys.stderr, flush=True)
    print(table([out]))
    met = _judge(out.redelivery)
    print(f"\nstarted {started}, {platform.node()}, {extra['data_dir_fs']} file system, {extra['workloads']} workloads "
          f"fed, wall {out.wall_s:.0f} s; peak RSS: " + ", ".join(f"{role} {rss / 2**20:.0f} MiB" for role, rss
                                                                in sorted(extra["rss_max_bytes"].items())))
    print(f"redelivery within the heartbeat timeout ({HEARTBEAT_TIMEOUT_S:g} s) plus 1 s: {'met' if met else 'NOT met'}")
    for note in out.notes:
        print(f"note: {note}")
    for point, counts in sorted(out.crash_points.items()):
        print(f"crash point {point}: {counts}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({**out.to_json(), **extra, "started": started}, file, indent=1)
    return 0 if out.passed and met else 1


if __name__ == "__main__":
    sys.exit(main())
