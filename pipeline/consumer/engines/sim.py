"""The `sim` engine: a simulated inference runtime with a real block-hash prefix cache.

It is the embedded default (no GPU needed) and the yardstick for what the broker buys: it
counts exactly what a vLLM-style engine would pay for and save.

Prefix cache, as vLLM's automatic prefix caching: a prompt is cut into full blocks of
`block_size_tokens`; block i's hash chains every token of blocks 0..i, so two prompts share
a cached block only if they share everything before it. A prompt's cached tokens are its
leading blocks found in the cache (the first miss ends the run); at least one token is
always computed, as an engine must produce logits. Capacity is in tokens (whole blocks),
evicted least recently used, and a prompt's blocks are touched tail first so a prefix's head
outlives its tail, as vLLM frees a request's blocks in reverse order.

Cost model: padded tokens (`len(prompts) * pad_to_tokens`), optionally slept at
`cost_s_per_padded_token` to emulate a GPU's time.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from pipeline.consumer.engines.base import Engine, EngineBatch, EngineResult

# vLLM's default KV block size.
DEFAULT_BLOCK_SIZE_TOKENS = 16
# About what one 80 GB GPU holds for a 7B model in FP16 after weights (~1M tokens of KV).
DEFAULT_CAPACITY_TOKENS = 1 << 20
# Generated tokens per prompt: the sim stands for the prefill-heavy batch work the broker
# schedules; a few output ids are enough to carry a result.
DEFAULT_OUTPUT_TOKENS = 4

_U64 = np.uint64
# Chained block hash, computed for every block of a prompt at once with numpy:
#   c_j = mix(sum_k tokens[j*B + k] * W_k)          block j's content (mod 2**64)
#   H_i = mix(sum_{j<=i} c_j * P**(i-j))            chains every block before it
# NOTE: xxh3 per block was rejected: one call per block from Python costs ~5 us for a
# 256-token prompt, which would make the simulator, not the broker, the bottleneck. A 64-bit
# polynomial hash with a strong finaliser is ample for a simulator's cache keys.
_CHAIN_P = _U64(0x9E3779B97F4A7C15)  # odd, so invertible mod 2**64
_CHAIN_P_INV = _U64(pow(int(_CHAIN_P), -1, 1 << 64))


def _ragged_local(counts: np.ndarray) -> np.ndarray:
    """0..n-1 for each n of `counts`, back to back: [2, 0, 3] -> [0, 1, 0, 1, 2]."""
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise (uint64, wrapping)."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


@dataclass(slots=True)
class SimConfig:
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    output_tokens: int = DEFAULT_OUTPUT_TOKENS
    cost_s_per_padded_token: float = 0.0


class SimEngine(Engine):
    """Simulated engine with an LRU block-hash prefix cache.

    Owner: one consumer process. Not thread-safe.

    Example, block size 4, empty cache: prompt A = [1..10] has blocks [1-4], [5-8] (the last
    two tokens are no full block): 0 cached, both blocks stored. Prompt B = [1..8, 99] then
    finds both blocks: 8 cached tokens. Prompt C = [0, 2, 3, 4, 5..8] differs in its first
    token, so even its second block hashes differently: 0 cached.
    """

    name = "sim"

    def __init__(self, config: SimConfig | None = None, **overrides) -> None:
        super().__init__()
        self.config = config or SimConfig(**overrides)
        block = self.config.block_size_tokens
        if block <= 0 or self.config.capacity_tokens < block or self.config.output_tokens < 0:
            raise ValueError(f"sim engine: bad config {self.config}")
        self._capacity_blocks = self.config.capacity_tokens // block
        self._cache: OrderedDict[int, None] = OrderedDict()
        rng = np.random.default_rng(0x5EED)
        self._weights = rng.integers(1, 1 << 63, size=block, dtype=np.uint64) | _U64(1)
        self._powers = np.ones(1, dtype=np.uint64)
        self._inverse_powers = np.ones(1, dtype=np.uint64)
        self.counters.extra.update(evicted_blocks=0, cacheable_hit_tokens=0)
        # Every cacheable block hash this engine has referenced, for compulsory misses. It
        # grows with the distinct prefix blocks (templates x their blocks), not with prompts:
        # suffix blocks are never added.
        self._referenced: set[int] = set()

    def _ensure_powers(self, count: int) -> None:
        if count <= self._powers.shape[0]:
            return
        size = max(count, 2 * self._powers.shape[0])
        mask, p, p_inv = (1 << 64) - 1, int(_CHAIN_P), int(_CHAIN_P_INV)
        powers, inverse = [1] * size, [1] * size
        for i in range(1, size):  # Python ints: numpy scalars would warn on the wrap-around
            powers[i] = powers[i - 1] * p & mask
            inverse[i] = inverse[i - 1] * p_inv & mask
        self._powers = np.array(powers, dtype=np.uint64)
        self._inverse_powers = np.array(inverse, dtype=np.uint64)

    def block_hashes(self, prompts: list[np.ndarray]) -> list[list[int]]:
        """The chained hash of each full block of each prompt, as lists (see `_hash_blocks`)."""
        flat, counts = self._hash_blocks(prompts, np.array([p.shape[0] for p in prompts], dtype=np.int64))
        hashes = flat.tolist()
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        return [hashes[a:b] for a, b in zip(starts[:-1], starts[1:])]

    def _hash_blocks(self, prompts: Sequence[np.ndarray], lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The chained hash of each full block of each prompt, for a whole batch at once:
        every prompt's hashes back to back (uint64) and how many each prompt has.

        Example, block size 4, prompts of 9 and 4 tokens: blocks [p0[0:4], p0[4:8], p1[0:4]]
        are hashed together; local block numbers are [0, 1, 0]; the running sums restart at
        each prompt's first block, so p1's chain does not include p0's blocks.
        """
        block = self.config.block_size_tokens
        counts = lengths // block
        total = int(counts.sum())
        if total == 0:
            return np.zeros(0, dtype=np.uint64), counts
        self._ensure_powers(int(counts.max()))
        tokens = np.concatenate(prompts)  # one copy of the batch, as an engine's input tensor
        whole = counts * block
        if not (whole == lengths).all():  # drop each prompt's partial last block
            tails = np.repeat(np.cumsum(lengths) - lengths + whole, lengths - whole)
            tokens = np.delete(tokens, tails + _ragged_local(lengths - whole))
        content = _mix((tokens.reshape(total, block).astype(np.uint64) * self._weights).sum(axis=1, dtype=np.uint64))
        first = np.repeat(np.cumsum(counts) - counts, counts)  # each block's prompt's first block
        local = np.arange(total, dtype=np.int64) - first
        running = np.cumsum(content * self._inverse_powers[local], dtype=np.uint64)
        before = np.concatenate([[_U64(0)], running])[first]  # sum before each prompt
        return _mix((running - before) * self._powers[local]), counts

    def _touch_batch(self, flat: np.ndarray, counts: np.ndarray) -> np.ndarray | None:
        """The batch's cache lookups and updates in a few bulk operations: per prompt, how
        many leading blocks were cached; or None, with nothing changed, when the batch must
        run prompt by prompt (`_lookup_and_insert`).

        Exact, not an approximation: it gives what running the prompts one by one gives,
        whenever no eviction during the batch hits a block the batch uses. A block of
        prompt i is then cached iff it was cached before the batch or an earlier prompt of
        the batch has it; the cache ends with every block the batch touched at the recent
        end, ordered by its last touch (tail first within a prompt); and the evicted blocks
        are the oldest ones before the batch, as many as the new blocks overflow.
        NOTE: one cache operation per block, prompt by prompt, was the first version: 16
        dictionary operations per 256-token prompt made the engine a third of a consumer's
        CPU time. Here the cost per block is numpy work and one C-level dictionary
        operation per distinct block.
        """
        cache = self._cache
        distinct, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
        known = distinct.tolist()
        was_cached = np.fromiter(map(cache.__contains__, known), dtype=bool, count=len(known))
        used = distinct[was_cached].tolist()
        evict = len(cache) + len(known) - len(used) - self._capacity_blocks
        # The oldest blocks go first, popped by C code; put back if the batch needs one of them.
        victims = [key for key, _ in map(cache.popitem, repeat(False, min(max(evict, 0), len(cache))))]
        if len(victims) < evict or not set(used).isdisjoint(victims):
            for key in reversed(victims):
                cache[key] = None
                cache.move_to_end(key, last=False)
            return None
        prompt_of = np.repeat(np.arange(counts.shape[0]), counts)
        starts = np.cumsum(counts) - counts
        local = _ragged_local(counts)
        cached = was_cached[inverse] | (prompt_of[first][inverse] < prompt_of)
        # Each prompt's first uncached block (its block count if none): the hits it gets.
        first_miss = np.where(cached, np.repeat(counts, counts), local)
        hits = np.zeros(counts.shape[0], dtype=np.int64)
        some = counts > 0
        hits[some] = np.minimum.reduceat(first_miss, starts[some])
        last_touch = np.full(len(known), -1, dtype=np.int64)
        np.maximum.at(last_touch, inverse, np.repeat(starts + counts - 1, counts) - local)
        deque(map(cache.pop, used), maxlen=0)  # a C loop: no bytecode per block
        cache.update(zip(distinct[np.argsort(last_touch)].tolist(), repeat(None)))
        self.counters.extra["evicted_blocks"] += len(victims)
        return hits

    def _lookup_and_insert(self, hashes: list[int]) -> int:
        """Cached blocks for one prompt, then every block of it becomes most recent (the
        prompt-by-prompt path, for batches `_touch_batch` cannot take)."""
        cache = self._cache
        hits = 0
        for h in hashes:
            if h not in cache:
                break
            hits += 1
        touch = cache.move_to_end
        for h in reversed(hashes):  # tail first: the head ends most recent
            if h in cache:
                touch(h)
            else:
                cache[h] = None  # new: inserted as the most recent
        evicted = 0
        while len(cache) > self._capacity_blocks:
            cache.popitem(last=False)
            evicted += 1
        self.counters.extra["evicted_blocks"] += evicted
        return hits

    def run(self, batch: EngineBatch) -> EngineResult:
        block = self.config.block_size_tokens
        prompts = batch.prompts
        count = len(prompts)
        lengths = np.array([p.shape[0] for p in prompts], dtype=np.int64)
        flat, counts = self._hash_blocks(prompts, lengths)
        hits = self._touch_batch(flat, counts) if flat.shape[0] else np.zeros(count, dtype=np.int64)
        if hits is None:
            ends = np.cumsum(counts).tolist()
            hashes = flat.tolist()
            hits = np.array([self._lookup_and_insert(hashes[end - n:end])
                             for end, n in zip(ends, counts.tolist())], dtype=np.int64)
        cached = np.minimum(hits * block, (lengths - 1) // block * block)
        cacheable = np.asarray(batch.prefix_lens, dtype=np.int64) // block * block
        compulsory_blocks = self._first_references(flat, counts, cacheable // block, hits)
        outputs = self._outputs(prompts, flat, counts)
        c = self.counters
        c.batches += 1
        c.prompts += count
        c.prompt_tokens += int(lengths.sum())
        c.padded_tokens += count * batch.pad_to_tokens
        c.cacheable_tokens += int(cacheable.sum())
        c.cache_hit_tokens += int(cached.sum())
        c.extra["cacheable_hit_tokens"] += int(np.minimum(cached, cacheable).sum())
        c.compulsory_miss_tokens += compulsory_blocks * block
        c.output_tokens += count * self.config.output_tokens
        if self.config.cost_s_per_padded_token > 0:
            time.sleep(count * batch.pad_to_tokens * self.config.cost_s_per_padded_token)
        return EngineResult(outputs, cached.tolist())

    def _first_references(self, flat: np.ndarray, counts: np.ndarray, cacheable_blocks: np.ndarray,
                          hits: np.ndarray) -> int:
        """How many distinct cacheable blocks of the batch missed and had never been
        referenced as cacheable by this engine (each a miss however the work had been
        scheduled), remembering every cacheable block of the batch. Only misses count, so
        hits + compulsory misses never exceed the cacheable blocks.

        Example, block size 4: two prompts of 9 tokens with prefix_len 8 share their 2
        leading blocks, never seen: 2 compulsory blocks, not 4 (the second prompt hits them).
        """
        if flat.shape[0] == 0:
            return 0
        local = _ragged_local(counts)
        in_prefix = local < np.repeat(np.minimum(cacheable_blocks, counts), counts)
        missed = in_prefix & (local >= np.repeat(hits, counts))
        new = set(flat[missed].tolist()) - self._referenced
        self._referenced.update(flat[in_prefix].tolist())
        return len(new)

    def _outputs(self, prompts: Sequence[np.ndarray], flat: np.ndarray, counts: np.ndarray) -> list[list[int]]:
        """Each prompt's output ids: bytes of its last block's hash (of its last token when
        it has no full block), a deterministic stand-in for generated tokens."""
        shifts = np.arange(self.config.output_tokens, dtype=np.uint64) * _U64(8)
        seeds = flat[np.maximum(np.cumsum(counts) - 1, 0)] if flat.shape[0] else np.zeros(len(prompts), dtype=np.uint64)
        outputs = (seeds[:, None] >> shifts) & _U64(0x7FFF)
        short = np.flatnonzero(counts == 0)
        if short.size:  # a last token may be negative: shift it as a signed number
            last = np.array([int(prompts[i][-1]) for i in short.tolist()], dtype=np.int64)
            outputs[short] = ((last[:, None] >> shifts.astype(np.int64)) & 0x7FFF).astype(np.uint64)
        return outputs.tolist()
