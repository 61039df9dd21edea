"""The broker's view of its connected producers and consumers (state only; the loop in
`pipeline.broker.service` does the I/O), and the bounds on connections that have not
registered (`Unregistered`).

Names of shared-memory objects are derived from the data directory, so a broker that
restarts on the same directory finds the rings its producers kept writing into.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import xxhash

from pipeline.broker.dispatch import Batch
from pipeline.broker.distinct import DistinctCount
from pipeline.broker.ids import ConsumerId
from pipeline.broker.packing import Contract
from pipeline.wire import fileops
from pipeline.wire.errors import ConfigError, FileOpError
from pipeline.wire.protocol import MAX_REQUEST_BYTES, MessageReader
from pipeline.wire.status import ConsumerWork
from shm.objects import named_objects
from shm.ring import RingReader, RingWriter

# The file in a data directory that names its shared-memory namespace (12 hex digits), made
# once by the first broker (`ensure_namespace`). Random for a fresh data directory: a hash of
# the path, the first scheme, let another local user who knew the path create objects under
# our names before us, a denial of service we could not even remove (/dev/shm is sticky).
# Kept in the data directory: a data directory moved after a crash keeps the names of the
# rings its run left (with the path's hash they were orphaned, and the next run said OK).
NAMESPACE_FILE = "shm-namespace"
NAMESPACE_DIGITS = 12
# How the names of every data directory's objects begin (`object_prefix`).
OBJECT_PREFIX_START = "sbrk-"
_NAMESPACE_RE = re.compile(rf"^[0-9a-f]{{{NAMESPACE_DIGITS}}}$")


def namespace_for(data_dir: str) -> str:
    """A data directory's tag in its shared-memory names: the one its NAMESPACE_FILE holds,
    or, where no broker made one yet, 12 hex digits of the xxh3 of its real path (what a
    data directory from before the file carries on its objects). ConfigError for a file
    that does not hold a namespace."""
    path = os.path.join(data_dir, NAMESPACE_FILE)
    try:
        with open(path) as file:
            text = file.read(64).strip()
    except FileNotFoundError:
        return _path_namespace(data_dir)
    if not _NAMESPACE_RE.match(text):
        raise ConfigError(f"{path}: {text[:20]!r} is not a shared-memory namespace ({NAMESPACE_DIGITS} hex "
                          f"digits); restore it, or remove it if no broker or producer of this data directory "
                          f"left anything in /dev/shm")
    return text


def ensure_namespace(data_dir: str, ran_before: bool) -> str:
    """The data directory's namespace, its file made if there is none: random for a fresh
    data directory, the path's hash for one a broker already ran on (`ran_before`: the
    objects its runs left carry that name). Made whole or not at all (a temp file linked
    into place), so two starts at once agree on one."""
    path = os.path.join(data_dir, NAMESPACE_FILE)
    if os.path.exists(path):
        return namespace_for(data_dir)
    chosen = _path_namespace(data_dir) if ran_before else secrets.token_hex(NAMESPACE_DIGITS // 2)
    temporary = f"{path}.{os.getpid()}.tmp"
    # Through the file layer, as every write of the data directory (a fault campaign sees
    # these operations; a failure is a FileOpError naming the file and the operation).
    fd = fileops.open_fd(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            fileops.write_all(fd, f"{chosen}\n".encode())
            fileops.fsync(fd)
        finally:
            fileops.close_fd(fd)
        try:
            fileops.link(temporary, path)
        except FileOpError as exc:
            if exc.errno != errno.EEXIST:
                raise
            # another start made it first: its choice stands
    finally:
        fileops.unlink(temporary)  # also after a failed write: no temporary file is left
    # Durable: without the file, the next start (finding the broker's state) would fall back
    # to the path's hash, the guessable names the file replaced.
    fileops.fsync_directory(data_dir)
    return namespace_for(data_dir)


def _path_namespace(data_dir: str) -> str:
    return f"{xxhash.xxh3_64_intdigest(os.path.realpath(data_dir).encode()):016x}"[:NAMESPACE_DIGITS]


def object_prefix(namespace: str) -> str:
    """How every shared-memory object (and the memory tier's tmpfs directory) of a data
    directory's runs begins, without the leading slash: what clean-up code searches for."""
    return f"{OBJECT_PREFIX_START}{namespace}-"


def doorbell_name(namespace: str) -> str:
    return f"/{object_prefix(namespace)}bell"


def producer_ring_name(namespace: str, producer_id: int) -> str:
    return f"/{object_prefix(namespace)}p{producer_id}"


def producer_ring_ids(namespace: str) -> list[int]:
    """The producer ids whose rings of this data directory's runs exist now, in order."""
    prefix = object_prefix(namespace) + "p"
    rings, _semaphores = named_objects(prefix)
    ids = [name[len(prefix) + 1:] for name in rings]  # "/" + prefix + id
    return sorted(int(found) for found in ids if found.isdigit())


def consumer_ring_name(namespace: str, consumer_id: int, generation: int) -> str:
    # The generation (the broker's start count) keeps a restarted broker from meeting the
    # ring of a consumer id it handed out before the restart.
    return f"/{object_prefix(namespace)}g{generation}-c{consumer_id}"


@dataclass(slots=True)
class Peer:
    """One control connection. Owner: the broker loop. Not thread-safe.

    Times are the broker's monotonic clock (never moved over the broker's own stalls: the
    broker reads its peers before judging them instead): `last_seen_s` is the last bytes
    read (a consumer's liveness),
    `last_message_s` the accept or the last whole message (an unregistered peer's idleness:
    trickling a partial message in does not keep a connection alive)."""

    sock: socket.socket
    reader: MessageReader = field(default_factory=lambda: MessageReader(MAX_REQUEST_BYTES))
    last_seen_s: float = 0.0
    last_message_s: float = 0.0
    buffered_bytes: int = 0  # what the broker counted of `reader`'s partial message
    closed: bool = False


class Unregistered:
    """Connections that have not registered (a status query, a client between its connect
    and its registration), oldest activity first: the broker times them out and sheds the
    oldest idle ones when there are too many. Pure state, no I/O; owner: the broker loop.
    Not thread-safe. Every operation is O(1) but `expired` and `oldest` (O(what they give)).
    """

    def __init__(self) -> None:
        self._peers: dict[socket.socket, Peer] = {}  # insertion order = activity order

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, sock: socket.socket) -> bool:
        return sock in self._peers

    def add(self, peer: Peer) -> None:
        self._peers[peer.sock] = peer

    def touch(self, peer: Peer, now_s: float) -> None:
        """A whole message came in: `peer` is the most recently active."""
        peer.last_message_s = now_s
        if self._peers.pop(peer.sock, None) is not None:
            self._peers[peer.sock] = peer

    def discard(self, sock: socket.socket) -> None:
        self._peers.pop(sock, None)

    def expired(self, now_s: float, timeout_s: float) -> list[Peer]:
        """Those idle for more than `timeout_s`."""
        old = []
        for peer in self._peers.values():
            if now_s - peer.last_message_s <= timeout_s:
                break  # activity order: every later one is younger
            old.append(peer)
        return old

    def oldest(self, count: int) -> list[Peer]:
        """The `count` idle longest."""
        taken = []
        for peer in self._peers.values():
            if len(taken) >= count:
                break
            taken.append(peer)
        return taken

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._peers.values()))


@dataclass(slots=True)
class ProducerPeer:
    """A registered producer: its ring (once it said it is ready) and what is ingested but
    not yet released."""

    peer: Peer | None  # None: a ring found at start whose producer has not registered again
    producer_id: int
    ring_name: str
    ring: RingReader | None = None
    unreleased_end: int | None = None  # release up to here after the next storage flush
    unregistered: bool = False  # said goodbye: drain the ring, then forget it
    frames: int = 0
    items: int = 0
    # Records before this ring position were there when the broker started: an earlier
    # run's work that this broker takes over (counted as adopted). 0: none.
    adopted_until: int = 0


@dataclass(slots=True)
class ConsumerTotals:
    """What a consumer reported doing, summed over its completions (items by result status
    and engine counters): the per-consumer part of status and of the run report."""

    batches: int = 0
    work: ConsumerWork = field(default_factory=ConsumerWork)
    switches: dict[str, int] = field(default_factory=dict)  # its shape switches, by reason
    shapes: DistinctCount = field(default_factory=DistinctCount)  # the (model, signature)s it started
    # Prefix tokens of the shapes it started after another consumer's cache had them: what
    # splitting shapes across consumers cost it (its cache computes that prefix again).
    split_prefix_tokens: int = 0
    # Prefix tokens first referenced by its cache (`firstrefs.FirstReferences`).
    compulsory_prefix_tokens: int = 0

    def add(self, work: ConsumerWork) -> None:
        """One completion's work (`ConsumerWork.from_results` of its message)."""
        self.work += work
        self.batches += 1


@dataclass(slots=True)
class ConsumerPeer:
    """A registered consumer: its contract, its descriptor ring (the broker creates it),
    how many more batches it asked for, and the batches it holds."""

    peer: Peer
    consumer_id: ConsumerId
    contract: Contract
    ring: RingWriter
    name: str
    pid: int
    credit: int = 0
    broken: str = ""  # why it must be disconnected, once the batch in hand is abandoned
    batches: dict[int, Batch] = field(default_factory=dict)
    totals: ConsumerTotals = field(default_factory=ConsumerTotals)


def peer_of(owner: Peer | ProducerPeer | ConsumerPeer) -> Peer:
    """The connection of a socket's owner: a bare Peer until it registers."""
    return owner if isinstance(owner, Peer) else owner.peer
