"""Compulsory prefix tokens, per consumer and against one cache for the whole model: what
splitting shapes across consumers cost.

A compulsory miss is a block's first reference (the 3C model): no order avoids it. Each
consumer's engine counts its own (`block_refs.py`, by token blocks); their sum pays once per
consumer every prefix two consumers both ran. One cache for the whole model would pay each
prefix once. The difference is the price of the split, and no consumer can see it alone.

The broker counts both, content-blind, from what it already has: each shape's prefix_len
(the tokens its components cover, on every item) and its chain (`lineage.py`'s input). A
shape's prefix covers its ancestors' prefixes, so a cache that has referenced a shape knows
every level of its chain. When a consumer starts a shape, the tokens new to a cache are

    prefix_len - len(deepest level of the shape's chain that the cache referenced already)

counted once for the consumer's cache and once for the model's (the model's cache has seen
a level if any consumer did). A level's length is known when some shape of that level was
ingested (its prefix_len); a level that is no shape's own (a prefix only shapes below it
have) has no known length, and the walk goes on up to a level that has one. So the counts
are exact (in tokens, not rounded to an engine's blocks) when every shared level is some
shape's own, as in a conversation whose earlier turns were items; else they count that
shared prefix once per shape below it, in both figures alike. Without chains (a producer that
declares none) each shape is a chain of one: the counts are then per shape.

NOTE: the exact block count was rejected: it needs the token ids of every prefix, which the
broker never reads (SPEC §4b: content-blind), or every consumer's block hashes sent to the
broker and merged (a set per model as large as every cached block, over the control socket).

Memory: one entry per known level and per (cache, level) referenced, at most
MAX_FIRST_REF_ENTRIES in all; past it nothing more is learnt or counted (`overflows` counts
the shapes started uncounted, so the figures are then lower bounds).

Pure: no I/O, no clock. Owner: the Dispatcher (declare, learn) and the broker's consumer side
(`start`), in the broker's single loop. Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pipeline.broker.ids import ShapeKey

# Entries held at most (levels known plus levels each cache referenced): ~100 bytes each in
# Python's dicts and sets, so 2**20 cost ~100 MiB at worst, as much as the trie's nodes;
# 100,000 shapes three levels deep served by 4 consumers need 1.5 million... of which most
# are the consumers' sets, so past the limit the counts stop rather than the broker grow.
MAX_FIRST_REF_ENTRIES = 1 << 20
# A chain walk's bound: MAX_CHAIN_DEPTH levels (pipeline.wire.layouts), a shape's own included.
_MAX_WALK = 64

_Node = tuple[int, int]  # (model, signature)
_MODEL = object()  # the key of the whole model's cache


class FirstReferences:
    """Prefix tokens first referenced by each consumer's cache and by the whole model's."""

    def __init__(self, max_entries: int = MAX_FIRST_REF_ENTRIES) -> None:
        assert max_entries >= 1, max_entries
        self.max_entries = max_entries
        self._parent: dict[_Node, int] = {}  # a level's parent signature (absent: depth 1)
        self._length: dict[_Node, int] = {}  # a level's prefix tokens, where a shape of it was seen
        self._seen: dict[Hashable, set[_Node]] = {}  # per cache: levels referenced
        self._entries = 0
        self.model_tokens: dict[int, int] = {}  # the whole model's compulsory prefix tokens
        self.overflows = 0  # shapes started while full: not counted

    def declare(self, model: int, chain: Sequence[int]) -> None:
        """A shape's chain (the same a producer declares to the trie): each level's parent."""
        for k in range(1, len(chain)):
            node = (model, int(chain[k]))
            if node not in self._parent and self._room(1):
                self._parent[node] = int(chain[k - 1])
                self._entries += 1

    def learn(self, shape: ShapeKey, prefix_len: int) -> None:
        """Items of `shape` carry `prefix_len`: the length of its own level."""
        node = (shape.model, shape.signature)
        if node not in self._length and self._room(1):
            self._length[node] = int(prefix_len)
            self._entries += 1

    def start(self, cache: Hashable, shape: ShapeKey, prefix_len: int) -> int:
        """Consumer `cache` starts a batch of `shape`: the prefix tokens new to its cache
        (returned) and to the model's (added to `model_tokens`)."""
        self.learn(shape, prefix_len)
        path = self._path(shape)
        if not self._room(2 * len(path)):
            self.overflows += 1
            return 0
        mine = self._first(cache, shape.model, path, prefix_len)
        model_new = self._first((_MODEL, shape.model), shape.model, path, prefix_len)
        self.model_tokens[shape.model] = self.model_tokens.get(shape.model, 0) + model_new
        return mine

    def referenced_elsewhere(self, cache: Hashable, shape: ShapeKey) -> bool:
        """Whether another consumer's cache referenced the shape's own level (it started the
        shape or a longer one) and `cache` did not: starting it here computes its prefix a
        second time. False once `start` would learn nothing more (the entry limit), so a split
        is counted once per consumer and shape, and past the limit not at all (a lower bound)."""
        node = (shape.model, shape.signature)
        if node in self._seen.get(cache, ()) or node not in self._seen.get((_MODEL, shape.model), ()):
            return False
        if not self._room(2 * len(self._path(shape))):  # `start` learns nothing: it would count again
            return False
        return any(node in levels for key, levels in self._seen.items()
                   if key != cache and not (isinstance(key, tuple) and key and key[0] is _MODEL))

    @property
    def model_total(self) -> int:
        return sum(self.model_tokens.values())

    def _path(self, shape: ShapeKey) -> list[_Node]:
        """The shape's levels, its own first, up to depth 1."""
        path = [(shape.model, shape.signature)]
        while len(path) < _MAX_WALK and (parent := self._parent.get(path[-1])) is not None:
            path.append((shape.model, parent))
        return path

    def _first(self, cache: Hashable, model: int, path: list[_Node], prefix_len: int) -> int:
        seen = self._seen.setdefault(cache, set())
        covered = 0
        for at, node in enumerate(path):
            if node in seen:  # this level and every one above it were referenced
                covered = next((self._length[n] for n in path[at:] if n in self._length), 0)
                break
        new = [node for node in path if node not in seen]
        seen.update(new)
        self._entries += len(new)
        return max(0, int(prefix_len) - covered)

    def _room(self, entries: int) -> bool:
        return self._entries + entries <= self.max_entries

    def check_invariants(self) -> None:
        """The entry count holds; the model's cache referenced every level any consumer's did."""
        seen_entries = sum(len(levels) for levels in self._seen.values())
        assert self._entries == len(self._parent) + len(self._length) + seen_entries <= self.max_entries
        for cache, levels in self._seen.items():
            if not (isinstance(cache, tuple) and cache and cache[0] is _MODEL):
                for model, signature in levels:
                    assert (model, signature) in self._seen[(_MODEL, model)], (cache, model, signature)
        assert all(tokens >= 0 for tokens in self.model_tokens.values())
