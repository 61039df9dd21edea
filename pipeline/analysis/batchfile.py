"""`BatchFileAnalysis`: a batch file's shapes, shared prefixes and prefix reuse, from the
items its producers make, one request at a time, in memory that does not grow with the
number of requests (`pipeline tools analyze FILE --model DIR`; the items come from
`pipeline/batchjob/preview.py`). Pure: no I/O, no clock.

    analysis = BatchFileAnalysis(block_tokens=16, cache_tokens=[65536])
    for item, line in items: analysis.add(item, line)
    figures = analysis.finish(top=10)

A request's shape is its item's (model, signature of its components), as the producer
declares it; its prefix levels are the shape's chain (`signature.chain`): level k names its
first k + 1 components, and its length is their tokens.

What is kept: one row per prefix level, in compact columns found through one dictionary by
(model, level signature): its parent level, its length, and, for a level that is some
request's whole prefix (a shape), its requests, their prompt tokens, and its first request's
line and cacheable blocks; the requests not yet hashed (HASH_BATCH_PROMPTS); and one LRU of
block hashes per cache size, its memory proportional to its capacity. Rows grow with
distinct prefixes, nothing with requests.

Figures (B: the block size; a prompt's cached tokens are whole blocks, at least its last
token computed: min(found, (length - 1) // B) * B, the sim engine's and vLLM's rule):
- shared prefix: each request's deepest prefix level that two or more requests have, its
  tokens summed over requests; distinct: each such level's own component counted once.
- arrival order: the sim engine's cache (chained hashes of full blocks, LRU in blocks, a
  prompt's head touched last) replayed on every request in file order, block for block. It
  counts every full block two prompts share, declared or not.
- shape-grouped order: the order the product runs a job in, modelled from per-shape
  figures: a model's shapes one after another, its shape without components first, then a
  depth-first walk of their chains (children in signature order, so shapes that share
  leading components are next to each other), each shape's requests together in file
  order, through one LRU cache of C blocks. With p the
  full blocks of a request's prefix (its declared components):
  * a request after the first of its shape finds min(p + t, C) blocks, t the full blocks
    after its prefix it shares with the request of its shape before it (up to
    TAIL_COMPARE_BLOCKS): that request is the one just before it and left its own leading
    blocks most recent;
  * a shape's first request finds min(q, C), q the full blocks of the deepest prefix level
    it shares with the shapes walked before it (those of the shape just before it);
  * no other block of a request's own tokens, after its prefix, is found.
  This equals replaying that order through the LRU when no two requests share a full block
  beyond their common declared prefix except neighbours of one shape. What it does not
  count: other text two requests share beyond it (two system prompts that begin alike,
  requests of a shape that share text with an earlier one but not with the one before,
  completions, which declare no prefix); the arrival figure counts those, so on such files
  it can be the larger one.
- bound: the shape-grouped model with an unbounded cache: each declared prefix computed
  once, and what neighbours of a shape share after it once. A structural figure, not a prediction of speed: decoding and scheduling are not in it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.analysis.reuse import ARRIVAL, CacheReplay, PromptBlocks
from pipeline.analysis.workload import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_CACHE_TOKENS,
    DEFAULT_TOP_SHAPES,
    HASH_BATCH_PROMPTS,
    check_analysis_limits,
    prompt_blocks,
)
from pipeline.consumer.engines.sim import SimEngine
from pipeline.producer.signature import UINT64_MAX
from pipeline.producer.signature import chain as shape_chain
from pipeline.producer.workload import WorkItem
from pipeline.wire.shapes import EMPTY_SHAPE_SIGNATURE

SHAPE_GROUPED = "shape-grouped"
# The largest cache replayed in arrival order, in blocks: its LRU holds ~100 bytes a block
# (~100 MB here), allocated up front. 16 Mi tokens of 16-token blocks: more KV than the
# GPUs of a whole node hold for a 7B model (an 80 GB GPU holds ~0.5 Mi tokens of it).
MAX_REPLAY_CACHE_BLOCKS = 1 << 20
# Blocks after a shape's prefix kept of its last request, to count what the next request of
# the shape shares with it (a user turn's template header and opening words): 256 bytes a
# shape, so 100,000 shapes keep 25 MiB; text shared further than 512 tokens is not counted.
TAIL_COMPARE_BLOCKS = 32
# What a model's id is multiplied by to make its block keys its own (splitmix64's increment).
MODEL_KEY_MIX = 0x9E37_79B9_7F4A_7C15
# Level rows allocated at first; the columns double as prefixes come.
FIRST_ROWS = 1024
# The columns of a level row (see the module doc); `first_line` 0: no request has it as its
# whole prefix (yet); `first_most` is that first request's (length - 1) // B.
_COLUMNS = (("sig", np.uint64), ("parent", np.int64), ("length", np.int64), ("depth", np.int64),
            ("requests", np.int64), ("tokens", np.int64), ("first_line", np.int64), ("first_most", np.int64))


class BatchFileAnalysis:
    """The module doc's figures over the items given to `add`. Owner: one caller."""

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 cache_tokens: Sequence[int] = DEFAULT_CACHE_TOKENS) -> None:
        check_analysis_limits(block_tokens, cache_tokens, 1)
        for size in cache_tokens:
            if size // block_tokens > MAX_REPLAY_CACHE_BLOCKS:
                raise ValueError(f"cache of {size:,} tokens: at most {MAX_REPLAY_CACHE_BLOCKS:,} blocks of "
                                 f"{block_tokens} tokens are replayed")
        self.block_tokens = block_tokens
        self.cache_tokens = list(cache_tokens)
        # Each cache size's capacity in blocks, then None: the unbounded cache of the bound.
        self._capacities: list[int | None] = [size // block_tokens for size in cache_tokens] + [None]
        self._arrival = [CacheReplay(block_tokens, [capacity]) for capacity in self._capacities[:-1]]
        self._hasher = SimEngine(block_size_tokens=block_tokens, capacity_tokens=block_tokens)
        self._index: dict[int, int] = {}  # (model << 64 | level signature) -> row
        self._cols = {name: np.zeros(FIRST_ROWS, dtype=dtype) for name, dtype in _COLUMNS}
        self._rows = 0
        self._pending: list[tuple[WorkItem, int, bool]] = []  # (item, its shape's row, first of its shape)
        # Per shape row: the block keys after its prefix of its last request (TAIL_COMPARE_BLOCKS).
        self._tails: dict[int, np.ndarray] = {}
        # Per capacity: blocks found by the requests after the first of their shape (shape-grouped).
        self._later_blocks = [0] * len(self._capacities)
        self.requests = 0  # hashed and counted (`add`ed, less the pending)
        self.prompt_tokens = 0

    def add(self, item: WorkItem, line: int) -> None:
        """One request's item, in file order; `line` its line in the file (1-based)."""
        assert line > 0, line
        row = self._index.get(item.model << 64 | item.signature)
        if row is None:
            row = self._new_shape(item)
        first = not self._cols["first_line"][row]
        if first:
            self._cols["first_line"][row] = line
            self._cols["first_most"][row] = (item.length - 1) // self.block_tokens
        self._pending.append((item, row, first))
        if len(self._pending) >= HASH_BATCH_PROMPTS:
            self._flush()

    def _new_shape(self, item: WorkItem) -> int:
        """The rows of a shape not seen before (and of its levels not seen before): its own."""
        if not item.components:
            return self._row(item.model, EMPTY_SHAPE_SIGNATURE, -1, 0, 0)
        ends = np.cumsum([len(c) for c in item.components]).tolist()
        parent = -1
        for k, level in enumerate(shape_chain(item.components)):
            row = self._index.get(item.model << 64 | level)
            parent = row if row is not None else self._row(item.model, level, parent, ends[k], k + 1)
        return parent

    def _row(self, model: int, sig: int, parent: int, length: int, depth: int) -> int:
        row = self._rows
        if row == self._cols["sig"].shape[0]:
            for name, column in self._cols.items():
                grown = np.zeros(2 * row, dtype=column.dtype)
                grown[:row] = column
                self._cols[name] = grown
        for name, value in (("sig", sig), ("parent", parent), ("length", length), ("depth", depth)):
            self._cols[name][row] = value
        self._index[model << 64 | sig] = row
        self._rows += 1
        return row

    def _flush(self) -> None:
        """Hash the pending requests' blocks through the arrival caches and count them."""
        if not self._pending:
            return
        items = [item for item, _, _ in self._pending]
        rows = np.array([row for _, row, _ in self._pending], dtype=np.int64)
        later = ~np.array([first for _, _, first in self._pending], dtype=bool)
        lengths = np.array([item.length for item in items], dtype=np.int64)
        own = np.array([item.prefix_len for item in items], dtype=np.int64) // self.block_tokens
        self._pending = []
        prompts = _per_model(prompt_blocks([item.tokens for item in items], self.block_tokens, self._hasher),
                             [item.model for item in items])
        for replay in self._arrival:
            replay.feed(0, prompts)
        own += self._shared_tails(rows.tolist(), own.tolist(), prompts)
        np.add.at(self._cols["requests"], rows, 1)
        np.add.at(self._cols["tokens"], rows, lengths)
        most = (lengths - 1) // self.block_tokens
        for k, capacity in enumerate(self._capacities):
            found = own if capacity is None else np.minimum(own, capacity)
            self._later_blocks[k] += int(np.minimum(found, most)[later].sum())
        self.requests += len(items)
        self.prompt_tokens += int(lengths.sum())

    def _shared_tails(self, rows: list[int], own: list[int], prompts: list[PromptBlocks]) -> np.ndarray:
        """Per request, the full blocks after its prefix it shares with the last request of
        its shape before it (0 for a shape's first): keys are chained, so the shared blocks
        are the leading run of equal keys."""
        shared = np.zeros(len(rows), dtype=np.int64)
        for k, (row, start, prompt) in enumerate(zip(rows, own, prompts)):
            tail = prompt.keys[start:start + TAIL_COMPARE_BLOCKS]
            before = self._tails.get(row)
            if before is not None:
                n = min(tail.shape[0], before.shape[0])
                differ = np.flatnonzero(tail[:n] != before[:n])
                shared[k] = differ[0] if differ.size else n
            self._tails[row] = tail.copy()
        return shared

    def finish(self, top: int = DEFAULT_TOP_SHAPES) -> dict:
        """Every figure, as a JSON-ready dict (`top`: shapes listed, most requests first)."""
        self._flush()
        col = {name: column[:self._rows] for name, column in self._cols.items()}
        shapes = np.flatnonzero(col["first_line"] > 0)
        through = self._through(col)
        block = self.block_tokens
        found = self._first_found(col, shapes) // block
        runs = []
        for k, capacity in enumerate(self._capacities):
            firsts = found if capacity is None else np.minimum(found, capacity)
            hit_blocks = self._later_blocks[k] + int(np.minimum(firsts, col["first_most"][shapes]).sum())
            runs.append(_run_row(SHAPE_GROUPED, self.cache_tokens[k] if capacity is not None else None,
                                 self.prompt_tokens, hit_blocks * block))
        rows = []
        for size, replay, grouped in zip(self.cache_tokens, self._arrival, runs):
            rows += [_run_row(ARRIVAL, size, replay.input_tokens, replay.hit_tokens), grouped]
        shared, distinct = _shared(col, through)
        return {
            "block_tokens": block, "caches": 1, "prompt_tokens": self.prompt_tokens,
            "shapes": {"count": int(shapes.shape[0]),
                       "max_depth": int(col["depth"][shapes].max()) if shapes.shape[0] else 0,
                       "top": _top_shapes(col, shapes, top)},
            "shared_prefix": {"request_tokens": shared, "distinct_tokens": distinct,
                              "share": shared / self.prompt_tokens if self.prompt_tokens else 0.0},
            "bound": runs[-1], "reuse": rows,
        }

    @staticmethod
    def _through(col: dict[str, np.ndarray]) -> np.ndarray:
        """Per level, the requests whose prefix holds it: its own and its descendants'
        (a child's row comes after its parent's, and is one level deeper)."""
        through = col["requests"].copy()
        depth, parent = col["depth"], col["parent"]
        for d in range(int(depth.max(initial=0)), 1, -1):
            at = np.flatnonzero(depth == d)
            np.add.at(through, parent[at], through[at])
        return through

    @staticmethod
    def _first_found(col: dict[str, np.ndarray], shapes: np.ndarray) -> np.ndarray:
        """Per shape, the tokens its first request shares with the shapes walked before it:
        the length of its deepest strict ancestor level walked before it, which is one
        that is a shape itself (a level is walked before its children) or one whose child
        towards it is not its first child (an earlier sibling's shapes hold that level)."""
        sig, parent, length, is_shape = col["sig"], col["parent"], col["length"], col["first_line"] > 0
        first_child = np.full(sig.shape[0], UINT64_MAX, dtype=np.uint64)
        child = np.flatnonzero(parent >= 0)
        np.minimum.at(first_child, parent[child], sig[child])
        found = np.zeros(shapes.shape[0], dtype=np.int64)
        at, open_ = shapes.copy(), np.ones(shapes.shape[0], dtype=bool)
        for _ in range(int(col["depth"].max(initial=0))):
            up = parent[at]
            open_ &= up >= 0
            if not open_.any():
                break
            above = np.maximum(up, 0)
            walked = open_ & (is_shape[above] | (first_child[above] != sig[at]))
            found[walked] = length[above[walked]]
            open_ &= ~walked
            at = np.where(open_, above, at)
        return found

    def check_invariants(self) -> None:
        """Side-effect free: rows and index agree, parents come first, counts add up, the
        grouped figures grow with the cache."""
        n = self._rows
        col = {name: column[:n] for name, column in self._cols.items()}
        assert len(self._index) == n <= self._cols["sig"].shape[0]
        assert (col["parent"] < np.arange(n)).all()
        assert int(col["requests"].sum()) == self.requests and int(col["tokens"].sum()) == self.prompt_tokens
        assert len(self._pending) < HASH_BATCH_PROMPTS
        assert len(self._tails) <= n and all(t.shape[0] <= TAIL_COMPARE_BLOCKS for t in self._tails.values())
        sized = list(zip(self.cache_tokens, self._later_blocks))
        assert all(a_blocks <= b_blocks for a, a_blocks in sized for b, b_blocks in sized if a <= b), sized
        assert all(blocks <= self._later_blocks[-1] for blocks in self._later_blocks)
        for replay in self._arrival:
            replay.check_invariants()
            assert replay.input_tokens == self.prompt_tokens


def _per_model(prompts: list[PromptBlocks], models: list[int]) -> list[PromptBlocks]:
    """Block keys of a model other than model 0 made its own (a LoRA adapter's KV is not the
    base model's: vLLM keys its blocks by the adapter too)."""
    return [prompt if not model else PromptBlocks(_frozen(prompt.keys ^ np.uint64(model * MODEL_KEY_MIX & UINT64_MAX)),
                                                  prompt.length) for prompt, model in zip(prompts, models)]


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _shared(col: dict[str, np.ndarray], through: np.ndarray) -> tuple[int, int]:
    """(each request's tokens in its deepest level that 2+ requests have, summed; each such
    level's own component's tokens, once)."""
    depth, parent, length = col["depth"], col["parent"], col["length"]
    deepest = np.zeros(depth.shape[0], dtype=np.int64)
    for d in range(1, int(depth.max(initial=0)) + 1):
        at = np.flatnonzero(depth == d)
        above = np.where(parent[at] >= 0, deepest[np.maximum(parent[at], 0)], 0)
        deepest[at] = np.where(through[at] >= 2, length[at], above)
    own = length - np.where(parent >= 0, length[np.maximum(parent, 0)], 0)
    return int((col["requests"] * deepest).sum()), int(own[(through >= 2) & (depth >= 1)].sum())


def _top_shapes(col: dict[str, np.ndarray], shapes: np.ndarray, top: int) -> list[dict]:
    order = shapes[np.lexsort((col["first_line"][shapes], -col["tokens"][shapes], -col["requests"][shapes]))][:top]
    return [{"signature": f"{int(col['sig'][r]):#018x}", "requests": int(col["requests"][r]),
             "tokens": int(col["tokens"][r]), "prefix_tokens": int(col["length"][r]),
             "components": int(col["depth"][r]), "first_line": int(col["first_line"][r])} for r in order.tolist()]


def _run_row(order: str, cache_tokens: int | None, input_tokens: int, hit_tokens: int) -> dict:
    """A replay's row, as `analyze_workload`'s rows are."""
    return {"order": order, "cache_tokens": cache_tokens, "caches": 1, "hit_tokens": hit_tokens,
            "input_tokens": input_tokens, "reuse": hit_tokens / input_tokens if input_tokens else 0.0}
