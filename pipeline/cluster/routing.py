"""Shape-affine routing of a job's items over the nodes of a cluster (pure: no I/O, no clock).

    tally = ShapeTally(keys=n)                                 # pass 1 over the job's items:
    tally.add(k, chain, component_tokens, suffix_tokens)       #   per shape its load, per key its shape
    plan = RoutingPlan.build(tally.chains, tally.loads(), nodes=3)   # once per job, per shape
    router = Router(plan, ["node-a", "node-b", "node-c"])      # bounded-load placement
    router.node_of(plan.route_key(tally.shape(k), item_hash))  # item k's node
    router.remove("node-b")                                    # only node-b's keys moved

Everything here is per shape (or per key of the plan), never per item but for pass 1's 4-byte
shape id per key: a job of any length plans in memory that grows with its distinct shapes.

The load of an item (`computed_token_loads` sums it over a shape's items): what its node's
GPU computes when routing does its job, i.e. when each distinct chain prefix is computed once
and served from the prefix cache after: the item's suffix tokens plus, for each of its components, the component's
tokens divided by the number of the job's items whose chains pass through that prefix. The
loads sum to the job's distinct prefix tokens plus its suffix tokens, and they add up over
any set of items, as the trie weights and the bound below need.
NOTE: prompt tokens were rejected: with prefixes cached they count a family's shared few-shot
block once per item, so a family with a long block looks several times heavier than one
with a short block although both cost their node about the same (one prefix, then suffixes);
balancing on them would leave the short-block families' node the busier. The sim cost
model's figures (padded tokens, a batch's fixed cost) are not available to routing: padding
and batch sizes are decided by each node's broker later, and a GPU node has no cost model.
What this leaves out: prefixes the cache evicts and computes again, padding, per-batch cost.

The routing key. Every item has its shape's chain of prefix signatures
(`pipeline.producer.signature.chain`): c1 = sig(system), c2 = sig(system, fewshot), ...
Routing on c1 alone sends everything to one node when every prompt shares a first component
(a common system prompt, as real traces have). Routing on the whole shape spreads load but
cuts a family of shapes that share a long prefix over every node, so each node computes that
prefix again. The rule here takes the shallowest prefix that is light enough:

    an item's key is the shallowest prefix c_d of its chain whose subtree (the items whose
    chains pass through c_d) carries at most `max_key_load`, the job's load / (nodes x
    KEYS_PER_NODE); an item whose whole chain is heavier than that is on a hot shape.

A hot shape (its own items alone, the leaf of the trie, weigh more than `max_key_load`) is
split into k = ceil(load / max_key_load) sub-keys (key, 0..k-1), each routed on its own and
weighing load / k in the plan; an item goes to sub-key item_hash mod k. `RoutingPlan.splits` counts the split shapes and
`sub_keys` their sub-keys. The plan is made once per job with the node count at its start, so
a node that leaves or joins later changes no key, only where keys go.

Placement: bounded-load rendezvous hashing. A key ranks the nodes by xxh3-64 of (key, node
name), highest first (the same names on every run rank alike). Keys are placed heaviest
first (ties by key), each on its highest-ranked node whose load stays at most the bound
(1 + EPSILON) x (total load / live nodes); where no node has room, on the least loaded (ties
by rank), counted in `Router.fallbacks`; so no node ends over the larger of the bound and
the mean plus the heaviest key (the least loaded node holds less than the mean). Plain
rendezvous (each key on its highest-ranked node) was what ran first: 120 keys put 332 / 280
/ 288 of 900 items on 3 nodes, and the makespan is the fullest node's.

What is guaranteed when the nodes change (the router keeps its placement and changes only
what it must; it does not place every key again):
  - remove(X): exactly X's keys move, none other; each goes, heaviest first, to its
    highest-ranked remaining node with room under the bound for the nodes left, else the
    least loaded, so no survivor ends over the larger of that bound, its own load before,
    and the new mean plus the heaviest key. (Placing every key again would also move the
    keys displaced in cascade by X's keys taking their room; keeping the placement makes
    that number zero.)
  - add(Y): keys move only to Y, and only keys that rank Y above the node they are on;
    they move heaviest first while Y's load stays within the bound for the new node count.
    The other nodes keep what they had (evening them out would move keys between them).
  - where the bound never binds (a large epsilon, or loads light enough), this is plain
    rendezvous: every key on its highest-ranked live node, add(Y) moves exactly the keys Y
    wins, and a node that leaves and comes back wins back exactly its old keys. Where it
    binds, the placement after a change depends on the order of the changes, and a node
    that comes back gets what it outranks and has room for, not necessarily its old keys.
  - loads are the plan's (the whole job's), not what is left unanswered.

Owner: the driver's main thread (`pipeline.cluster.driver`); not thread-safe.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

# Keys per node the plan aims at: enough keys that heaviest-first placement under the bound
# can even the nodes out (each key is at most 1/KEYS_PER_NODE of a node's fair share), few
# enough that a family of shapes sharing a prefix stays whole; more keys would cut shape
# families apart for no gain.
KEYS_PER_NODE = 8
# A split shape never gets more sub-keys than this (a job of one shape over a huge cluster).
MAX_SUB_KEYS = 1024
# Seed of the rendezvous hash, so its scores are not the signatures' own hashes.
RENDEZVOUS_SEED = 0x5348_4150_455F_5244  # "SHAPE_RD"
# How far over the mean a node's load may go before a key goes to its next-ranked node. The
# makespan is the fullest node's, and heaviest-first placement fills the nodes most keys rank
# first up to the bound, so epsilon is about what a run gives away. Measured on
# tools/bench_ray.py's job (120 keys over 3 nodes, fullest node's planned load / mean):
# plain rendezvous 1.094, epsilon 0.05 1.046, 0.02 1.015, 0.01 1.005, 0 1.003; keys not on
# their first-ranked node 0, 3, 5, 7, 9. The router keeps its placement when nodes change,
# so a small epsilon moves no more keys then; what it costs is keys off their first-ranked
# node, which only matters where a node leaves and comes back. Below the load estimate's own
# error (each node's simulated GPU seconds per planned token agreed within 0.5% in that run)
# a tighter bound buys nothing. NOTE: 0.05 ran first: 2.78x one node's throughput, the
# fullest node 4.6% over the mean and its makespan the run's.
EPSILON = 0.01

# Keys of a run (pass 1 keeps a uint32 shape id per key, 0 for none): request indices of a job
# of at most the batch file's limit, far below this.
MAX_KEYS = (1 << 32) - 1

RouteKey = tuple  # (depth, signature) or (depth, signature, sub_key)


def rendezvous_score(key: RouteKey, node: str) -> int:
    """The weight of `node` for `key`: xxh3-64 of the key's numbers and the node's name."""
    packed = struct.pack(f"<{len(key)}Q", *key) + node.encode()
    return xxhash.xxh3_64_intdigest(packed, seed=RENDEZVOUS_SEED)


def ranked_nodes(key: RouteKey, nodes: Iterable[str]) -> list[str]:
    """The nodes in `key`'s order, highest score first (ties, impossible in practice, by name)."""
    return sorted(nodes, key=lambda node: (rendezvous_score(key, node), node), reverse=True)


def highest_node(key: RouteKey, nodes: Iterable[str]) -> str:
    """The node with the highest score for `key`: where plain rendezvous puts it."""
    return max(nodes, key=lambda node: (rendezvous_score(key, node), node))


class ShapeTally:
    """Pass 1 of a run, item by item: each distinct shape's chain, its components' token
    counts, its items and their suffix tokens, and each key's shape (`shape_of[k]`: 0 for a
    key with no item, else its shape's id + 1, so the array starts as untouched zero pages).

    Per shape a few hundred bytes (its chain and counts); per key 4 bytes: pass 2 finds
    each item's route without making it again (see `pipeline.cluster.stream`)."""

    def __init__(self, keys: int) -> None:
        check_key_space(keys)
        self.shape_of = np.zeros(keys, dtype=np.uint32)
        self.ids: dict[tuple[int, int], int] = {}  # (depth, signature) of a chain's last prefix -> shape id
        self.chains: list[tuple[int, ...]] = []
        self.component_tokens: list[tuple[int, ...]] = []
        self.items: list[int] = []
        self.suffix_tokens: list[int] = []
        self.count = 0

    def add(self, key: int, chain: Sequence[int], component_tokens: Sequence[int], suffix_tokens: int) -> int:
        """Key `key`'s item (each key once) has this shape; the shape's id."""
        assert chain and len(component_tokens) <= len(chain), (chain, component_tokens)
        assert self.shape_of[key] == 0, key
        leaf = (len(chain), chain[-1])
        shape = self.ids.get(leaf)
        if shape is None:
            shape = self.ids[leaf] = len(self.chains)
            self.chains.append(tuple(chain))
            self.component_tokens.append(tuple(component_tokens))
            self.items.append(0)
            self.suffix_tokens.append(0)
        self.items[shape] += 1
        self.suffix_tokens[shape] += suffix_tokens
        self.shape_of[key] = shape + 1
        self.count += 1
        return shape

    def shape(self, key: int) -> int | None:
        """Key `key`'s shape id; None for a key with no item."""
        found = int(self.shape_of[key])
        return found - 1 if found else None

    def loads(self) -> list[float]:
        """Each shape's load (`computed_token_loads`)."""
        return computed_token_loads(self.chains, self.component_tokens, self.items, self.suffix_tokens)

    def check_invariants(self) -> None:
        shapes = len(self.chains)
        assert len(self.component_tokens) == len(self.items) == len(self.suffix_tokens) == len(self.ids) == shapes
        assert sum(self.items) == self.count == int(np.count_nonzero(self.shape_of))
        assert all(n >= 1 for n in self.items)
        assert all(self.ids[(len(c), c[-1])] == shape for shape, c in enumerate(self.chains))
        assert int(self.shape_of.max(initial=0)) <= shapes
        assert np.bincount(self.shape_of, minlength=shapes + 1)[1:].tolist() == self.items


def check_key_space(keys: int) -> None:
    """ValueError unless a run's keys (0..keys-1) fit pass 1's per-key shape ids."""
    if not 0 <= keys <= MAX_KEYS:
        raise ValueError(f"a cluster run's keys must be fewer than {MAX_KEYS + 1:,}, got {keys:,}")


def computed_token_loads(chains: Sequence[Sequence[int]], component_tokens: Sequence[Sequence[int]],
                         items: Sequence[int], suffix_tokens: Sequence[int]) -> list[float]:
    """Each shape's load, its items' together (the module's rule): their suffix tokens, plus
    for each of its components the component's tokens times the shape's items over the
    items whose chains pass through that component's prefix."""
    assert len(chains) == len(component_tokens) == len(items) == len(suffix_tokens)
    sharing: Counter = Counter()
    for shape_chain, count in zip(chains, items):
        for depth, sig in enumerate(shape_chain, start=1):
            sharing[(depth, sig)] += count
    loads = []
    for shape_chain, tokens, count, suffix in zip(chains, component_tokens, items, suffix_tokens):
        assert len(tokens) <= len(shape_chain), (len(tokens), len(shape_chain))  # none: the empty shape's chain
        shared = sum(n * count / sharing[(depth, sig)]
                     for depth, (sig, n) in enumerate(zip(shape_chain, tokens), start=1))
        loads.append(float(suffix) + shared)
    return loads


@dataclass(slots=True)
class RoutingPlan:
    """Each shape's routing key, made once from the whole job's shapes (see the module's rule).

    `shape_keys[s]` is shape s's key (depth, signature): the depth (1-based) of the chain
    prefix its items route on; `split[key]` the number of sub-keys of a hot shape's key;
    `route_loads` the load of each key an item is placed by (a split key's sub-keys share
    its load evenly); `route_key(s, h)` the one an item of shape s with hash h is placed by."""

    shape_keys: list[tuple[int, int]]
    split: dict[tuple[int, int], int]
    max_key_load: float
    total_load: float
    key_loads: dict[tuple[int, int], float] = field(default_factory=dict)
    route_loads: dict[RouteKey, float] = field(default_factory=dict)

    @classmethod
    def build(cls, chains: Sequence[Sequence[int]], loads: Sequence[float], nodes: int) -> RoutingPlan:
        """The plan of distinct shapes with these chains and loads for `nodes` nodes."""
        assert len(chains) == len(loads), (len(chains), len(loads))
        assert nodes >= 1, nodes
        total = float(sum(loads))
        max_key_load = total / (nodes * KEYS_PER_NODE) if total > 0 else 1.0
        subtree: dict[tuple[int, int], float] = {}
        for shape_chain, load in zip(chains, loads):
            for depth, sig in enumerate(shape_chain, start=1):
                subtree[(depth, sig)] = subtree.get((depth, sig), 0.0) + load
        keys: list[tuple[int, int]] = []
        key_loads: dict[tuple[int, int], float] = {}
        for shape_chain, load in zip(chains, loads):
            assert shape_chain, "every shape has a chain of at least one signature"
            key = (len(shape_chain), shape_chain[-1])
            for depth, sig in enumerate(shape_chain, start=1):
                if subtree[(depth, sig)] <= max_key_load:
                    key = (depth, sig)
                    break
            keys.append(key)
            key_loads[key] = key_loads.get(key, 0.0) + load
        split = {key: min(MAX_SUB_KEYS, math.ceil(load / max_key_load))
                 for key, load in key_loads.items() if load > max_key_load}
        # NOTE: a sub-key's load is its key's over the sub-keys, not its own items' (hash mod
        # k deals them out evenly, up to chance): the exact figure needs each item's hash in
        # pass 1, and k is only known once every shape's load is.
        route_loads: dict[RouteKey, float] = {}
        for key, load in key_loads.items():
            parts = split.get(key, 1)
            for part in range(parts):
                route_loads[key if parts == 1 else (*key, part)] = load / parts
        return cls(keys, split, max_key_load, total, key_loads, route_loads)

    def route_key(self, shape: int, item_hash: int) -> RouteKey:
        """The key an item of shape `shape` whose hash is `item_hash` is placed by."""
        key = self.shape_keys[shape]
        parts = self.split.get(key)
        return key if parts is None else (*key, item_hash % parts)

    @property
    def splits(self) -> int:
        """Hot shapes split over several sub-keys."""
        return len(self.split)

    @property
    def sub_keys(self) -> int:
        return sum(self.split.values())

    def check_invariants(self) -> None:
        scale = 1e-6 * max(1.0, self.total_load)
        assert abs(sum(self.key_loads.values()) - self.total_load) <= scale
        assert abs(sum(self.route_loads.values()) - self.total_load) <= scale
        for key, load in self.key_loads.items():
            parts = self.split.get(key, 1)
            assert parts >= 1
            # A key over the limit is a hot shape's leaf, split; any other fits the limit.
            assert load <= self.max_key_load or key in self.split, (key, load, self.max_key_load)
            assert parts == 1 or load > self.max_key_load, (key, parts, load)
        assert set(self.shape_keys) == set(self.key_loads)
        expected = {key if key not in self.split else (*key, part)
                    for key in self.key_loads for part in range(self.split.get(key, 1))}
        assert set(self.route_loads) == expected


class Router:
    """Where each routing key of a plan goes, by bounded-load rendezvous hashing over the live
    nodes (the module's rule and its guarantees).

    Node names are stable across a node's loss and return (the node's slot, not its Ray id).
    `epsilon` is EPSILON but in tests (a large one never binds: plain rendezvous)."""

    def __init__(self, plan: RoutingPlan, nodes: Iterable[str], epsilon: float = EPSILON) -> None:
        self.plan = plan
        self.epsilon = epsilon
        self.nodes: set[str] = set(nodes)
        if not self.nodes:
            raise ValueError("a router needs at least one node")
        self.placement: dict[RouteKey, str] = {}
        self.loads: dict[str, float] = {node: 0.0 for node in self.nodes}
        # The most a node's load may be: the highest bound it took a key under, or its load
        # after a key that fitted nowhere. Only check_invariants reads it.
        self.ceiling: dict[str, float] = {node: 0.0 for node in self.nodes}
        self.fallbacks = 0
        self._place(list(plan.route_loads))

    def bound(self) -> float:
        """The most load a live node takes a key up to: (1 + epsilon) x the mean."""
        return (1.0 + self.epsilon) * self.plan.total_load / len(self.nodes)

    def _heaviest_first(self, keys: Iterable[RouteKey]) -> list[RouteKey]:
        loads = self.plan.route_loads
        return sorted(keys, key=lambda key: (-loads[key], key))

    def _place(self, keys: Iterable[RouteKey]) -> None:
        """Each key (heaviest first) on its highest-ranked node with room, else the least loaded."""
        bound = self.bound()
        for key in self._heaviest_first(keys):
            load = self.plan.route_loads[key]
            ranking = ranked_nodes(key, self.nodes)
            node = next((n for n in ranking if self.loads[n] + load <= bound), None)
            if node is None:
                node = min(ranking, key=lambda n: (self.loads[n], ranking.index(n)))
                self.fallbacks += 1
                self.ceiling[node] = max(self.ceiling[node], self.loads[node] + load)
            else:
                self.ceiling[node] = max(self.ceiling[node], bound)
            self.placement[key] = node
            self.loads[node] += load

    def node_of(self, route_key: RouteKey) -> str:
        """Where the items of `route_key` go now."""
        return self.placement[route_key]

    def add(self, node: str) -> None:
        """A node joins (or comes back): it takes the keys that rank it above their node,
        heaviest first, while its load stays within the bound; nothing else moves."""
        if node in self.nodes:
            return
        self.nodes.add(node)
        self.loads[node] = 0.0
        bound = self.bound()
        self.ceiling[node] = bound
        for key in self._heaviest_first(self.placement):
            here = self.placement[key]
            load = self.plan.route_loads[key]
            outranks = (rendezvous_score(key, node), node) > (rendezvous_score(key, here), here)
            if outranks and self.loads[node] + load <= bound:
                self.loads[here] -= load
                self.loads[node] += load
                self.placement[key] = node

    def remove(self, node: str) -> None:
        """A node leaves: its keys, and only they, are placed again over the others."""
        if node not in self.nodes:
            return
        if len(self.nodes) == 1:
            raise ValueError(f"cannot remove {node}: it is the last node")
        self.nodes.discard(node)
        del self.loads[node], self.ceiling[node]
        self._place([key for key, there in self.placement.items() if there == node])

    def check_invariants(self) -> None:
        assert self.nodes and set(self.loads) == set(self.ceiling) == self.nodes
        self.plan.check_invariants()
        assert set(self.placement) == set(self.plan.route_loads)
        assert set(self.placement.values()) <= self.nodes
        scale = 1e-9 * max(1.0, self.plan.total_load)
        for node in self.nodes:
            load = sum(self.plan.route_loads[key] for key, there in self.placement.items() if there == node)
            assert abs(load - self.loads[node]) <= scale, (node, load, self.loads[node])
            assert load <= self.ceiling[node] + scale, (node, load, self.ceiling[node])
