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
from collections import OrderedDict
from dataclasses import dataclass

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
        """The chained hash of each full block of each prompt, for a whole batch at once.

        Example, block size 4, prompts of 9 and 4 tokens: blocks [p0[0:4], p0[4:8], p1[0:4]]
        are hashed together; local block numbers are [0, 1, 0]; the running sums restart at
        each prompt's first block, so p1's chain does not include p0's blocks.
        """
        block = self.config.block_size_tokens
        counts = np.array([p.shape[0] // block for p in prompts], dtype=np.int64)
        total = int(counts.sum())
        if total == 0:
            return [[] for _ in prompts]
        self._ensure_powers(int(counts.max()))
        blocks = np.concatenate([p[: n * block] for p, n in zip(prompts, counts.tolist()) if n])
        content = _mix((blocks.reshape(total, block).astype(np.uint64) * self._weights).sum(axis=1, dtype=np.uint64))
        starts = np.zeros(counts.shape[0], dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        local = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
        running = np.cumsum(content * self._inverse_powers[local], dtype=np.uint64)
        before = np.concatenate([[_U64(0)], running])[np.repeat(starts, counts)]  # sum before each prompt
        hashes = _mix((running - before) * self._powers[local]).tolist()
        out, at = [], 0
        for n in counts.tolist():
            out.append(hashes[at:at + n])
            at += n
        return out

    def _lookup_and_insert(self, hashes: list[int], length: int) -> int:
        """Cached tokens for one prompt, then every block of it becomes most recent."""
        cache = self._cache
        hits = 0
        for h in hashes:
            if h not in cache:
                break
            hits += 1
        block = self.config.block_size_tokens
        cached = min(hits * block, ((length - 1) // block) * block)
        touch = cache.move_to_end
        for h in reversed(hashes):  # tail first: the head ends most recent
            try:
                touch(h)  # a hit: one operation
            except KeyError:
                cache[h] = None  # new: inserted as the most recent
        evicted = 0
        while len(cache) > self._capacity_blocks:
            cache.popitem(last=False)
            evicted += 1
        self.counters.extra["evicted_blocks"] += evicted
        return cached

    def cacheable_tokens(self, prefix_len: int) -> int:
        block = self.config.block_size_tokens
        return (prefix_len // block) * block

    def run(self, batch: EngineBatch) -> EngineResult:
        block = self.config.block_size_tokens
        outputs: list[list[int]] = []
        cached_tokens: list[int] = []
        c = self.counters
        all_hashes = self.block_hashes(list(batch.prompts))
        for prompt, prefix_len, hashes in zip(batch.prompts, batch.prefix_lens, all_hashes):
            length = int(prompt.shape[0])
            cached = self._lookup_and_insert(hashes, length)
            cacheable = (int(prefix_len) // block) * block
            cached_tokens.append(cached)
            seed = hashes[-1] if hashes else int(prompt[-1])
            outputs.append([(seed >> (8 * k)) & 0x7FFF for k in range(self.config.output_tokens)])
            c.prompt_tokens += length
            c.cacheable_tokens += cacheable
            c.cache_hit_tokens += cached
            c.extra["cacheable_hit_tokens"] += min(cached, cacheable)
            c.output_tokens += self.config.output_tokens
        count = len(batch.prompts)
        c.batches += 1
        c.prompts += count
        c.padded_tokens += count * batch.pad_to_tokens
        if self.config.cost_s_per_padded_token > 0:
            time.sleep(count * batch.pad_to_tokens * self.config.cost_s_per_padded_token)
        return EngineResult(outputs, cached_tokens)
