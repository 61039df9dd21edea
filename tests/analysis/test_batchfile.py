"""pipeline.analysis.batchfile: a batch file's figures from its items, one at a time. Figures
worked out by hand on five requests; the shape-grouped model against replaying its walk
through the LRU (random prefix trees whose requests share nothing beyond their declared
prefixes); memory that does not grow with the requests; the replayed cache's limit."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from pipeline.analysis.batchfile import MAX_REPLAY_CACHE_BLOCKS, SHAPE_GROUPED, TAIL_COMPARE_BLOCKS, BatchFileAnalysis
from pipeline.analysis.reuse import ARRIVAL, CacheReplay
from pipeline.analysis.workload import prompt_blocks
from pipeline.producer.signature import chain
from pipeline.producer.workload import WorkItem


def item(components: list[list[int]], suffix: list[int], model: int = 0) -> WorkItem:
    return WorkItem(model=model, components=[np.array(c, dtype=np.int32) for c in components],
                    suffix=np.array(suffix, dtype=np.int32), payload=b"", timestamp_ms=None, line=0)


def analyze(items: list[WorkItem], block: int, sizes: list[int], top: int = 10) -> dict:
    analysis = BatchFileAnalysis(block, sizes)
    for line, one in enumerate(items, start=1):
        analysis.add(one, line)
        analysis.check_invariants()
    got = analysis.finish(top)
    analysis.check_invariants()
    return got


A = list(range(1, 9))  # 8 tokens: two blocks of 4
AB = [9, 10, 11, 12]
X = [20, 21, 22, 23, 24, 25]
FIVE = [
    item([A], [100, 101, 102]),       # 11 tokens
    item([X], [103, 104, 105, 106]),  # 10
    item([A, AB], [107, 108]),        # 14
    item([A], [109, 110, 111]),       # 11
    item([], [1, 2, 3, 4, 5]),        # 5: no components, but its first block is A's
]


def test_five_requests_by_hand():
    got = analyze(FIVE, 4, [4, 64])
    assert (got["prompt_tokens"], got["block_tokens"], got["caches"]) == (51, 4, 1)
    assert got["shapes"]["count"] == 4 and got["shapes"]["max_depth"] == 2
    # level A is in requests 1, 3 and 4 (8 tokens each); nothing else is in two
    assert got["shared_prefix"] == {"request_tokens": 24, "distinct_tokens": 8, "share": 24 / 51}
    top = [(s["requests"], s["tokens"], s["prefix_tokens"], s["components"], s["first_line"])
           for s in got["shapes"]["top"]]
    assert top == [(2, 22, 8, 1, 1), (1, 14, 12, 2, 3), (1, 10, 6, 1, 2), (1, 5, 0, 0, 5)]
    rows = {(r["order"], r["cache_tokens"]): r["hit_tokens"] for r in got["reuse"]}
    # Shape-grouped: request 4 finds A's 2 blocks after request 1; the first of (A, AB)
    # finds A's 2 blocks (its parent is a shape walked before it); with one block of
    # cache, one each. Arrival with one block: request 4 finds A's first block (request 3
    # left it), request 5 too; with 16, requests 3 and 4 find A's 2 blocks and request 5
    # the first (undeclared: the grouped model does not count it).
    assert rows == {(ARRIVAL, 4): 8, (SHAPE_GROUPED, 4): 8, (ARRIVAL, 64): 20, (SHAPE_GROUPED, 64): 16}
    assert got["bound"] == {"order": SHAPE_GROUPED, "cache_tokens": None, "caches": 1, "hit_tokens": 16,
                            "input_tokens": 51, "reuse": 16 / 51}


def test_no_requests():
    got = analyze([], 16, [4096])
    assert got["prompt_tokens"] == 0 and got["shapes"] == {"count": 0, "max_depth": 0, "top": []}
    assert got["bound"]["hit_tokens"] == 0 and got["shared_prefix"]["share"] == 0.0


def _random_items(rng: random.Random, stems: bool = False) -> list[WorkItem]:
    """Requests over a random tree of components, each token drawn once (so two requests
    share a full block only inside a common declared prefix), in random order. With `stems`
    every request of a shape opens its own tokens with its shape's stem (a user turn's
    template header): requests of a shape share text after their declared prefix too."""
    fresh = iter(range(1000, 10 ** 9))

    def tokens(low: int, high: int) -> list[int]:
        return [next(fresh) for _ in range(rng.randint(low, high))]

    shapes: list[list[list[int]]] = [[]]
    for _ in range(rng.randint(1, 12)):
        parent = rng.choice(shapes)
        if len(parent) < 4:
            shapes.append(parent + [tokens(1, 40)])
    stem = [tokens(0, TAIL_COMPARE_BLOCKS) if stems else [] for _ in shapes]  # within what is compared
    out = []
    for _ in range(rng.randint(1, 80)):
        k = rng.randrange(len(shapes))
        out.append(item(shapes[k], stem[k] + tokens(1, 30), model=rng.choice((0, 0, 0, 1))))
    return out


def _keyed(one: WorkItem) -> np.ndarray:
    """A request's tokens made its model's own (no block of model 1 is one of model 0)."""
    return one.tokens + np.int32(10 ** 9 * one.model)


def _replay(items: list[WorkItem], block: int, capacity_blocks: int) -> int:
    replay = CacheReplay(block, [capacity_blocks])
    replay.feed(0, prompt_blocks([_keyed(one) for one in items], block))
    return replay.hit_tokens


def _walk_replay(items: list[WorkItem], block: int, capacity_blocks: int) -> int:
    """The shape-grouped order replayed through the LRU: shapes by (model, chain), the
    empty one first; each shape's requests together, in file order."""
    walk = sorted(range(len(items)), key=lambda k: (items[k].model, chain(items[k].components)
                                                    if items[k].components else (), k))
    return _replay([items[k] for k in walk], block, capacity_blocks)


@pytest.mark.parametrize("stems", (False, True))
@pytest.mark.parametrize("seed", range(40))
def test_shape_grouped_model_is_the_lru_on_its_walk(seed, stems):
    rng = random.Random(seed)
    items = _random_items(rng, stems)
    block = rng.choice((1, 2, 4, 16))
    sizes = sorted({block * rng.randint(1, 6), block * rng.randint(1, 60)})
    got = analyze(items, block, sizes)
    grouped = {r["cache_tokens"]: r["hit_tokens"] for r in got["reuse"] if r["order"] == SHAPE_GROUPED}
    for size in sizes:
        assert grouped[size] == _walk_replay(items, block, size // block), (seed, size)
    everything = sum(len(one.tokens) for one in items) // block + 1
    assert got["bound"]["hit_tokens"] == _walk_replay(items, block, everything)
    arrival = {r["cache_tokens"]: r["hit_tokens"] for r in got["reuse"] if r["order"] == ARRIVAL}
    for size in sizes:
        assert arrival[size] == _replay(items, block, size // block)


@pytest.mark.parametrize("stem_blocks", (TAIL_COMPARE_BLOCKS, TAIL_COMPARE_BLOCKS + 1))
def test_text_shared_after_the_prefix_counts_up_to_what_is_compared(stem_blocks):
    # Blocks of one token: a 4-token prefix, then a stem both requests open with, then
    # their own token. The second finds the prefix and the stem, at most
    # TAIL_COMPARE_BLOCKS of it.
    stem = list(range(100, 100 + stem_blocks))
    got = analyze([item([[1, 2, 3, 4]], stem + [7]), item([[1, 2, 3, 4]], stem + [8])], 1, [4096])
    grouped = {r["cache_tokens"]: r["hit_tokens"] for r in got["reuse"] if r["order"] == SHAPE_GROUPED}
    assert grouped[4096] == got["bound"]["hit_tokens"] == 4 + min(stem_blocks, TAIL_COMPARE_BLOCKS)


def _peak_bytes(requests: int) -> int:
    """Traced peak of analyzing `requests` requests of three shapes, 40-token user turns of
    their own, through caches that the first few hundred requests fill."""
    systems = [np.arange(n, dtype=np.int32) + 10 ** 6 * n for n in (300, 120, 45)]
    tracemalloc.start()
    try:
        analysis = BatchFileAnalysis(16, [4096, 16384])
        for k in range(requests):
            turn = np.arange(40 * k, 40 * k + 40, dtype=np.int32)
            analysis.add(WorkItem(0, [systems[k % 3]], turn, b"", None, 0), k + 1)
        analysis.finish()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_requests():
    small, large = _peak_bytes(1_000), _peak_bytes(10_000)
    # Ten times the requests; anything kept per request (even 100 bytes of it) would add
    # 0.9 MB to the larger run, against a peak of about 0.5 MB (mostly the replayed caches).
    assert large <= 1.25 * small, (small, large)


def test_the_replayed_cache_at_and_past_its_limit():
    BatchFileAnalysis(1, [MAX_REPLAY_CACHE_BLOCKS]).check_invariants()
    with pytest.raises(ValueError, match="blocks"):
        BatchFileAnalysis(1, [MAX_REPLAY_CACHE_BLOCKS + 1])
