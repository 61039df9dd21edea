"""The analyzer's cache replay, prefix-sorted walk and shared-prefix figures against a
brute-force reference (an OrderedDict LRU keyed by the prompts' own token prefixes), on small
random workloads; check_invariants through a seeded stress run; the limits at and past."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.analysis.reuse import ARRIVAL, PREFIX_SORTED, CacheReplay, prefix_sorted_order, replay, shared_prefix
from pipeline.analysis.workload import (
    MAX_BLOCK_TOKENS,
    MAX_CACHE_BLOCKS,
    MAX_CACHE_SIZES,
    MAX_CACHES,
    check_analysis_limits,
    prompt_blocks,
)
from tests.support.reuse import reference_cached


# Prompts that share prefixes: each is a cut of one of a few base prompts plus a short own
# tail, over a tiny alphabet (so equal blocks also arise by chance).
@st.composite
def workloads(draw) -> tuple[list[list[int]], int]:
    block = draw(st.integers(1, 4))
    bases = draw(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=14), min_size=1, max_size=3))
    prompts = []
    for _ in range(draw(st.integers(1, 12))):
        base = draw(st.sampled_from(bases))
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(0, 2), min_size=0 if cut else 1, max_size=5))
        prompts.append(base[:cut] + tail)
    return prompts, block


def as_arrays(prompts: list[list[int]]) -> list[np.ndarray]:
    return [np.array(p, dtype=np.int32) for p in prompts]


@settings(max_examples=150, deadline=None)
@given(workloads(), st.one_of(st.none(), st.integers(1, 8)), st.integers(1, 3))
def test_replay_matches_the_reference_in_both_orders(workload, capacity, caches):
    prompts, block = workload
    blocks = prompt_blocks(as_arrays(prompts), block)
    cache_tokens = None if capacity is None else capacity * block
    walk = prefix_sorted_order(blocks)
    for name, order in ((ARRIVAL, list(range(len(prompts)))), (PREFIX_SORTED, walk)):
        got = replay(blocks, order, name, block, cache_tokens, caches)
        if name == ARRIVAL:
            shares = [order[k::caches] for k in range(caches)]
        else:
            shares = [part.tolist() for part in np.array_split(np.array(order, dtype=np.int64), caches)]
        want = sum(sum(reference_cached([prompts[i] for i in share], block, capacity)) for share in shares)
        assert got.hit_tokens == want, (name, order)
        assert got.input_tokens == sum(map(len, prompts))


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_the_bound_is_the_unbounded_cache_in_token_sorted_order(workload):
    """The walk sorts by hashed keys, the reference by tokens: siblings come in another
    order, yet one unbounded cache gives the same total (each distinct block is computed
    once either way, and a prefix comes before what extends it in both)."""
    prompts, block = workload
    blocks = prompt_blocks(as_arrays(prompts), block)
    bound = replay(blocks, prefix_sorted_order(blocks), PREFIX_SORTED, block, None)
    by_tokens = sorted(prompts, key=lambda p: ([p[i * block:(i + 1) * block] for i in range(len(p) // block)], len(p)))
    assert bound.hit_tokens == sum(reference_cached(by_tokens, block, None))
    # and no order of one unbounded cache does better than the bound (all of them, few prompts)
    if len(prompts) <= 5:
        import itertools
        best = max(sum(reference_cached(list(p), block, None)) for p in itertools.permutations(prompts))
        assert bound.hit_tokens == best


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_the_walk_is_depth_first_and_shared_prefixes_match_the_reference(workload):
    prompts, block = workload
    blocks = prompt_blocks(as_arrays(prompts), block)
    walk = prefix_sorted_order(blocks)
    assert sorted(walk) == list(range(len(prompts)))
    names = [{tuple(p[:(i + 1) * block]) for i in range(len(p) // block)} for p in prompts]
    counts = Counter(name for per_prompt in names for name in per_prompt)
    for name in counts:  # the prompts holding a trie node are one stretch of the walk
        at = [k for k, i in enumerate(walk) if name in names[i]]
        assert at == list(range(at[0], at[-1] + 1))
    shared = shared_prefix(blocks, block)
    assert shared.item_tokens == sum(n for n in counts.values() if n >= 2) * block
    assert shared.distinct_tokens == sum(1 for n in counts.values() if n >= 2) * block
    assert shared.distinct_blocks == len(counts)


def test_check_invariants_through_a_seeded_stress_run():
    rng = random.Random(15)
    block = 4
    bases = [[rng.randrange(3) for _ in range(rng.randrange(40))] for _ in range(5)]
    replay_run = CacheReplay(block, [6, 11])
    references: list[list[list[int]]] = [[], []]
    for _ in range(400):
        cache = rng.randrange(2)
        batch = []
        for _ in range(rng.randrange(1, 5)):
            base = rng.choice(bases)
            batch.append(base[:rng.randrange(len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(1, 9))])
        got = replay_run.feed(cache, prompt_blocks(as_arrays(batch), block))
        references[cache].extend(batch)
        want = reference_cached(references[cache], block, [6, 11][cache])[-len(batch):]
        assert got == want
        replay_run.check_invariants()
    assert 0 < replay_run.reuse < 1


def test_degenerate_prompts():
    """No full block, exactly full blocks (the last is recomputed), an empty workload."""
    blocks = prompt_blocks(as_arrays([[1, 2], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4, 5]]), 2)
    assert [len(b.keys) for b in blocks] == [1, 2, 2, 2]
    run = CacheReplay(2, [100])
    assert run.feed(0, blocks) == [0, 2, 2, 4]
    run.check_invariants()
    assert replay([], [], ARRIVAL, 2, None).hit_tokens == 0
    assert shared_prefix([], 2).distinct_blocks == 0


def test_a_cache_smaller_than_a_block_is_refused():
    blocks = prompt_blocks(as_arrays([[1, 2, 3]]), 2)
    with pytest.raises(ValueError, match="holds no block"):
        replay(blocks, [0], ARRIVAL, 2, 1)
    with pytest.raises(ValueError, match="caches"):
        replay(blocks, [0], ARRIVAL, 2, 2, caches=0)


def test_analysis_limits_at_and_past():
    check_analysis_limits(1, [1], 1)
    check_analysis_limits(MAX_BLOCK_TOKENS, [MAX_BLOCK_TOKENS] * MAX_CACHE_SIZES, MAX_CACHES)
    check_analysis_limits(16, [MAX_CACHE_BLOCKS * 16], 1)
    for args, match in [((0, [], 1), "block"), ((MAX_BLOCK_TOKENS + 1, [], 1), "block"),
                        ((16, [], 0), "caches"), ((16, [], MAX_CACHES + 1), "caches"),
                        ((16, [16] * (MAX_CACHE_SIZES + 1), 1), "cache sizes"),
                        ((16, [15], 1), "cache of 15"), ((16, [(MAX_CACHE_BLOCKS + 1) * 16], 1), "cache of")]:
        with pytest.raises(ValueError, match=match):
            check_analysis_limits(*args)
