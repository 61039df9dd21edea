"""A cluster run's two passes over its source, against a reference: pass 1 tallies each
shape once per item; pass 2's cursors together make every item exactly once (each makes
only its own, whatever nodes leave or join meanwhile), a cursor's items are those whose
keys were first placed on its nodes, and there are never more cursors than MAX_CURSORS.
Pure: a source in memory, no Ray."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cluster.routing import Router, RoutingPlan
from pipeline.cluster.stream import MAX_CURSORS, Cursor, Routes, item_hash, tally_items
from pipeline.producer.signature import chain


def planned(source, nodes: list[str]):
    tally = tally_items(source)
    plan = RoutingPlan.build(tally.chains, tally.loads(), nodes=len(nodes))
    router = Router(plan, nodes)
    return tally, plan, router, Routes(tally, plan, router.placement)


shapes_st = st.dictionaries(st.integers(0, 299), st.sampled_from([(1,), (1, 2), (1, 3), (4,), (4, 5, 6), (7, 8)]),
                            min_size=1, max_size=120)
node_names = [f"n{k}" for k in range(20)]


@settings(max_examples=100, deadline=None)
@given(shapes=shapes_st, node_count=st.integers(1, 20))
def test_the_cursors_share_out_every_tallied_item_once(list_source, shapes, node_count):
    source = list_source(300, shapes)
    tally, plan, router, routes = planned(source, node_names[:node_count])
    tally.check_invariants()
    routes.check_invariants()
    assert source.made == Counter(shapes.keys())  # pass 1: every item once
    assert tally.count == len(shapes)
    assert routes.cursors == min(node_count, MAX_CURSORS, len(set(router.placement.values())) or 1)
    owners = {k: [c for c in range(routes.cursors) if routes.wanted_by(c)(k)] for k in range(300)}
    assert all(len(found) == (1 if k in shapes else 0) for k, found in owners.items())
    # A cursor's items are those whose route keys the first placement put on its nodes.
    nodes = sorted(set(router.placement.values()))
    for k in shapes:
        first = router.placement[routes.route_key(k)]
        assert owners[k] == [nodes.index(first) % MAX_CURSORS]
        shape = tally.shape(k)
        assert routes.route_key(k) == plan.route_key(shape, item_hash(k))
        assert chain(list_source.components(shapes[k])) == tally.chains[shape]


@settings(max_examples=100, deadline=None)
@given(shapes=shapes_st, node_count=st.integers(2, 6), data=st.data())
def test_pass_two_reads_each_item_once_while_nodes_leave_and_join(list_source, shapes, node_count, data):
    """Cursors read in any interleaving; a node leaves (and another joins) part way: each
    item is made once in pass 2, and goes to its key's node at the time it is read."""
    source = list_source(300, shapes)
    nodes = node_names[:node_count]
    _tally, _plan, router, routes = planned(source, nodes)
    source.made.clear()
    cursors = [Cursor(source.items(routes.wanted_by(c))) for c in range(routes.cursors)]
    read: list[int] = []
    gone, joined = data.draw(st.sampled_from(nodes)), "m0"
    leave_at, join_at = data.draw(st.integers(0, len(shapes))), data.draw(st.integers(0, len(shapes)))
    pick = data.draw(st.randoms(use_true_random=True))
    while not all(cursor.done for cursor in cursors):
        if len(read) == leave_at and gone in router.nodes:
            router.remove(gone)
        if len(read) == join_at and joined not in router.nodes:
            router.add(joined)
        cursor = pick.choice(cursors)
        ahead = cursor.peek()
        if ahead is None:
            continue
        assert cursor.peek() is ahead  # kept until popped, not read again
        k, item = ahead
        assert item.payload == b"%d" % k
        assert router.node_of(routes.route_key(k)) in router.nodes
        read.append(k)
        cursor.pop()
    assert sorted(read) == sorted(shapes)
    assert source.made == Counter(shapes.keys())  # pass 2: every item made once, by its own cursor


def test_more_nodes_than_cursors_share_them(list_source):
    shapes = {k: (k % 40,) for k in range(400)}  # 40 shapes, 10 items each
    source = list_source(400, shapes)
    _tally, _plan, router, routes = planned(source, node_names)
    assert len(set(router.placement.values())) == 20 and routes.cursors == MAX_CURSORS
    assert {routes.cursor_of(k) for k in shapes} == set(range(MAX_CURSORS))
