"""The cluster's routing plan and bounded-load rendezvous router against references: pass 1's
tally keeps per shape what per-item loads would sum to, each shape's key is the shallowest
prefix of its chain light enough, a hot shape is split into sub-keys, keys are placed
heaviest first on their highest-ranked node with room under (1 + epsilon) x the mean, a node
leaving moves its keys only and a node joining takes keys only to itself. Pure: no Ray here."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from pipeline.cluster.routing import (
    EPSILON,
    KEYS_PER_NODE,
    MAX_KEYS,
    Router,
    RoutingPlan,
    ShapeTally,
    check_key_space,
    computed_token_loads,
    highest_node,
    rendezvous_score,
)

# Chains of a small trie: depth 1..3, few signatures per level, so prefixes are shared.
chains_st = st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), min_size=1, max_size=60)
loads_st = st.integers(1, 50)
nodes_st = st.lists(st.sampled_from([f"n{k}" for k in range(8)]), min_size=1, max_size=6, unique=True)
hashes_st = st.lists(st.integers(0, 2**64 - 1), min_size=60, max_size=60)
# 0: the bound binds as hard as it can; EPSILON: what runs; 1e9: never binds (plain rendezvous).
epsilon_st = st.sampled_from([0.0, EPSILON, 0.3, 1e9])
NEVER_BINDS = 1e9


def as_chain(path: tuple[int, ...]) -> tuple[int, ...]:
    """A chain of prefix signatures from a path of component ids (each prefix its own value)."""
    return tuple(hash(path[:d]) & ((1 << 64) - 1) for d in range(1, len(path) + 1))


def reference_key(chains, loads, k: int, limit: float) -> tuple[int, int]:
    """Shape k's key by brute force: the shallowest prefix whose shapes weigh at most `limit`."""
    mine = chains[k]
    for depth in range(1, len(mine) + 1):
        weight = sum(load for c, load in zip(chains, loads) if c[:depth] == mine[:depth])
        if weight <= limit:
            return (depth, mine[depth - 1])
    return (len(mine), mine[-1])


def reference_ranking(key, nodes) -> list[str]:
    return [n for _score, n in sorted(((rendezvous_score(key, n), n) for n in nodes), reverse=True)]


def reference_place(route_loads: dict, keys, nodes, total: float, epsilon: float, placement: dict,
                    node_loads: dict) -> int:
    """Place `keys` into `placement` by the rule, one at a time, heaviest first; fallbacks."""
    bound = (1 + epsilon) * total / len(nodes)
    fallbacks = 0
    for key in sorted(keys, key=lambda key: (-route_loads[key], key)):
        ranking = reference_ranking(key, nodes)
        room = [n for n in ranking if node_loads[n] + route_loads[key] <= bound]
        if room:
            node = room[0]
        else:
            fallbacks += 1
            node = sorted(ranking, key=lambda n: (node_loads[n], ranking.index(n)))[0]
        placement[key] = node
        node_loads[node] += route_loads[key]
    return fallbacks


def plan_of(paths, data, nodes: int) -> tuple[list, list, RoutingPlan]:
    """A plan of the distinct shapes of `paths`, each with a drawn load."""
    chains = list(dict.fromkeys(as_chain(p) for p in paths))
    loads = data.draw(st.lists(loads_st, min_size=len(chains), max_size=len(chains)))
    return chains, loads, RoutingPlan.build(chains, loads, nodes=nodes)


def node_loads(router: Router) -> dict[str, float]:
    loads = dict.fromkeys(router.nodes, 0.0)
    for key, node in router.placement.items():
        loads[node] += router.plan.route_loads[key]
    return loads


@settings(max_examples=150, deadline=None)
@given(paths=chains_st, data=st.data(), node_count=st.integers(1, 6), hashes=hashes_st)
def test_the_plan_matches_the_reference(paths, data, node_count, hashes):
    chains, loads, plan = plan_of(paths, data, node_count)
    plan.check_invariants()
    limit = sum(loads) / (node_count * KEYS_PER_NODE)
    assert plan.max_key_load == limit
    assert plan.shape_keys == [reference_key(chains, loads, k, limit) for k in range(len(chains))]
    expected_routes = {}
    for key in set(plan.shape_keys):
        weight = sum(load for kk, load in zip(plan.shape_keys, loads) if kk == key)
        parts = math.ceil(weight / limit) if weight > limit else 1
        assert plan.split.get(key, 1) == parts
        if key in plan.split:  # only a whole shape (the leaf of its chain) is ever split
            assert [c for c, kk in zip(chains, plan.shape_keys) if kk == key] == [c for c in chains
                                                                                 if (len(c), c[-1]) == key]
        expected_routes.update({key if parts == 1 else (*key, j): weight / parts for j in range(parts)})
    assert plan.splits == len(plan.split)
    for shape, h in zip(range(len(chains)), hashes):  # a split shape's item on sub-key hash mod k
        key = plan.shape_keys[shape]
        assert plan.route_key(shape, h) == (key if key not in plan.split else (*key, h % plan.split[key]))
    assert plan.route_loads.keys() == expected_routes.keys()
    assert all(math.isclose(plan.route_loads[rk], load) for rk, load in expected_routes.items())


@settings(max_examples=200, deadline=None)
@given(paths=chains_st, data=st.data(), nodes=nodes_st, epsilon=epsilon_st)
def test_the_placement_matches_the_reference_and_keeps_the_bound(paths, data, nodes, epsilon):
    _chains, _loads, plan = plan_of(paths, data, len(nodes))
    router = Router(plan, nodes, epsilon=epsilon)
    router.check_invariants()
    expected: dict = {}
    fallbacks = reference_place(plan.route_loads, plan.route_loads, nodes, plan.total_load, epsilon, expected,
                                dict.fromkeys(nodes, 0.0))
    assert router.placement == expected and router.fallbacks == fallbacks
    assert router.loads == node_loads(router)
    bound = (1 + epsilon) * plan.total_load / len(nodes)
    if fallbacks == 0:
        assert max(router.loads.values()) <= bound
    # A key that fits nowhere goes to the least loaded node, which holds less than the mean.
    assert max(router.loads.values()) <= max(bound, plan.total_load / len(nodes) + max(plan.route_loads.values()))
    for key, node in router.placement.items():  # every node ranked above a key's had no room
        ranking = reference_ranking(key, nodes)
        for better in ranking[:ranking.index(node)]:
            assert router.loads[better] + plan.route_loads[key] > bound, (key, node, better)
    for shape in range(len(plan.shape_keys)):
        route_key = plan.route_key(shape, shape)
        assert router.node_of(route_key) == router.placement[route_key]


def test_no_fallback_while_keys_are_a_small_share_of_a_node():
    """Many keys, each a small share of a node (120 families of 1..12 items over 3 nodes):
    every key finds room, and the fullest node is within (1 + EPSILON) x the mean, where
    plain rendezvous (the bound never binding) leaves it further off."""
    chains = [as_chain((0, family, k)) for family in range(120) for k in range(1 + family % 12)]
    plan = RoutingPlan.build(chains, [1] * len(chains), nodes=3)
    router = Router(plan, ["a", "b", "c"])
    router.check_invariants()
    assert router.fallbacks == 0 and plan.splits == 0
    assert max(router.loads.values()) <= (1 + EPSILON) * len(chains) / 3
    plain = Router(plan, ["a", "b", "c"], epsilon=NEVER_BINDS)
    assert max(plain.loads.values()) > (1 + EPSILON) * len(chains) / 3


@settings(max_examples=150, deadline=None)
@given(paths=chains_st, data=st.data(), nodes=nodes_st)
def test_a_bound_that_never_binds_is_plain_rendezvous(paths, data, nodes):
    _chains, _loads, plan = plan_of(paths, data, len(nodes))
    router = Router(plan, nodes, epsilon=NEVER_BINDS)
    assert router.placement == {key: highest_node(key, nodes) for key in plan.route_loads} and router.fallbacks == 0
    before = dict(router.placement)
    for extra in ("m0", "m1"):  # a joiner takes exactly the keys it wins; leaving, gives them back
        router.add(extra)
        assert router.placement == {key: highest_node(key, [*nodes, extra]) for key in plan.route_loads}
        router.remove(extra)
        assert router.placement == before
    if len(nodes) > 1:  # a node that leaves and comes back wins back exactly its keys
        gone = data.draw(st.sampled_from(nodes))
        router.remove(gone)
        router.add(gone)
        assert router.placement == before
    router.check_invariants()


@settings(max_examples=200, deadline=None)
@given(paths=chains_st, data=st.data(), nodes=nodes_st.filter(lambda n: len(n) > 1), epsilon=epsilon_st)
def test_a_node_leaving_moves_its_keys_and_no_other(paths, data, nodes, epsilon):
    _chains, _loads, plan = plan_of(paths, data, len(nodes))
    router = Router(plan, nodes, epsilon=epsilon)
    before, before_loads = dict(router.placement), dict(router.loads)
    gone = data.draw(st.sampled_from(nodes))
    router.remove(gone)
    router.check_invariants()
    stayed = {key: node for key, node in before.items() if node != gone}
    assert {key: router.placement[key] for key in stayed} == stayed  # not one other key moved
    assert gone not in router.placement.values()
    # Its keys placed by the rule over what the others already held, for the nodes left.
    survivors = [n for n in nodes if n != gone]
    held = dict.fromkeys(survivors, 0.0)
    for key, node in stayed.items():
        held[node] += plan.route_loads[key]
    expected = dict(stayed)
    reference_place(plan.route_loads, [k for k, n in before.items() if n == gone], survivors, plan.total_load,
                    epsilon, expected, held)
    assert router.placement == expected
    bound = (1 + epsilon) * plan.total_load / len(survivors)
    assert max(router.loads.values()) <= max(bound, *before_loads.values(),
                                             plan.total_load / len(survivors) + max(plan.route_loads.values()))


@settings(max_examples=200, deadline=None)
@given(paths=chains_st, data=st.data(), nodes=nodes_st, extra=st.sampled_from(["m0", "m1"]), epsilon=epsilon_st)
def test_a_node_joining_takes_keys_only_to_itself_within_the_bound(paths, data, nodes, extra, epsilon):
    _chains, _loads, plan = plan_of(paths, data, len(nodes))
    router = Router(plan, nodes, epsilon=epsilon)
    before = dict(router.placement)
    router.add(extra)
    router.check_invariants()
    bound = (1 + epsilon) * plan.total_load / (len(nodes) + 1)
    assert router.loads[extra] <= bound
    for key, was in before.items():
        now = router.placement[key]
        outranks = (rendezvous_score(key, extra), extra) > (rendezvous_score(key, was), was)
        if now != was:  # moved: only to the joiner, only a key that ranks it above its node
            assert now == extra and outranks, (key, was, now)
        elif outranks:  # it would have gone, but the joiner had no room at its turn
            assert router.loads[extra] + plan.route_loads[key] > bound, (key, was)


@settings(max_examples=150, deadline=None)
@given(paths=chains_st, data=st.data())
def test_the_tally_sums_per_shape_what_each_item_would_weigh(paths, data):
    """Items into pass 1's tally (some keys left without an item): per shape, its items and
    their suffixes; its load is its items' per-item loads summed (each component's tokens
    shared out over the items through its prefix), and the loads sum to every distinct
    prefix's tokens once plus every suffix."""
    chains = [as_chain(p) for p in paths]
    # A component's length depends on its prefix only (the same prefix, the same tokens).
    length_of = {c: 1 + c % 97 for chain in chains for c in chain}
    tokens = [[length_of[c] for c in chain] for chain in chains]
    suffixes = data.draw(st.lists(st.integers(0, 40), min_size=len(chains), max_size=len(chains)))
    keys = data.draw(st.lists(st.integers(0, 199), min_size=len(chains), max_size=len(chains), unique=True))
    tally = ShapeTally(keys=200)
    for key, chain, shape_tokens, suffix in zip(keys, chains, tokens, suffixes):
        tally.add(key, chain, shape_tokens, suffix)
    tally.check_invariants()
    assert tally.count == len(chains) and len(tally.chains) == len(set(chains))
    assert [tally.chains[tally.shape(key)] for key in keys] == chains
    assert all(tally.shape(key) is None for key in set(range(200)) - set(keys))
    per_item = {}
    for k, chain in enumerate(chains):
        through = [sum(1 for other in chains if other[:d] == chain[:d]) for d in range(1, len(chain) + 1)]
        per_item[k] = suffixes[k] + sum(n / m for n, m in zip(tokens[k], through))
    loads = tally.loads()
    for shape, chain in enumerate(tally.chains):
        assert math.isclose(loads[shape], sum(load for k, load in per_item.items() if chains[k] == chain))
    distinct = {(d, c) for chain in chains for d, c in enumerate(chain, start=1)}
    assert math.isclose(sum(loads), sum(suffixes) + sum(length_of[c] for _d, c in distinct))


def test_computed_token_loads_of_the_empty_shape():
    """No components: the load is the suffix (the empty shape's chain has one signature)."""
    assert computed_token_loads([(7,)], [[]], [2], [8]) == [8.0]


def test_the_key_space_is_checked_at_its_limit():
    check_key_space(MAX_KEYS)  # the largest: every shape id + 1 fits a uint32
    with pytest.raises(ValueError, match="fewer than 4,294,967,296"):
        check_key_space(MAX_KEYS + 1)
    with pytest.raises(ValueError):
        check_key_space(-1)


def test_a_common_system_prompt_does_not_send_everything_to_one_node():
    """Every prompt shares its first component; 40 few-shot families of 3 shapes under it:
    the plan routes on the second level (a family stays together), spread over the nodes."""
    chains = [as_chain((0, family, variant)) for family in range(40) for variant in range(3)]
    plan = RoutingPlan.build(chains, [1] * len(chains), nodes=3)
    assert {key[0] for key in plan.shape_keys} == {2} and plan.splits == 0
    router = Router(plan, ["a", "b", "c"])
    placed = Counter(router.node_of(plan.route_key(shape, 0)) for shape in range(len(chains)))
    # Keys of 3 items, 40 to a node: the fullest node within the bound or one key past the mean.
    assert set(placed) == {"a", "b", "c"} and max(placed.values()) <= max((1 + EPSILON) * 40, 40 + 3)


def test_a_hot_shape_is_split_and_counted():
    """One shape carries half the load: split into sub-keys, the rest routed whole."""
    chains = [as_chain((0, 1))] + [as_chain((0, 2 + k % 50, k)) for k in range(100)]
    plan = RoutingPlan.build(chains, [100] + [1] * 100, nodes=2)
    hot = (2, as_chain((0, 1))[-1])
    limit = 200 / (2 * KEYS_PER_NODE)
    assert plan.split == {hot: math.ceil(100 / limit)} and plan.splits == 1
    plan.check_invariants()
    router = Router(plan, ["a", "b"])
    assert {router.node_of(plan.route_key(0, h)) for h in range(100)} == {"a", "b"}  # the hot shape on both


def test_the_last_node_cannot_leave():
    plan = RoutingPlan.build([as_chain((0,))], [1], nodes=1)
    router = Router(plan, ["a"])
    try:
        router.remove("a")
    except ValueError as exc:
        assert "last node" in str(exc)
    else:
        raise AssertionError("the last node left")
    assert router.node_of(plan.route_key(0, 0)) == "a"
