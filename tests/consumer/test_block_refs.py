"""BlockReferences: the sim engine's cacheable and compulsory-miss counts beside an engine
that reports only its cached tokens per prompt (the vllm engine)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.consumer.engines import EngineBatch, SimEngine
from pipeline.consumer.engines.block_refs import BlockReferences


def test_the_docstring_example():
    refs = BlockReferences(block_size_tokens=2)
    prompt = np.array([1, 2, 3, 4, 5], dtype=np.int32)
    assert refs.account([prompt], [4], [0]) == (4, 4)
    assert refs.account([prompt], [4], [4]) == (4, 0)
    assert refs.account([np.array([9, 2, 3, 4], dtype=np.int32)], [4], [0]) == (4, 4)
    with pytest.raises(ValueError):
        BlockReferences(0)


@pytest.mark.parametrize("capacity_tokens", [64, 256, 4096])
def test_it_counts_what_the_sim_engine_counts(capacity_tokens):
    """Shapes share a system prompt, then their own component, then a random suffix; batches
    mix them so that blocks are first referenced as hits and as misses, and a small cache
    evicts: fed the sim's own cached tokens, the counts are the sim's."""
    rng = np.random.default_rng(7)
    block = 8
    system = rng.integers(0, 1000, 24, dtype=np.int32)
    shapes = [np.concatenate([system, rng.integers(0, 1000, int(n), dtype=np.int32)])
              for n in rng.integers(0, 40, 6)]
    sim = SimEngine(block_size_tokens=block, capacity_tokens=capacity_tokens)
    refs = BlockReferences(block)
    cacheable = compulsory = 0
    for _ in range(40):
        picks = rng.integers(0, len(shapes), int(rng.integers(1, 6)))
        prompts = [np.concatenate([shapes[s], rng.integers(0, 1000, int(rng.integers(0, 20)), dtype=np.int32)])
                   for s in picks]
        prefix_lens = [len(shapes[s]) - int(rng.integers(0, 10)) for s in picks]  # a prefix may end mid-block
        result = sim.run(EngineBatch(prompts, max(map(len, prompts)), prefix_lens))
        got = refs.account(prompts, prefix_lens, result.cached_tokens)
        cacheable += got[0]
        compulsory += got[1]
    assert sim.counters.compulsory_miss_tokens > 0
    assert (cacheable, compulsory) == (sim.counters.cacheable_tokens, sim.counters.compulsory_miss_tokens)


def test_two_generations_of_references_are_remembered_and_older_ones_forgotten():
    """At max_remembered_blocks the current generation becomes the one before: a block of
    either is not compulsory again; one that fell out of both counts once more."""
    refs = BlockReferences(block_size_tokens=1, max_remembered_blocks=3)

    def compulsory(token: int) -> int:
        return refs.account([np.array([token], dtype=np.int32)], [1], [0])[1]

    assert [compulsory(t) for t in (1, 2, 3)] == [1, 1, 1]  # the generation fills at 3: the one before
    assert len(refs) == 3 and refs.forgotten_generations == 1
    assert [compulsory(t) for t in (4, 1, 5)] == [1, 0, 1]  # 1 remembered, now a recent one
    assert [compulsory(t) for t in (2, 1, 6)] == [1, 0, 1]  # 2 fell out of both; 1 did not
    assert len(refs) <= 2 * refs.max_remembered_blocks
