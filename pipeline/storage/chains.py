"""The shapes' chains of prefix signatures (SPEC §4b), durable as LINEAGE records of the store
log (`storelog.py`), so that shapes recovered from disk after a broker restart are placed
under their prefixes again before dispatch starts. A producer sends a shape's chain once per
connection, and one that finished never comes back: without them the recovered backlog is
served as chains of one (most tokens first).

One record per trie node newly declared, never per item: a chain's levels the log does not
hold yet, each with its parent (`LineageLog.record`, a frame's chains in one append):

    record      appended during ingest, before the frame's items are; `power`: synced with
                the log at the group commit, so a chain is durable before any item that
                needs it is acknowledged
    recovery    `recovered_chains`: the chains of the shapes still live from the log's
                records (the first record of a node wins; a record of an impossible depth is
                damage, named), and the bodies the recovery's compaction of the log keeps:
                their nodes only. A compaction while running keeps every node.

Bounded: at most MAX_LINEAGE_RECORDS nodes a broker life (the trie's MAX_TRIE_NODES). Past it
(or on a disk too full to append) a chain's new levels are not recorded (`unrecorded` counts
the chains, the broker's status shows it): after a restart those shapes come back as chains
of one, as a shape past the trie's own limit is placed; their items are unaffected.

Owner: the DiskTier, in the broker's single dispatch loop. Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.broker.ids import ShapeKey
from pipeline.storage.storelog import LogReading, StoreLog
from pipeline.wire.errors import DiskFullError
from pipeline.wire.layouts.frames import MAX_CHAIN_DEPTH

# Nodes recorded at most a broker life: the trie's MAX_TRIE_NODES (one record per node, a
# shape's own included): 32 MiB of log, and the set that dedupes them, about 100 bytes a node.
MAX_LINEAGE_RECORDS = 1 << 19

_Node = tuple[int, int]  # (model, signature)


def lineage_bodies(nodes: Sequence[tuple[_Node, int, int]]) -> np.ndarray:
    """LINEAGE record bodies, (n, 4) uint64, of ((model, signature), parent, depth) nodes."""
    bodies = np.zeros((len(nodes), 4), dtype=np.uint64)
    for row, ((model, signature), parent, depth) in enumerate(nodes):
        bodies[row, :3] = (model | depth << 32, signature, parent)
    return bodies


@dataclass(slots=True)
class LineageReading:
    """The LINEAGE records of a store log: each node's (parent, depth), the first record of
    it winning, and the records no chain can hold (`damaged`, named)."""

    nodes: dict[_Node, tuple[int, int]] = field(default_factory=dict)
    damaged: list[str] = field(default_factory=list)

    def chain(self, shape: ShapeKey) -> tuple[int, ...] | None:
        """The shape's chain, walked up its parents (None: the log does not hold it). A level
        the log lost (a damaged record) ends the walk: the chain keeps what is below."""
        found = self.nodes.get((shape.model, shape.signature))
        if found is None:
            return None
        chain = [shape.signature]
        parent, depth = found
        while depth > 1 and len(chain) < MAX_CHAIN_DEPTH:
            above = self.nodes.get((shape.model, parent))
            if above is None or above[1] != depth - 1:
                break
            chain.append(parent)
            parent, depth = above
        return tuple(reversed(chain))


def read_lineage(log: LogReading) -> LineageReading:
    """The log's LINEAGE records replayed (a few per shape, never per item)."""
    reading = LineageReading()
    bodies = log.lineage
    depths = (bodies[:, 0] >> np.uint64(32)).astype(np.int64)
    bad = np.flatnonzero((depths < 1) | (depths > MAX_CHAIN_DEPTH))
    if bad.size:
        reading.damaged.append(f"{log.path}: {bad.size} lineage records of a depth no chain has (first: "
                               f"{int(depths[bad[0]])}; 1 to {MAX_CHAIN_DEPTH} are)")
    good = np.flatnonzero((depths >= 1) & (depths <= MAX_CHAIN_DEPTH))
    models = (bodies[good, 0] & np.uint64(0xFFFFFFFF)).tolist()
    for model, signature, parent, depth in zip(models, bodies[good, 1].tolist(), bodies[good, 2].tolist(),
                                               depths[good].tolist()):
        reading.nodes.setdefault((model, signature), (parent, depth))
    return reading


def recovered_chains(reading: LineageReading, live: Iterable[ShapeKey]
                     ) -> tuple[list[tuple[int, tuple[int, ...]]], np.ndarray]:
    """The `live` shapes' chains to declare again (deepest level last), and the LINEAGE
    bodies of their nodes (each once, parents first): what recovery's compaction keeps."""
    chains = []
    for shape in sorted(live, key=lambda s: (s.model, s.signature)):
        chain = reading.chain(shape)
        if chain is not None and len(chain) > 1:
            chains.append((shape.model, chain))
    nodes: dict[_Node, tuple[int, int]] = {}
    for model, chain in chains:
        for signature in chain:
            nodes.setdefault((model, signature), reading.nodes[(model, signature)])
    ordered = sorted(((node, parent, depth) for node, (parent, depth) in nodes.items()), key=lambda n: (n[2], n[0]))
    return chains, lineage_bodies(ordered)


class LineageLog:
    """The chains recorded while the broker runs, appended to the store log (see the module
    docstring). `known`: the nodes the log holds (a chain declared again writes nothing)."""

    def __init__(self, log: StoreLog, known: set[_Node], max_records: int | None = None) -> None:
        self._log = log
        self._known = known
        self.max_records = MAX_LINEAGE_RECORDS if max_records is None else max_records
        self.unrecorded = 0  # chains with new levels past max_records or refused for space

    def record(self, chains: Iterable[tuple[int, Sequence[int]]]) -> int:
        """Append each chain's levels the log does not hold yet (each with its parent), all
        in one write; returns how many. A chain past `max_records`, or all of them when the
        disk has no room, is not written and `unrecorded` counts it.
        NOTE: one write per chain was 5,000 writes for a frame of 5,000 requests with their
        own system prompts, about a tenth of the broker's extra CPU on them."""
        nodes: list[tuple[_Node, int, int]] = []
        written: set[_Node] = set()  # this call's nodes: known once the write is done
        counted = 0
        for model, chain in chains:
            new = [k for k, signature in enumerate(chain)
                   if (model, int(signature)) not in self._known and (model, int(signature)) not in written]
            if not new:
                continue
            if len(self._known) + len(written) + len(new) > self.max_records:
                self.unrecorded += 1
                continue
            nodes += [((model, int(chain[k])), int(chain[k - 1]) if k else 0, k + 1) for k in new]
            written.update((model, int(chain[k])) for k in new)
            counted += 1
        if not nodes:
            return 0
        try:
            self._log.lineage(lineage_bodies(nodes))
        except DiskFullError:
            self.unrecorded += counted  # the items still go in (or wait for space): only the order is lost
            return 0
        self._known |= written
        return len(nodes)
