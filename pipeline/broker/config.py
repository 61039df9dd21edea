"""The broker's settings (`BrokerConfig`) and the limits they are checked against, with
the reason for each limit on the line above it. Checked on construction, so a broker never
starts with a setting it cannot honour; `check_contract` checks a consumer's contract (at
registration, and in a launcher before it starts anything)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from pipeline.broker.lanes import LaneConfig
from pipeline.broker.packing import Contract
from pipeline.broker.pool import MAX_POOL_ITEMS
from pipeline.broker.selection import SHAPE_ORDER_PREFIX, SHAPE_ORDERS

DISPATCH_STICKY = "sticky"
DISPATCH_NO_LANES = "no-lanes"
# `--dispatch`: the product's sticky policy, and the evaluation's baselines.
DISPATCH_POLICIES = (DISPATCH_STICKY, "fifo", "round-robin", DISPATCH_NO_LANES)
from pipeline.wire.errors import ConfigError, ContractError
from pipeline.wire.layouts.descriptors import descriptor_size_bytes
from pipeline.wire.layouts.names import DEFAULT_MAX_MODELS, MODEL_ID_LIMIT
from shm.ring_layout import max_body_bytes

RUN_DIR = "run"
SOCKET_NAME = "broker.sock"
# SPEC §6: the loop yields at least every 100 ms of fill (or dispatch) work. 10 ms, because
# dispatch waits for the fill, and credit a completion returns waits for the next dispatch:
# with 100 ms, quick consumers sat idle while the broker ingested alone (one process of five
# runnable for most of a run's first second, tools/profile_pipeline.py). The flood of
# `pipeline bench e2e`, alternating: 179 k against 142-170 k items/s at 64-item batches, 246-258 k
# against 241-247 k at 256. One frame (about 10 ms at 4,096 items) is the unit of work anyway.
# NOTE: it costs some fill on shallow streams with quick consumers (the demo's mean batch
# fill 0.21 against 0.25, the Mooncake trace's 0.22 against 0.24; shape switches unchanged).
# Together with letting partial batches through whenever another shape waits, it took the
# demo to 86-96 shape switches instead of 16: that rule was rejected (Dispatcher.next_batch).
WORK_SLICE_S = 0.01
# Lane maintenance and heartbeat checks run this often; the lane policy's idle time (5 s)
# and a heartbeat timeout of seconds both want far finer steps than that.
TICK_INTERVAL_S = 0.1
# A consumer silent this long is dead: its pending entries go back to dispatch. Consumers
# heartbeat at a quarter of it, so three lost heartbeats in a row are tolerated.
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
# Below 1 s, a busy machine's scheduling delays (a consumer heartbeats every quarter of the
# timeout) would get healthy consumers declared dead; and STALL_GAP_S must stay well below it.
MIN_HEARTBEAT_TIMEOUT_S = 1.0
# Above a day, a dead consumer's batches would wait a day to come back; and consumers sleep a
# quarter of it between heartbeats (1e308 s overflowed their thread's wait).
MAX_HEARTBEAT_TIMEOUT_S = 86_400.0
# A turn takes at most two work slices, a select wait and a tick (about 70 ms; a status
# reply at 100,000 lanes adds a few ms). A gap between two of the loop's looks at the clock
# at least this long (or half the heartbeat timeout, if less) means the broker itself did not
# run: SIGSTOP, a VM pause, a starved or swapping host. It then reads what its peers sent
# before judging them: a paused broker must not wake up and evict every healthy consumer (a
# select interrupted by the pause returns nothing, PEP 475, though heartbeats wait).
STALL_GAP_S = 0.5
# Registered consumers at once: each costs a 1 MiB descriptor ring in /dev/shm and a
# connection. 128 is twice the largest node's GPUs split into MIG slices (8 x 7).
MAX_CONSUMERS = 128
# Registered producers at once (rings adopted at a restart included): each maps its ring
# (64 MiB by default) into the broker and holds a connection. With 128 consumers and
# MAX_UNREGISTERED_PEERS, the store's open segment files take what the descriptor limit
# leaves (runtime/processes.py's open_files_budget).
MAX_PRODUCERS = 128
# Connections that have not registered: status queries come and go within milliseconds;
# past this many, the one idle longest is closed for each new one.
MAX_UNREGISTERED_PEERS = 64
# A connection that sends no whole message for this long without registering is closed (a
# status client asks within milliseconds of connecting, a consumer or producer registers).
UNREGISTERED_TIMEOUT_S = 10.0
# Partial messages the broker buffers, summed over every connection: requests are at most
# pipeline.wire.protocol.MAX_REQUEST_BYTES (64 KiB) each, and a few MiB covers every registered
# peer sending at once; past it the peer holding the most is refused. Without it, 400
# connections holding 1 MiB partial messages grew the broker from 35 MB to 449 MB.
MAX_BUFFERED_BYTES = 4 << 20
# sockaddr_un.sun_path holds 108 bytes on Linux, the last for the terminating NUL: a longer
# path cannot be bound (or is silently cut on other systems).
MAX_SOCKET_PATH_BYTES = 107
# The longest starvation bound: a week. Longer bounds nothing a batch job would notice, and
# the bound is kept in nanoseconds next to monotonic times.
MAX_AGE_BOUND_S = 7 * 86_400.0
# A contract's numbers end up in u4 fields (descriptor item counts, token lengths).
MAX_CONTRACT_NUMBER = 2**32 - 1
# `sync_interval_s` (durability `process`: a syncfs of the data directory's filesystem this
# often; pipeline/broker/periodic_sync.py): under 10 ms the syncs would be back to back on a
# loaded disk (one took 5-60 ms here), and over an hour bounds nothing the kernel's own
# writeback (30 s by default) does not already.
MIN_SYNC_INTERVAL_S = 0.01
MAX_SYNC_INTERVAL_S = 3600.0
# `min_consumers_wait_s` (pipeline/broker/start_gate.py): the longest dispatch waits for
# `min_consumers` to register. 30 s by default, as Spark's maxRegisteredResourcesWaitingTime:
# long enough for engines loading a model side by side, short enough that a consumer that
# never comes costs a job only that. At most a day, as the heartbeat timeout: a longer wait
# would hold a whole job for a consumer that is not coming.
DEFAULT_MIN_CONSUMERS_WAIT_S = 30.0
MAX_MIN_CONSUMERS_WAIT_S = 86_400.0
# A consumer's descriptor ring: a 64-item descriptor is 2 KiB, so 1 MiB holds hundreds of
# batches, far more than any credit a consumer asks for.
DESCRIPTOR_RING_BYTES = 1 << 20
# `pool_max_items` by default: the default contract's batch (64 items). A shape that fills
# batches of its own needs no pool; one with fewer items would ride one-item batches alone.
DEFAULT_POOL_MAX_ITEMS = 64
# `pool_min_shapes` by default: a model's live shapes before the pool takes any (pool.py says
# why). Below it each shape has its file, switch and batches, about 2 ms a shape here; the
# prefix comparison's workloads hold 28 to 166 shapes, so 256 keeps them as they were. It
# costs 5,000 requests with their own system prompts 256 one-item batches first: 1.21x the
# time of the same requests sharing one (`pipeline bench shapes --repeat 5`) against about
# 1.05x with no bound (and 5.7x without the pool).
DEFAULT_POOL_MIN_SHAPES = 256
# `pool_min_shapes` at most: past a million live shapes the per-shape path's memory (a few
# KiB a shape) is gigabytes; a bound above it would leave the pool off in practice.
MAX_POOL_MIN_SHAPES = 1 << 20
# `max_live_shapes` by default: live shapes (pooled items or lanes of their own) past which
# the broker reads no producer ring until some finish. A live shape costs ~400 bytes pooled
# and a few KiB with lanes, and a job whose requests each have their own system prompt would
# otherwise queue one per request (1,000,000 queued: ~400 MB to GBs); 65,536 hold 25 to
# ~250 MiB and still far more shapes than any consumer's cache, so the order loses nothing.
# The hold is checked before each frame, which adds at most its items (DEFAULT_FRAME_ITEMS).
# Only models some consumer serves count (a model without one would hold every other). A
# shape with lanes of its own stays live QUIESCE_IDLE_S after its last item, so at the bound
# ~13,000 new such shapes a second get in: more than a node's engines answer. At or below
# `pool_min_shapes` the pool never takes a shape.
DEFAULT_MAX_LIVE_SHAPES = 1 << 16
# `max_live_shapes` at most: 16 Mi shapes with lanes are tens of GB of the broker's memory.
MAX_LIVE_SHAPES_LIMIT = 1 << 24


@dataclass(slots=True)
class BrokerConfig:
    """The broker's settings, checked on construction (ConfigError names the value and its
    limit) so that nothing starts with one it cannot honour; `check_contract` checks a
    consumer's contract against them (registration, and a launcher before it starts)."""

    data_dir: str
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    work_slice_s: float = WORK_SLICE_S
    tick_interval_s: float = TICK_INTERVAL_S
    descriptor_ring_bytes: int = DESCRIPTOR_RING_BYTES
    max_models: int = DEFAULT_MAX_MODELS
    max_consumers: int = MAX_CONSUMERS
    max_producers: int = MAX_PRODUCERS
    max_unregistered_peers: int = MAX_UNREGISTERED_PEERS
    unregistered_timeout_s: float = UNREGISTERED_TIMEOUT_S
    max_buffered_bytes: int = MAX_BUFFERED_BYTES
    # The dispatch policy's settings: the lane policy's constants (SPEC §2), and the
    # starvation bound (SPEC §4: the oldest shape's work is served once it waited this
    # long, even while the current shape has tokens; None, the default: no bound).
    lanes: LaneConfig = field(default_factory=LaneConfig)
    max_age_s: float | None = None
    # Which shape a consumer drains next (pipeline/broker/selection.py): prefix (the longest
    # shared chain prefix first, SPEC §4b) or most-tokens (the design note's rule); and shape
    # affinity across consumers (a small shape with a prefix runs on one consumer; off, the model's
    # consumers drain one shape together, as the note has it). The defaults are the product's
    # by the figures (docs/history/BENCHMARKS-history.md, "Scheduling beyond the design
    # note"): prefix with
    # affinity took 98.9 to 99.5% of the prefix-reuse bound on the Mooncake trace and the
    # multi-turn demo-chat where the note's policy took 14 to 87%, in 0.44 to 0.87 of its
    # makespan, and the embedded demo ran the same (padding 98.55%, one switch per shape).
    shape_order: str = SHAPE_ORDER_PREFIX
    affinity: bool = True
    # The dispatch policy itself: sticky (the product's, with the order and affinity above),
    # or a baseline for comparison (pipeline/broker/baselines.py: fifo, round-robin; no-lanes
    # is sticky with one length lane per shape).
    dispatch: str = DISPATCH_STICKY
    # The solitary pool (pipeline/broker/pool.py): a shape whose chain shares nothing with
    # any other live shape's keeps up to this many items in its model's pool, batched with
    # the other such shapes' items (0: off, every shape has lanes of its own). The sticky
    # policy's only: the baselines stand for the queues users have, one per shape.
    pool_max_items: int = DEFAULT_POOL_MAX_ITEMS
    # ...once its model holds at least this many live shapes (0: from the first).
    pool_min_shapes: int = DEFAULT_POOL_MIN_SHAPES
    # Live shapes past which the producers' rings wait (backpressure) until some finish.
    max_live_shapes: int = DEFAULT_MAX_LIVE_SHAPES
    # Durability `process` on disk: syncfs the data directory's filesystem this often, so a
    # power cut loses at most about this much acknowledged work (None, the default: the
    # kernel's writeback, up to about 35 s; pipeline/broker/periodic_sync.py).
    sync_interval_s: float | None = None
    # Dispatch starts once this many consumers have registered, or min_consumers_wait_s after
    # the broker started (pipeline/broker/start_gate.py; 0, the default: at the first one).
    min_consumers: int = 0
    min_consumers_wait_s: float = DEFAULT_MIN_CONSUMERS_WAIT_S

    def dispatch_policy(self):
        """The dispatch policy and the lane settings this config names (for the Dispatcher)."""
        from pipeline.broker.baselines import BASELINES
        from pipeline.broker.selection import ShapeSelector

        policy_class = BASELINES.get(self.dispatch, ShapeSelector)
        policy = policy_class(self.max_age_s, shape_order=self.shape_order, affinity=self.affinity)
        lanes = replace(self.lanes, max_lanes=1) if self.dispatch == DISPATCH_NO_LANES else self.lanes
        return policy, lanes

    @property
    def pool_items(self) -> int:
        """The solitary pool's `max_items` for the Dispatcher: 0 (off) under a baseline."""
        return self.pool_max_items if self.dispatch == DISPATCH_STICKY else 0

    def __post_init__(self) -> None:
        path_bytes = len(os.fsencode(self.socket_path))
        if path_bytes > MAX_SOCKET_PATH_BYTES:
            raise ConfigError(
                f"data directory {self.data_dir}: its broker socket {self.socket_path} is {path_bytes} bytes "
                f"long, and a Unix socket path holds at most {MAX_SOCKET_PATH_BYTES}: give --data-dir a path "
                f"of at most {MAX_SOCKET_PATH_BYTES - path_bytes + len(os.fsencode(self.data_dir))} bytes")
        if not (isinstance(self.heartbeat_timeout_s, (int, float)) and math.isfinite(self.heartbeat_timeout_s)
                and MIN_HEARTBEAT_TIMEOUT_S <= self.heartbeat_timeout_s <= MAX_HEARTBEAT_TIMEOUT_S):
            raise ConfigError(f"heartbeat timeout {self.heartbeat_timeout_s!r} s must be a number from "
                              f"{MIN_HEARTBEAT_TIMEOUT_S} to {MAX_HEARTBEAT_TIMEOUT_S:g} s")
        for name in ("work_slice_s", "tick_interval_s", "unregistered_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"broker setting {name} {value!r} must be a positive number of seconds")
        if self.max_age_s is not None and not (isinstance(self.max_age_s, (int, float)) and not isinstance(
                self.max_age_s, bool) and math.isfinite(self.max_age_s) and 0 < self.max_age_s <= MAX_AGE_BOUND_S):
            raise ConfigError(f"broker setting max_age_s {self.max_age_s!r} must be a number of seconds in "
                              f"(0, {MAX_AGE_BOUND_S:g}], or unset for no starvation bound")
        if self.sync_interval_s is not None and not (
                isinstance(self.sync_interval_s, (int, float)) and not isinstance(self.sync_interval_s, bool)
                and MIN_SYNC_INTERVAL_S <= self.sync_interval_s <= MAX_SYNC_INTERVAL_S):
            raise ConfigError(f"broker setting sync_interval_s {self.sync_interval_s!r} must be a number of seconds "
                              f"from {MIN_SYNC_INTERVAL_S:g} to {MAX_SYNC_INTERVAL_S:g}, or unset for the kernel's "
                              f"writeback")
        if self.shape_order not in SHAPE_ORDERS:
            raise ConfigError(f"broker setting shape_order {self.shape_order!r} must be one of "
                              f"{', '.join(SHAPE_ORDERS)}")
        if self.dispatch not in DISPATCH_POLICIES:
            raise ConfigError(f"broker setting dispatch {self.dispatch!r} must be one of "
                              f"{', '.join(DISPATCH_POLICIES)}")
        if not isinstance(self.affinity, bool):
            raise ConfigError(f"broker setting affinity {self.affinity!r} must be true or false")
        if isinstance(self.pool_max_items, bool) or not isinstance(self.pool_max_items, int) or not (
                0 <= self.pool_max_items <= MAX_POOL_ITEMS):
            raise ConfigError(f"broker setting pool_max_items {self.pool_max_items!r} must be an integer from 0 (no "
                              f"pool) to {MAX_POOL_ITEMS}")
        if isinstance(self.pool_min_shapes, bool) or not isinstance(self.pool_min_shapes, int) or not (
                0 <= self.pool_min_shapes <= MAX_POOL_MIN_SHAPES):
            raise ConfigError(f"broker setting pool_min_shapes {self.pool_min_shapes!r} must be an integer from 0 to "
                              f"{MAX_POOL_MIN_SHAPES}")
        if isinstance(self.max_live_shapes, bool) or not isinstance(self.max_live_shapes, int) or not (
                1 <= self.max_live_shapes <= MAX_LIVE_SHAPES_LIMIT):
            raise ConfigError(f"broker setting max_live_shapes {self.max_live_shapes!r} must be an integer from 1 to "
                              f"{MAX_LIVE_SHAPES_LIMIT}")
        if not isinstance(self.lanes, LaneConfig):
            raise ConfigError(f"broker setting lanes {self.lanes!r} must be a LaneConfig")
        ceilings = {"descriptor_ring_bytes": 1 << 40, "max_models": MODEL_ID_LIMIT, "max_consumers": 1 << 20,
                    "max_producers": 1 << 20, "max_unregistered_peers": 1 << 20, "max_buffered_bytes": 1 << 40}
        for name, ceiling in ceilings.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= ceiling:
                raise ConfigError(f"broker setting {name} {value!r} must be an integer from 1 to {ceiling}")
        # After the ceilings: it is checked against max_consumers.
        if isinstance(self.min_consumers, bool) or not isinstance(self.min_consumers, int) or not (
                0 <= self.min_consumers <= self.max_consumers):
            raise ConfigError(f"broker setting min_consumers {self.min_consumers!r} must be an integer from 0 to "
                              f"max_consumers ({self.max_consumers!r})")
        if isinstance(self.min_consumers_wait_s, bool) or not (
                isinstance(self.min_consumers_wait_s, (int, float))
                and 0 <= self.min_consumers_wait_s <= MAX_MIN_CONSUMERS_WAIT_S):
            raise ConfigError(f"broker setting min_consumers_wait_s {self.min_consumers_wait_s!r} must be a number "
                              f"of seconds from 0 to {MAX_MIN_CONSUMERS_WAIT_S:g}")

    @property
    def run_dir(self) -> str:
        return os.path.join(self.data_dir, RUN_DIR)

    @property
    def socket_path(self) -> str:
        return os.path.join(self.run_dir, SOCKET_NAME)

    @property
    def stall_gap_s(self) -> float:
        """A gap in the loop at least this long is the broker's own stall (STALL_GAP_S)."""
        return min(STALL_GAP_S, self.heartbeat_timeout_s / 2)

    def check_contract(self, model: int, max_batch_items: int, max_batch_tokens: int,
                       max_input_len: int) -> Contract:
        """The contract if this broker can serve it, else ContractError naming the value and
        its limit: every number an integer (model >= 0, the others >= 1, all at most
        MAX_CONTRACT_NUMBER), the model below `max_models`, and a batch of `max_batch_items`
        items fitting one descriptor in the descriptor ring. One function for registration
        and for a launcher that checks before it starts anything."""
        contract = Contract(model, max_batch_items, max_batch_tokens, max_input_len)
        if model >= self.max_models:
            raise ContractError(f"contract: model {model} is unknown (models are 0..{self.max_models - 1}: "
                                f"max_models is {self.max_models})")
        for name in ("max_batch_items", "max_batch_tokens", "max_input_len"):
            value = getattr(contract, name)
            if value > MAX_CONTRACT_NUMBER:
                raise ContractError(f"contract: {name} {value} exceeds {MAX_CONTRACT_NUMBER}")
        largest = descriptor_size_bytes(max_batch_items)
        room = max_body_bytes(self.descriptor_ring_bytes)
        if largest > room:
            raise ContractError(
                f"contract: max_batch_items {max_batch_items} needs {largest}-byte batch descriptors; the "
                f"descriptor ring of {self.descriptor_ring_bytes} bytes takes at most {room} "
                f"(at most {_items_that_fit(room)} items a batch)")
        return contract


def _items_that_fit(room_bytes: int) -> int:
    """The most items whose descriptor fits in `room_bytes` (descriptor sizes grow with items)."""
    low, high = 0, max(1, room_bytes)
    while low < high:  # the largest count whose descriptor fits
        middle = (low + high + 1) // 2
        if descriptor_size_bytes(middle) <= room_bytes:
            low = middle
        else:
            high = middle - 1
    return low

