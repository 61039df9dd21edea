"""Power cuts on a real kernel (the loss window at `process`, in items and
milliseconds): a live run on an ext4 filesystem of its own, on a loop device, whose disk
image is copied at seeded random moments. A copy holds exactly what had reached the "disk"
at that moment: what the page cache still held dirty (written, not yet written back by
the kernel, not fsynced) is not in it, which is what a power cut loses. Each copy is then
mounted (ext4 replays its journal, as after a reboot), a broker and consumers run on it to
the end (the product's own recovery), and the checker counts the acknowledged items that
came back neither as a result of before the cut nor as one of after it.

    campaign = PowerCutCampaign(work, durability="process", seed=1)
    report = campaign.run()        # needs root, losetup and mkfs.ext4 (`available()`)

A copy is taken only while the loop device has no request in flight and its write
counters do not move during the copy (/sys/block/loopN/stat); a copy that saw a write is
discarded and taken again a moment later, so every judged image is one instant's disk.

What this measures is the kernel's writeback: at `process` the broker never fsyncs, so a
written byte reaches the disk when the kernel writes it back (vm.dirty_expire_centisecs
after it was dirtied, checked every vm.dirty_writeback_centisecs; ext4's journal commit
every 5 s for metadata). At `power` every acknowledged item was fdatasync'ed first, and the
same campaign must lose none (the method's control).

Owner: one caller per work directory (not thread-safe); the filesystems, loop devices
and processes it makes are gone when `run` returns.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass, field

from pipeline.producer.feed import DEFAULT_CHUNK_ITEMS
from pipeline.producer.workload import Workload, load_workload
from pipeline.audit.checker import ItemKey
from lab.reliability.kills import concatenate, wait_drained
from lab.reliability.procs import COMMAND_TIMEOUT_S, Stages, spawn, write_workload
from pipeline.audit.sources import attempted, deliver_results, hold_leftovers, results_dirs
from lab.reliability.timing import percentiles
from pipeline.reporting.accounting import result_rows
from pipeline.wire.client import broker_progress

# The filesystem image's size: sparse, so only what is written takes host disk. Room for
# the segments of a few dozen open lanes (each file grows to at most the segment limit).
IMAGE_SIZE_BYTES = 16 << 30
# Inodes of the filesystem: the store makes a few files per segment; few inodes keep
# mkfs's inode tables (written whole at mkfs, so no lazy-init writes spoil a copy) small.
IMAGE_INODE_COUNT = 16_384
# The ext4 journal's size: the default for 16 GiB (256 MiB) would be copied with each cut.
JOURNAL_SIZE_MIB = 32
# A copy that saw the device write is taken again after this pause, this often at most.
SNAPSHOT_RETRY_S = 0.02
SNAPSHOT_TRIES_MAX = 500
# Fields of /sys/block/<dev>/stat that move when the device writes or flushes (write I/Os,
# write merges, write sectors; discards; flushes) and the in-flight count (Linux's
# Documentation/block/stat.rst: 0-based indexes).
STAT_WRITE_FIELDS = (4, 5, 6, 11, 12, 13, 15)
STAT_IN_FLIGHT_FIELD = 8
# The live run's feeds must all be received within this long each (a stalled broker or
# producer is a campaign failure, not a wait forever).
FEED_TIMEOUT_S = COMMAND_TIMEOUT_S


class PowerCutError(RuntimeError):
    """The campaign could not run or judge a cut (a stage failed, a feed stalled, a cut's
    verdict had unexpected or corrupt items): the message says which."""


class PowerCutSetupError(PowerCutError):
    """The machine cannot run this campaign (not root, no loop device, mkfs failed) or a
    filesystem could not be unmounted: the message says what."""


def available() -> str | None:
    """Why this machine cannot run the campaign, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (losetup and mount)"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not os.path.exists("/dev/loop-control"):
        return "needs loop devices (/dev/loop-control)"
    return None


def _sh(*args: str) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if done.returncode != 0:
        raise PowerCutSetupError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
    return done.stdout.strip()


class LoopFilesystem:
    """An ext4 filesystem in an image file, on a loop device, mounted at `mountpoint`.
    Owner: the campaign; `close()` unmounts and detaches (the image file stays)."""

    def __init__(self, image: str, mountpoint: str, *, fresh: bool) -> None:
        if fresh:
            with open(image, "wb") as file:
                file.truncate(IMAGE_SIZE_BYTES)
            try:
                _sh("mkfs.ext4", "-q", "-F", "-N", str(IMAGE_INODE_COUNT), "-J", f"size={JOURNAL_SIZE_MIB}",
                    "-E", "lazy_itable_init=0,lazy_journal_init=0", image)
            except PowerCutSetupError:
                os.unlink(image)
                raise
        self.image = image
        self.mountpoint = mountpoint
        os.makedirs(mountpoint, exist_ok=True)
        self.device = _sh("losetup", "-f", "--show", image)
        try:
            _sh("mount", "-t", "ext4", self.device, mountpoint)  # a copy's journal is replayed here
        except PowerCutSetupError:
            _sh("losetup", "-d", self.device)
            raise

    def _write_counters(self) -> tuple[int, ...] | None:
        """The device's write and flush counters, or None while a request is in flight."""
        with open(f"/sys/block/{os.path.basename(self.device)}/stat") as file:
            fields = [int(x) for x in file.read().split()]
        if fields[STAT_IN_FLIGHT_FIELD]:
            return None
        return tuple(fields[i] for i in STAT_WRITE_FIELDS if i < len(fields))

    def snapshot(self, into: str) -> int | None:
        """Copy the image to `into` (sparse) as one instant's disk; the instant
        (time.monotonic_ns() at the copy's start), or None when the device wrote during the
        copy (the copy is removed)."""
        before = self._write_counters()
        if before is None:
            return None
        at_ns = time.monotonic_ns()
        _sh("cp", "--sparse=always", self.image, into)
        if self._write_counters() != before:
            os.unlink(into)
            return None
        return at_ns

    def close(self) -> None:
        """Unmount and detach. A mount still busy (a stage that outlived its stop) is
        detached lazily and PowerCutSetupError names it: the next cut must not be mounted
        over it."""
        done = subprocess.run(["umount", self.mountpoint], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", self.mountpoint], capture_output=True, timeout=COMMAND_TIMEOUT_S)
        subprocess.run(["losetup", "-d", self.device], capture_output=True, timeout=COMMAND_TIMEOUT_S)
        if done.returncode != 0:
            raise PowerCutSetupError(f"umount {self.mountpoint} failed ({done.stderr.strip()[-300:]}): detached "
                                     f"lazily; a process of the run still uses it")


@dataclass(slots=True)
class Cut:
    """One power cut: when, what the broker had acknowledged then, and (once judged) what
    the disk image gave back."""

    index: int
    at_ns: int
    acknowledged: int  # the first N items of the feed order, surely acknowledged before the cut
    lost: int = -1
    window_ms: float | None = None  # the cut's instant minus the oldest lost item's submit time
    newest_lost_ms: float | None = None  # ... minus the newest lost item's
    recovered_items: int = 0
    delivered_after: int = 0  # results lines the run on the image wrote


@dataclass
class PowerCutReport:
    durability: str
    sync_interval_s: float | None
    seed: int
    items: int
    cuts: list[Cut] = field(default_factory=list)
    discarded_snapshots: int = 0
    wall_s: float = 0.0
    kernel: dict[str, int] = field(default_factory=dict)

    def figures(self) -> dict:
        judged = [c for c in self.cuts if c.lost >= 0]
        windows = [c.window_ms for c in judged if c.window_ms is not None]
        lost = [c.lost for c in judged]
        return {"cuts": len(judged), "cuts_losing": sum(1 for n in lost if n), "items_lost": sum(lost),
                "lost_per_cut": percentiles([float(n) for n in lost]) if lost else {},
                "max_lost": max(lost, default=0), "window_ms": percentiles(windows) if windows else {},
                "max_window_ms": max(windows, default=0.0), "discarded_snapshots": self.discarded_snapshots}

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "figures": self.figures()}


def kernel_settings() -> dict[str, int]:
    names = ("dirty_expire_centisecs", "dirty_writeback_centisecs", "dirty_background_ratio", "dirty_ratio")
    found = {}
    for name in names:
        with open(f"/proc/sys/vm/{name}") as file:
            found[name] = int(file.read())
    return found


def acknowledged_prefix(received: int, items_per_feed: int, frame_items: int = DEFAULT_CHUNK_ITEMS) -> int:
    """How many items of the feed order were surely acknowledged when the broker counted
    `received`: the feeds before the current one, and the current one's whole frames
    (`pipeline produce` submits `frame_items` a frame; a frame's record is released, its
    items acknowledged, only once all of it is stored, and the broker counts a frame's
    items as it stores each lane group of it, not in file order). It takes the calls to be
    of `frame_items` each, as `produce` makes them unless its token bound cuts one short;
    the runs in RELIABILITY.md only ever cut at whole feeds. Pure."""
    done, into = divmod(received, items_per_feed)
    return done * items_per_feed + into // frame_items * frame_items


def lost_window(cut_ns: int, lost: list[ItemKey], submit_ns: dict[ItemKey, int]) -> tuple[float | None, float | None]:
    """The cut's window in ms: from the oldest and from the newest lost item's submit time
    to the cut (None, None when nothing was lost). Pure."""
    times = [submit_ns[key] for key in lost if key in submit_ns]
    if not times:
        return None, None
    return (cut_ns - min(times)) / 1e6, (cut_ns - max(times)) / 1e6


class PowerCutCampaign:
    """One live run with `feeds` workloads of `items_per_feed` items, one every `feed_gap_s`
    (each through `pipeline produce`, started once the one before is stored, so the items
    are acknowledged in file order), power cuts every `cut_gap_s` (seeded, uniform), then
    each cut judged on its own image (see the module docstring)."""

    def __init__(self, work: str, *, durability: str, seed: int, feeds: int = 12, items_per_feed: int = 6000,
                 feed_gap_s: float = 4.0, cut_gap_s: tuple[float, float] = (2.0, 6.0), batch_cost_s: float = 0.02,
                 max_cuts: int = 16, sync_interval_s: float | None = None) -> None:
        self.work = work
        self.durability = durability
        self.rng = random.Random(seed)
        self.feeds = feeds
        self.items_per_feed = items_per_feed
        self.feed_gap_s = feed_gap_s
        self.cut_gap_s = cut_gap_s
        self.batch_cost_s = batch_cost_s
        self.max_cuts = max_cuts
        # The live broker's `sync_interval_s` (durability `process`: its bound on the window).
        self.broker_settings = () if sync_interval_s is None else (f"sync_interval_s={sync_interval_s}",)
        self.report = PowerCutReport(durability, sync_interval_s, seed, feeds * items_per_feed,
                                     kernel=kernel_settings())
        self.paths = [write_workload(os.path.join(work, f"w{n}.jsonl"), items_per_feed, seed * 1000 + n,
                                     key=f"p{n}") for n in range(feeds)]

    def run(self) -> PowerCutReport:
        started = time.monotonic()
        live = LoopFilesystem(os.path.join(self.work, "disk.img"), os.path.join(self.work, "live"), fresh=True)
        try:
            stages = Stages(os.path.join(live.mountpoint, "data"), durability=self.durability,
                            batch_cost_s=self.batch_cost_s, broker_settings=self.broker_settings)
            stages.start()
            try:
                self._live(stages, live)
            finally:
                stages.close()
            submit_ns = _submit_times(stages.data_dir)
        finally:
            live.close()
            os.unlink(live.image)
        order = [ItemKey(f"p{n}-{i}".encode()) for n in range(self.feeds) for i in range(self.items_per_feed)]
        workload = load_workload(concatenate(self.paths, os.path.join(self.work, "all.jsonl")))
        try:
            for cut in self.report.cuts:
                self._judge(cut, workload, order, submit_ns)
        finally:
            for cut in self.report.cuts:  # a failed run's copies are not kept (16 GiB sparse each)
                image = os.path.join(self.work, f"cut{cut.index}.img")
                if os.path.exists(image):
                    os.unlink(image)
        self.report.wall_s = time.monotonic() - started
        return self.report

    def _live(self, stages: Stages, disk: LoopFilesystem) -> None:
        """Feed, cut and wait until every item is completed."""
        t0 = time.monotonic()
        next_cut = t0 + self.rng.uniform(*self.cut_gap_s)
        producer, fed, fed_at = None, 0, t0
        while True:
            now = time.monotonic()
            if producer is not None and producer.poll() is not None:
                err = producer.communicate()[1]
                if producer.returncode != 0:
                    raise PowerCutError(f"pipeline produce: exit {producer.returncode}: {err.strip()[-1500:]}")
                producer = None
            received = broker_progress(stages.socket_path).items_received
            if received != fed * self.items_per_feed and now - fed_at > FEED_TIMEOUT_S:
                raise PowerCutError(f"feed {fed}: {received:,} of {fed * self.items_per_feed:,} items received "
                                    f"after {FEED_TIMEOUT_S:g} s")
            if producer is None and fed < self.feeds and now >= t0 + fed * self.feed_gap_s \
                    and received == fed * self.items_per_feed:
                producer = spawn("produce", self.paths[fed], "--data-dir", stages.data_dir)
                fed, fed_at = fed + 1, now
            if now >= next_cut and len(self.report.cuts) < self.max_cuts:
                self._cut(stages, disk)
                next_cut = time.monotonic() + self.rng.uniform(*self.cut_gap_s)
            if producer is None and fed == self.feeds:
                break
            time.sleep(0.01)
        wait_drained(stages)

    def _cut(self, stages: Stages, disk: LoopFilesystem) -> None:
        index = len(self.report.cuts)
        into = os.path.join(self.work, f"cut{index}.img")
        for _ in range(SNAPSHOT_TRIES_MAX):
            received = broker_progress(stages.socket_path).items_received
            at_ns = disk.snapshot(into)
            if at_ns is not None:
                self.report.cuts.append(Cut(index, at_ns, acknowledged_prefix(received, self.items_per_feed)))
                return
            self.report.discarded_snapshots += 1
            time.sleep(SNAPSHOT_RETRY_S)
        raise PowerCutError(f"no quiet instant of {disk.device} in {SNAPSHOT_TRIES_MAX} tries")

    def _judge(self, cut: Cut, workload: Workload, order: list[ItemKey], submit_ns: dict[ItemKey, int]) -> None:
        """Reboot onto the cut's image: mount it, run the product to the end on it, count."""
        image = os.path.join(self.work, f"cut{cut.index}.img")
        disk = LoopFilesystem(image, os.path.join(self.work, "judged"), fresh=False)
        try:
            data_dir = os.path.join(disk.mountpoint, "data")
            before = _result_lines(data_dir)
            stages = Stages(data_dir, durability=self.durability, batch_cost_s=0.0)
            stages.start()
            try:
                wait_drained(stages)
            finally:
                stages.close()
            history = attempted(workload)
            for key in order[:cut.acknowledged]:
                history.acknowledge(key)
            lines = sum(deliver_results(history, path) for path in results_dirs(data_dir))
            cut.recovered_items = hold_leftovers(history, data_dir)
            cut.delivered_after = lines - before
            lost = history.lost_keys()
            verdict = history.verdict()
            if verdict.unexpected or verdict.corrupt:
                raise PowerCutError(f"cut {cut.index}: {verdict.line()}")
            cut.lost = len(lost)
            cut.window_ms, cut.newest_lost_ms = lost_window(cut.at_ns, lost, submit_ns)
        finally:
            disk.close()
            os.unlink(image)


def _result_lines(data_dir: str) -> int:
    return sum(1 for path in results_dirs(data_dir) for name in os.listdir(path) if name.endswith(".jsonl")
               for _ in result_rows(os.path.join(path, name)))


def _submit_times(data_dir: str) -> dict[ItemKey, int]:
    """Each item's submit time (time.monotonic_ns() of its producer) from the live run's
    results, by key (the payload)."""
    found: dict[ItemKey, int] = {}
    for path in results_dirs(data_dir):
        for name in os.listdir(path):
            if name.endswith(".jsonl"):
                for row in result_rows(os.path.join(path, name)):
                    found.setdefault(ItemKey(base64.b64decode(row["payload"])), int(row["submit_ns"]))
    return found
