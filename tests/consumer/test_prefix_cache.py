"""The numpy prefix cache against a one-prompt-at-a-time OrderedDict reference, on raw
block keys (duplicates within a prompt and across prompts, capacities smaller than a
prompt), long enough for index rebuilds, log compaction and log growth."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.consumer.engines.prefix_cache import BatchLayout, PrefixCache


class Reference:
    """The semantics, spelled out: hits are the leading keys cached; the prompt's keys are
    then touched tail first; the oldest are evicted down to the capacity."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.seen: set[int] = set()
        self.evicted = 0

    def run(self, keys: list[int], cacheable: int) -> tuple[int, int]:
        hits = 0
        while hits < len(keys) and keys[hits] in self.cache:
            hits += 1
        compulsory = 0
        for i, key in enumerate(keys[:cacheable]):
            compulsory += i >= hits and key not in self.seen
            self.seen.add(key)
        for key in reversed(keys):
            self.cache[key] = None
            self.cache.move_to_end(key)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
            self.evicted += 1
        return hits, compulsory


def _check(cache: PrefixCache, reference: Reference, batches: list[list[tuple[list[int], int]]]) -> None:
    for n, batch in enumerate(batches):
        flat = np.array([k for keys, _ in batch for k in keys], dtype=np.uint64)
        counts = np.array([len(keys) for keys, _ in batch], dtype=np.int64)
        cacheable = np.array([c for _, c in batch], dtype=np.int64)
        hits, compulsory = cache.run(flat, BatchLayout.of(counts), cacheable)
        expected = [reference.run(keys, c) for keys, c in batch]
        assert hits.tolist() == [h for h, _ in expected], n
        assert compulsory == sum(c for _, c in expected), n
        assert len(cache) == len(reference.cache), n
        assert cache.evicted_blocks == reference.evicted, n
    assert cache.keys_lru() == list(reference.cache)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(
    st.integers(1, 30),
    st.integers(2, 60),
    st.lists(st.lists(st.tuples(st.lists(st.integers(0, 59), max_size=12), st.integers(0, 12)),
                      min_size=1, max_size=6), min_size=1, max_size=15),
)
def test_matches_the_reference(capacity, universe, batches):
    batches = [[([k % universe for k in keys], c) for keys, c in batch] for batch in batches]
    _check(PrefixCache(capacity), Reference(capacity), batches)


def test_long_run_with_rebuilds_compaction_and_shared_prefixes():
    # Prompts of a few "shapes": a shared head of keys, then keys of their own; the cache
    # holds about 40 prompts' worth, so it evicts all the time, and the index and log turn
    # over many times. Batches are sometimes one shape (bulk) and sometimes mixed.
    rng = np.random.default_rng(7)
    capacity = 300
    heads = [rng.integers(1, 1 << 63, size=6, dtype=np.uint64).tolist() for _ in range(5)]
    cache, reference = PrefixCache(capacity), Reference(capacity)
    batches = []
    for b in range(400):
        shapes = [b % 5] * 8 if b % 3 else rng.integers(0, 5, size=8).tolist()
        batch = []
        for s in shapes:
            own = rng.integers(1, 1 << 63, size=int(rng.integers(0, 8)), dtype=np.uint64).tolist()
            if rng.random() < 0.2:  # an earlier prompt's exact keys come back
                own = batches[-1][0][0][6:] if batches and len(batches[-1][0][0]) > 6 else own
            batch.append((heads[s] + own, 6))
        batches.append(batch)
    _check(cache, reference, batches)
    assert cache.evicted_blocks > 10 * capacity


def test_a_prompt_longer_than_the_capacity_keeps_its_head():
    cache, reference = PrefixCache(3), Reference(3)
    _check(cache, reference, [[([1, 2], 2)], [([5, 6, 7, 8, 9], 5)]])
    assert cache.keys_lru() == [7, 6, 5]  # touched 9, 8, 7, 6, 5: the last three stay
    _check(cache, reference, [[([5, 6, 7, 1], 0), ([2], 1)]])


@settings(max_examples=150, derandomize=True, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1), st.sampled_from([2**63, 2**64 - 1])),
                min_size=1, max_size=300))
def test_group_sort_puts_equal_keys_side_by_side(values):
    # Small keys share their high bits with unequal ones (the fallback), large ones do not
    # (the packed sort); either way each distinct key is one run, `order` is a permutation
    # and `head` marks exactly the runs' starts.
    from pipeline.consumer.engines.prefix_cache import _group_sort

    keys = np.array(values, dtype=np.uint64)
    order, by_key, head = _group_sort(keys)
    assert sorted(order.tolist()) == list(range(keys.shape[0]))
    assert np.array_equal(by_key, keys[order])
    runs = [key for k, key in enumerate(by_key.tolist()) if head[k]]
    assert len(runs) == len(set(runs)) == len(set(values))
    assert head[0] and all(head[k] == (by_key[k] != by_key[k - 1]) for k in range(1, keys.shape[0]))


def test_remembered_layouts_stay_within_their_count_and_blocks(monkeypatch):
    from pipeline.consumer.engines import prefix_cache

    layouts = prefix_cache._Layouts()
    monkeypatch.setattr(prefix_cache, "_LAYOUTS", layouts)
    monkeypatch.setattr(prefix_cache, "LAYOUT_CACHE_MAX_BLOCKS", 100)
    monkeypatch.setattr(prefix_cache, "LAYOUT_CACHE_MAX", 4)
    first = BatchLayout.of(np.array([30, 20], dtype=np.int64))
    assert BatchLayout.of(np.array([30, 20], dtype=np.int64)) is first  # remembered
    BatchLayout.of(np.array([50], dtype=np.int64))
    assert (len(layouts.by_counts), layouts.blocks) == (2, 100)  # at the block limit: both kept
    BatchLayout.of(np.array([1], dtype=np.int64))
    assert (len(layouts.by_counts), layouts.blocks) == (1, 1)  # one block past it: forgotten, then kept
    for k in range(2, 5):
        BatchLayout.of(np.array([k], dtype=np.int64))
    assert len(layouts.by_counts) == 4  # at the count limit
    BatchLayout.of(np.array([9], dtype=np.int64))
    assert (len(layouts.by_counts), layouts.blocks) == (1, 9)  # past it
    alone = BatchLayout.of(np.array([101], dtype=np.int64))
    assert alone.counts.tolist() == [101] and (len(layouts.by_counts), layouts.blocks) == (0, 0)  # never kept


def test_past_max_remembered_blocks_old_references_are_forgotten_and_the_index_stays_bounded():
    """Distinct prompts without end: every evicted block's reference was kept, so the index
    grew with the run; past the bound they are forgotten at a rebuild (the compulsory count
    is then an upper bound of the reference's), and the index stops growing."""
    capacity, bound = 64, 1000
    cache, reference = PrefixCache(capacity, max_remembered_blocks=bound), Reference(capacity)
    rng = np.random.default_rng(3)
    old: list[int] = []
    largest_index = counted = expected = 0
    for n in range(2000):
        keys = rng.integers(1, 1 << 63, size=8, dtype=np.uint64).tolist()
        if n % 10 == 9 and old:  # an old prompt comes back: its blocks may be forgotten by now
            keys = old
        old = keys if n % 50 == 0 else old
        hits, compulsory = cache.run(np.array(keys, dtype=np.uint64), BatchLayout.of(np.array([8])), np.array([8]))
        want_hits, want = reference.run(keys, 8)
        assert hits.tolist() == [want_hits]
        counted, expected = counted + compulsory, expected + want
        largest_index = max(largest_index, cache._index_key.shape[0])
    assert cache.forgotten_references > 0 and counted > expected
    assert largest_index <= 8 * (bound + capacity)  # 16,000 blocks were referenced
