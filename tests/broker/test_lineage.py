"""The shape trie (pipeline/broker/lineage.py) against a brute-force reference: the next
shape is the one sharing the longest chain prefix with the last, ties by most tokens, then
the lower signature; invariants after every step of a seeded random run; the node limit."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.broker.ids import ShapeKey
from pipeline.broker.lineage import ShapeTrie


def reference_next(chains: dict[int, tuple[int, ...]], tokens: dict[int, int], after: int | None,
                   eligible=lambda s: True, preferred=lambda s: True) -> int | None:
    """Every shape with tokens scored by its common chain prefix with `after`'s chain, then
    whether it is preferred, then its tokens."""
    last = chains.get(after, ()) if after is not None else ()

    def common(chain: tuple[int, ...]) -> int:
        n = 0
        while n < min(len(chain), len(last)) and chain[n] == last[n]:
            n += 1
        return n

    candidates = [(-common(chains[s]), not preferred(s), -t, s) for s, t in tokens.items() if t and eligible(s)]
    return min(candidates)[-1] if candidates else None


def random_chains(rng: random.Random, shapes: int) -> dict[int, tuple[int, ...]]:
    """Chains of a few systems prompts, few-shot blocks and turns: prefixes shared a lot."""
    chains: dict[int, tuple[int, ...]] = {}
    prefixes: list[tuple[int, ...]] = [()]
    next_sig = 1
    while len(chains) < shapes:
        base = rng.choice(prefixes)
        chain = base + (next_sig,)
        next_sig += 1
        prefixes.append(chain)
        if rng.random() < 0.8 and chain[-1] not in chains:
            chains[chain[-1]] = chain
    return chains


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), shapes=st.integers(1, 30), steps=st.integers(1, 60))
def test_next_shape_matches_the_reference(seed, shapes, steps):
    rng = random.Random(seed)
    chains = random_chains(rng, shapes)
    trie = ShapeTrie()
    tokens: dict[int, int] = {}
    # Some shapes never declare a chain (items recovered before their chain came): leaves
    # only, so every other chain is placed whole.
    interior = {sig for chain in chains.values() for sig in chain[:-1]}
    declared = {s for s in chains if s in interior or rng.random() < 0.8}
    for s in declared:
        trie.declare(0, chains[s])
    view = {s: (chains[s] if s in declared else (s,)) for s in chains}
    for _ in range(steps):
        shape = rng.choice(list(chains))
        value = rng.choice([0, 0, rng.randrange(1, 5000)])
        trie.set_tokens(ShapeKey(0, shape), value)
        tokens[shape] = value
        trie.check_invariants()
        after = rng.choice([None, *chains])
        banned = {s for s in chains if rng.random() < 0.2}
        want = reference_next(view, tokens, after, lambda s: s not in banned)
        assert trie.next_shape(0, after, lambda s: s not in banned) == want
        # Served elsewhere (affinity): a preferred shape first among those sharing as much.
        others = {s for s in chains if rng.random() < 0.3}
        want = reference_next(view, tokens, after, lambda s: s not in banned, lambda s: s not in others)
        assert trie.next_shape(0, after, lambda s: s not in banned, lambda s: s not in others) == want


def test_a_shape_extending_the_last_one_comes_before_a_bigger_stranger():
    trie = ShapeTrie()
    trie.declare(0, (1,))
    trie.declare(0, (1, 2))
    trie.declare(0, (1, 2, 3))
    trie.declare(0, (9,))
    for shape, tokens in ((2, 10), (3, 20), (9, 10_000)):
        trie.set_tokens(ShapeKey(0, shape), tokens)
    assert trie.next_shape(0, after=2) == 3  # extends 2 (2 itself still has work: it comes first from 3)
    trie.set_tokens(ShapeKey(0, 3), 0)  # 3 drained
    assert trie.next_shape(0, after=3) == 2  # its parent: shares (1, 2)
    assert trie.next_shape(0, after=None) == 9  # from the root: the most tokens
    assert trie.next_shape(1, after=None) is None  # another model has nothing
    trie.check_invariants()


def test_a_chain_that_arrives_after_its_items_moves_the_shape():
    trie = ShapeTrie()
    trie.set_tokens(ShapeKey(0, 5), 100)  # items recovered before any chain: a chain of one
    trie.declare(0, (4, 5))
    trie.set_tokens(ShapeKey(0, 4), 0)
    trie.check_invariants()
    assert trie.depth(ShapeKey(0, 5)) == 2
    trie.declare(0, (7,))
    trie.set_tokens(ShapeKey(0, 7), 1_000)
    assert trie.next_shape(0, after=4) == 5  # below 4 now


def test_forgotten_shapes_leave_no_node_behind_and_the_limit_holds():
    trie = ShapeTrie(max_nodes=2)  # prefix nodes: 1 and 2
    trie.declare(0, (1, 2, 3))
    trie.declare(0, (1, 4))
    assert len(trie) == 5 and trie.overflows == 0  # the root, 1, 2 and the shapes 3, 4
    trie.declare(0, (1, 2, 8, 9))  # a third prefix node (8): over the limit; 9 goes under 2
    assert trie.overflows == 1 and trie.depth(ShapeKey(0, 9)) == 3
    trie.check_invariants()
    for shape in (3, 4, 9):
        trie.forget(ShapeKey(0, shape))
        trie.check_invariants()
    assert len(trie) == 0


def test_a_seeded_random_run_keeps_every_invariant():
    rng = random.Random(7)
    trie = ShapeTrie(max_nodes=200)
    chains = random_chains(rng, 300)
    live: set[int] = set()
    for step in range(3000):
        shape = rng.choice(list(chains))
        action = rng.random()
        if action < 0.3:
            trie.declare(step % 2, chains[shape])
            live.add(shape)
        elif action < 0.8:
            trie.set_tokens(ShapeKey(step % 2, shape), rng.choice([0, rng.randrange(1, 100)]))
            live.add(shape)
        else:
            key = ShapeKey(step % 2, shape)
            trie.set_tokens(key, 0)
            trie.forget(key)
        trie.check_invariants()


def test_a_preferred_shape_is_looked_for_a_bounded_way_past_the_first_eligible():
    from pipeline.broker.lineage import PREFERRED_LOOKAHEAD

    served, wanted = 1, 2
    # At the root, by tokens: the served shape, then `gap` ineligible ones, then the preferred
    # one, found only within the lookahead.
    for gap in (PREFERRED_LOOKAHEAD - 1, PREFERRED_LOOKAHEAD):
        trie = ShapeTrie()
        trie.set_tokens(ShapeKey(0, served), 10_000)
        for k in range(gap):
            trie.set_tokens(ShapeKey(0, 100 + k), 5_000 - k)
        trie.set_tokens(ShapeKey(0, wanted), 10)
        got = trie.next_shape(0, None, lambda s: s < 100, lambda s: s != served)
        assert got == (wanted if gap < PREFERRED_LOOKAHEAD else served), gap
        trie.check_invariants()
