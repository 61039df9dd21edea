"""Cache accounting that needs no cache: cacheable and compulsory-miss tokens of a batch,
given how many tokens the engine's own prefix cache served each prompt.

A real engine (vLLM) keeps its prefix cache to itself and reports per prompt only how many
prompt tokens it served (`num_cached_tokens`). The sim engine's other two counters are
defined by blocks, not by the cache's contents, so they can be computed beside any engine:

- cacheable tokens: the whole blocks inside each prompt's declared prefix (the shape's
  components), `prefix_len // block * block`;
- compulsory misses: cacheable blocks missed on their first reference by this engine (the
  3C model's compulsory misses), as `PrefixCache._reference` counts them for the sim: a
  block is known by its chained hash (it names every token up to its end), a prompt's hits
  are its leading `cached // block` blocks, and a block counts when its first reference, in
  prompt order, is a miss.

Pure: no clock, no files; one instance per engine, not thread-safe.

    refs = BlockReferences(block_size_tokens=32)
    cacheable, compulsory = refs.account(prompts, prefix_lens, cached_tokens)

Memory: two generations of at most MAX_REMEMBERED_BLOCKS block hashes. A block referenced
last before both (256 Ki to 512 Ki other blocks since) is forgotten, and its next first miss counts
as compulsory again: an upper bound then, where a set of every block grew with a job whose
requests each have their own system prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

# Block hashes a generation holds (two are kept): ~70 bytes each in a Python set, so ~35 MiB
# at most beside the engine, for 8 Mi tokens of 16-token blocks not referenced since.
MAX_REMEMBERED_BLOCKS = 1 << 18


class BlockReferences:
    """The chained hashes of every cacheable block this engine has been asked for.

    Example, block size 2: prompt [1, 2, 3, 4, 5] with prefix 4 and 0 cached has cacheable
    blocks [1, 2] and [1, 2 | 3, 4]: 4 cacheable, 4 compulsory. The same prompt again with
    4 cached: 4 cacheable, 0 compulsory. [9, 2, 3, 4] with prefix 4 and 0 cached: its blocks
    chain a different first token, so 4 compulsory again.
    """

    def __init__(self, block_size_tokens: int, max_remembered_blocks: int = MAX_REMEMBERED_BLOCKS) -> None:
        if block_size_tokens <= 0:
            raise ValueError(f"block references: block size {block_size_tokens} tokens")
        assert max_remembered_blocks >= 1, max_remembered_blocks
        self.block_size_tokens = block_size_tokens
        self.max_remembered_blocks = max_remembered_blocks
        # Two generations of referenced blocks: a full current one becomes the one before.
        self._referenced: set[int] = set()
        self._referenced_before: set[int] = set()
        self.forgotten_generations = 0

    def __len__(self) -> int:
        """The blocks remembered as referenced (at most twice `max_remembered_blocks`)."""
        return len(self._referenced) + len(self._referenced_before)

    def account(self, prompts: Sequence[np.ndarray], prefix_lens: Sequence[int],
                cached_tokens: Sequence[int]) -> tuple[int, int]:
        """(cacheable tokens, compulsory-miss tokens) of prompts run in this order, each
        with the prompt tokens its engine served from cache; every cacheable block is
        referenced from now on.
        NOTE: one xxh3 call per block, where the sim hashes a batch in numpy: the sim
        rejected this for ~5 us per 256-token prompt, but beside a real engine's
        milliseconds per prompt it is noise, and it needs no per-engine state."""
        block = self.block_size_tokens
        cacheable_total = compulsory = 0
        for tokens, prefix, cached in zip(prompts, prefix_lens, cached_tokens):
            blocks = min(int(prefix), len(tokens)) // block
            cacheable_total += int(prefix) // block * block
            hits = int(cached) // block
            data = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
            chain = 0
            width = block * 4  # int32 bytes per block
            for i in range(blocks):
                chain = xxhash.xxh3_64_intdigest(data[i * width:(i + 1) * width], seed=chain)
                if chain not in self._referenced:
                    if chain not in self._referenced_before and i >= hits:
                        compulsory += block
                    self._remember(chain)
        return cacheable_total, compulsory

    def _remember(self, chain: int) -> None:
        self._referenced.add(chain)
        if len(self._referenced) >= self.max_remembered_blocks:
            self._referenced_before, self._referenced = self._referenced, set()
            self.forgotten_generations += 1
