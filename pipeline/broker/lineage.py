"""Shape lineage: a trie of each model's shapes, from the chains producers declare (SPEC §4b).

A chain is a shape's prefix signatures: the signature of its components[:1], [:2], ..., the
last one the shape's own. Shapes whose chains share a prefix share those leading components
(a system prompt, a few-shot block, the earlier turns of a conversation), so serving them one
after the other keeps that prefix in a consumer's cache. The broker sees only the hashes.

    trie = ShapeTrie()
    trie.declare(0, (sys, sys_fewshot))          # shape sys_fewshot extends shape sys
    trie.set_tokens(ShapeKey(0, sys_fewshot), 5_000)
    trie.next_shape(0, after=sys)                # -> sys_fewshot: it shares sys's whole chain

Next-shape order (`next_shape`): the shape with dispatchable tokens sharing the longest chain
prefix with the one just run (a depth-first walk: the shapes below it first, then those below
its parent, and so on up to the root), ties first by the caller's `preferred` (the selector's
affinity: a shape no other consumer serves; looked for a bounded way past the first eligible
one), then by most dispatchable tokens, then the lower signature. Each node keeps its
subtree's shapes with tokens, most first, so a choice walks up one path and stops at the
first eligible shape it meets (or a preferred one a bounded few entries after it).

Memory: one node per distinct prefix signature of a live shape, at most MAX_TRIE_NODES in
all (model roots aside). Past it, a new shape's missing prefixes are not kept: it hangs
under the deepest prefix the trie has (the root, at worst: a chain of one, served in token
order) and `overflows` counts it. Nodes no live
shape needs are removed with the last shape below them (`forget`).

Pure: no I/O, no clock. Owner: the ShapeSelector, in the broker's dispatch loop. Not
thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from pipeline.broker.ids import ShapeKey

# Prefix nodes (a chain level that is not a live shape's own) the trie holds at most, over
# every model: about 0.5 KiB each (a node, its sorted list, dict entries), so 2**19 cost
# ~256 MiB at worst; a run of 100,000 shapes three prefix levels deep needs 200,000. A
# shape's own node is always kept: one per live shape, as the dispatcher keeps its lanes.
MAX_TRIE_NODES = 1 << 19

# Entries of a level looked at past its first eligible shape for a preferred one: each
# costs an `eligible` call (a few trie walks for a small shape), and a level can hold 100,000
# shapes, so an unbounded look would cost a switch tens of milliseconds (43 ms at 20,000
# ineligible shapes, measured). Non-preferred shapes (served by another consumer) number at
# most the consumers, so a preferred one is found within this many unless most entries
# after them are ineligible, and then the first eligible shape is taken as before.
PREFERRED_LOOKAHEAD = 32

_NodeKey = tuple[int, int | None]  # (model, prefix signature); None: the model's root


@dataclass(slots=True)
class _Node:
    parent: _NodeKey | None
    depth: int
    children: int = 0
    is_shape: bool = False
    # Shapes of this subtree with dispatchable tokens: (-tokens, signature), most first.
    work: SortedList = field(default_factory=SortedList)


class ShapeTrie:
    """Every model's shapes by their chains, with each subtree's dispatchable tokens."""

    def __init__(self, max_nodes: int = MAX_TRIE_NODES) -> None:
        assert max_nodes >= 1, max_nodes
        self.max_nodes = max_nodes
        self._nodes: dict[_NodeKey, _Node] = {}
        self._tokens: dict[ShapeKey, int] = {}
        self._prefix_nodes = 0  # nodes that are neither a model's root nor a shape's own
        self.overflows = 0  # shapes placed as a chain of one because the trie was full

    def __len__(self) -> int:
        """Nodes held, model roots included."""
        return len(self._nodes)

    def declare(self, model: int, chain: Sequence[int]) -> None:
        """Place shape `chain[-1]` under its prefixes (moving it if it was placed without
        them: a shape's items came before its chain, as after a broker restart)."""
        assert chain, "a chain holds at least the shape's own signature"
        shape = ShapeKey(model, int(chain[-1]))
        node = self._nodes.get((model, shape.signature))
        if node is not None and node.is_shape:
            if node.depth == len(chain) or len(chain) == 1:
                return  # placed already (a shape's chain never changes)
            tokens = self._tokens.get(shape, 0)
            self._unplace(shape)
        else:
            tokens = 0
        self._place(model, [int(s) for s in chain])
        if tokens:
            self.set_tokens(shape, tokens)

    def set_tokens(self, shape: ShapeKey, tokens: int) -> None:
        """The shape's dispatchable tokens are now `tokens` (placing it as a chain of one if
        it was never declared)."""
        assert tokens >= 0, (shape, tokens)
        key = (shape.model, shape.signature)
        node = self._nodes.get(key)
        if node is None or not node.is_shape:
            self._place(shape.model, [shape.signature])
            node = self._nodes[key]
        old = self._tokens.get(shape, 0)
        if old == tokens:
            return
        at: _NodeKey | None = key
        while at is not None:
            here = self._nodes[at]
            if old:
                here.work.remove((-old, shape.signature))
            if tokens:
                here.work.add((-tokens, shape.signature))
            at = here.parent
        if tokens:
            self._tokens[shape] = tokens
        else:
            self._tokens.pop(shape, None)

    def forget(self, shape: ShapeKey) -> None:
        """The shape is retired (nothing dispatchable, no lane): drop it and every node only
        it needed."""
        assert not self._tokens.get(shape), shape
        if (shape.model, shape.signature) in self._nodes:
            self._unplace(shape)

    def next_shape(self, model: int, after: int | None,
                   eligible: Callable[[int], bool] = lambda _signature: True,
                   preferred: Callable[[int], bool] | None = None) -> int | None:
        """The eligible shape of `model` with dispatchable tokens sharing the longest chain
        prefix with shape `after` (None, or a shape the trie no longer has: the root), ties
        first by `preferred` (a preferred one before any other at the same depth, looked for
        among the PREFERRED_LOOKAHEAD entries after the first eligible one), then by most
        tokens, then the lower signature; None when there is none."""
        at: _NodeKey | None = (model, after) if (model, after) in self._nodes else (model, None)
        while at is not None:
            node = self._nodes.get(at)
            if node is None:  # a model without any shape yet
                return None
            fallback, looked = None, 0
            for _tokens, signature in node.work:
                if fallback is not None:  # only a preferred one beats it now: the cheap test first
                    looked += 1
                    if looked > PREFERRED_LOOKAHEAD:
                        break
                    if preferred(signature) and eligible(signature):
                        return signature
                elif eligible(signature):
                    if preferred is None or preferred(signature):
                        return signature
                    fallback = signature
            if fallback is not None:
                return fallback
            at = node.parent
        return None

    def shared_depth(self, model: int, a: int | None, b: int | None) -> int:
        """How many chain levels shapes `a` and `b` share (0 for a shape the trie lacks)."""
        if a is None or b is None or (model, a) not in self._nodes or (model, b) not in self._nodes:
            return 0
        ancestors: set[_NodeKey] = set()
        at: _NodeKey | None = (model, a)
        while at is not None:
            ancestors.add(at)
            at = self._nodes[at].parent
        at = (model, b)
        while at not in ancestors:
            at = self._nodes[at].parent
        return self._nodes[at].depth

    def depth(self, shape: ShapeKey) -> int:
        """The shape's chain length as placed (0: not placed)."""
        node = self._nodes.get((shape.model, shape.signature))
        return node.depth if node is not None and node.is_shape else 0

    # ----------------------------------------------------------------- placing

    def _place(self, model: int, chain: list[int]) -> None:
        """Put the shape `chain[-1]` in the trie: below the deepest prefix of its chain the
        trie has already (where that node is, it stays: a shape placed as a chain of one
        before its chain came keeps its place for the shapes below it), creating the rest."""
        root: _NodeKey = (model, None)
        if root not in self._nodes:
            self._nodes[root] = _Node(parent=None, depth=0)
        have = max((k for k, s in enumerate(chain) if (model, s) in self._nodes), default=-1)
        missing = chain[have + 1:]
        if self._prefix_nodes + len(missing) - 1 > self.max_nodes:
            self.overflows += 1
            missing = missing[-1:]  # only the shape's own node: under the deepest one it has
        parent = (model, chain[have]) if have >= 0 else root
        for signature in missing:
            key = (model, signature)
            self._nodes[key] = _Node(parent=parent, depth=self._nodes[parent].depth + 1)
            self._nodes[parent].children += 1
            self._prefix_nodes += 1
            parent = key
        self._mark(model, chain[-1], True)

    def _mark(self, model: int, signature: int, is_shape: bool) -> None:
        node = self._nodes[(model, signature)]
        if node.is_shape != is_shape:
            node.is_shape = is_shape
            self._prefix_nodes += -1 if is_shape else 1

    def _unplace(self, shape: ShapeKey) -> None:
        """Take the shape (and its tokens) out, and prune the nodes nothing needs."""
        if self._tokens.get(shape):
            self.set_tokens(shape, 0)
        key: _NodeKey | None = (shape.model, shape.signature)
        self._mark(shape.model, shape.signature, False)
        while key is not None:
            node = self._nodes[key]
            if node.children or node.is_shape or node.parent is None:
                if node.parent is None and not node.children:
                    del self._nodes[key]  # a model's root with nothing under it
                return
            del self._nodes[key]
            self._prefix_nodes -= 1
            self._nodes[node.parent].children -= 1
            key = node.parent

    # ----------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Assert every internal invariant. O(nodes x depth)."""
        prefixes = sum(1 for key, node in self._nodes.items() if key[1] is not None and not node.is_shape)
        assert prefixes == self._prefix_nodes <= self.max_nodes, (prefixes, self._prefix_nodes, self.max_nodes)
        children: dict[_NodeKey, int] = {}
        want: dict[_NodeKey, list] = {key: [] for key in self._nodes}
        for key, node in self._nodes.items():
            if node.parent is None:
                assert key[1] is None and node.depth == 0, (key, node.depth)
                continue
            parent = self._nodes[node.parent]
            assert parent.depth == node.depth - 1 and node.parent[0] == key[0], (key, node.parent)
            children[node.parent] = children.get(node.parent, 0) + 1
            assert node.is_shape or node.children, f"node {key} holds no shape and has no children"
        for key, node in self._nodes.items():
            assert node.children == children.get(key, 0), (key, node.children, children.get(key, 0))
        for shape, tokens in self._tokens.items():
            assert tokens > 0 and self._nodes[(shape.model, shape.signature)].is_shape, shape
            at: _NodeKey | None = (shape.model, shape.signature)
            while at is not None:
                want[at].append((-tokens, shape.signature))
                at = self._nodes[at].parent
        for key, node in self._nodes.items():
            assert list(node.work) == sorted(want[key]), (key, list(node.work), sorted(want[key]))
