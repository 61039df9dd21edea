"""Prefix reuse of a workload through modelled prefix caches: the prefix trie's figures, the
prefix-sorted order (a depth-first walk of the trie), and an LRU replay. Pure code.

A prompt is given as its chained full-block keys (block i's key names every token of blocks
0..i, as vLLM's automatic prefix caching and the sim engine hash them; `blocks.py` makes
them with the sim's own hash) and its length in tokens. The cache is the sim's: the sim
engine's `PrefixCache` (LRU in blocks, a prompt's blocks touched tail first), and a
prompt's cached tokens are its leading cached blocks, cut so that at least its last token
is computed: min(hits * B, (length - 1) // B * B), the sim engine's formula (vLLM
recomputes the whole last block of a fully cached prompt).

Prefix reuse = cached tokens / input tokens (every token of every prompt, partial last
blocks included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.consumer.engines.prefix_cache import BatchLayout, PrefixCache

# Prompts replayed through a cache per call of PrefixCache.run: a batch gives exactly what
# its prompts give one by one, and the numpy work per call is amortised over the batch.
# NOTE: one prompt per call was rejected: on the Mooncake trace with 16-token blocks the
# per-call overhead dominated.
REPLAY_BATCH_PROMPTS = 64


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """One prompt as the cache sees it: `keys`, its full blocks' chained keys (uint64,
    read-only), and `length`, its tokens (at least len(keys) * block_tokens)."""

    keys: np.ndarray
    length: int


def prefix_sorted_order(prompts: Sequence[PromptBlocks]) -> list[int]:
    """Indices of `prompts` in a depth-first walk of their block trie: sorted by key
    sequence, a prompt before the prompts it is a prefix of, and among prompts with the
    same full blocks the shorter first (a prompt of exactly its full blocks computes its last
    block even when all of them are cached, so it goes where nothing it has is cached yet).
    Every set of prompts that share a block is contiguous in this order."""
    return sorted(range(len(prompts)), key=lambda i: (prompts[i].keys.tolist(), prompts[i].length, i))


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """How much of a workload sits in blocks that two or more prompts share (at the block
    size the keys were cut at): `item_tokens` counts each prompt's shared blocks,
    `distinct_tokens` each shared block once, `distinct_blocks` every distinct block."""

    item_tokens: int
    distinct_tokens: int
    distinct_blocks: int


def shared_prefix(prompts: Sequence[PromptBlocks], block_tokens: int) -> SharedPrefix:
    """The SharedPrefix figures. A chained key is in a prompt at most once, so a key's count
    is how many prompts share that prefix."""
    if not prompts:
        return SharedPrefix(0, 0, 0)
    keys, counts = np.unique(np.concatenate([p.keys for p in prompts]), return_counts=True)
    shared = counts >= 2
    return SharedPrefix(int(counts[shared].sum()) * block_tokens, int(np.count_nonzero(shared)) * block_tokens,
                        int(keys.shape[0]))


class CacheReplay:
    """Prompts replayed through `len(capacities)` independent LRU caches, counting input and
    cached tokens. Owner: one caller; not thread-safe.

        replay = CacheReplay(16, [4096, 4096])
        replay.feed(0, [prompt_a, prompt_b])   # prompts to cache 0, in this order
        replay.hit_tokens / replay.input_tokens
    """

    def __init__(self, block_tokens: int, capacities_blocks: Sequence[int]) -> None:
        if block_tokens < 1 or not capacities_blocks:
            raise ValueError(f"cache replay: block of {block_tokens} tokens, {len(capacities_blocks)} caches")
        self.block_tokens = block_tokens
        self.caches = [PrefixCache(capacity) for capacity in capacities_blocks]
        self.prompts = 0
        self.input_tokens = 0
        self.hit_tokens = 0
        self.most_cacheable_tokens = 0  # what the at-least-one-token rule leaves cacheable

    def feed(self, cache: int, prompts: Sequence[PromptBlocks]) -> list[int]:
        """Run `prompts` in order through cache `cache`; each one's cached tokens."""
        block = self.block_tokens
        out: list[int] = []
        for start in range(0, len(prompts), REPLAY_BATCH_PROMPTS):
            batch = prompts[start:start + REPLAY_BATCH_PROMPTS]
            counts = np.array([p.keys.shape[0] for p in batch], dtype=np.int64)
            lengths = np.array([p.length for p in batch], dtype=np.int64)
            flat = np.concatenate([p.keys for p in batch]) if counts.sum() else np.zeros(0, dtype=np.uint64)
            # No block is named cacheable: compulsory misses are not counted here, and a block
            # once named cacheable keeps its index entry after eviction (an index growing with
            # every distinct block replayed, not with the cache).
            hits, _ = self.caches[cache].run(flat, BatchLayout.of(counts), np.zeros_like(counts))
            most = np.minimum(counts * block, (lengths - 1) // block * block)
            cached = np.minimum(hits * block, most)
            self.prompts += len(batch)
            self.input_tokens += int(lengths.sum())
            self.hit_tokens += int(cached.sum())
            self.most_cacheable_tokens += int(most.sum())
            out.extend(cached.tolist())
        return out

    @property
    def reuse(self) -> float:
        """Cached tokens / input tokens (0 before any input)."""
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def check_invariants(self) -> None:
        """Side-effect free: counts are whole blocks and bounded, no cache over capacity."""
        assert 0 <= self.hit_tokens <= self.most_cacheable_tokens <= self.input_tokens, self
        assert self.hit_tokens % self.block_tokens == 0
        assert self.input_tokens >= self.prompts
        for cache in self.caches:
            assert 0 <= len(cache) <= cache.capacity_blocks


@dataclass(frozen=True, slots=True)
class ReuseResult:
    """One replay's figures: the order, cache size (None: unbounded) and count."""

    order: str
    cache_tokens: int | None
    caches: int
    input_tokens: int
    hit_tokens: int

    @property
    def reuse(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


ARRIVAL = "arrival"
PREFIX_SORTED = "prefix-sorted"


def replay(prompts: Sequence[PromptBlocks], order: Sequence[int], name: str, block_tokens: int,
           cache_tokens: int | None, caches: int = 1, distinct_blocks: int | None = None) -> ReuseResult:
    """Replay `prompts` in `order` through `caches` caches of `cache_tokens` each (None:
    unbounded). Arrival order deals prompt k to cache k % caches (a round-robin dispatcher);
    any other order is cut into `caches` contiguous runs (each cache takes one stretch of
    the walk, as a shape-aware dispatcher keeps a prefix on one consumer).

    `distinct_blocks` (how many distinct keys there are, if known) caps each cache's
    allocation: a cache that large never evicts, so larger ones give the same result.
    """
    if caches < 1:
        raise ValueError(f"replay through {caches} caches")
    if cache_tokens is not None and cache_tokens < block_tokens:
        raise ValueError(f"a cache of {cache_tokens} tokens holds no block of {block_tokens}")
    room = distinct_blocks if distinct_blocks is not None else sum(p.keys.shape[0] for p in prompts)
    capacity = max(room, 1) if cache_tokens is None else max(min(cache_tokens // block_tokens, room), 1)
    run = CacheReplay(block_tokens, [capacity] * caches)
    if name == ARRIVAL:
        shares = [list(order[k::caches]) for k in range(caches)]
    else:
        shares = [part.tolist() for part in np.array_split(np.asarray(order, dtype=np.int64), caches)]
    for cache, share in enumerate(shares):
        run.feed(cache, [prompts[i] for i in share])
    return ReuseResult(name, cache_tokens, caches, run.input_tokens, run.hit_tokens)
