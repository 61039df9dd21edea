"""Sticky shape selection, the guard and the starvation bound (pipeline/broker/selection.py,
SPEC §4) against a plain reference written here. Deterministic: hypothesis is derandomised,
stress runs are seeded."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.broker.ids import ConsumerId, ShapeKey
from pipeline.broker.selection import ShapeSelector, SwitchReason
from pipeline.wire.errors import BadInputError, PipelineError, ShapeGuardError
from pipeline.wire.shapes import POOL_SIGNATURE

DETERMINISTIC = settings(derandomize=True, database=None, deadline=None, max_examples=200)
# With model 0's solitary pool (pipeline/broker/pool.py): last in the order, and it gives way.
SHAPES = [ShapeKey(0, 5), ShapeKey(0, 9), ShapeKey(0, 2), ShapeKey(1, 5), ShapeKey(1, 7), ShapeKey(0, POOL_SIGNATURE)]
NS = 1_000_000_000
C0 = ConsumerId(0)  # the one consumer of these tests (the multi-consumer policy: test_affinity.py)


class RefSelector:
    """SPEC §4 with linear scans over every dispatchable item."""

    def __init__(self, max_age_s: float | None, resolution_ns: int) -> None:
        self.max_age_s = max_age_s
        self.resolution_ns = resolution_ns
        self.items: dict[ShapeKey, list[tuple[int, int]]] = {}  # (arrival ns, length)
        self.current: dict[int, int | None] = {}
        self.switches: Counter[SwitchReason] = Counter()

    def tokens(self, shape: ShapeKey) -> int:
        return sum(length for _, length in self.items.get(shape, []))

    def oldest_bucket(self, shape: ShapeKey) -> int | None:
        arrivals = [a // self.resolution_ns for a, _ in self.items.get(shape, [])]
        return min(arrivals, default=None)

    def starving(self, bucket: int, now_s: float) -> bool:
        return now_s * NS - bucket * self.resolution_ns > self.max_age_s * NS

    def select(self, model: int, now_s: float) -> ShapeKey | None:
        shapes = [s for s in self.items if s.model == model]
        if not shapes:
            return None
        current = self.current.get(model)
        if self.max_age_s is not None:
            aged = [(self.oldest_bucket(s), s.signature) for s in shapes if self.items[s]]
            if aged:
                bucket, signature = min(aged)
                own = self.oldest_bucket(ShapeKey(model, current)) if current is not None else None
                if (signature != current and self.starving(bucket, now_s)
                        and not (own is not None and self.starving(own, now_s))):
                    return self.switch(model, signature, SwitchReason.STARVATION)
        # The pool last: ranked after every shape with tokens, whatever its own tokens.
        ranked = sorted((s.signature == POOL_SIGNATURE, -self.tokens(s), s.signature) for s in shapes if self.tokens(s))
        if current is not None and self.tokens(ShapeKey(model, current)) > 0:
            if current != POOL_SIGNATURE or ranked[0][2] == POOL_SIGNATURE:
                return ShapeKey(model, current)
            own = self.oldest_bucket(ShapeKey(model, current)) if self.max_age_s is not None else None
            if own is not None and self.starving(own, now_s):
                return ShapeKey(model, current)  # the pool serves its own starving work
            return self.switch(model, ranked[0][2], SwitchReason.YIELD)  # the pool gives way
        if not ranked:
            return None
        reason = SwitchReason.INITIAL if current is None else SwitchReason.DRAINED
        return self.switch(model, ranked[0][2], reason)

    def switch(self, model: int, signature: int, reason: SwitchReason) -> ShapeKey:
        self.current[model] = signature
        self.switches[reason] += 1
        return ShapeKey(model, signature)


class Harness:
    def __init__(self, max_age_s: float | None, resolution_ns: int = 100_000_000) -> None:
        self.sut = ShapeSelector(max_age_s=max_age_s, age_resolution_ns=resolution_ns)
        self.ref = RefSelector(max_age_s, resolution_ns)
        self.now_s = 0.0

    def queue(self, pick: int, lengths: list[int], back_s: float) -> None:
        shape = SHAPES[pick % len(SHAPES)]
        arrival = max(0, int((self.now_s - back_s) * NS))
        arrivals = [arrival + i * 37_000_000 for i in range(len(lengths))]
        self.sut.on_queued(shape, sum(lengths), np.array(arrivals, dtype=np.int64))
        self.ref.items.setdefault(shape, []).extend(zip(arrivals, lengths))

    def dispatch(self, pick: int, picks: list[int]) -> None:
        shape = SHAPES[pick % len(SHAPES)]
        items = self.ref.items.get(shape, [])
        chosen = sorted({p % len(items) for p in picks}) if items else []
        if not chosen:
            return
        taken = [items[i] for i in chosen]
        self.ref.items[shape] = [x for i, x in enumerate(items) if i not in chosen]
        self.sut.on_dispatched(shape, sum(n for _, n in taken), [a for a, _ in taken])

    def select(self, model: int, advance_s: float) -> None:
        self.now_s += advance_s
        want = self.ref.select(model, self.now_s)
        assert self.sut.select(model, self.now_s, consumer=C0) == want
        if want is not None:
            self.sut.guard(want, consumer=C0)  # the selected shape always passes the guard

    def check(self) -> None:
        self.sut.check_invariants()
        assert dict(self.sut.counters.switches) == {r: self.ref.switches[r] for r in SwitchReason}
        for shape in SHAPES:
            assert self.sut.dispatchable_tokens(shape) == self.ref.tokens(shape)
            if self.ref.max_age_s is not None:
                bucket = self.ref.oldest_bucket(shape)
                want = None if bucket is None else bucket * self.ref.resolution_ns
                assert self.sut.oldest_arrival_ns(shape) == want
        for model in (0, 1):
            cur = self.ref.current.get(model)
            assert self.sut.current(model, consumer=C0) == (None if cur is None else ShapeKey(model, cur))

    def run(self, op: tuple) -> None:
        kind, *args = op
        {"queue": self.queue, "dispatch": self.dispatch, "select": self.select}[kind](*args)
        self.check()


picks = st.integers(0, 100)
operations = st.one_of(
    st.tuples(st.just("queue"), picks, st.lists(st.integers(1, 2000), min_size=1, max_size=6),
              st.sampled_from([0.0, 1.0, 29.9, 30.0, 30.1, 45.0, 100.0])),
    st.tuples(st.just("dispatch"), picks, st.lists(picks, min_size=1, max_size=6)),
    st.tuples(st.just("select"), st.integers(0, 1), st.sampled_from([0.0, 0.05, 1.0, 10.0, 31.0])),
)


@DETERMINISTIC
@given(max_age_s=st.sampled_from([None, 30.0, 0.5]), ops=st.lists(operations, max_size=60))
def test_matches_reference(max_age_s, ops):
    harness = Harness(max_age_s)
    for op in ops:
        harness.run(op)


@pytest.mark.parametrize("seed,max_age_s", [(1, None), (2, 5.0), (3, 0.3)])
def test_seeded_stress(seed, max_age_s):
    rng = np.random.default_rng(seed)
    harness = Harness(max_age_s, resolution_ns=int(rng.choice([1, 50_000_000, 1_000_000_000])))
    for _ in range(400):
        roll = rng.random()
        pick = int(rng.integers(100))
        if roll < 0.35:
            lengths = rng.integers(1, 3000, int(rng.integers(1, 8))).tolist()
            harness.run(("queue", pick, lengths, float(rng.choice([0.0, 2.0, 8.0]))))
        elif roll < 0.7:
            harness.run(("dispatch", pick, rng.integers(0, 100, int(rng.integers(1, 6))).tolist()))
        else:
            harness.run(("select", int(rng.integers(2)), float(rng.choice([0.0, 0.2, 1.0, 3.0]))))


@pytest.mark.parametrize("seed,max_age_s,least_yields", [(11, None, 10), (12, 30.0, 1)])
def test_seeded_stress_around_the_pool(seed, max_age_s, least_yields):
    """Model 0 only, the pool's items coming and the others' going most: the pool is often the
    one shape with work when the consumer switches, and others come while it is served."""
    rng = np.random.default_rng(seed)
    harness = Harness(max_age_s)
    pool, others = SHAPES.index(ShapeKey(0, POOL_SIGNATURE)), [0, 1, 2]
    yields = 0
    for _ in range(600):
        roll = rng.random()
        if roll < 0.3:  # mostly the pool's items come, mostly the others' go
            pick = pool if rng.random() < 0.7 else int(rng.choice(others))
            harness.run(("queue", pick, rng.integers(1, 3000, int(rng.integers(1, 4))).tolist(), 0.0))
        elif roll < 0.65:
            pick = pool if rng.random() < 0.2 else int(rng.choice(others))
            harness.run(("dispatch", pick, rng.integers(0, 100, int(rng.integers(1, 4))).tolist()))
        else:
            harness.run(("select", 0, float(rng.choice([0.0, 0.2, 3.0]))))
        yields = harness.sut.counters.switches[SwitchReason.YIELD]
    assert yields >= least_yields, yields  # the case this stress is for happened (starving work holds the pool)


def test_the_pool_comes_last_and_gives_way_to_a_shape_with_work():
    pool, a = ShapeKey(0, POOL_SIGNATURE), ShapeKey(0, 0xA)
    selector = ShapeSelector()
    selector.on_queued(pool, 9000, [0])
    selector.on_queued(a, 100, [0])
    assert selector.select(0, 0.0, consumer=C0) == a  # a shape before the pool, whatever the tokens
    selector.on_dispatched(a, 100, [0])
    assert selector.select(0, 0.0, consumer=C0) == pool  # drained: the pool
    selector.on_queued(a, 50, [0])
    assert selector.select(0, 0.0, consumer=C0) == a  # the pool gives way at once
    assert selector.counters.switches[SwitchReason.YIELD] == 1
    selector.check_invariants()


def test_docstring_example():
    a, b, c = ShapeKey(0, 0xA), ShapeKey(0, 0xB), ShapeKey(0, 0xC)
    selector = ShapeSelector()
    selector.on_queued(a, 900, [0])
    selector.on_queued(b, 2000, [0])
    assert selector.select(0, 0.0, consumer=C0) == b
    selector.on_dispatched(b, 1999, [0])
    selector.on_queued(a, 4100, [0])
    selector.on_queued(c, 6000, [0])
    assert selector.select(0, 0.0, consumer=C0) == b  # one token left: B stays
    selector.on_dispatched(b, 1, [0])
    assert selector.select(0, 0.0, consumer=C0) == c
    assert selector.counters.switches == {
        SwitchReason.INITIAL: 1, SwitchReason.DRAINED: 1, SwitchReason.STARVATION: 0, SwitchReason.TAKEOVER: 0,
        SwitchReason.ORDER: 0, SwitchReason.YIELD: 0,
    }
    assert selector.counters.per_consumer == {C0: selector.counters.switches}
    selector.check_invariants()


def test_starvation_switch_and_its_hysteresis():
    a, c = ShapeKey(0, 0xA), ShapeKey(0, 0xC)
    selector = ShapeSelector(max_age_s=30.0)
    selector.on_queued(c, 6000, [98 * NS])
    selector.on_queued(a, 5000, [69 * NS])
    assert selector.select(0, 99.0, consumer=C0) == c  # A waited 30 s: not over the bound yet; C has more
    assert selector.select(0, 100.0, consumer=C0) == a  # A waited 31 s
    assert selector.counters.switches[SwitchReason.STARVATION] == 1
    assert selector.select(0, 200.0, consumer=C0) == a  # C starves too now, but A is serving starving work
    selector.on_dispatched(a, 5000, [69 * NS])
    assert selector.select(0, 200.0, consumer=C0) == c
    assert selector.counters.switches[SwitchReason.STARVATION] == 2  # C was over the bound
    selector.check_invariants()


def test_no_starvation_switch_when_the_bound_is_off():
    a, c = ShapeKey(0, 0xA), ShapeKey(0, 0xC)
    selector = ShapeSelector()
    selector.on_queued(c, 6000, [0])
    assert selector.select(0, 0.0, consumer=C0) == c
    selector.on_queued(a, 9000, [0])
    assert selector.select(0, 1e9, consumer=C0) == c  # sticky however old A's work is
    assert selector.oldest_arrival_ns(a) is None  # ages are not tracked


def test_models_drain_independently():
    selector = ShapeSelector()
    selector.on_queued(ShapeKey(0, 1), 10, [0])
    selector.on_queued(ShapeKey(1, 2), 10, [0])
    assert selector.select(0, 0.0, consumer=C0) == ShapeKey(0, 1)
    assert selector.select(1, 0.0, consumer=C0) == ShapeKey(1, 2)
    assert selector.select(7, 0.0, consumer=C0) is None
    assert selector.counters.switches[SwitchReason.INITIAL] == 2


def test_guard_refuses_a_chunk_of_another_shape():
    selector = ShapeSelector()
    selector.on_queued(ShapeKey(0, 1), 10, [0])
    selector.on_queued(ShapeKey(0, 2), 5, [0])
    with pytest.raises(ShapeGuardError, match="current shape is none"):
        selector.guard(ShapeKey(0, 1), consumer=C0)
    assert selector.select(0, 0.0, consumer=C0) == ShapeKey(0, 1)
    selector.guard(ShapeKey(0, 1), consumer=C0)
    with pytest.raises(ShapeGuardError, match="poisoned cache is worse than a restart") as raised:
        selector.guard(ShapeKey(0, 2), "batch for consumer 4", consumer=C0)
    assert "0x0000000000000002" in str(raised.value) and "consumer 4" in str(raised.value)
    assert isinstance(raised.value, PipelineError) and not isinstance(raised.value, BadInputError)


def test_forget_keeps_the_current_shape_until_the_next_switch():
    a, b = ShapeKey(0, 1), ShapeKey(0, 2)
    selector = ShapeSelector(max_age_s=1.0)
    selector.on_queued(a, 10, [0])
    assert selector.select(0, 0.0, consumer=C0) == a
    selector.on_dispatched(a, 10, [0])
    selector.forget(a)
    assert selector.current(0, consumer=C0) == a and selector.select(0, 0.0, consumer=C0) is None
    selector.on_queued(b, 5, [0])
    assert selector.select(0, 0.0, consumer=C0) == b
    assert selector.counters.switches[SwitchReason.DRAINED] == 1
    selector.check_invariants()


@pytest.mark.parametrize("bad", [dict(max_age_s=0), dict(max_age_s=-1.0), dict(max_age_s="5"),
                                 dict(max_age_s=True), dict(age_resolution_ns=0),
                                 dict(age_resolution_ns=0.5)])
def test_bad_config(bad):
    with pytest.raises(BadInputError):
        ShapeSelector(**bad)
