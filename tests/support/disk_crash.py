"""The crash tests of the disk tier (tests/storage/test_disk_crash.py, the I/O-fault and
power-cut campaigns of tests/storage/test_io_faults.py): a driver and the checks by item.

A forked child drives a Dispatcher over a DiskTier the way the broker loop does: it reads
frames from simulated producer rings, ingests them, flushes, then "releases" them by
appending an `A` line to an append-only log (written before anything of them can be
dispatched), serves two consumers that check every item's tokens, and logs each batch's
completion (`C` line: the consumer's durable result) before telling the dispatcher. The
parent kills it with SIGKILL at a random moment (or it ends itself at a named crash point),
recovers the store, runs `verify`, and checks against the log:

- lost: every accepted item is completed (logged) or live in the store;
- unexpected: every live item is accepted or in a frame the rings still hold, with exactly
  the shape, length and tokens its producer gave it;
- corrupt delivered: the consumers found none (they exit with status 3 on a bad item);
- duplicates: items completed and still live (redelivered later) are bounded by one batch
  (the completion in flight) per crash, and no item is stored twice (verify checks it).

The simulated ring of each producer holds its next RING_DEPTH frames from its released
position; frames are a pure function of (producer, first seq), so a restarted child sees
exactly the records a real ring would present again. After recovery the child first ingests
what every ring holds, flushes and releases it before serving anyone (the catch-up turn of
the loop protocol, pipeline.storage.base).
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest

from pipeline.broker.dispatch import Batch, Dispatcher
from pipeline.broker.ids import ConsumerId
from pipeline.broker.packing import Contract
from pipeline.storage import DiskTier, Durability, crashpoints
from pipeline.storage.inspect import verify
from pipeline.storage.paths import iter_segments
from pipeline.storage.segment import scan_segment
from pipeline.storage.storelog import read_store_log
from pipeline.wire.layouts.frames import make_item_id
from pipeline.wire.layouts.segments import ENTRY_HEADER_SIZE_BYTES, ENTRY_LIVE
from pipeline.wire.shapes import POOL_SIGNATURE
from tests.support.frames import make_frame, token_ids

PRODUCERS = 3
SHAPES = [(0, 0x51), (0, 0x52), (1, 0x53)]
# With the solitary pool on (`pooled`): those and 40 more shapes that share nothing, most
# with a few items live at a time (pooled), some past POOL_ITEMS (lanes of their own).
POOLED_SHAPES = SHAPES + [(k % 2, 0x1000 + k) for k in range(40)]
POOL_ITEMS = 4
# Frames a simulated ring holds beyond its producer's released position; the driver reads
# at most this many frames of one producer per turn, so every stored, unreleased frame is
# among them.
RING_DEPTH = 3
MAX_FRAME_ITEMS = 8
CONTRACT_ITEMS = 16
CONTRACTS = [Contract(m, CONTRACT_ITEMS, 4096, 1024) for m in (0, 1)]
# Small segments: they seal and rotate every few dozen items, and finished ones are deleted.
SEGMENT_BYTES = 16 << 10
CORRUPT_EXIT = 3


def frame_size(producer: int, first: int) -> int:
    return 1 + (first * 2654435761 + producer * 40503) % MAX_FRAME_ITEMS


def item_spec(producer: int, seq: int, pooled: bool = False) -> tuple[tuple[int, int], int]:
    """(shape, length) of a producer's item: a pure function, so anyone can check it."""
    mixed = seq * 2246822519 + producer * 3266489917
    shapes = POOLED_SHAPES if pooled else SHAPES
    return shapes[mixed % len(shapes)], 5 + (mixed >> 7) % 250


def ring_frame(producer: int, first: int, pooled: bool = False):
    count = frame_size(producer, first)
    specs = [item_spec(producer, seq, pooled) for seq in range(first, first + count)]
    return make_frame(producer, first, [s for s, _ in specs], [n for _, n in specs], submit_ns=first)


@dataclass
class Log:
    """What the child's append-only log says: per producer the released position (frames
    are released in order), the accepted items, and every logged completion."""

    released: list[int] = field(default_factory=lambda: [0] * PRODUCERS)
    accepted: set[tuple[int, int]] = field(default_factory=set)
    completed: Counter = field(default_factory=Counter)
    corrupt: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, path: str) -> Log:
        log = cls()
        if not os.path.exists(path):
            return log
        with open(path) as file:
            text = file.read()
        for line in text.split("\n")[:-1]:  # a line cut by the kill has no newline: not written
            kind, *words = line.split()
            if kind == "A":
                producer, first, count = map(int, words)
                assert first == log.released[producer], (line, log.released)
                log.released[producer] = first + count
                log.accepted.update((producer, s) for s in range(first, first + count))
            elif kind == "C":
                log.completed.update(tuple(map(int, w.split(":"))) for w in words)
            else:
                log.corrupt.append(line)
        return log

    def in_rings(self) -> set[tuple[int, int]]:
        """Items of the frames the rings hold: stored ones may be live, not yet accepted."""
        held = set()
        for producer, first in enumerate(self.released):
            for _ in range(RING_DEPTH):
                count = frame_size(producer, first)
                held.update((producer, s) for s in range(first, first + count))
                first += count
        return held


class Driver:
    """The broker loop in miniature, in a child process (see the module docstring)."""

    def __init__(self, data_dir: str, log_path: str, seed: int, durability: Durability, pooled: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.pooled = pooled
        self.tier = DiskTier.open(data_dir, durability, segment_max_bytes=SEGMENT_BYTES)
        self.dispatcher = Dispatcher(self.tier, pool_max_items=POOL_ITEMS if pooled else 0)
        self.dispatcher.recover(0.0)
        self.log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.position = Log.read(log_path).released
        self.in_flight: dict[int, list[Batch]] = {1: [], 2: []}
        self.consumer_ids = {1: 1, 2: 2}
        self.now_s = 0.0

    def write(self, text: str) -> None:
        os.write(self.log_fd, text.encode())  # one write: a kill leaves it whole or cut

    def ingest(self, frames_by_producer: dict[int, int]) -> None:
        """Read frames from the rings, store them, flush, release (log) them."""
        released = []
        for producer, frames in frames_by_producer.items():
            for _ in range(frames):
                first = self.position[producer]
                frame = ring_frame(producer, first, self.pooled)
                self.dispatcher.ingest(frame, self.now_s)
                released.append(f"A {producer} {first} {len(frame.items)}\n")
                self.position[producer] = first + len(frame.items)
        self.dispatcher.flush()
        if released:
            self.write("".join(released))

    def serve(self, slot: int) -> None:
        consumer = ConsumerId(self.consumer_ids[slot])
        batch = self.dispatcher.next_batch(consumer, CONTRACTS[slot % 2], self.now_s)
        if batch is None:
            return
        for entry in batch.entries:
            (shape, length) = item_spec(entry.producer_id, entry.seq, self.pooled)
            tokens = self.tier.read_tokens(entry.ref)
            if ((entry.lane.model, entry.signature) != shape or entry.length != length or entry.item_id != make_item_id(entry.producer_id, entry.seq)
                    or not np.array_equal(tokens, token_ids(entry.item_id, length))):
                self.write(f"X {entry.producer_id}:{entry.seq} at {tuple(entry.ref)}\n")
                os._exit(CORRUPT_EXIT)
        self.dispatcher.commit(batch)
        self.in_flight[slot].append(batch)

    def finish(self, slot: int) -> None:
        batch = self.in_flight[slot].pop(0)
        self.write("C " + " ".join(f"{e.producer_id}:{e.seq}" for e in batch.entries) + "\n")
        self.dispatcher.complete_batch(ConsumerId(self.consumer_ids[slot]), batch)

    def run(self, turns: int) -> None:
        self.ingest({producer: RING_DEPTH for producer in range(PRODUCERS)})  # catch-up turn
        if not turns:
            return self.drain()
        for turn in range(turns):
            self.now_s = turn * 0.01
            if self.rng.random() < 0.7:
                picks = self.rng.integers(0, PRODUCERS, int(self.rng.integers(1, RING_DEPTH + 1)))
                self.ingest(dict(Counter(picks.tolist())))
            for slot in (1, 2):
                if len(self.in_flight[slot]) < 2:
                    self.serve(slot)
            slot = int(self.rng.integers(1, 3))
            if self.in_flight[slot] and self.rng.random() < 0.8:
                self.finish(slot)
            if self.rng.random() < 0.02:  # consumer 2 is lost; it comes back under a new id
                self.dispatcher.consumer_lost(ConsumerId(self.consumer_ids[2]))
                self.in_flight[2] = []
                self.consumer_ids[2] += 10
            if turn % 25 == 24:
                self.dispatcher.tick(self.now_s + 10.0)  # idle lanes quiesce, drained ones go

    def drain(self) -> None:
        """No new work: serve and complete until nothing is queued or in flight."""
        while self.tier.queued_items() or any(self.in_flight.values()):
            for slot in (1, 2):
                self.serve(slot)
                while self.in_flight[slot]:
                    self.finish(slot)
        self.dispatcher.check_invariants()


def run_child(data_dir: str, log_path: str, seed: int, durability: Durability, turns: int,
              crash_point: tuple[str, int] | None = None, pooled: bool = False) -> int:
    """Fork a driver; return its pid. It exits 0 after `turns` turns (0: after draining
    everything), CRASH_EXIT_CODE at the crash point, 1 with a traceback in
    log_path + '.err' on any error."""
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        if crash_point is not None:
            crashpoints.arm(*crash_point)
        Driver(data_dir, log_path, seed, durability, pooled).run(turns)
        status = 0
    except BaseException:
        with open(log_path + ".err", "a") as file:
            file.write(traceback.format_exc())
    finally:
        os._exit(status)


def wait(pid: int, log_path: str) -> int:
    """The child's exit: -SIGKILL, or its exit status; fails on an error inside it."""
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    if os.path.exists(log_path + ".err"):
        with open(log_path + ".err") as file:
            pytest.fail(f"driver failed:\n{file.read()}")
    assert code != CORRUPT_EXIT, "a consumer was handed a corrupt item"
    return code


def check_after_recovery(data_dir: str, log_path: str, crashes: int, pooled: bool = False) -> tuple[Log, set]:
    """Recover the store, verify it, and check it against the log (module docstring)."""
    tier = DiskTier.open(data_dir)
    assert not tier.recovery.quarantined, tier.recovery.summary()
    tier.close()
    result = verify(data_dir)
    assert result.ok, result.problems
    log = Log.read(log_path)
    assert not log.corrupt, log.corrupt
    live = live_items(data_dir, pooled=pooled)
    lost = log.accepted - set(log.completed) - live
    assert not lost, f"accepted items lost: {sorted(lost)[:10]}"
    unexpected = live - log.accepted - log.in_rings()
    assert not unexpected, f"live items nobody accepted: {sorted(unexpected)[:10]}"
    assert set(log.completed) <= log.accepted, "an item was dispatched before its release"
    redelivered = sum(n - 1 for n in log.completed.values()) + len(set(log.completed) & live)
    assert redelivered <= CONTRACT_ITEMS * crashes, (redelivered, crashes)
    return log, live


def live_items(data_dir: str, name_confirmed: bool = False, pooled: bool = False) -> set[tuple[int, int]]:
    """(producer, seq) of every live entry, each checked against what its producer sent (a
    pool segment's entries each of a shape of their own). `name_confirmed`: a segment whose
    identity block is damaged is read under its file name's keys (as recovery does when its
    store log knows the name)."""
    live = set()
    log = read_store_log(data_dir)  # once for every segment
    for seg in iter_segments(data_dir):
        keys = seg.keys if name_confirmed else None
        scan = scan_segment(seg.path, keys, name_confirmed=name_confirmed, records=log.of(seg.keys))
        data = np.fromfile(seg.path, dtype=np.uint8)
        for offset, header in zip(scan.offsets.tolist(), scan.headers):
            if header["state"] != ENTRY_LIVE:
                continue
            producer, seq = int(header["producer_id"]), int(header["seq"])
            shape, length = item_spec(producer, seq, pooled)
            assert (seg.model, int(header["signature"])) == shape and header["length"] == length, (producer, seq)
            assert seg.signature in (shape[1], POOL_SIGNATURE), (seg.path, producer, seq)
            at = offset + ENTRY_HEADER_SIZE_BYTES
            tokens = data[at:at + 4 * length].view(np.int32)
            assert np.array_equal(tokens, token_ids(int(header["item_id"]), length)), (producer, seq)
            assert (producer, seq) not in live
            live.add((producer, seq))
    return live


def drain_and_check(data_dir: str, log_path: str, crashes: int, pooled: bool = False) -> None:
    """A last child runs with no kill until the work is done; then everything accepted was
    completed, the store holds nothing the rings would not present again."""
    pid = run_child(data_dir, log_path, seed=999, durability=Durability.PROCESS, turns=0, pooled=pooled)
    assert wait(pid, log_path) == 0
    log, live = check_after_recovery(data_dir, log_path, crashes, pooled)
    assert log.accepted <= set(log.completed), "accepted items never completed"
    assert not live and log.accepted


def kill_loop(tmp_path, seed: int, kills: int, pooled: bool = False) -> None:
    data_dir, log_path = str(tmp_path / "data"), str(tmp_path / "log")
    rng = np.random.default_rng(seed)
    done = 0
    for cycle in range(kills):
        durability = Durability.POWER if cycle % 3 == 2 else Durability.PROCESS
        pid = run_child(data_dir, log_path, seed * 1000 + cycle, durability, turns=10**6, pooled=pooled)
        time.sleep(float(rng.uniform(0.002, 0.045)))  # a random moment: recovery, ingest, ...
        os.kill(pid, signal.SIGKILL)
        assert wait(pid, log_path) == -signal.SIGKILL, "the child ended before the kill"
        done += 1
        check_after_recovery(data_dir, log_path, crashes=done, pooled=pooled)
    drain_and_check(data_dir, log_path, crashes=done, pooled=pooled)
    assert done == kills
