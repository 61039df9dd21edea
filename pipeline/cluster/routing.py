"""Shape-affine routing of a job's items over the nodes of a cluster (pure: no I/O, no clock).

    plan = RoutingPlan.build(chains, loads, nodes=3)       # once per job, from every item
    router = Router(plan, ["node-a", "node-b", "node-c"])
    router.node_of(k, item_hash)                           # item k's node
    router.remove("node-b"); router.node_of(k, item_hash)  # only node-b's keys moved

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
`sub_keys` their sub-keys. The plan is made once per job with the node count at its start, so a
node that leaves or joins later changes no key: rendezvous hashing over the live nodes then
moves exactly the keys whose highest-scoring node left, or that the new node now wins.

Rendezvous (highest random weight) hashing: a key's node is the live node with the highest
xxh3-64 of (key, node name); the same names on every run give the same placement.

Owner: the driver's main thread (`pipeline.cluster.driver`); not thread-safe.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

# Keys per node the plan aims at: rendezvous hashing of K keys over N nodes gives each node
# K/N keys with a spread of about sqrt(K/N); 8 keys per node keeps the busiest node within
# about 1/sqrt(8) ~ 35% of the mean in the worst case of equal keys and much closer with the
# many light keys real jobs have; more keys would cut shape families apart for no gain.
KEYS_PER_NODE = 8
# A split shape never gets more sub-keys than this (a job of one shape over a huge cluster).
MAX_SUB_KEYS = 1024
# Seed of the rendezvous hash, so its scores are not the signatures' own hashes.
RENDEZVOUS_SEED = 0x5348_4150_455F_5244  # "SHAPE_RD"

RouteKey = tuple  # (depth, signature) or (depth, signature, sub_key)


def rendezvous_score(key: RouteKey, node: str) -> int:
    """The weight of `node` for `key`: xxh3-64 of the key's numbers and the node's name."""
    packed = struct.pack(f"<{len(key)}Q", *key) + node.encode()
    return xxhash.xxh3_64_intdigest(packed, seed=RENDEZVOUS_SEED)


def highest_node(key: RouteKey, nodes: Iterable[str]) -> str:
    """The node with the highest score for `key` (ties, impossible in practice, by name)."""
    return max(nodes, key=lambda node: (rendezvous_score(key, node), node))


@dataclass(slots=True)
class RoutingPlan:
    """Each item's routing key, made once from the whole job (see the module's rule).

    `keys[k]` is item k's key (depth, signature): the depth (1-based) of the chain prefix it
    routes on; `split[key]` the number of sub-keys of a hot shape's key."""

    keys: list[tuple[int, int]]
    split: dict[tuple[int, int], int]
    max_key_load: float
    total_load: float
    key_loads: dict[tuple[int, int], float] = field(default_factory=dict)

    @classmethod
    def build(cls, chains: Sequence[Sequence[int]], loads: Sequence[float], nodes: int) -> RoutingPlan:
        """The plan of items with these chains and loads (tokens, say) for `nodes` nodes."""
        assert len(chains) == len(loads), (len(chains), len(loads))
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
        return cls(keys, split, max_key_load, total, key_loads)

    @property
    def splits(self) -> int:
        """Hot shapes split over several sub-keys."""
        return len(self.split)

    @property
    def sub_keys(self) -> int:
        return sum(self.split.values())

    def route_key(self, k: int, item_hash: int) -> RouteKey:
        """Item k's routing key, with its sub-key where its shape is split."""
        key = self.keys[k]
        parts = self.split.get(key)
        return key if parts is None else (*key, item_hash % parts)

    def check_invariants(self) -> None:
        assert abs(sum(self.key_loads.values()) - self.total_load) <= 1e-6 * max(1.0, self.total_load)
        for key, load in self.key_loads.items():
            parts = self.split.get(key, 1)
            assert parts >= 1
            # A key over the limit is a hot shape's leaf, split; any other fits the limit.
            assert load <= self.max_key_load or key in self.split, (key, load, self.max_key_load)
            assert parts == 1 or load > self.max_key_load, (key, parts, load)
        assert set(self.keys) == set(self.key_loads)


class Router:
    """The live nodes and which of them each routing key goes to (rendezvous hashing).

    Node names are stable across a node's loss and return (the node's slot, not its Ray id),
    so a node that comes back wins back exactly its old keys."""

    def __init__(self, plan: RoutingPlan, nodes: Iterable[str]) -> None:
        self.plan = plan
        self.nodes: set[str] = set(nodes)
        if not self.nodes:
            raise ValueError("a router needs at least one node")

    def node_of(self, k: int, item_hash: int) -> str:
        return highest_node(self.plan.route_key(k, item_hash), sorted(self.nodes))

    def add(self, node: str) -> None:
        self.nodes.add(node)

    def remove(self, node: str) -> None:
        if node in self.nodes and len(self.nodes) == 1:
            raise ValueError(f"cannot remove {node}: it is the last node")
        self.nodes.discard(node)

    def check_invariants(self) -> None:
        assert self.nodes
        self.plan.check_invariants()
