"""The solitary pool (beyond the design note): where a model's shapes that share nothing with
any other live shape keep their items, batched together.

A consumer's cache gains from sticky draining only what shapes share: a shape's prefix, kept
between its batches and for the shapes whose chains extend it (SPEC §4, §4b). A shape whose
chain shares no element with any other live shape's (a request with a system prompt of its
own: one customer's name, one document) has nothing to keep: its prefix is computed once
however it is batched. Drained as shapes, 5,000 such one-item requests cost 5,000 shape
switches, 5,000 segment files and 5,000 one-item batches (5.7x the time of the same requests
sharing one system prompt, `pipeline bench shapes`). The pool batches them together:

    pool = SolitaryPool(max_items=64, min_shapes=256)
    pool.declare(model, chain)               # a producer declared a shape's chain
    pool.route(shape, items)                 # True: these items go to the pool, else to the
                                             # shape's own lanes
    pool.done(shape, items)                  # pooled items completed: True once the shape left
    pool.own_retired(shape)                  # the shape's own lanes retired
    pool.guard(lane_shape, signatures, ...)  # ShapeGuardError unless every chunk may ride

Rule. A shape *pools* (its new items go to the pool) from its first live item, when the pool
is on, its model holds at least `min_shapes` live shapes, the chain it was declared with
(its own signature alone if none was) shares no element with the chain of any other live
shape, and it holds at most `max_items` items (a batch's worth: a larger shape fills
batches of its own). It stops pooling, for the rest
of its life, once it would hold more than `max_items` pooled items (`outgrown`) or once
another shape that shares an element of its chain becomes live (`shared`: that shape is
not solitary either, and goes to lanes of its own); its later items go to its own lanes,
where the selector's prefix order and affinity place it as any shape (SPEC §4b). Items
already pooled stay in the pool until they are done: at most `max_items` a shape, none of
them shared when it was stored. A shape is live while it has pooled items (queued or
pending) or own lanes.

Guard (SPEC §4's, extended): a pool batch's every chunk is of a shape with items in the pool
(so one that shared nothing with a live shape when it started pooling: a shape that shared
a prefix when its items came never rides in one), and the consumer's current shape is the
pool's (the selector's guard), so a consumer draining a shape that shares is never handed a
pool batch: its cache is never flushed by surprise. Any other batch's every chunk is of the
batch's own shape. Each entry names its shape in its header (`pipeline.wire.layouts`).
NOTE: moving a pooled shape's items to its own lanes when it stops pooling was rejected: the
pool's lane queues hold offsets only (their signatures are in the segment files), so finding
them costs a read of every queued header, or a second copy of every pooled ref in memory
(8 bytes an item for the job's whole backlog); at most `max_items` of them, arrived before
the shape that shares, run in pool batches instead.

Why `min_shapes`: the pool cannot know, at a shape's first item, that more will come; a
shape whose items arrive apart (a trace's prompts that share long leading blocks, a
document asked about several times) rides pool batches an item at a time, on whichever
consumer, and pays its prefix for each. With a few hundred shapes the per-shape path costs
little (a file, a switch, a batch each) and keeps such a shape's items together, so the pool
only takes shapes once a model is that crowded.
NOTE: no such bound was rejected: the Mooncake slice of `pipeline bench prefix --quick` (55
shapes, nearly all solitary) got 2.1-4.3% prefix reuse against 6.2% (max_items 1 to 64).
NOTE: sharding the pool by signature (64 shards, each a shape to the selector) was rejected:
6.2% in two runs of three, 4.9% in the third, at 2.2x the batches of a single pool on 5,000
one-item shapes (224 against 102, mean fill 0.35 against 0.77).

Memory: per live shape, its chain and a few counters, and one entry per element of its chain
(about 250 bytes a one-level shape, as the dispatcher's own set of the run's shapes);
declared chains whose shape has no live item yet, at most MAX_DECLARED_CHAINS.

Pure: no I/O, no clock. Owner: the Dispatcher, in the broker's single loop. Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.broker.ids import ConsumerId, ShapeKey
from pipeline.wire.errors import ShapeGuardError
from pipeline.wire.shapes import POOL_SIGNATURE

# `max_items` at most: a contract's batch holds at most 2**32 - 1 items, but a pool member
# is a shape small enough to need no batches of its own; past 65,536 items a shape fills
# batches of any contract a consumer registers in practice (vLLM's max_num_seqs is 256 to
# 1,024). Larger would keep big solitary shapes mixed in pool batches for nothing.
MAX_POOL_ITEMS = 65_536
# Chains declared for shapes with no live item yet, kept for when their items come (a
# producer sends a shape's chain with the frame of its first item, so normally none wait).
# Past it the oldest are dropped: such a shape counts as a chain of its own signature alone.
# 65,536 chains of the deepest kind (MAX_CHAIN_DEPTH levels) are ~40 MiB.
MAX_DECLARED_CHAINS = 65_536

STOPPED_OUTGROWN = "outgrown"
STOPPED_SHARED = "shared"

_Element = tuple[int, int]  # (model, chain element)


def pool_shape(model: int) -> ShapeKey:
    """The model's pool, as the shape the selector, lanes and storage see."""
    return ShapeKey(model, POOL_SIGNATURE)


def is_pool(shape: ShapeKey) -> bool:
    return shape.signature == POOL_SIGNATURE


@dataclass(slots=True)
class _Live:
    chain: tuple[int, ...]
    pooling: bool  # its new items go to the pool
    pooled: int = 0  # its items in the pool, queued or pending
    own: bool = False  # it has lanes of its own


@dataclass(slots=True)
class PoolCounters:
    items: int = 0  # items routed to the pool
    shapes: int = 0  # shapes that started pooling
    stopped: dict[str, int] = field(default_factory=lambda: {STOPPED_OUTGROWN: 0, STOPPED_SHARED: 0})


class SolitaryPool:
    """Which live shapes pool, by the elements of their chains (see the module docstring).
    `max_items` 0: the pool is off (every shape has lanes of its own; chains are still kept,
    for the selector's trie). `min_shapes`: live shapes a model holds before the pool takes
    any (see the module docstring)."""

    def __init__(self, max_items: int = 0, min_shapes: int = 0) -> None:
        assert 0 <= max_items <= MAX_POOL_ITEMS and 0 <= min_shapes, (max_items, min_shapes)  # BrokerConfig checks
        self.max_items = max_items
        self.min_shapes = min_shapes
        self._live: dict[ShapeKey, _Live] = {}
        self._live_in_model: dict[int, int] = {}
        self._declared: dict[ShapeKey, tuple[int, ...]] = {}
        self._holders: dict[_Element, int] = {}  # live shapes whose chain holds the element
        self._pooling_at: dict[_Element, ShapeKey] = {}  # the pooling shape holding it (alone)
        self.counters = PoolCounters()

    @property
    def enabled(self) -> bool:
        return self.max_items > 0

    # ----------------------------------------------------------------- read-only state

    def chain_of(self, shape: ShapeKey) -> tuple[int, ...]:
        """The shape's chain as the pool knows it (its own signature alone if none came)."""
        live = self._live.get(shape)
        if live is not None:
            return live.chain
        return self._declared.get(shape, (shape.signature,))

    def pooling(self, shape: ShapeKey) -> bool:
        live = self._live.get(shape)
        return live is not None and live.pooling

    def pooled(self, shape: ShapeKey) -> int:
        """The shape's items in the pool (queued or pending)."""
        live = self._live.get(shape)
        return 0 if live is None else live.pooled

    def owns_lanes(self, shape: ShapeKey) -> bool:
        live = self._live.get(shape)
        return live is not None and live.own

    def own_shapes(self) -> set[ShapeKey]:
        """Live shapes with lanes of their own (O(live shapes): invariants)."""
        return {shape for shape, live in self._live.items() if live.own}

    def pooled_by_model(self) -> dict[int, int]:
        """Items in each model's pool (O(live shapes): invariants)."""
        totals: dict[int, int] = {}
        for shape, live in self._live.items():
            if live.pooled:
                totals[shape.model] = totals.get(shape.model, 0) + live.pooled
        return totals

    @property
    def live_shapes(self) -> int:
        return len(self._live)

    def live_in(self, models: Iterable[int]) -> int:
        """Live shapes of these models."""
        return sum(self._live_in_model.get(model, 0) for model in models)

    @property
    def pooling_shapes(self) -> int:
        """Live shapes whose new items go to the pool (O(live shapes): for status)."""
        return sum(1 for live in self._live.values() if live.pooling)

    # ----------------------------------------------------------------- events

    def declare(self, model: int, chain: Sequence[int]) -> None:
        """A producer declared a shape's chain of prefix signatures (the last its own)."""
        assert chain, "a chain holds at least the shape's own signature"
        values = tuple(int(s) for s in chain)
        shape = ShapeKey(model, values[-1])
        live = self._live.get(shape)
        if live is not None:
            if len(values) > len(live.chain):  # a shape first seen without its chain (a restart)
                self._release(shape, live)
                live.chain = values
                self._hold(shape, live)
                if live.pooling and any(self._holders[(model, e)] > 1 for e in values):
                    self._stop(shape, live, STOPPED_SHARED)
            return
        self._declared.pop(shape, None)
        self._declared[shape] = values
        if len(self._declared) > MAX_DECLARED_CHAINS:
            del self._declared[next(iter(self._declared))]

    def route(self, shape: ShapeKey, items: int) -> bool:
        """`items` new items of `shape` are to be stored: True if they go to the pool (they
        count as pooled from now), False if to the shape's own lanes (it has own lanes from
        now). Example, max_items 2: A (chain (a,)) routes 1 -> pool; B (chain (b, ab))
        routes 1 -> pool; C (chain (b, bc)) routes 1 -> own lanes, and B stops pooling
        (shared); A routes 2 more -> own lanes (outgrown), its first item stays pooled."""
        return self.route_many([(shape, items)])[0]

    def route_many(self, groups: Sequence[tuple[ShapeKey, int]]) -> list[bool]:
        """`route` for the shapes of one frame (each once), as if its new shapes became live
        first: a new shape whose chain shares an element with another new shape's does not
        pool, nor does a pooling shape take more items in the frame whose new shape shares
        with it (routed one by one, either would pool, to stop a moment later)."""
        fresh: dict[_Element, int] = {}
        for shape, _items in groups:
            if shape not in self._live:
                for element in set(self._declared.get(shape, (shape.signature,))):
                    key = (shape.model, element)
                    fresh[key] = fresh.get(key, 0) + 1
                    other = self._pooling_at.get(key)
                    if other is not None:
                        self._stop(other, self._live[other], STOPPED_SHARED)
        return [self._route(shape, items, fresh) for shape, items in groups]

    def _route(self, shape: ShapeKey, items: int, fresh: dict[_Element, int]) -> bool:
        assert items >= 1 and not is_pool(shape), (shape, items)
        live = self._live.get(shape)
        if live is None:
            chain = self._declared.pop(shape, (shape.signature,))
            alone = not any(self._holders.get((shape.model, e)) or fresh[(shape.model, e)] > 1 for e in chain)
            live = self._make_live(shape, chain, alone and items <= self.max_items)
            if live.pooling:
                self.counters.shapes += 1
        elif live.pooling and live.pooled + items > self.max_items:
            self._stop(shape, live, STOPPED_OUTGROWN)
        if live.pooling:
            live.pooled += items
            self.counters.items += items
            return True
        live.own = True
        return False

    def done(self, shape: ShapeKey, items: int) -> bool:
        """`items` pooled items of `shape` were completed; True when the shape left (no
        pooled item and no own lanes: forget it)."""
        live = self._live[shape]
        assert 0 < items <= live.pooled, (shape, items, live.pooled)
        live.pooled -= items
        return self._retire_if_idle(shape, live)

    def own_retired(self, shape: ShapeKey) -> bool:
        """The shape's own lanes retired (nothing of them queued or pending); True when the
        shape left."""
        live = self._live.get(shape)
        if live is None:
            return True
        live.own = False
        return self._retire_if_idle(shape, live)

    def adopt(self, shape: ShapeKey, pooled: int = 0, own: bool = False) -> None:
        """Recovery: a restarted broker found `pooled` items of the shape in the pool and/or
        own lanes of it. It pools on if it still may (solitary, at most max_items)."""
        assert (pooled > 0 or own) and not is_pool(shape), (shape, pooled, own)
        live = self._live.get(shape)
        if live is None:
            chain = self._declared.pop(shape, (shape.signature,))
            alone = not any(self._holders.get((shape.model, e)) for e in chain)
            live = self._make_live(shape, chain, alone and not own and pooled <= self.max_items)
        elif live.pooling and (own or live.pooled + pooled > self.max_items):
            self._stop(shape, live, STOPPED_OUTGROWN)
        live.pooled += pooled
        live.own = live.own or own

    # ----------------------------------------------------------------- the guard

    def guard(self, lane_shape: ShapeKey, signatures: np.ndarray, what: str, consumer: ConsumerId) -> None:
        """ShapeGuardError (fatal: stop the broker) unless every chunk may ride in a batch of
        `lane_shape`: one of a shape with pooled items in a pool batch, the lane's own shape
        in any other (`signatures`: each entry's, uint64)."""
        model = lane_shape.model
        if is_pool(lane_shape):
            for signature in np.unique(signatures).tolist():
                if not self.pooled(ShapeKey(model, signature)):
                    self._refuse(lane_shape, signature, what, consumer,
                                 "a shape that has no item in the pool (it shares a prefix, or was never solitary)")
        elif not (signatures == np.uint64(lane_shape.signature)).all():
            stray = int(signatures[np.argmax(signatures != np.uint64(lane_shape.signature))])
            self._refuse(lane_shape, stray, what, consumer, "not the batch's shape")

    @staticmethod
    def _refuse(lane_shape: ShapeKey, signature: int, what: str, consumer: ConsumerId, why: str) -> None:
        batch = "the solitary pool" if is_pool(lane_shape) else f"shape {lane_shape.signature:#018x}"
        raise ShapeGuardError(
            f"{what}: a chunk of shape (model {lane_shape.model}, signature {signature:#018x}) was about to "
            f"be handed to consumer {consumer} in a batch of {batch}: {why}; stopping the broker: a poisoned "
            f"cache is worse than a restart")

    # ----------------------------------------------------------------- internals

    def _make_live(self, shape: ShapeKey, chain: tuple[int, ...], may_pool: bool) -> _Live:
        crowded = self._live_in_model.get(shape.model, 0) >= self.min_shapes
        live = self._live[shape] = _Live(chain, pooling=self.enabled and crowded and may_pool)
        self._live_in_model[shape.model] = self._live_in_model.get(shape.model, 0) + 1
        self._hold(shape, live)
        return live

    def _hold(self, shape: ShapeKey, live: _Live) -> None:
        """The shape's chain elements count it; a pooling shape that held one of them alone
        stops pooling (shared)."""
        for element in set(live.chain):
            key = (shape.model, element)
            other = self._pooling_at.get(key)
            if other is not None and other != shape:
                self._stop(other, self._live[other], STOPPED_SHARED)
            self._holders[key] = self._holders.get(key, 0) + 1
            if live.pooling:
                self._pooling_at[key] = shape

    def _release(self, shape: ShapeKey, live: _Live) -> None:
        for element in set(live.chain):
            key = (shape.model, element)
            left = self._holders[key] - 1
            if left:
                self._holders[key] = left
            else:
                del self._holders[key]
            if self._pooling_at.get(key) == shape:
                del self._pooling_at[key]

    def _stop(self, shape: ShapeKey, live: _Live, why: str) -> None:
        live.pooling = False
        for element in set(live.chain):
            self._pooling_at.pop((shape.model, element), None)
        self.counters.stopped[why] += 1

    def _retire_if_idle(self, shape: ShapeKey, live: _Live) -> bool:
        if live.pooled or live.own:
            return False
        self._release(shape, live)
        del self._live[shape]
        left = self._live_in_model[shape.model] - 1
        if left:
            self._live_in_model[shape.model] = left
        else:
            del self._live_in_model[shape.model]
        return True

    # ----------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Every index agrees with the live shapes. O(live shapes x chain depth)."""
        holders: dict[_Element, int] = {}
        pooling_at: dict[_Element, ShapeKey] = {}
        in_model: dict[int, int] = {}
        for shape, live in self._live.items():
            in_model[shape.model] = in_model.get(shape.model, 0) + 1
            assert not is_pool(shape) and live.chain and live.chain[-1] == shape.signature, (shape, live)
            assert live.pooled > 0 or live.own, f"{shape} is live with nothing in the pool or its lanes"
            assert live.pooled >= 0 and (not live.pooling or (not live.own and live.pooled <= self.max_items))
            assert self.enabled or not live.pooling, shape
            for element in set(live.chain):
                holders[(shape.model, element)] = holders.get((shape.model, element), 0) + 1
                if live.pooling:
                    pooling_at[(shape.model, element)] = shape
        assert in_model == self._live_in_model, (in_model, self._live_in_model)
        assert holders == self._holders, "element counts disagree with the live shapes' chains"
        assert pooling_at == self._pooling_at, "pooling index disagrees with the live shapes"
        for key in pooling_at:
            assert holders[key] == 1, f"pooling shape {pooling_at[key]} shares element {key}"
        assert len(self._declared) <= MAX_DECLARED_CHAINS
        assert not (self._declared.keys() & self._live.keys()), "a live shape's chain also waits as declared"
