#!/usr/bin/env python3
"""The abnormal stops a hostile test run found losing work, at its scale (20,000 items), as a user meets them: one table.

    .venv/bin/python tools/abnormal_stops.py [--items 20000] [--only kill-broker ...]

Each scenario runs `pipeline launch --items N --data-dir D` with slow consumers (2 us per
padded token, so the run is mid-way when it is stopped), stops it the way the hostile run
did, then reruns `pipeline launch --items 100 --data-dir D` and checks, by item id, that
every item the first run accepted has a result in one run or the other, and that nothing
of D is left in /dev/shm:

    kill-broker     kill -9 of the broker once about 3,000 items were received
    ctrl-c-twice    two SIGINTs a second apart once about 3,000 were received
    kill-launcher   kill -9 of the launcher itself once about 3,000 were received
    disk-full       D on a 64 MiB tmpfs that a filler leaves 24 MiB of (needs root):
                    the run fills it, waits (DISK FULL), gets two SIGINTs; the filler is
                    removed before the rerun

Figures go to stdout as a table (and as JSON with --json); RELIABILITY.md records them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.broker.peers import namespace_for, object_prefix  # noqa: E402
from pipeline.reporting.accounting import summarize_results  # noqa: E402
from pipeline.wire.layouts.frames import make_item_id  # noqa: E402

SLOW = "consumers = 2\n[engine_options]\ncost_s_per_padded_token = 2e-6\n"
STOP_AT_RECEIVED = 3000
RUN_TIMEOUT_S = 600
SCENARIOS = ("kill-broker", "ctrl-c-twice", "kill-launcher", "disk-full")


def pipeline(*args: str, timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)


def broker_status(data: str) -> dict | None:
    """What `pipeline status --json` prints (the report's keys), None while no broker answers."""
    done = pipeline("status", "--data-dir", data, "--json", timeout_s=30)
    return json.loads(done.stdout) if done.returncode == 0 else None


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


def shm_of(data: str) -> list[str]:
    tag = object_prefix(namespace_for(data))
    return [name for name in os.listdir("/dev/shm") if tag in name]


def result_ids(data: str) -> set[int]:
    return set().union(*(summarize_results(d).item_ids for d in glob.glob(os.path.join(data, "results", "run-*"))))


def first_run(scenario: str, data: str, items: int, work: Path) -> tuple[dict, int, float]:
    """Run and stop the first launch; (its report or {}, its exit status, seconds it ran)."""
    config, report = work / "slow.toml", work / f"{scenario}-first.json"
    config.write_text(SLOW)
    started = time.monotonic()
    launch = subprocess.Popen([sys.executable, "-m", "pipeline", "launch", "--items", str(items), "--config",
                               str(config), "--data-dir", data, "--report", str(report)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        if scenario == "disk-full":
            wait_until(lambda: (s := broker_status(data)) and s["disk_full"], 120, "the disk to fill")
        else:
            wait_until(lambda: (s := broker_status(data)) and s["items_received"] >= STOP_AT_RECEIVED, 120,
                       f"{STOP_AT_RECEIVED} items received")
        if scenario == "kill-broker":
            with open(os.path.join(data, "run", "broker.lock")) as lock:
                os.kill(int(lock.read()), signal.SIGKILL)
        elif scenario == "kill-launcher":
            launch.kill()
        else:
            launch.send_signal(signal.SIGINT)
            time.sleep(1.0)
            launch.send_signal(signal.SIGINT)
        launch.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if launch.poll() is None:
            launch.kill()
    if scenario == "kill-launcher":
        time.sleep(5)  # its children stop on their own (PDEATHSIG)
    return (json.loads(report.read_text()) if report.exists() else {}), launch.returncode, time.monotonic() - started


def run_scenario(scenario: str, items: int, work: Path) -> dict:
    base = work / scenario
    base.mkdir()
    mount = None
    if scenario == "disk-full":
        mount = base / "mnt"
        mount.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(mount)], check=True)
        filler = mount / "filler"
        filler.write_bytes(b"\0" * (40 << 20))
        data = str(mount / "data")
    else:
        data = str(base / "data")
    try:
        report, code, first_s = first_run(scenario, data, items, work)
        if mount is not None:
            os.unlink(mount / "filler")
        left_after_first = len(shm_of(data))
        before = result_ids(data)
        rerun_report = work / f"{scenario}-rerun.json"
        rerun = pipeline("launch", "--items", "100", "--data-dir", data, "--report", str(rerun_report))
        again = json.loads(rerun_report.read_text()) if rerun_report.exists() else {}
        accepted = {make_item_id(int(p), s) for p, n in report.get("items_accepted_by_producer", {}).items()
                    for s in range(n)}
        if not report:  # the killed launcher wrote none: its two producers took the two halves
            accepted = {make_item_id(p, s) for p in (0, 1) for s in range(items // 2)}
        after = result_ids(data)
        return {
            "scenario": scenario, "first_exit": code, "first_s": round(first_s, 1),
            "first_outcome": report.get("outcome", "(no report: the launcher was killed)"),
            "accepted": report.get("items_accepted"), "with_results": report.get("items_with_results", len(before)),
            "in_store": report.get("items_in_store"), "in_rings": report.get("items_in_rings"),
            "not_submitted": report.get("items_not_submitted"), "lost": report.get("lost"),
            "verdict_ok": report.get("accounting_ok"), "shm_objects_kept": left_after_first,
            "rerun_exit": rerun.returncode, "rerun_lost": again.get("lost"), "rerun_ok": again.get("accounting_ok"),
            "taken_over": again.get("items_taken_over"),
            "first_run_items_without_a_result": len(accepted - after),
            "shm_objects_left": len(shm_of(data)),
        }
    finally:
        if mount is not None:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=20000)
    parser.add_argument("--only", nargs="*", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sbrk-abnormal-"))
    rows = []
    try:
        for scenario in args.only:
            if scenario == "disk-full" and os.geteuid() != 0:
                print("disk-full: skipped (mounting a tmpfs needs root)", file=sys.stderr)
                continue
            rows.append(run_scenario(scenario, args.items, work))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = list(rows[0]) if rows else []
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    bad = [r for r in rows if r["lost"] or r["rerun_lost"] or r["first_run_items_without_a_result"]
           or r["shm_objects_left"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
