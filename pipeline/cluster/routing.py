"""Shape-affine routing of a job's items over the nodes of a cluster (pure: no I/O, no clock).

    loads = computed_token_loads(chains, component_tokens, suffix_tokens)
    plan = RoutingPlan.build(chains, loads, hashes, nodes=3)  # once per job, from every item
    router = Router(plan, ["node-a", "node-b", "node-c"])       # bounded-load placement
    router.node_of(k)                                          # item k's node
    router.remove("node-b"); router.node_of(k)                 # only node-b's keys moved

The load of an item (`computed_token_loads`): what its node's GPU computes when routing does
its job, i.e. when each distinct chain prefix is computed once and served from the prefix
cache after: the item's suffix tokens plus, for each of its components, the component's
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
split into k = ceil(load / max_key_load) sub-keys (key, 0..k-1), each routed on its own; an
item goes to sub-key item_hash mod k. `RoutingPlan.splits` counts the split shapes and
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


def computed_token_loads(chains: Sequence[Sequence[int]], component_tokens: Sequence[Sequence[int]],
                         suffix_tokens: Sequence[int]) -> list[float]:
    """Each item's load (the module's rule): its suffix tokens, plus each of its components'
    tokens over the number of items whose chains pass through that component's prefix."""
    assert len(chains) == len(component_tokens) == len(suffix_tokens)
    sharing = Counter((depth, sig) for item_chain in chains for depth, sig in enumerate(item_chain, start=1))
    loads = []
    for item_chain, tokens, suffix in zip(chains, component_tokens, suffix_tokens):
        assert len(tokens) <= len(item_chain), (len(tokens), len(item_chain))  # none: the empty shape's chain
        shared = sum(n / sharing[(depth, sig)] for depth, (sig, n) in enumerate(zip(item_chain, tokens), start=1))
        loads.append(float(suffix) + shared)
    return loads


@dataclass(slots=True)
class RoutingPlan:
    """Each item's routing key, made once from the whole job (see the module's rule).

    `keys[k]` is item k's key (depth, signature): the depth (1-based) of the chain prefix it
    routes on; `split[key]` the number of sub-keys of a hot shape's key; `item_keys[k]` the
    key item k is placed by (with its sub-key where split) and `route_loads` their loads."""

    keys: list[tuple[int, int]]
    split: dict[tuple[int, int], int]
    max_key_load: float
    total_load: float
    key_loads: dict[tuple[int, int], float] = field(default_factory=dict)
    item_keys: list[RouteKey] = field(default_factory=list)
    route_loads: dict[RouteKey, float] = field(default_factory=dict)

    @classmethod
    def build(cls, chains: Sequence[Sequence[int]], loads: Sequence[float], hashes: Sequence[int],
              nodes: int) -> RoutingPlan:
        """The plan of items with these chains, loads and hashes (a split shape's items go
        to sub-key hash mod k) for `nodes` nodes."""
        assert len(chains) == len(loads) == len(hashes), (len(chains), len(loads), len(hashes))
        assert nodes >= 1, nodes
        total = float(sum(loads))
        max_key_load = total / (nodes * KEYS_PER_NODE) if total > 0 else 1.0
        subtree: dict[tuple[int, int], float] = {}
        for item_chain, load in zip(chains, loads):
            for depth, sig in enumerate(item_chain, start=1):
                subtree[(depth, sig)] = subtree.get((depth, sig), 0.0) + load
        keys: list[tuple[int, int]] = []
        key_loads: dict[tuple[int, int], float] = {}
        for item_chain, load in zip(chains, loads):
            assert item_chain, "every shape has a chain of at least one signature"
            key = (len(item_chain), item_chain[-1])
            for depth, sig in enumerate(item_chain, start=1):
                if subtree[(depth, sig)] <= max_key_load:
                    key = (depth, sig)
                    break
            keys.append(key)
            key_loads[key] = key_loads.get(key, 0.0) + load
        split = {key: min(MAX_SUB_KEYS, math.ceil(load / max_key_load))
                 for key, load in key_loads.items() if load > max_key_load}
        item_keys: list[RouteKey] = [key if key not in split else (*key, h % split[key])
                                     for key, h in zip(keys, hashes)]
        route_loads: dict[RouteKey, float] = {}
        for route_key, load in zip(item_keys, loads):
            route_loads[route_key] = route_loads.get(route_key, 0.0) + load
        return cls(keys, split, max_key_load, total, key_loads, item_keys, route_loads)

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
        assert set(self.keys) == set(self.key_loads)
        assert len(self.item_keys) == len(self.keys) and set(self.item_keys) == set(self.route_loads)
        for key, route_key in zip(self.keys, self.item_keys):
            assert route_key[:2] == key and (len(route_key) == 3) == (key in self.split), (key, route_key)


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

    def node_of(self, k: int) -> str:
        """Item k's node."""
        return self.placement[self.plan.item_keys[k]]

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
