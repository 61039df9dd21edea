"""The lineage file (DATA_DIR/shapes.lineage, LINEAGE_* in `pipeline.wire.layouts`): the
shapes' chains of prefix signatures (SPEC §4b), durable, so that shapes recovered from disk
after a broker restart are placed under their prefixes again before dispatch starts. A
producer sends a shape's chain once per connection, and one that finished never comes back:
without this file the recovered backlog was served as chains of one (most tokens first).

One record per trie node newly declared, never per item: a chain's levels the file does not
hold yet, each with its parent (`record`, a frame's chains in one write):

    record      pwrite into preallocated space during ingest, before the frame's items are
                appended; `power`: fdatasync at the group commit (`sync`, from the tier's
                flush), so a chain is durable before any item that needs it is acknowledged
    recovery    `LineageLog.recover`: read every record (a torn last record ignored, a damaged
                one before the last reported with path and byte offset), rebuild the chains
                of the shapes still live, and rewrite the file holding only their nodes
                (temp file, fsync, rename, directory fsync)

Bounded: at most MAX_LINEAGE_RECORDS records (the trie's MAX_TRIE_NODES). Past it (or on a
disk too full to grow the file) a chain's new levels are not recorded (`unrecorded` counts
the chains, the broker's status shows it):
after a restart those shapes come back as chains of one, as a shape past the trie's own
limit is placed. The limit holds per broker life; recovery compacts to the live shapes.

Owner: the DiskTier, in the broker's single dispatch loop; the only writer. Not thread-safe.
`close()` releases the descriptor; the file stays.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from pipeline.broker.ids import ShapeKey
from pipeline.broker.storage.replace import preallocate, write_replacement
from pipeline.wire import fileops
from pipeline.wire.errors import DiskFullError, DurabilityError, StoreReadError
from pipeline.wire.fileops import errno_text
from pipeline.wire.layouts.frames import MAX_CHAIN_DEPTH
from pipeline.wire.layouts.lineage import (
    LINEAGE_CHECKSUM_FROM,
    LINEAGE_FILE,
    LINEAGE_HEADER_DTYPE,
    LINEAGE_HEADER_STRUCT,
    LINEAGE_MAGIC,
    LINEAGE_NODE,
    LINEAGE_RECORD_DTYPE,
    LINEAGE_RECORD_SIZE_BYTES,
    LINEAGE_RECORD_STRUCT,
    LINEAGE_VERSION,
)

# Records the file holds at most, the header aside: the trie's MAX_TRIE_NODES (one record
# per node, a shape's own included), 32 MiB of file and ~32 MiB of the set that dedupes them.
MAX_LINEAGE_RECORDS = 1 << 19
# Preallocation step: 1,024 records (64 KiB), so growing the file is a per-thousand-shapes cost.
LINEAGE_CHUNK_RECORDS = 1024
# Suffix of the compaction's temp file beside the lineage file.
LINEAGE_TMP_SUFFIX = ".tmp"

_Node = tuple[int, int]  # (model, signature)


def lineage_path(data_dir: str) -> str:
    return os.path.join(data_dir, LINEAGE_FILE)


def encode_header(time_ns: int | None = None) -> bytes:
    body = LINEAGE_HEADER_STRUCT.pack(LINEAGE_MAGIC, LINEAGE_VERSION, LINEAGE_RECORD_SIZE_BYTES,
                                      time.time_ns() if time_ns is None else time_ns, 0)
    return body[:LINEAGE_CHECKSUM_FROM] + xxhash.xxh3_64_intdigest(body[:LINEAGE_CHECKSUM_FROM]).to_bytes(8, "little")


def encode_node(model: int, signature: int, parent: int, depth: int, time_ns: int) -> bytes:
    """One node record, checksummed."""
    body = LINEAGE_RECORD_STRUCT.pack(LINEAGE_NODE, depth, model, signature, parent, time_ns, 0)
    return body[:LINEAGE_CHECKSUM_FROM] + xxhash.xxh3_64_intdigest(body[:LINEAGE_CHECKSUM_FROM]).to_bytes(8, "little")


def _checksum_fails(raw: np.ndarray, stored: int) -> bool:
    return xxhash.xxh3_64_intdigest(raw[:LINEAGE_CHECKSUM_FROM].tobytes()) != stored


@dataclass(slots=True)
class LineageReading:
    """A lineage file read back: each node's (parent, depth), where the next record goes,
    and what was wrong with the file."""

    path: str
    nodes: dict[_Node, tuple[int, int]] = field(default_factory=dict)
    used: int = 0  # record slots after the header up to the last valid one
    damaged: list[str] = field(default_factory=list)
    torn_last: str = ""
    header_problem: str = ""  # not a lineage file of this version: nothing in it is read

    def chain(self, shape: ShapeKey) -> tuple[int, ...] | None:
        """The shape's chain, walked up its parents (None: the file does not hold it). A
        level the file lost (a damaged record) ends the walk: the chain keeps what is below."""
        key = (shape.model, shape.signature)
        found = self.nodes.get(key)
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


def read_lineage(path: str) -> LineageReading | None:
    """Replay a lineage file (None if there is none). StoreReadError if it cannot be read."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreReadError(f"{path}: cannot read the lineage file ({errno_text(exc)})") from exc
    reading = LineageReading(path)
    size = LINEAGE_RECORD_SIZE_BYTES
    if len(data) < size:
        reading.header_problem = f"{path}: offset 0: {len(data)} bytes, shorter than the header ({size})"
        return reading
    header = np.frombuffer(data, dtype=LINEAGE_HEADER_DTYPE, count=1)[0]
    raw_header = np.frombuffer(data, dtype=np.uint8, count=size)
    if (_checksum_fails(raw_header, int(header["checksum"])) or header["magic"] != LINEAGE_MAGIC
            or int(header["version"]) != LINEAGE_VERSION or int(header["record_size"]) != size):
        reading.header_problem = (f"{path}: offset 0: not a lineage header of version {LINEAGE_VERSION} "
                                  f"(magic {bytes(header['magic'])!r}, version {int(header['version'])})")
        return reading
    whole = len(data) // size - 1
    raw = np.frombuffer(data, dtype=np.uint8, count=whole * size, offset=size).reshape(whole, size)
    records = raw.view(LINEAGE_RECORD_DTYPE).reshape(-1)
    nonzero = np.flatnonzero(raw.any(axis=1))
    partial = len(data) % size and any(data[(whole + 1) * size:])
    last = int(nonzero[-1]) if nonzero.size else -1
    for index in range(last + 1):
        offset = (index + 1) * size
        why = _record_problem(records[index], raw[index])
        if not why:
            model, signature = int(records[index]["model"]), int(records[index]["signature"])
            reading.nodes.setdefault((model, signature), (int(records[index]["parent"]), int(records[index]["depth"])))
            reading.used = index + 1
        elif index == last and not partial:
            reading.torn_last = f"{path}: offset {offset}: last lineage record {why} (a torn append, ignored)"
        else:
            reading.damaged.append(f"{path}: offset {offset}: lineage record {why}")
            reading.used = index + 1  # never written over: the records after it are valid
    if partial:
        reading.torn_last = f"{path}: offset {(whole + 1) * size}: a partial last record (a torn append, ignored)"
    return reading


def _record_problem(record: np.void, raw: np.ndarray) -> str:
    if not raw.any():
        return "is zero"
    if _checksum_fails(raw, int(record["checksum"])):
        return "fails its checksum"
    if int(record["kind"]) != LINEAGE_NODE or not 1 <= int(record["depth"]) <= MAX_CHAIN_DEPTH:
        return f"has kind {int(record['kind'])}, depth {int(record['depth'])}"
    return ""


@dataclass(slots=True)
class RecoveredLineage:
    """What recovery found: the live shapes' chains to declare again (deepest level last),
    the file's damage (`problems`: named by path and offset) and benign findings (`notes`)."""

    chains: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class LineageLog:
    """The lineage file open for appending (see the module docstring)."""

    def __init__(self, path: str, fd: int, durable: bool, used: int, known: set[_Node],
                 max_records: int | None = None) -> None:
        """Use `LineageLog.recover`. fd -1 with max_records 0: no file (a disk too full to
        write one at start): every chain is counted unrecorded."""
        self.path = path
        self.durable = durable  # `power`: fdatasync at the group commit
        self._fd = fd
        self.used = used  # record slots after the header written so far
        self.allocated = os.fstat(fd).st_size // LINEAGE_RECORD_SIZE_BYTES - 1 if fd >= 0 else 0
        self._known = known  # nodes the file holds: a chain declared again writes nothing
        self._dirty = False
        self.unrecorded = 0  # chains with new levels past MAX_LINEAGE_RECORDS, not recorded
        self.max_records = MAX_LINEAGE_RECORDS if max_records is None else max_records

    @classmethod
    def recover(cls, data_dir: str, live: Iterable[ShapeKey], durable: bool) -> tuple[LineageLog, RecoveredLineage]:
        """Read the file, keep the chains of the `live` shapes (those recovery found items
        of), and rewrite it holding only their nodes. A full disk keeps the old file, in
        use as it is (appends go after its last valid record)."""
        path = lineage_path(data_dir)
        found = RecoveredLineage()
        leftover = path + LINEAGE_TMP_SUFFIX
        if os.path.exists(leftover):
            fileops.unlink(leftover)  # an interrupted compaction: the file itself is whole
            found.notes.append(f"{leftover}: an interrupted compaction's temp file, removed")
        reading = read_lineage(path)
        if reading is not None:
            found.problems += reading.damaged + ([reading.header_problem] if reading.header_problem else [])
            found.notes += [reading.torn_last] if reading.torn_last else []
            for shape in sorted(live, key=lambda s: (s.model, s.signature)):
                chain = reading.chain(shape)
                if chain is not None and len(chain) > 1:
                    found.chains.append((shape.model, chain))
        nodes = _chain_nodes(found.chains, reading)
        try:
            return cls._write_fresh(path, nodes, durable), found
        except DiskFullError as exc:
            if reading is None or reading.header_problem:  # nothing usable to append to
                found.notes.append(f"{exc}: no chain is kept while this broker runs (counted as unrecorded)")
                return cls(path, -1, durable, 0, set(), max_records=0), found
            found.notes.append(f"{exc}: the lineage file is kept as it is")
        fd = fileops.open_fd(path, os.O_RDWR, 0o600)
        return cls(path, fd, durable, reading.used, set(reading.nodes)), found

    @classmethod
    def _write_fresh(cls, path: str, nodes: list[tuple[_Node, int, int]], durable: bool) -> LineageLog:
        now = time.time_ns()
        data = bytearray(encode_header(now))
        for (model, signature), parent, depth in nodes:
            data += encode_node(model, signature, parent, depth, now)
        fd = write_replacement(path, path + LINEAGE_TMP_SUFFIX, bytes(data),
                               _size_bytes(len(nodes) + LINEAGE_CHUNK_RECORDS), "lineage file")
        return cls(path, fd, durable, len(nodes), {node for node, _parent, _depth in nodes})

    def record(self, chains: Iterable[tuple[int, Sequence[int]]]) -> int:
        """Write each chain's levels the file does not hold yet (each with its parent), all
        in one write; returns how many. A chain past MAX_LINEAGE_RECORDS, or one the disk has
        no room to grow the file for, is not written and `unrecorded` counts it (after a
        restart that shape is a chain of one: its items are unaffected).
        NOTE: one write per chain was 5,000 writes for a frame of 5,000 requests with their
        own system prompts, about a tenth of the broker's extra CPU on them."""
        data = bytearray()
        written: set[_Node] = set()  # this call's nodes: known once the write is done
        now = time.time_ns()
        for model, chain in chains:
            new = [k for k, signature in enumerate(chain)
                   if (model, int(signature)) not in self._known and (model, int(signature)) not in written]
            if not new:
                continue
            if self.used + len(written) + len(new) > self.max_records or \
                    not self._room(self.used + len(written) + len(new)):
                self.unrecorded += 1
                continue
            for k in new:
                data += encode_node(model, int(chain[k]), int(chain[k - 1]) if k else 0, k + 1, now)
            written.update((model, int(chain[k])) for k in new)
        if written:
            fileops.pwrite_all(self._fd, bytes(data), (self.used + 1) * LINEAGE_RECORD_SIZE_BYTES)
            self.used += len(written)
            self._known |= written
            self._dirty = self.durable
        return len(written)

    def _room(self, records: int) -> bool:
        """Whether the file holds `records` after its header, grown by a chunk if need be
        (False: the disk has no room for it)."""
        if records <= self.allocated:
            return True
        try:
            _allocate(self._fd, self.path, records + LINEAGE_CHUNK_RECORDS)
        except DiskFullError:
            return False  # the items still go in (or wait for space): only the order is lost
        self.allocated = os.fstat(self._fd).st_size // LINEAGE_RECORD_SIZE_BYTES - 1
        return True

    def sync(self) -> None:
        """`power`: fdatasync what was recorded since the last call (DurabilityError: fatal)."""
        if self._dirty:
            try:
                fileops.fdatasync(self._fd)
            except OSError as exc:
                raise DurabilityError(f"{self.path}: fdatasync failed ({errno_text(exc)}): the kernel may have "
                                      f"dropped the dirty pages, so the broker must stop") from exc
            self._dirty = False

    def close(self) -> None:
        if self._fd >= 0:
            fileops.close_fd(self._fd)
            self._fd = -1


def _chain_nodes(chains: list[tuple[int, tuple[int, ...]]],
                 reading: LineageReading | None) -> list[tuple[_Node, int, int]]:
    """Every node of the chains once, parents first, with its record's (parent, depth)."""
    nodes: dict[_Node, tuple[int, int]] = {}
    for model, chain in chains:
        for k, signature in enumerate(chain):
            node = (model, signature)
            if node not in nodes:
                assert reading is not None
                nodes[node] = reading.nodes[node]
    return sorted(((node, parent, depth) for node, (parent, depth) in nodes.items()),
                  key=lambda n: (n[2], n[0]))


def _size_bytes(records: int) -> int:
    """The file's size for the header and `records` (rounded up to a chunk)."""
    return (-(-records // LINEAGE_CHUNK_RECORDS) * LINEAGE_CHUNK_RECORDS + 1) * LINEAGE_RECORD_SIZE_BYTES


def _allocate(fd: int, path: str, records: int) -> None:
    """Preallocate the file to hold the header and `records` (rounded up to a chunk)."""
    preallocate(fd, path, _size_bytes(records), "lineage file")

