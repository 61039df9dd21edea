"""The cluster's routing plan and rendezvous router against a reference: each item's key is
the shallowest prefix of its chain light enough, a hot shape is split into sub-keys, a key's
node is the highest-scoring live node, and a node leaving or joining moves only the keys it
must. Pure: no Ray here."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cluster.routing import KEYS_PER_NODE, Router, RoutingPlan, highest_node, rendezvous_score

# Chains of a small trie: depth 1..3, few signatures per level, so prefixes are shared.
chains_st = st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), min_size=1, max_size=60)
loads_st = st.integers(1, 50)
nodes_st = st.lists(st.sampled_from([f"n{k}" for k in range(8)]), min_size=1, max_size=6, unique=True)


def as_chain(path: tuple[int, ...]) -> tuple[int, ...]:
    """A chain of prefix signatures from a path of component ids (each prefix its own value)."""
    return tuple(hash(path[:d]) & ((1 << 64) - 1) for d in range(1, len(path) + 1))


def reference_key(chains, loads, k: int, limit: float) -> tuple[int, int]:
    """Item k's key by brute force: the shallowest prefix whose items weigh at most `limit`."""
    mine = chains[k]
    for depth in range(1, len(mine) + 1):
        weight = sum(load for c, load in zip(chains, loads) if c[:depth] == mine[:depth])
        if weight <= limit:
            return (depth, mine[depth - 1])
    return (len(mine), mine[-1])


def reference_node(key, nodes) -> str:
    return sorted(nodes, key=lambda n: (rendezvous_score(key, n), n))[-1]


@settings(max_examples=150, deadline=None)
@given(paths=chains_st, data=st.data(), node_count=st.integers(1, 6))
def test_the_plan_matches_the_reference(paths, data, node_count):
    chains = [as_chain(p) for p in paths]
    loads = data.draw(st.lists(loads_st, min_size=len(chains), max_size=len(chains)))
    plan = RoutingPlan.build(chains, loads, nodes=node_count)
    plan.check_invariants()
    limit = sum(loads) / (node_count * KEYS_PER_NODE)
    assert plan.max_key_load == limit
    assert plan.keys == [reference_key(chains, loads, k, limit) for k in range(len(chains))]
    for key in set(plan.keys):
        weight = sum(load for kk, load in zip(plan.keys, loads) if kk == key)
        assert plan.split.get(key, 1) == (math.ceil(weight / limit) if weight > limit else 1)
        if key in plan.split:  # only a whole shape (the leaf of its chain) is ever split
            assert all(chains[k][-1] == key[1] and len(chains[k]) == key[0]
                       for k in range(len(chains)) if plan.keys[k] == key)
    assert plan.splits == len(plan.split)


@settings(max_examples=150, deadline=None)
@given(paths=chains_st, nodes=nodes_st, hashes=st.lists(st.integers(0, 2**64 - 1), min_size=60, max_size=60))
def test_a_key_goes_to_its_highest_scoring_node(paths, nodes, hashes):
    chains = [as_chain(p) for p in paths]
    plan = RoutingPlan.build(chains, [1] * len(chains), nodes=len(nodes))
    router = Router(plan, nodes)
    router.check_invariants()
    for k in range(len(chains)):
        key = plan.route_key(k, hashes[k])
        assert router.node_of(k, hashes[k]) == reference_node(key, nodes) == highest_node(key, nodes)


@settings(max_examples=150, deadline=None)
@given(paths=chains_st, nodes=nodes_st, extra=st.sampled_from(["m0", "m1"]), data=st.data(),
       hashes=st.lists(st.integers(0, 2**64 - 1), min_size=60, max_size=60))
def test_a_node_leaving_or_joining_moves_only_what_must_move(paths, nodes, extra, data, hashes):
    chains = [as_chain(p) for p in paths]
    plan = RoutingPlan.build(chains, [1] * len(chains), nodes=len(nodes))
    router = Router(plan, nodes)
    before = [router.node_of(k, hashes[k]) for k in range(len(chains))]
    router.add(extra)
    joined = [router.node_of(k, hashes[k]) for k in range(len(chains))]
    assert all(now in (was, extra) for was, now in zip(before, joined))  # only to the new node
    router.remove(extra)
    assert [router.node_of(k, hashes[k]) for k in range(len(chains))] == before  # and back
    if len(nodes) > 1:
        gone = data.draw(st.sampled_from(nodes))
        router.remove(gone)
        after = [router.node_of(k, hashes[k]) for k in range(len(chains))]
        assert all(now == was for was, now in zip(before, after) if was != gone)  # the rest stay
        assert gone not in after


def test_a_common_system_prompt_does_not_send_everything_to_one_node():
    """Every prompt shares its first component; 40 few-shot families of 3 shapes under it:
    the plan routes on the second level (a family stays together), spread over the nodes."""
    chains = [as_chain((0, family, variant)) for family in range(40) for variant in range(3)]
    plan = RoutingPlan.build(chains, [1] * len(chains), nodes=3)
    assert {key[0] for key in plan.keys} == {2} and plan.splits == 0
    nodes = {Router(plan, ["a", "b", "c"]).node_of(k, 0) for k in range(len(chains))}
    assert nodes == {"a", "b", "c"}


def test_a_hot_shape_is_split_and_counted():
    """One shape carries half the load: split into sub-keys, the rest routed whole."""
    chains = [as_chain((0, 1))] * 100 + [as_chain((0, 2 + k % 50, k)) for k in range(100)]
    plan = RoutingPlan.build(chains, [1] * len(chains), nodes=2)
    hot = (2, as_chain((0, 1))[-1])
    limit = 200 / (2 * KEYS_PER_NODE)
    assert plan.split == {hot: math.ceil(100 / limit)} and plan.splits == 1
    router = Router(plan, ["a", "b"])
    assert {router.node_of(k, k) for k in range(100)} == {"a", "b"}  # the hot shape on both nodes
