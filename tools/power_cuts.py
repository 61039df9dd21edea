"""Power cuts on a real kernel: the loss window of a durability level, in items and
milliseconds (`lab.reliability.powercuts`). Needs root, losetup and mkfs.ext4.

    sudo .venv/bin/python tools/power_cuts.py --durability process --seed 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lab.reliability.powercuts import PowerCutCampaign, available  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--durability", choices=("process", "power"), default="process")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--feeds", type=int, default=12)
    parser.add_argument("--items-per-feed", type=int, default=6000)
    parser.add_argument("--feed-gap-s", type=float, default=4.0)
    parser.add_argument("--cut-gap-s", type=float, nargs=2, default=(2.0, 6.0))
    parser.add_argument("--max-cuts", type=int, default=16)
    parser.add_argument("--sync-interval-s", type=float, help="the live broker's sync_interval_s (process)")
    parser.add_argument("--work", help="work directory (default: a temporary one under /work or /tmp)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    why = available()
    if why is not None:
        print(f"error: this campaign {why}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the campaign's finally blocks unmount and detach.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    work = args.work or tempfile.mkdtemp(prefix="powercuts-", dir="/work" if os.path.isdir("/work") else None)
    campaign = PowerCutCampaign(work, durability=args.durability, seed=args.seed, feeds=args.feeds,
                                items_per_feed=args.items_per_feed, feed_gap_s=args.feed_gap_s,
                                cut_gap_s=tuple(args.cut_gap_s), max_cuts=args.max_cuts,
                                sync_interval_s=args.sync_interval_s)
    report = campaign.run()
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    for cut in report.cuts:
        print(f"cut {cut.index}: acknowledged {cut.acknowledged:,}, lost {cut.lost:,}, window "
              f"{'-' if cut.window_ms is None else f'{cut.window_ms:,.0f} ms'} (newest lost "
              f"{'-' if cut.newest_lost_ms is None else f'{cut.newest_lost_ms:,.0f} ms'} before the cut), "
              f"held {cut.recovered_items:,}, lines after {cut.delivered_after:,}")
    print(json.dumps(report.figures()))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report.to_json(), file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
