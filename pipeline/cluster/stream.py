"""A cluster run's items read from their source twice, in memory that does not grow with the run.

    tally = tally_items(source)                    # pass 1: every item made once, kept by shape
    plan = RoutingPlan.build(tally.chains, tally.loads(), nodes=3)
    router = Router(plan, nodes)
    routes = Routes(tally, plan, router.placement)
    cursors = [Cursor(source.items(routes.wanted_by(c))) for c in range(routes.cursors)]   # pass 2
    k, item = cursors[0].peek()                    # a cursor's next item, for router.node_of(routes.route_key(k))
    cursors[0].pop()                               # routed: the cursor reads on

Pass 1 makes every item (routing needs each one's shape: its chain and token counts) and
keeps, per shape, its chain and load (`routing.ShapeTally`), and per key a 4-byte shape id.
The plan and placement are made from those. Pass 2 makes the items again, as they are sent.

Pass 2 reads through one cursor per node the first placement put keys on (at most
MAX_CURSORS; more nodes share them): cursor c makes only the items whose route keys were
first placed on its nodes, telling them from the others by their key's shape id alone, so
each item is made once in pass 2 and the others cost a line read (about 0.7 us a line, against
about 230 us to make a short chat request with the tiny model's tokenizer). Every route key
belongs to one cursor for the whole run, and an item goes to its key's node at the time it is
read, so a node lost or joined changes where a cursor's items go, never which cursor reads
them: every item is read once. The driver reads a cursor only while its next item's node has
room (`driver.READ_AHEAD_ITEMS` queued), so what is read and not answered is bounded.
NOTE: one cursor over the whole source was rejected: on a file in shape order it stops at the
first node whose queue is full and the other nodes wait. Measured on the 3-node test cluster
(2 shared cores) with windows cut to 64 items per consumer, so that a key's run of 1,000
items is several times what its node holds, as at 10 million requests in shape order: 24,000
requests sorted by shape took 66.3 s with one cursor and 45.3 s with one per node; shuffled,
47.3 s and 46.2 s.

Owner: the driver's main thread (`driver.py`); nothing here does I/O but through the source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import xxhash

from pipeline.cluster.routing import RouteKey, RoutingPlan, ShapeTally
from pipeline.producer.signature import chain as shape_chain
from pipeline.producer.workload import WorkItem

# Cursors of pass 2 at most: each reads every line of the source (making only its own
# items), so a cursor costs a line read per item of the others; at 16, about 16 x 0.7 us
# against 230 us to make an item (5%), and 16 nodes each read at their own pace.
MAX_CURSORS = 16


class ItemSource(Protocol):
    """What a cluster run reads its items from, twice, in the same key order each time."""

    keys: int  # every key is in 0..keys-1

    def scan(self) -> Iterator[tuple[int, WorkItem]]:
        """Pass 1: every item, made once, with its key (an item that cannot be made is the
        source's to answer, and left out)."""
        ...

    def items(self, wanted: Callable[[int], bool]) -> Iterator[tuple[int, WorkItem]]:
        """Pass 2: the items of the keys `wanted` says, made again, with their keys; a key
        not wanted costs its source no item made."""
        ...


def item_hash(key: int) -> int:
    """The hash that picks a split shape's sub-key for the item named `key`."""
    return xxhash.xxh3_64_intdigest(b"%d" % key)


def tally_items(source: ItemSource, on_read: Callable[[int], None] | None = None) -> ShapeTally:
    """Pass 1: every item of `source` into a tally of its shapes (`on_read(items so far)`
    after each)."""
    tally = ShapeTally(source.keys)
    for key, item in source.scan():
        tally.add(key, shape_chain(item.components), [len(c) for c in item.components], len(item.suffix))
        if on_read is not None:
            on_read(tally.count)
    return tally


class Routes:
    """Each key's route key (`route_key`) and pass-2 cursor (`cursor_of`), from pass 1's
    tally, the plan and the placement the run started with. Pure; per shape and per route
    key, nothing per item."""

    def __init__(self, tally: ShapeTally, plan: RoutingPlan, placement: dict[RouteKey, str]) -> None:
        self.tally = tally
        self.plan = plan
        nodes = sorted(set(placement.values()))
        cursor_of_node = {node: position % MAX_CURSORS for position, node in enumerate(nodes)}
        self.cursors = max(1, min(len(nodes), MAX_CURSORS))
        self.key_cursor = {key: cursor_of_node[node] for key, node in placement.items()}
        # A shape routed whole is read by one cursor; a split one's items by their sub-key's (-1).
        self.shape_cursor = [-1 if key in plan.split else self.key_cursor[key] for key in plan.shape_keys]

    def route_key(self, key: int) -> RouteKey:
        """The route key of the item named `key` (one pass 1 tallied)."""
        shape = self.tally.shape(key)
        assert shape is not None, key
        return self.plan.route_key(shape, item_hash(key))

    def cursor_of(self, key: int) -> int:
        """The cursor that reads the item named `key`; -1 for a key with no item."""
        shape = self.tally.shape(key)
        if shape is None:
            return -1
        cursor = self.shape_cursor[shape]
        return cursor if cursor >= 0 else self.key_cursor[self.plan.route_key(shape, item_hash(key))]

    def wanted_by(self, cursor: int) -> Callable[[int], bool]:
        return lambda key: self.cursor_of(key) == cursor

    def check_invariants(self) -> None:
        assert set(self.key_cursor) == set(self.plan.route_loads)
        assert all(0 <= c < self.cursors for c in self.key_cursor.values())
        assert len(self.shape_cursor) == len(self.plan.shape_keys) == len(self.tally.chains)


class Cursor:
    """One stream of pass 2. `peek` reads (makes) its next item, once, and keeps it until
    `pop`: an item whose node has no room yet waits here. Owner: the driver."""

    __slots__ = ("_items", "ahead", "done")

    def __init__(self, items: Iterator[tuple[int, WorkItem]]) -> None:
        self._items = items
        self.ahead: tuple[int, WorkItem] | None = None
        self.done = False

    def peek(self) -> tuple[int, WorkItem] | None:
        """The next item and its key, read now or kept from the last call; None at the end."""
        if self.ahead is None and not self.done:
            self.ahead = next(self._items, None)
            self.done = self.ahead is None
        return self.ahead

    def pop(self) -> None:
        assert self.ahead is not None
        self.ahead = None
