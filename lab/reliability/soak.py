"""A soak: for `duration_s`, workloads fed one after another through the
stage commands while faults of every kind land at seeded random moments; at the end
`pipeline tools check` judges every item, with the run's figures.

Faults, each drawn with its weight (WEIGHTS): kill -9 of the broker; the broker armed at a
named crash point (PIPELINE_CRASH_POINT; its durability is `power`, so the sync points
exist); SIGKILL of a consumer (started again), SIGSTOP then SIGCONT after twice the
heartbeat timeout, its control socket shut down; kill -9 of a producer process while it
writes; a disk-full episode (a filler file leaves the data directory's file system
DISK_FULL_FREE_BYTES, below the store's 2% floor, for a few seconds, then goes).

I/O faults: the seeded I/O layer (lab/reliability/faults.py) is installed inside one
process and cannot be armed from outside, so the soak injects what the kernel itself
returns: ENOSPC (the disk-full episodes, on a real file system) and the crash points (the
process ending between two writes). EIO and short writes are the fault campaign's
(tests/storage/test_io_faults.py).

Where it runs: as root, on a tmpfs of TMPFS_BYTES mounted for it (a small file system fills
in seconds and is private to the soak); otherwise on the work directory's own file system,
whose filler must then be as large as its free space (said in the figures).

Owner: one caller; everything it starts is stopped (and the tmpfs unmounted) before it returns.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field

import psutil

from pipeline.storage.crashpoints import POINTS
from lab.reliability.kills import (
    NEVER_SUBMITTED,
    NO_BROKER,
    PRODUCER_FAILED,
    Outcome,
    check,
    concatenate,
    consumer_fault,
    crash_at,
    kill_broker,
    redelivery_figures,
    wait_drained,
)
from lab.reliability.procs import Stages, kill, spawn, wait_until, write_workload

# Relative weights of the faults.
WEIGHTS = {"broker kill -9": 4, "broker crash point": 2, "consumer kill": 1, "consumer stop": 1, "consumer socket": 1,
           "producer kill -9": 1, "disk full": 1}
TMPFS_BYTES = 256 << 20
# What a disk-full episode leaves free: under the store's floor (2% of 256 MiB is 5.1 MiB),
# over what the consumers' results lines need meanwhile (they then keep completing).
DISK_FULL_FREE_BYTES = 3 << 20
DISK_FULL_HOLD_S = (2.0, 6.0)
# Gap between faults (uniform), and items of each fed workload; feeds queue at most this deep.
FAULT_GAP_S = (0.3, 1.5)
FEED_ITEMS = 4000
MAX_FEEDS = 2


@dataclass
class Feed:
    process: subprocess.Popen
    path: str
    resubmits: int = 0


@dataclass
class Soak:
    """The soak's state (one instance per run). Owner: `soak`, one thread."""

    work: str
    stages: Stages
    rng: random.Random
    out: Outcome
    deadline_s: float
    feeds: list[Feed] = field(default_factory=list)
    workloads: list[str] = field(default_factory=list)
    losses: list[tuple[str, str, int]] = field(default_factory=list)
    returned: list[int] = field(default_factory=list)
    brokers_changed: list[bool] = field(default_factory=list)  # per loss: another broker (or none) at its end
    _loss_broker: tuple[int, int] | None = None  # the last loss's broker (pid, generation), until its window ends
    rss_max: Counter = field(default_factory=Counter)
    faults_ns: list[int] = field(default_factory=list)

    def feed(self, extra: bool = False) -> None:
        """Keep MAX_FEEDS workloads being submitted (`extra`: one more now, under a broker
        armed at a crash point, so that it ingests): alternately mixed (four shapes, lengths
        8 to 300) and one lane (one shape, one length: the redelivery figures read those)."""
        self.feeds = [f for f in self.feeds if not self._settled(f)]
        while len(self.feeds) < MAX_FEEDS or extra:
            extra = False
            n = len(self.workloads)
            lane = n % 2 == 1
            path = write_workload(os.path.join(self.work, f"w{n}.jsonl"), FEED_ITEMS, n,
                                  key=f"{'s' if lane else 'm'}{n}", shapes=1 if lane else 4, length=48 if lane else None)
            self.workloads.append(path)
            self.feeds.append(Feed(spawn("produce", path, "--data-dir", self.stages.data_dir), path))

    def _settled(self, feed: Feed) -> bool:
        """The feed ended (True), or failed and is submitted again from what it says was never
        submitted (`kills.produce_to_the_end`, without waiting)."""
        if feed.process.poll() is None:
            return False
        err = feed.process.communicate()[1]
        if feed.process.returncode == 0:
            return True
        unsent = NEVER_SUBMITTED.search(err)
        with open(feed.path) as file:
            lines = file.readlines()
        count = int(unsent.group(1).replace(",", "")) if unsent else len(lines) if NO_BROKER in err else None
        if count is None and PRODUCER_FAILED in err:
            return True  # killed once all was submitted: the broker stores what its ring holds
        if count is None:
            raise RuntimeError(f"pipeline produce {feed.path}: exit {feed.process.returncode}: {err.strip()[-1500:]}")
        self.out.resubmits += 1
        feed.resubmits += 1
        feed.path = f"{feed.path}.rest{feed.resubmits}"
        with open(feed.path, "w") as file:
            file.writelines(lines[-count:] if count else [])
        feed.process = spawn("produce", feed.path, "--data-dir", self.stages.data_dir)
        return False

    def sample(self) -> None:
        for role, pid in [("broker", self.stages.broker_pid())] + [
                ("consumer", self.stages.consumer_pid(name)) for name in self.stages.consumers]:
            try:
                self.rss_max[role] = max(self.rss_max[role], psutil.Process(pid).memory_info().rss)
            except (psutil.Error, TypeError, ValueError):
                pass

    def end_loss_window(self) -> None:
        """The last consumer loss's window ends (the next fault, or the run's end): whether
        another broker serves now than at the loss (or none does)."""
        if self._loss_broker is not None:
            status = self.stages.status()
            self.brokers_changed.append(status is None or (status.pid, status.generation) != self._loss_broker)
            self._loss_broker = None

    def fault(self, kind: str) -> None:
        stages, out = self.stages, self.out
        self.end_loss_window()
        self.faults_ns.append(time.monotonic_ns())  # a consumer loss's window ends at the next fault
        if kind == "broker kill -9":  # each counts its own faults (the kill before an armed start too)
            kill_broker(stages, out)
            return
        if kind == "broker crash point":
            crash_at(stages, out, self.rng.choice(POINTS), self.rng, lambda wait=True: self.feed(extra=True))
            return
        if kind.startswith("consumer "):
            name = self.rng.choice(stages.consumers)
            before = wait_until(stages.status, 30, "the broker's status")
            at_ns = consumer_fault(stages, name, kind.split()[1])
            if at_ns is None:
                return  # between connections: nothing to cut
            time.sleep(stages.heartbeat_timeout_s + 1.0)  # its batch redelivered meanwhile
            after = wait_until(stages.status, 30, "the broker's status")
            self.losses.append((name, kind.split()[1], at_ns))
            self.returned.append(after.items_returned - before.items_returned)
            self._loss_broker = (before.pid, before.generation)  # judged at the window's end
        elif kind == "producer kill -9":
            children = [c for f in self.feeds if f.process.poll() is None for c in _children(f.process.pid)]
            if not children:
                return
            kill(self.rng.choice(children))
        else:
            self._disk_full()
        out.faults[kind] = out.faults.get(kind, 0) + 1

    def _disk_full(self) -> None:
        base = os.path.dirname(self.stages.data_dir)
        filler = os.path.join(base, "filler")
        free = os.statvfs(base)
        size = free.f_bavail * free.f_frsize - DISK_FULL_FREE_BYTES
        if size <= 0:
            return
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            pass  # the store grew meanwhile: fuller still
        finally:
            os.close(fd)
        time.sleep(self.rng.uniform(*DISK_FULL_HOLD_S))
        os.unlink(filler)


def _children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def _mount_tmpfs(path: str) -> bool:
    if os.geteuid() != 0:
        return False
    os.makedirs(path, mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", path], check=True)
    return True


def soak(work: str, duration_s: float, seed: int, use_tmpfs: bool = True) -> tuple[Outcome, dict]:
    """Run the soak (see the module docstring); returns its outcome and extra figures."""
    os.makedirs(work, exist_ok=True)
    started = time.monotonic()
    mount = os.path.join(work, "mnt")
    mounted = use_tmpfs and _mount_tmpfs(mount)
    base = mount if mounted else work
    stages = Stages(os.path.join(base, "data"), consumers=("c0", "c1", "c2"), durability="power",
                    max_batch=8, batch_cost_s=0.02)
    run = Soak(work, stages, random.Random(seed), Outcome("soak"), started + duration_s)
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    try:
        stages.start()
        try:
            while time.monotonic() < run.deadline_s:
                run.feed()
                run.sample()
                time.sleep(run.rng.uniform(*FAULT_GAP_S))
                run.fault(run.rng.choices(kinds, weights)[0])
            while run.feeds:
                run.feeds = [f for f in run.feeds if not run._settled(f)]
                time.sleep(0.1)
            wait_drained(stages)
            run.end_loss_window()
            run.sample()
        finally:
            stages.close()
        whole = concatenate(run.workloads, os.path.join(work, "all.jsonl"))
        run.out.verdict = check(stages.data_dir, whole, run.out.bound(stages.in_flight_bound))
        redelivery_figures(run.out, stages, run.losses, run.returned, keys=b"s", faults_ns=run.faults_ns,
                           brokers_changed=run.brokers_changed)
    finally:
        if mounted:
            if not run.out.passed:
                # The evidence of a failed (or stopped) soak outlives the tmpfs it ran on.
                try:
                    shutil.copytree(mount, os.path.join(work, "kept"), symlinks=True, dirs_exist_ok=True)
                except shutil.Error:
                    pass  # sockets and fifos cannot be copied; the files that can are
            subprocess.run(["umount", "-l", mount], check=False)
    run.out.wall_s = time.monotonic() - started
    extra = {"duration_s": duration_s, "data_dir_fs": "tmpfs 256 MiB" if mounted else "the work directory's",
             "workloads": len(run.workloads), "rss_max_bytes": dict(run.rss_max)}
    return run.out, extra



def judged_redeliveries(redelivery: list[dict]) -> tuple[list[float], dict[str, int]]:
    """The redelivery latencies (s) a soak is judged by, and why the others are not: a
    loss is measured only where the results show exactly the items the broker returned
    for it (the one-lane premise: the consumer held only items of the soak's one-lane
    feeds, key `s`; it also held mixed-feed items often, whose redelivery cannot be told
    from a first delivery), and no broker restart fell in its window (those items came
    back through recovery). Pure."""
    latencies: list[float] = []
    skipped = {"premise not held": 0, "broker restarted in the window": 0}
    for r in redelivery:
        if r.get("broker_restarted"):
            skipped["broker restarted in the window"] += 1
        elif r["latency_s"] is None or r["items"] != r["returned_by_broker"]:
            skipped["premise not held"] += 1
        else:
            latencies.append(r["latency_s"])
    return latencies, skipped
