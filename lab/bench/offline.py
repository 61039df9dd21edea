"""Offline padding policies: a queue of lengths packed into batches without processes, the
lane benchmark's policies (tools/bench_lanes.py) and `pipeline bench padding`'s offline side.

A stream of items keeps `depth` items queued: prefill `depth`, then repeatedly dispatch one
batch and refill as many items as it took, until the stream is spent; every batch of that
loop is counted. Padding efficiency = real tokens / padded tokens; fill = items per batch /
the contract's items. Lane policies use the real ShapeLanes and, for "queue longest/8", the
broker's real packing function (pipeline.broker.packing.pack, pad-to = the lane's longest
queued item, rounded up to 8); virtual time advances 1 / ARRIVAL_RATE_ITEMS_PER_S per
arriving item and the maintenance tick runs every TICK_EVERY_S of it; a dispatched batch
completes at once. The offline optimum sorts the whole stream longest first and packs it in
order.

Pure code: no I/O, clock or processes. Each policy object is owned by one simulation (not
thread-safe).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np

from pipeline.broker.ids import LaneId
from pipeline.broker.lanes import ShapeLanes, WasteMeasure
from pipeline.broker.packing import Contract, batch_items_limit, pack

# The consumer contract the padding figures are measured under (the launch default).
MAX_BATCH_ITEMS = 64
MAX_BATCH_TOKENS = 65_536
# Packing never filters by input length (SPEC §3); any valid value gives the same batches.
MAX_INPUT_LEN = 262_144
CONTRACT = Contract(0, MAX_BATCH_ITEMS, MAX_BATCH_TOKENS, MAX_INPUT_LEN)
# Virtual arrival rate: about the design note's 17,800 lane reuses per second. It only sets
# how much stream passes per virtual second, i.e. what "idle 5 s" means to the tick.
ARRIVAL_RATE_ITEMS_PER_S = 20_000
# How often the simulated broker runs the maintenance tick, in virtual seconds.
TICK_EVERY_S = 0.1


@dataclass(slots=True)
class Batch:
    items: int
    real_tokens: int
    padded_tokens: int


def pack_own_longest(queue: deque[int], contract: Contract = CONTRACT) -> Batch:
    """Baselines: take items from the front in order while the batch, padded to its own
    longest item (unrounded), fits the contract; at least one item."""
    count = longest = real = 0
    while queue and count < contract.max_batch_items:
        longer = max(longest, queue[0])
        if count and (count + 1) * longer > contract.max_batch_tokens:
            break
        length = queue.popleft()
        count, longest, real = count + 1, longer, real + length
    return Batch(count, real, count * longest)


def pack_contract(queue: deque[int], longest: int, contract: Contract = CONTRACT) -> Batch:
    """The broker's packing (pipeline.broker.packing.pack, SPEC §3): pad-to = `longest`, the
    queue's longest item, rounded up to 8; the front items in order; at least one. Takes the
    batch off the front of `queue`; the overflow stays there in its order."""
    front = list(islice(queue, batch_items_limit(longest, contract)))
    packing = pack(front, longest, contract)
    for _ in range(packing.count):
        queue.popleft()
    return Batch(packing.count, packing.real_tokens, packing.padded_tokens)


class BucketPolicy:
    """Fixed buckets by a key of the length; the bucket with the most queued tokens is served
    first (as lanes are); each batch is padded to its own longest item."""

    def __init__(self, key: Callable[[np.ndarray], np.ndarray]) -> None:
        self.key = key
        self.queues: dict[int, deque[int]] = {}
        self.tokens: dict[int, int] = {}

    def add(self, values: np.ndarray, now_s: float) -> None:
        for bucket, length in zip(self.key(values).tolist(), values.tolist()):
            self.queues.setdefault(bucket, deque()).append(length)
            self.tokens[bucket] = self.tokens.get(bucket, 0) + length

    def take(self, contract: Contract = CONTRACT) -> Batch:
        bucket = max(self.tokens, key=lambda b: (self.tokens[b], -b))
        batch = pack_own_longest(self.queues[bucket], contract)
        self.tokens[bucket] -= batch.real_tokens
        if not self.queues[bucket]:
            del self.queues[bucket], self.tokens[bucket]
        return batch

    def tick(self, now_s: float) -> None:
        pass

    def lanes_used(self) -> str:
        return ""


class LanePolicy:
    """The real ShapeLanes decides the lane; this class plays the storage tier (one deque of
    lengths per lane) and the dispatcher (fullest lane first, packed by the real `pack`, or
    each batch padded to its own longest item with `own_longest`)."""

    def __init__(self, max_lanes: int, measure: WasteMeasure, own_longest: bool = False):
        self.lanes = ShapeLanes(max_lanes=max_lanes, measure=measure)
        self.own_longest = own_longest
        self.queues: dict[int, deque[int]] = {}

    def add(self, values: np.ndarray, now_s: float) -> None:
        for lane, length in zip(self.lanes.assign_many(values, now_s).tolist(), values.tolist()):
            self.queues.setdefault(lane, deque()).append(length)

    def take(self, contract: Contract = CONTRACT) -> Batch:
        lane = self.lanes.fullest_lane()
        assert lane is not None
        queue = self.queues[lane]
        # on_dispatched needs the batch's lengths
        front = list(islice(queue, contract.max_batch_items))
        if self.own_longest:
            batch = pack_own_longest(queue, contract)
        else:
            longest = self.lanes.queued_max(LaneId(lane))
            assert longest is not None
            batch = pack_contract(queue, longest, contract)
        self.lanes.on_dispatched(LaneId(lane), front[: batch.items])
        self.lanes.on_completed(LaneId(lane), batch.items)
        return batch

    def tick(self, now_s: float) -> None:
        for lane in self.lanes.tick(now_s).released:
            assert not self.queues.pop(lane, None)

    def lanes_used(self) -> str:
        c = self.lanes.counters
        return f"{c.max_in_use} lanes max, {c.force_fits} force-fits"


POLICIES: dict[str, Callable[[], BucketPolicy | LanePolicy]] = {
    "FIFO, no buckets (own longest)": lambda: BucketPolicy(np.zeros_like),
    "power-of-two buckets (own longest)": lambda: BucketPolicy(
        lambda v: np.ceil(np.log2(v)).astype(np.int64)),
    "fixed 64-token ranges (own longest)": lambda: BucketPolicy(lambda v: (v - 1) // 64),
    "lanes 128, queued-min (queue longest/8)": lambda: LanePolicy(128, WasteMeasure.QUEUED_MIN),
    "lanes 2048, literal (queue longest/8)": lambda: LanePolicy(2048, WasteMeasure.LITERAL),
    "lanes 2048, queued-min (queue longest/8)": lambda: LanePolicy(2048, WasteMeasure.QUEUED_MIN),
    "lanes 2048, literal (own longest)": lambda: LanePolicy(
        2048, WasteMeasure.LITERAL, own_longest=True),
    "lanes 2048, queued-min (own longest)": lambda: LanePolicy(
        2048, WasteMeasure.QUEUED_MIN, own_longest=True),
}
DEFAULT_POLICY = "lanes 2048, queued-min (queue longest/8)"
# The targets' reference: the optimum packed by the same contract packer as the lanes.
OPTIMUM = "offline optimum, same packer (pad/8)"
# Context only: each batch of the sorted stream padded to its own longest item, unrounded.
OPTIMUM_UNROUNDED = "offline optimum, own longest unrounded"


@dataclass(slots=True)
class SimResult:
    efficiency: float
    fill: float
    note: str


def summarise(batches: list[Batch], note: str, max_items: Sequence[int] | None = None) -> SimResult:
    """Efficiency and mean fill; `max_items[i]` is batch i's contract size (default 64)."""
    real = sum(b.real_tokens for b in batches)
    padded = sum(b.padded_tokens for b in batches)
    if max_items is None:
        fill = sum(b.items for b in batches) / (len(batches) * MAX_BATCH_ITEMS)
    else:
        fill = sum(b.items / cap for b, cap in zip(batches, max_items)) / len(batches)
    return SimResult(real / padded, fill, note)


def simulate(make: Callable[[], BucketPolicy | LanePolicy], stream: np.ndarray, depth: int,
             contract: Contract = CONTRACT) -> SimResult:
    """The policy `make()` on `stream` held at `depth` queued items (the module docstring)."""
    policy = make()
    policy.add(stream[:depth], 0.0)
    arrived, next_tick_s = depth, TICK_EVERY_S
    batches: list[Batch] = []
    while arrived < stream.size:
        batch = policy.take(contract)
        batches.append(batch)
        now_s = arrived / ARRIVAL_RATE_ITEMS_PER_S
        policy.add(stream[arrived : arrived + batch.items], now_s)
        arrived += batch.items
        if now_s >= next_tick_s:
            policy.tick(now_s)
            next_tick_s = now_s + TICK_EVERY_S
    return summarise(batches, policy.lanes_used(), [contract.max_batch_items] * len(batches))


def check_invariants(result: SimResult) -> None:
    """A result's figures are shares: efficiency in (0, 1], fill in (0, 1]."""
    assert 0 < result.efficiency <= 1 and 0 < result.fill <= 1, result


def offline_optimum(stream: np.ndarray, same_packer: bool, contract: Contract = CONTRACT) -> SimResult:
    """Every item of the stream known in advance, sorted longest first, packed in order: by
    the contract packer (the queue's longest, i.e. the front item, rounded up to 8), or with
    each batch padded to its own longest item, unrounded."""
    queue = deque(sorted(stream.tolist(), reverse=True))
    batches = []
    while queue:
        batches.append(pack_contract(queue, queue[0], contract) if same_packer else pack_own_longest(queue, contract))
    return summarise(batches, "", [contract.max_batch_items] * len(batches))
