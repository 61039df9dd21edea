"""The demo's target: `python3 quickstart.py demo` on a fresh clone, timed.

    .venv/bin/python tools/bench_demo.py [--runs 2]

Clones this repository's HEAD into a temporary directory (with ../shared beside it, as CI
has it), then times `python3 quickstart.py demo --report R` there: the first run creates the
virtual environment and installs the package (from the package index or its local mirror),
the later ones reuse it. Prints, per run, the whole command's wall time and the launcher's
own `wall_s` (start of the broker to the last completion), and the report's accounting.
Target: under 60 s for the first run, start-up included.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The demo's target.
TARGET_S = 60.0


def clone(into: Path) -> Path:
    checkout = into / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(checkout)], check=True)
    shared = ROOT.parent / "shared"
    if shared.exists():
        os.symlink(shared, into / "shared")
    return checkout


def run_demo(checkout: Path, report: Path) -> tuple[float, dict]:
    started = time.monotonic()
    # The README's command exactly: the system's python3, not this script's interpreter.
    done = subprocess.run(["python3", "quickstart.py", "demo", "--report", str(report)], cwd=checkout,
                          capture_output=True, text=True)
    elapsed = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"the demo failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return elapsed, json.loads(report.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs on the same clone (the first installs)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-demo-"))
    try:
        checkout = clone(scratch)
        for run in range(args.runs):
            elapsed, report = run_demo(checkout, scratch / f"report-{run}.json")
            kind = "fresh clone (venv + install + demo)" if run == 0 else "venv reused"
            verdict = "" if run else f"  target < {TARGET_S:.0f} s: {'met' if elapsed < TARGET_S else 'MISSED'}"
            print(f"run {run}: {kind}: {elapsed:.1f} s; launch wall_s {report['wall_s']:.1f} s, "
                  f"{report['items_completed']:,} items, {report['tokens_completed']:,} tokens, "
                  f"lost {report['lost']}, accounting_ok {report['accounting_ok']}{verdict}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
