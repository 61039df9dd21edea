"""FirstReferences (pipeline/broker/firstrefs.py) against a reference: each shape's prefix as
a set of token positions owned by its chain's levels, unioned per cache; the whole model's
count never exceeds the consumers' sum, their difference is what splitting cost; the memory
limit at and past."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.broker.firstrefs import FirstReferences
from pipeline.broker.ids import ShapeKey


def forest(draw_parents: list[int], lengths: list[int]) -> tuple[dict[int, tuple[int, ...]], dict[int, int]]:
    """Shapes 1..n: shape k's parent is draw_parents[k-1] (0: none, else an earlier shape);
    its prefix_len is its parent's plus lengths[k-1] (every level is a shape's own)."""
    chains: dict[int, tuple[int, ...]] = {}
    prefix: dict[int, int] = {}
    for k, (parent, extra) in enumerate(zip(draw_parents, lengths), start=1):
        parent = parent % k  # 0 or an earlier shape
        chains[k] = (*chains[parent], k) if parent else (k,)
        prefix[k] = (prefix[parent] if parent else 0) + extra
    return chains, prefix


def reference_tokens(chains, prefix, shapes) -> int:
    """Token positions of the started shapes' prefixes, each owned by the level it extends."""
    positions = set()
    for shape in shapes:
        chain = chains[shape]
        for depth, level in enumerate(chain):
            start = prefix[chain[depth - 1]] if depth else 0
            positions |= {(level, i) for i in range(start, prefix[level])}
    return len(positions)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 50)), min_size=1, max_size=12),
       st.lists(st.tuples(st.integers(0, 2), st.integers(1, 12)), max_size=40))
def test_counts_match_the_reference_and_the_split_cost_is_the_difference(shapes, starts):
    chains, prefix = forest([p for p, _ in shapes], [n for _, n in shapes])
    refs = FirstReferences()
    for shape, chain in chains.items():
        refs.declare(0, chain)
        refs.learn(ShapeKey(0, shape), prefix[shape])  # at ingest, before any dispatch
    per_consumer = [0, 0, 0]
    started: list[set[int]] = [set(), set(), set()]
    for consumer, shape in starts:
        shape = (shape - 1) % len(chains) + 1
        cached = [{level for s in started[c] for level in chains[s]} for c in range(3)]  # each cache's levels
        elsewhere = shape not in cached[consumer] and any(shape in cached[c] for c in range(3) if c != consumer)
        assert refs.referenced_elsewhere(f"c{consumer}", ShapeKey(0, shape)) == elsewhere
        per_consumer[consumer] += refs.start(f"c{consumer}", ShapeKey(0, shape), prefix[shape])
        started[consumer].add(shape)
        refs.check_invariants()
    for consumer in range(3):
        assert per_consumer[consumer] == reference_tokens(chains, prefix, started[consumer])
    model = reference_tokens(chains, prefix, set().union(*started))
    assert refs.model_tokens.get(0, 0) == model <= sum(per_consumer)


def test_a_level_that_is_no_shape_is_counted_once_per_shape_below_it():
    refs = FirstReferences()
    for chain in ((1, 2), (1, 3)):  # level 1 is a prefix only: its length is never seen
        refs.declare(0, chain)
    assert refs.start("c0", ShapeKey(0, 2), 100) == 100
    assert refs.start("c0", ShapeKey(0, 3), 120) == 120  # shares level 1, of unknown length
    refs.learn(ShapeKey(0, 1), 80)  # once a shape of level 1 is seen, it is known
    assert refs.start("c1", ShapeKey(0, 2), 100) == 100 and refs.start("c1", ShapeKey(0, 3), 120) == 40
    assert refs.model_tokens[0] == 220  # the model's cache met 2 and 3 before level 1's length was known


def test_a_shape_started_again_and_on_a_second_consumer():
    refs = FirstReferences()
    assert refs.start("c0", ShapeKey(0, 7), 64) == 64 and refs.start("c0", ShapeKey(0, 7), 64) == 0
    assert refs.start("c1", ShapeKey(0, 7), 64) == 64  # its own cache pays again...
    assert refs.model_tokens == {0: 64}  # ...one cache for the model once
    assert refs.start("c1", ShapeKey(1, 7), 64) == 64 and refs.model_tokens == {0: 64, 1: 64}  # per model


def test_the_memory_limit_at_and_past():
    refs = FirstReferences(max_entries=6)
    refs.declare(0, (1, 2))  # one entry: 2's parent
    # learns 2's length (one), then 2 levels in 2 caches (four): 6, at the limit
    assert refs.start("c0", ShapeKey(0, 2), 10) == 10
    refs.check_invariants()
    assert refs.overflows == 0 and refs.start("c1", ShapeKey(0, 2), 10) == 0  # past it: not counted
    assert refs.overflows == 1 and refs.model_tokens == {0: 10}
    refs.check_invariants()
