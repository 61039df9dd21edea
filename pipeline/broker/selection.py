"""Sticky shape draining per model, the signature guard and the starvation bound (SPEC §4).

Pure policy: no I/O; time is passed in (`now_s`, and item arrival times as the producers'
`submit_ns`, on the same monotonic clock of the machine). The dispatcher feeds it the
dispatchable tokens of every shape as they change and asks it which shape a model drains:

    selector = ShapeSelector(max_age_s=None)             # the starvation bound is off by default
    selector.on_queued(shape, tokens, arrivals_ns)       # items of the shape became dispatchable
    selector.on_dispatched(shape, tokens, arrivals_ns)   # a batch of them was committed
    selector.on_returned(shape, tokens, arrivals_ns)     # a lost consumer's items came back
    shape = selector.select(model, now_s, consumer=c)    # the shape to serve c (maybe a switch)
    selector.guard(batch_shape, consumer=c)              # ShapeGuardError unless it is c's current
    selector.consumer_lost(c)                            # c's current shape is no longer held

Policy. Each consumer has a current shape (SPEC §4b: per consumer, not per model). A request
gets the consumer's current shape while it has dispatchable (queued, not pending) tokens;
only when it has none does the consumer switch, to the next shape in the shape order (ties:
the lower signature). With affinity off, a switch moves every consumer of the model to the
new shape, as the design note has it: one shape per model, drained by all together (the
switch counts for the consumer that made it). With affinity
on (`affinity=True`), a small shape (its dispatchable tokens at most
AFFINITY_BATCHES_PER_CONSUMER full batches per consumer of the model) that another consumer
already serves is not taken: it runs on that one consumer, so its prefix is computed once,
not once per consumer; nor one whose chain another consumer's current shape shares more of
(with the prefix order: it waits for the consumer whose cache holds most of its prefix); a
large shape may still be joined by every consumer (in the prefix order, where no shape as
close is free: see `_next`), and so may the empty shape (prompts without cacheable
components: EMPTY_SHAPE_SIGNATURE), however small, since it has no prefix to compute once.
A consumer that finds nothing else takes another's small shape over rather
than idle (reason `takeover`, counted).
NOTE: holding the empty shape to one consumer, as any small shape, cost the Mooncake slice
of `pipeline bench prefix` 0.6 points of prefix reuse (14.2% held against 14.8% joined, the bound).
Joining it, the small shapes wait until both their items are in rather than run each item on
another consumer, their prefix computed twice. The price, as for any large shape: an empty shape refilled as fast as it drains keeps every
consumer (sticky draining), and a small shape nobody serves waits for it to drain or for
`max_age_s`, the starvation bound (off by default), to pass (tests/broker/test_affinity.py).

Shape orders (`shape_order`):
    most-tokens   the shape with the most dispatchable tokens (the design note's rule)
    prefix        the shape sharing the longest chain prefix with the one just drained,
                  ties (with affinity) first by whether another consumer serves it (one
                  nobody serves first: joining computes its prefix a second time), then by
                  most tokens (SPEC §4b; the chains producers declare, kept in a
                  trie: `pipeline/broker/lineage.py`); without chains it is most-tokens

Starvation bound (beyond the design note; off unless `max_age_s` is set): when some other
shape's oldest dispatchable item has waited longer than `max_age_s`, and the current shape's
own oldest item has not, the model switches to the shape with the oldest item. While the
current shape is itself over the bound it keeps serving: that is starving work too, and
switching back and forth would serve neither. Arrival times are kept per shape in buckets of
`age_resolution_ns` (ages read at most one bucket high), so the bookkeeping is a few dict
updates per batch, not one per item.

The solitary pool (`pipeline/broker/pool.py`: POOL_SIGNATURE, the shapes that share nothing,
batched together) is a shape here, with three differences, all because it has no prefix for
a cache to keep: it comes last in the shape order (a consumer takes it when no other shape
it may take has work, before taking over another's small shape); it is not sticky (a
consumer on it moves to such a shape as soon as one has work: reason `yield`); and it is
never small (affinity lets every consumer drain it, as the empty shape). So shapes that share
are ordered and held as they were, and the shapes of the pool, each of which would have come
last as a shape of a few tokens of its own, are served where those came.

Every switch is counted by its reason, in all and per consumer: initial (the consumer had
no current shape), drained (its current shape had no dispatchable tokens), starvation,
takeover (affinity: only other consumers' small shapes were left), yield (see above).
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from sortedcontainers import SortedList

from pipeline.broker.ids import ConsumerId, ShapeKey
from pipeline.broker.lineage import ShapeTrie
from pipeline.wire.errors import BadInputError, ShapeGuardError
from pipeline.wire.shapes import EMPTY_SHAPE_SIGNATURE, POOL_SIGNATURE

# Width of an arrival-time bucket for the starvation bound: a tenth of a second is far finer
# than any useful bound (seconds to minutes) and keeps the buckets of a shape's backlog few.
AGE_RESOLUTION_NS = 100_000_000
# A shape's heap of buckets is rebuilt when stale entries outnumber live ones by this factor
# (entries go stale when a bucket empties; they are dropped lazily at the top).
_HEAP_SLACK_FACTOR = 2
_NS_PER_S = 1_000_000_000
SHAPE_ORDER_MOST_TOKENS = "most-tokens"
SHAPE_ORDER_PREFIX = "prefix"
SHAPE_ORDERS = (SHAPE_ORDER_MOST_TOKENS, SHAPE_ORDER_PREFIX)
# Affinity: a shape with at most this many full batches of dispatchable tokens per consumer
# of its model is "small", served by one consumer. Split across K consumers, each would pay
# the shape's prefix once for at most one batch of its own, which is what a cache-warm
# consumer saves; a batch each or more, and splitting it finishes sooner than the prefix
# costs.
AFFINITY_BATCHES_PER_CONSUMER = 1


class SwitchReason(enum.Enum):
    INITIAL = "initial"  # the model had no current shape yet
    DRAINED = "drained"  # the current shape had no dispatchable tokens left
    STARVATION = "starvation"  # another shape's oldest item waited longer than max_age_s
    TAKEOVER = "takeover"  # affinity: only other consumers' small shapes had work left
    ORDER = "order"  # a baseline policy's order moved on (FIFO, round-robin: pipeline/broker/baselines.py)
    YIELD = "yield"  # the solitary pool gave way to a shape with work (the pool has no cache to keep)


@dataclass(slots=True)
class SelectorCounters:
    switches: dict[SwitchReason, int] = field(
        default_factory=lambda: dict.fromkeys(SwitchReason, 0)
    )
    # The same, per consumer (kept after it is lost: its switches happened).
    per_consumer: dict[ConsumerId, dict[SwitchReason, int]] = field(default_factory=dict)


class DispatchPolicy(Protocol):
    """What the Dispatcher asks of a dispatch policy: which shape each consumer's next batch
    comes from. A policy is one class behind this interface (`ShapeSelector` is the
    product's; the evaluation's baselines are others); the Dispatcher tells it every change
    of a shape's dispatchable tokens and asks it at every batch. Pure, time passed in."""

    counters: SelectorCounters

    def declare(self, model: int, chain: Sequence[int]) -> None: ...
    def on_queued(self, shape: ShapeKey, tokens: int, arrivals_ns: Sequence[int] | np.ndarray) -> None: ...
    def on_returned(self, shape: ShapeKey, tokens: int, arrivals_ns: Sequence[int] | np.ndarray) -> None: ...
    def on_dispatched(self, shape: ShapeKey, tokens: int, arrivals_ns: Sequence[int] | np.ndarray) -> None: ...
    def forget(self, shape: ShapeKey) -> None: ...
    def choose(self, model: int, now_s: float, *, consumer: ConsumerId,
               batch_tokens: int = 0) -> tuple[ShapeKey, SwitchReason | None] | None: ...
    def switch(self, shape: ShapeKey, reason: SwitchReason, *, consumer: ConsumerId) -> None: ...
    def guard(self, shape: ShapeKey, what: str = "chunk", *, consumer: ConsumerId) -> None: ...
    def consumer_lost(self, consumer: ConsumerId) -> None: ...
    def current(self, model: int, *, consumer: ConsumerId) -> ShapeKey | None: ...
    def dispatchable_tokens(self, shape: ShapeKey) -> int: ...
    def check_invariants(self) -> None: ...


@dataclass(slots=True)
class _Ages:
    """A multiset of a shape's dispatchable items' arrival buckets: count per bucket, and a
    min-heap of buckets (with stale entries dropped lazily) for the oldest."""

    counts: dict[int, int] = field(default_factory=dict)
    heap: list[int] = field(default_factory=list)

    def add(self, buckets: list[int], counts: list[int]) -> None:
        for bucket, count in zip(buckets, counts):
            if bucket in self.counts:
                self.counts[bucket] += count
            else:
                self.counts[bucket] = count
                heapq.heappush(self.heap, bucket)

    def remove(self, buckets: list[int], counts: list[int]) -> None:
        for bucket, count in zip(buckets, counts):
            left = self.counts[bucket] - count
            assert left >= 0, (bucket, self.counts[bucket], count)
            if left:
                self.counts[bucket] = left
            else:
                del self.counts[bucket]
        if len(self.heap) > _HEAP_SLACK_FACTOR * len(self.counts) + 16:
            self.heap = list(self.counts)
            heapq.heapify(self.heap)

    def oldest(self) -> int | None:
        heap = self.heap
        while heap and heap[0] not in self.counts:
            heapq.heappop(heap)
        return heap[0] if heap else None


@dataclass(slots=True)
class _Model:
    # Each consumer's current shape's signature, and who serves each shape.
    current: dict[ConsumerId, int] = field(default_factory=dict)
    serving: dict[int, set[ConsumerId]] = field(default_factory=dict)
    consumers: set[ConsumerId] = field(default_factory=set)  # asking for this model's work
    # Shapes with dispatchable tokens, most first: (-tokens, signature).
    by_tokens: SortedList = field(default_factory=SortedList)
    # Shapes with dispatchable items, oldest first: (oldest bucket, signature). Only kept
    # when ages are (the starvation bound, the FIFO baseline).
    by_age: SortedList = field(default_factory=SortedList)


class ShapeSelector:
    """Which shape each model drains (SPEC §4), for every model of the broker.

    Owned by the dispatcher, driven by the broker's single dispatch loop. Not thread-safe.
    """

    KEEPS_AGES = False  # a subclass that orders by arrival keeps them without a bound

    def __init__(
        self, max_age_s: float | None = None, age_resolution_ns: int = AGE_RESOLUTION_NS,
        shape_order: str = SHAPE_ORDER_MOST_TOKENS, affinity: bool = False,
    ) -> None:
        if max_age_s is not None and (
            isinstance(max_age_s, bool) or not isinstance(max_age_s, (int, float))
            or not max_age_s > 0
        ):
            raise BadInputError(f"selection: max_age_s must be a number > 0 or None, got {max_age_s!r}")
        if isinstance(age_resolution_ns, bool) or not isinstance(age_resolution_ns, int) or age_resolution_ns < 1:
            raise BadInputError(f"selection: age_resolution_ns must be an int >= 1, got {age_resolution_ns!r}")
        if shape_order not in SHAPE_ORDERS:
            raise BadInputError(f"selection: shape_order {shape_order!r} is not one of {', '.join(SHAPE_ORDERS)}")
        self.shape_order = shape_order
        self.affinity = bool(affinity)
        # The shapes' lineage, kept only where the order reads it.
        self._trie = ShapeTrie() if shape_order == SHAPE_ORDER_PREFIX else None
        self._max_age_ns = None if max_age_s is None else max_age_s * _NS_PER_S
        # Arrival ages are kept where something reads them: the starvation bound, or a
        # policy that orders by age (KEEPS_AGES: the FIFO baseline).
        self._ages_kept = max_age_s is not None or self.KEEPS_AGES
        self._resolution_ns = age_resolution_ns
        self._models: dict[int, _Model] = {}
        self._tokens: dict[ShapeKey, int] = {}
        self._ages: dict[ShapeKey, _Ages] = {}
        self._oldest: dict[ShapeKey, int] = {}  # shape -> its entry in by_age
        self.counters = SelectorCounters()

    # ----------------------------------------------------------------- read-only state

    @property
    def max_age_s(self) -> float | None:
        return None if self._max_age_ns is None else self._max_age_ns / _NS_PER_S

    def current(self, model: int, *, consumer: ConsumerId) -> ShapeKey | None:
        state = self._models.get(model)
        signature = None if state is None else state.current.get(consumer)
        return None if signature is None else ShapeKey(model, signature)

    def dispatchable_tokens(self, shape: ShapeKey) -> int:
        return self._tokens.get(shape, 0)

    def oldest_arrival_ns(self, shape: ShapeKey) -> int | None:
        """Start of the arrival bucket of the shape's oldest dispatchable item; None when it
        has none or the starvation bound is off (ages are then not tracked)."""
        bucket = self._oldest.get(shape)
        return None if bucket is None else bucket * self._resolution_ns

    def shapes(self, model: int) -> list[ShapeKey]:
        """Shapes of the model with dispatchable tokens, most first."""
        state = self._models.get(model)
        return [] if state is None else [ShapeKey(model, sig) for _, sig in state.by_tokens]

    # ----------------------------------------------------------------- events

    def declare(self, model: int, chain: Sequence[int]) -> None:
        """A producer declared a shape's chain of prefix signatures (SPEC §4b)."""
        if self._trie is not None:
            self._trie.declare(model, chain)

    @property
    def lineage_overflows(self) -> int:
        """Shapes whose chain the trie had no room for (0 where it keeps none)."""
        return 0 if self._trie is None else self._trie.overflows

    def on_queued(self, shape: ShapeKey, tokens: int, arrivals_ns: Sequence[int] | np.ndarray) -> None:
        """Items of `shape` (their total tokens, their submit times) became dispatchable."""
        assert tokens >= len(arrivals_ns) > 0, (shape, tokens, len(arrivals_ns))
        self._set_tokens(shape, self._tokens.get(shape, 0) + tokens)
        if self._ages_kept:
            buckets, counts = self._buckets(arrivals_ns)
            self._ages.setdefault(shape, _Ages()).add(buckets, counts)
            self._update_oldest(shape)

    # Returned items are dispatchable again exactly like new ones; the name says why.
    on_returned = on_queued

    def on_dispatched(self, shape: ShapeKey, tokens: int, arrivals_ns: Sequence[int] | np.ndarray) -> None:
        """A batch of `shape` was committed: its items are no longer dispatchable."""
        left = self._tokens.get(shape, 0) - tokens
        assert left >= 0 and len(arrivals_ns) > 0, (shape, tokens, left)
        self._set_tokens(shape, left)
        if self._ages_kept:
            buckets, counts = self._buckets(arrivals_ns)
            self._ages[shape].remove(buckets, counts)
            self._update_oldest(shape)

    def forget(self, shape: ShapeKey) -> None:
        """Drop a shape with nothing dispatchable (the dispatcher retired it). A model whose
        current shape is forgotten keeps it as current until the next request switches."""
        assert not self._tokens.get(shape), (shape, self._tokens.get(shape))
        self._tokens.pop(shape, None)
        if self._trie is not None:
            self._trie.forget(shape)
        ages = self._ages.pop(shape, None)
        assert ages is None or not ages.counts, shape

    def _set_tokens(self, shape: ShapeKey, tokens: int) -> None:
        state = self._models.get(shape.model)
        if state is None:
            state = self._models[shape.model] = _Model()
        old = self._tokens.get(shape, 0)
        if old:
            state.by_tokens.remove((-old, shape.signature))
        if tokens:
            state.by_tokens.add((-tokens, shape.signature))
        self._tokens[shape] = tokens
        if self._trie is not None:
            self._trie.set_tokens(shape, tokens)

    def _buckets(self, arrivals_ns: Sequence[int] | np.ndarray) -> tuple[list[int], list[int]]:
        values = np.asarray(arrivals_ns, dtype=np.int64) // self._resolution_ns
        if values.min() == values.max():
            return [int(values[0])], [int(values.size)]  # one bucket: the common case
        buckets, counts = np.unique(values, return_counts=True)
        return buckets.tolist(), counts.tolist()

    def _update_oldest(self, shape: ShapeKey) -> None:
        oldest = self._ages[shape].oldest()
        before = self._oldest.get(shape)
        if oldest == before:
            return
        by_age = self._models[shape.model].by_age
        if before is not None:
            by_age.remove((before, shape.signature))
            del self._oldest[shape]
        if oldest is not None:
            by_age.add((oldest, shape.signature))
            self._oldest[shape] = oldest

    # ----------------------------------------------------------------- selection

    def select(self, model: int, now_s: float, *, consumer: ConsumerId, batch_tokens: int = 0) -> ShapeKey | None:
        """The shape `consumer`'s next batch of `model` comes from, or None when the model has
        nothing dispatchable. Switches (and counts the switch) when the policy says so:
        `choose`, then `switch` if it named a reason. `batch_tokens`: what one full batch of
        the consumer's contract holds (affinity sizes a small shape by it).

        Worked example, model 0, shapes A (900 tokens) and B (2,000 tokens), a consumer with
        no current shape: select -> B (initial: the most tokens). B's tokens are dispatched
        down to 0 while A grows to 5,000 and C appears with 6,000: select -> B while B has
        any token, then C (drained). With max_age_s = 30: if A's oldest item arrived 31 s ago
        and C's oldest 2 s ago, select -> A (starvation), and A stays current until it
        drains or another shape starves while A does not.
        """
        chosen = self.choose(model, now_s, consumer=consumer, batch_tokens=batch_tokens)
        if chosen is None:
            return None
        shape, reason = chosen
        if reason is not None:
            self.switch(shape, reason, consumer=consumer)
        return shape

    def choose(self, model: int, now_s: float, *, consumer: ConsumerId,
               batch_tokens: int = 0) -> tuple[ShapeKey, SwitchReason | None] | None:
        """What `select` would return, and the reason of the switch it would make (None: the
        consumer's current shape stays), changing nothing: a caller that may hand nothing out
        (a consumer offered full batches only) switches only when it does hand one out."""
        state = self._models.get(model)
        if state is None:
            return None
        state.consumers.add(consumer)
        mine = state.current.get(consumer)
        if self._max_age_ns is not None:
            starving = self._starving(state, model, now_s, mine)
            if starving is not None:
                return ShapeKey(model, starving), SwitchReason.STARVATION
        if mine is not None and self._tokens.get(ShapeKey(model, mine), 0) > 0:
            if mine != POOL_SIGNATURE:
                return ShapeKey(model, mine), None
            instead = self._instead_of_pool(state, model, consumer, now_s, batch_tokens)
            return (ShapeKey(model, mine), None) if instead is None else (ShapeKey(model, instead), SwitchReason.YIELD)
        if not state.by_tokens:
            return None
        reason = SwitchReason.INITIAL if mine is None else SwitchReason.DRAINED
        eligible = self._not_pool(self._free_for(state, model, consumer, batch_tokens))
        if mine is None:  # a consumer new to the model joins what the others drain, as the note has it
            joined = self._joinable(state, model, eligible)
            if joined is not None:
                return ShapeKey(model, joined), reason
        following = self._next(state, model, consumer, mine, eligible)
        if following is None and self._tokens.get(ShapeKey(model, POOL_SIGNATURE), 0) > 0:
            following = POOL_SIGNATURE  # last, but before another consumer's small shape
        if following is None:  # only others' small shapes have work: take one rather than idle
            following, reason = self._next(state, model, consumer, mine, None), SwitchReason.TAKEOVER
        assert following is not None, (model, mine)  # by_tokens is not empty
        return ShapeKey(model, following), reason

    @staticmethod
    def _not_pool(eligible):
        """`eligible` (None: every shape) without the solitary pool, which comes last."""
        if eligible is None:
            return lambda signature: signature != POOL_SIGNATURE
        return lambda signature: signature != POOL_SIGNATURE and eligible(signature)

    def _instead_of_pool(self, state: _Model, model: int, consumer: ConsumerId, now_s: float,
                         batch_tokens: int) -> int | None:
        """For a consumer on the pool: the shape it moves to, the one it would take were the
        pool drained, if that is not the pool (None: it stays). The pool stays while its own
        oldest item is over the starvation bound."""
        if len(state.by_tokens) == 1:  # the pool alone has work: the common case, in O(1)
            return None
        if self._max_age_ns is not None:
            oldest = self._oldest.get(ShapeKey(model, POOL_SIGNATURE))
            if oldest is not None and self._over_bound(oldest, now_s):
                return None
        eligible = self._not_pool(self._free_for(state, model, consumer, batch_tokens))
        return self._next(state, model, consumer, POOL_SIGNATURE, eligible)

    def _joinable(self, state: _Model, model: int, eligible) -> int | None:
        """The shape other consumers serve with the most dispatchable tokens that this one
        may take (None: none has any left)."""
        best = None
        for signature in state.serving:
            tokens = self._tokens.get(ShapeKey(model, signature), 0)
            if tokens and (eligible is None or eligible(signature)) and (
                    best is None or (-tokens, signature) < best):
                best = (-tokens, signature)
        return None if best is None else best[1]

    def _next(self, state: _Model, model: int, consumer: ConsumerId, after: int | None, eligible) -> int | None:
        """The next shape in the shape order among the `eligible` (None: every one). In the
        prefix order with affinity, of the shapes sharing as much of the chain, one no other
        consumer serves comes first: joining another's shape computes its prefix a second
        time, while a shape nobody serves has its prefix computed here once. SPEC §4b lets
        every consumer drain a large shape, and one still joins it where no shape as close
        is free; the preference only orders the ties of the longest-chain rule. The empty
        shape is always preferred: it has no prefix to compute twice, and joining it keeps
        small shapes waiting for all their items (the NOTE above)."""
        if self._trie is not None:
            preferred = None
            if self.affinity:
                def preferred(signature: int) -> bool:
                    others = state.serving.get(signature)
                    return signature == EMPTY_SHAPE_SIGNATURE or not others or others == {consumer}
            return self._trie.next_shape(model, after, eligible or (lambda _signature: True), preferred)
        for _tokens, signature in state.by_tokens:
            if eligible is None or eligible(signature):
                return signature
        return None

    def _free_for(self, state: _Model, model: int, consumer: ConsumerId, batch_tokens: int):
        """Which shapes `consumer` may switch to: all (None) without affinity; with it, none
        that is small (the empty shape is never small) and already served by another
        consumer, nor one another consumer's cache holds more of."""
        if not self.affinity:
            return None
        small_tokens = AFFINITY_BATCHES_PER_CONSUMER * max(batch_tokens, 1) * len(state.consumers)

        mine = state.current.get(consumer)

        def eligible(signature: int) -> bool:
            if signature in (EMPTY_SHAPE_SIGNATURE, POOL_SIGNATURE):
                return True  # no prefix to share: nothing to compute once, so every consumer may drain it
            if self._tokens.get(ShapeKey(model, signature), 0) > small_tokens:
                return True  # large: every consumer drains it
            others = state.serving.get(signature)
            if others:
                return others == {consumer}  # small and another's: its own
            return not self._closer_elsewhere(state, model, consumer, mine, signature)
        return eligible

    def _closer_elsewhere(self, state: _Model, model: int, consumer: ConsumerId, mine: int | None,
                          signature: int) -> bool:
        """Whether another consumer's current shape shares more of `signature`'s chain than
        this consumer's does: a small shape waits for the consumer whose cache holds most of
        its prefix (prefix order only: without chains no consumer is closer)."""
        if self._trie is None:
            return False
        own = self._trie.shared_depth(model, mine, signature)
        return any(self._trie.shared_depth(model, theirs, signature) > own
                   for other, theirs in state.current.items() if other != consumer)

    def switch(self, shape: ShapeKey, reason: SwitchReason, *, consumer: ConsumerId) -> None:
        """Make `shape` `consumer`'s current shape and count why (after `choose`)."""
        state = self._models[shape.model]
        # Without affinity the model's consumers move together (the design note's one shape
        # per model); with it, each on its own.
        for moved in (state.consumers | {consumer}) if not self.affinity else (consumer,):
            self._release(state, moved)
            state.current[moved] = shape.signature
            state.serving.setdefault(shape.signature, set()).add(moved)
        self.counters.switches[reason] += 1
        mine = self.counters.per_consumer.setdefault(consumer, dict.fromkeys(SwitchReason, 0))
        mine[reason] += 1

    def _release(self, state: _Model, consumer: ConsumerId) -> None:
        """The consumer no longer serves its current shape."""
        old = state.current.pop(consumer, None)
        if old is not None:
            serving = state.serving[old]
            serving.discard(consumer)
            if not serving:
                del state.serving[old]

    def consumer_lost(self, consumer: ConsumerId) -> None:
        """The consumer is gone: it serves nothing and no longer counts for affinity."""
        for state in self._models.values():
            self._release(state, consumer)
            state.consumers.discard(consumer)

    def _starving(self, state: _Model, model: int, now_s: float, mine: int | None) -> int | None:
        """The signature to switch to for starvation, or None."""
        if not state.by_age:
            return None
        oldest_bucket, signature = state.by_age[0]
        if signature == mine or not self._over_bound(oldest_bucket, now_s):
            return None
        if mine is not None:
            own = self._oldest.get(ShapeKey(model, mine))
            if own is not None and self._over_bound(own, now_s):
                return None  # the current shape is serving starving work itself
        return signature

    def _over_bound(self, bucket: int, now_s: float) -> bool:
        assert self._max_age_ns is not None
        return now_s * _NS_PER_S - bucket * self._resolution_ns > self._max_age_ns

    def guard(self, shape: ShapeKey, what: str = "chunk", *, consumer: ConsumerId) -> None:
        """SPEC §4's hard guard: raise ShapeGuardError (fatal: the process loop stops the
        broker) unless `shape` is `consumer`'s current shape. Called for every chunk handed
        out, with the shape its entries were stored under."""
        current = self.current(shape.model, consumer=consumer)
        if current != shape:
            raise ShapeGuardError(
                f"{what} of shape (model {shape.model}, signature {shape.signature:#018x}) was "
                f"about to be handed out while consumer {consumer}'s current shape is "
                f"{'none' if current is None else f'{current.signature:#018x}'}; stopping the "
                f"broker: a poisoned cache is worse than a restart"
            )

    # ----------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Assert every internal invariant. O(shapes + arrival buckets)."""
        for model, state in self._models.items():
            want = sorted(
                (-tokens, shape.signature) for shape, tokens in self._tokens.items()
                if shape.model == model and tokens
            )
            assert list(state.by_tokens) == want, (model, list(state.by_tokens), want)
            ages = sorted((b, s.signature) for s, b in self._oldest.items() if s.model == model)
            assert list(state.by_age) == ages, (model, list(state.by_age), ages)
        assert all(tokens >= 0 for tokens in self._tokens.values()), self._tokens
        assert all(shape.model in self._models for shape in self._tokens), self._tokens
        if not self._ages_kept:
            assert not self._ages and not self._oldest
        for shape, ages in self._ages.items():
            assert all(count > 0 for count in ages.counts.values()), (shape, ages.counts)
            assert set(ages.counts) <= set(ages.heap), shape
            assert self._oldest.get(shape) == min(ages.counts, default=None), shape
            assert bool(ages.counts) <= bool(self._tokens.get(shape)), shape
        assert set(self._oldest) <= set(self._ages), self._oldest
        for state in self._models.values():
            serving: dict[int, set] = {}
            for consumer, signature in state.current.items():
                serving.setdefault(signature, set()).add(consumer)
                assert consumer in state.consumers, consumer
            assert serving == state.serving, (serving, state.serving)
        if self._trie is not None:
            self._trie.check_invariants()
