"""The HTTP endpoint serving a run's Prometheus metrics (pipeline.reporting.metrics):

    server = MetricsServer.start(9100, lambda: broker_status(socket_path))
    ...                                    # GET http://127.0.0.1:9100/metrics
    server.close()

The endpoint is its owner's, like every other object of a run (SPEC §7, §12). It listens on
the loopback and serves only a connection whose other end is a socket of this user (Linux
lists each TCP socket's owner in /proc/net/tcp and tcp6): any other is closed as soon as it
is accepted, before anything is read from it (the log says why). With a token file (`--metrics-token-file`,
0600) it answers instead any request carrying `Authorization: Bearer TOKEN`, what Prometheus
sends from `authorization: credentials_file`: a Prometheus running as another user scrapes
that way.

What a hostile local process can do to the owner's scrapes: without a token, another user
can take no place at all (its connections are closed at accept), only cost the serving
thread an accept and a share of one read of the socket tables a connection. Whatever the
mode, a client that holds places, idle or sending a byte at a time, starves no one: a
connection finding every place held takes the place of the one idle the longest (request
bytes are no progress; an answered connection goes first). A turn of the serving thread reads
the open connections' requests before it accepts, and accepts no more than it can hold
without closing one accepted in that turn: the rest wait in the listener's queue, in the
order they came, so a burst of connects pushes a scrape back, never out. A held connection
younger than EVICTION_MIN_AGE_S keeps its place (a newcomer waits in the queue until one is
old enough), so a client that reconnects as fast as its places are taken cannot turn over
every place before a scrape's request is read. What remains, with a token (every local user
may connect) or from the owner's own processes: a scrape whose request arrives more than
EVICTION_MIN_AGE_S after its connect, while every place is held by others; that scrape fails
and the next one tries again.
NOTE: a 403 sent at accept is not: the close that follows it, with the peer's request unread
or still coming, resets the connection, and the peer lost the 403 in 3 of 8 tries.
NOTE: a Unix socket (owner-only by its mode) is not used: Prometheus scrapes only TCP targets.
NOTE: prometheus_client's start_http_server is not used: it answers each connection on a
thread of its own, with no timeout (600 idle connections held 597 threads).
"""

from __future__ import annotations

import errno
import hmac
import http.client
import io
import ipaddress
import logging
import os
import re
import selectors
import socket
import stat
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from pipeline.reporting.metrics import StatusCollector
from pipeline.wire.errors import MetricsPortError, SettingsError
from pipeline.wire.status import BrokerStatus

log = logging.getLogger("pipeline.metrics")

# How long `close()` waits for the serving thread: it stops at once, unless a scrape is asking
# the broker for its status (the status request's own timeout is 5 s).
CLOSE_TIMEOUT_S = 10.0

# Connections the endpoint holds at once. Prometheus scrapes a target over one connection at
# a time; an HA pair, a second scraper and a person with curl need a handful. Past it a new
# connection takes the place of one held, the one idle the longest (counted): descriptors and
# buffers stay bounded whoever connects, and holding places starves no scrape.
MAX_METRICS_CONNECTIONS = 16
# A connection is closed this long after its last progress (its accept, or a part of the
# answer taken): its whole request head must arrive within it, so one that sends nothing, or a
# byte at a time, gives its place back. Prometheus sends its request at once; its default
# scrape timeout is 10 s.
METRICS_IDLE_TIMEOUT_S = 10.0
# The longest request head (request line and headers) read: a scrape's is a few hundred
# bytes, and nginx's default header buffer is 8 KiB. A longer one is answered 431.
MAX_REQUEST_HEAD_BYTES = 8192
# The largest token file read: a bearer token is tens of bytes (`openssl rand -hex 32`: 64).
MAX_TOKEN_FILE_BYTES = 4096
# What `Authorization: Bearer` carries: an RFC 6750 b64token.
TOKEN_PATTERN = re.compile(rb"[A-Za-z0-9\-._~+/]+=*")
# Connections accepted (foreign ones closed at once included) in one turn of the serving thread
# before the open ones get theirs: a flood of connects cannot starve a scrape in progress.
ACCEPTS_PER_TURN = 4 * MAX_METRICS_CONNECTIONS
# A held connection younger than this keeps its place (unless its answer was all sent): a
# scrape sends its request within milliseconds of its connect, and a second covers a scraper
# descheduled on a saturated machine, so a client that reconnects as fast as its places are
# taken cannot turn over every place before a scrape's request is read. A newcomer finding
# every place held by younger ones waits in the listener's queue until one is old enough.
EVICTION_MIN_AGE_S = 1.0
# After an accept fails for want of descriptors or memory the listener rests this long: a
# readable listener whose accept fails would spin the thread (and take the GIL from the loop).
ACCEPT_BACKOFF_S = 0.1
# Where Linux lists the TCP sockets of this network namespace, each with its owner's uid.
PROC_NET_TCP = ("/proc/net/tcp", "/proc/net/tcp6")
# The state /proc/net/tcp shows for TIME_WAIT: such rows give uid 0, whoever owned the socket.
TCP_TIME_WAIT = "06"
# The paths the metrics are served on: Prometheus' default metrics_path, and the root.
METRICS_PATHS = ("/metrics", "/")
# A connection's phases: its request head arriving, its answer leaving, then (our side shut)
# the peer's leftovers read and dropped until it closes, so that closing sends no reset that
# could destroy the answer in the peer's buffer.
REQUEST, ANSWER, DRAIN = "request", "answer", "drain"


def bind_metrics_port(port: int, host: str = "127.0.0.1") -> socket.socket:
    """A listening socket on host:port (port 0: a free one, read back with getsockname()),
    for a MetricsServer to serve: bound before a command's long work, so a port in use is
    said first (MetricsPortError, one line naming it) and a port 0 is known from the start."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise MetricsPortError(f"metrics port {port} ({host}:{port}) is in use: another process listens there; "
                                   f"give another --metrics-port, or 0 for any free one") from None
        raise MetricsPortError(f"metrics port {port} ({host}:{port}): cannot listen there: "
                               f"{exc.strerror or exc}") from None


def read_token_file(path: str) -> bytes:
    """The bearer token in `path`: a regular file of this user's that no other user may read
    or write (0600 or 0400), holding one RFC 6750 token (surrounding whitespace dropped, as
    Prometheus reads its credentials_file). SettingsError naming the path and the fix."""
    where = f"metrics_token_file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # NONBLOCK: a FIFO does not hang us
    except OSError as exc:
        raise SettingsError(f"{where}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SettingsError(f"{where}: not a regular file")
        if info.st_uid != os.geteuid():
            raise SettingsError(f"{where}: owned by uid {info.st_uid}, not by you (uid {os.geteuid()}): "
                                f"another user could change it")
        if info.st_mode & 0o077:
            raise SettingsError(f"{where}: mode {stat.S_IMODE(info.st_mode):04o} lets other users at the token: "
                                f"chmod 600 {path}")
        data = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    token = data.strip()
    if len(data) > MAX_TOKEN_FILE_BYTES or not TOKEN_PATTERN.fullmatch(token):
        raise SettingsError(f"{where}: not one bearer token of at most {MAX_TOKEN_FILE_BYTES:,} bytes (letters, "
                            f"digits, -._~+/ and trailing =; `openssl rand -hex 32` makes one)")
    return token


def peer_uids(endpoints: list[tuple[tuple, tuple] | None],
              tables: tuple[str, ...] = PROC_NET_TCP) -> list[int | None]:
    """The uid owning the other end of each accepted TCP connection (its getpeername() and
    getsockname(); None: unknown), from one read of the kernel's socket tables: the row whose
    local address is the peer's and whose remote address is ours. None where there is no such
    row (the peer is on another host, or gone; not Linux) or the rows disagree."""
    texts = []
    for table in tables:
        try:
            with open(table) as file:
                texts.append(file.read())
        except OSError:
            continue
    found: list[int | None] = []
    for pair in endpoints:
        uids: set[int] = set()
        if pair is not None:
            theirs, ours = proc_addresses(pair[0]), proc_addresses(pair[1])
            for text in texts:
                uids |= socket_uids(text, theirs, ours)
        found.append(uids.pop() if len(uids) == 1 else None)
    return found


def socket_uids(table: str, local: set[str], remote: set[str]) -> set[int]:
    """The uids of the rows of a /proc/net/tcp table (sl, local, remote, state, 3 more fields,
    uid, ...) whose local and remote addresses are among `local` and `remote`, TIME_WAIT rows
    aside. Rows are found by a substring search: a table lists every socket of the host."""
    uids = set()
    for address in local:
        at = table.find(address)
        while at >= 0:
            end = table.find("\n", at)
            fields = table[table.rfind("\n", 0, at) + 1:end if end >= 0 else None].split(None, 8)
            if len(fields) > 7 and fields[1] == address and fields[2] in remote and fields[3] != TCP_TIME_WAIT:
                uids.add(int(fields[7]))
            at = table.find(address, at + 1)
    return uids


def proc_addresses(endpoint: tuple) -> set[str]:
    """An endpoint's forms in /proc/net/tcp and tcp6: each 32-bit word of the address in hex
    as this host's byte order reads it, a colon, the port in hex. An IPv4 address has a second
    form, IPv4-mapped IPv6 (an IPv6 socket's view of it)."""
    address = ipaddress.ip_address(endpoint[0].split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    forms = [address.packed]
    if address.version == 4:
        forms.append(b"\0" * 10 + b"\xff\xff" + address.packed)
    return {"".join(f"{word:08X}" for (word,) in struct.iter_unpack("=I", packed)) + f":{endpoint[1]:04X}"
            for packed in forms}


def answer(head: bytes, token: bytes | None, render: Callable[[str], tuple[bytes, str]]) -> tuple[int, bytes]:
    """The status and whole HTTP response for one request head (up to its blank line, or
    MAX_REQUEST_HEAD_BYTES of one without). With a token, a request needs it (`Authorization:
    Bearer`); without one, the connection's peer was found to be the owner's at accept."""
    end = head.find(b"\r\n\r\n", 0, MAX_REQUEST_HEAD_BYTES)
    if end < 0:
        return _response(431, f"a request head is at most {MAX_REQUEST_HEAD_BYTES:,} bytes")
    request_line, _, rest = head[:end + 2].partition(b"\r\n")
    parts = request_line.split()
    try:
        headers = http.client.parse_headers(io.BytesIO(rest + b"\r\n"))
    except http.client.HTTPException:
        headers = None
    if headers is None or len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return _response(400, "not an HTTP/1 request")
    if token is not None and not _bearer_matches(headers.get_all("Authorization") or [], token):
        return _response(401, "this endpoint needs its bearer token (Authorization: Bearer ...)",
                         extra=("WWW-Authenticate: Bearer",))
    method, path = parts[0], parts[1].split(b"?")[0].decode("latin-1")
    if method not in (b"GET", b"HEAD"):
        return _response(405, "only GET and HEAD", extra=("Allow: GET, HEAD",))
    if path not in METRICS_PATHS:
        return _response(404, "the metrics are at /metrics")
    try:
        body, content_type = render(headers.get("Accept", ""))
    except Exception:  # a bug: logged whole; this scrape fails, the endpoint keeps serving
        log.exception("metrics: rendering failed")
        return _response(500, "the metrics could not be rendered: the log says why")
    return _response(200, body, content_type, head_only=method == b"HEAD")


def _bearer_matches(values: list[str], token: bytes) -> bool:
    """One Authorization header, of the Bearer scheme (in any case: RFC 7235), whose
    credentials are the token (compared in constant time)."""
    if len(values) != 1:
        return False
    scheme, _, credentials = values[0].strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode("latin-1"), token)


def _response(code: int, body: bytes | str, content_type: str = "text/plain; charset=utf-8",
              head_only: bool = False, extra: tuple[str, ...] = ()) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else f"{code} {HTTPStatus(code).phrase}: {body}\n".encode()
    lines = (f"HTTP/1.1 {code} {HTTPStatus(code).phrase}", f"Content-Type: {content_type}",
             f"Content-Length: {len(data)}", "Connection: close", *extra)
    return code, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else data)


@dataclass(slots=True)
class _Connection:
    sock: socket.socket
    deadline_s: float  # closed then: METRICS_IDLE_TIMEOUT_S after its last progress
    accepted_s: float  # when it was accepted: it gives its place no sooner than EVICTION_MIN_AGE_S after
    phase: str = REQUEST
    head: bytearray = field(default_factory=bytearray)  # the request as read, at most MAX_REQUEST_HEAD_BYTES
    unsent: memoryview = memoryview(b"")  # the answer's bytes not yet taken


class MetricsServer:
    """An HTTP endpoint serving the metrics of `fetch()` in the Prometheus text format, to
    its owner only: with a token file, to a request that carries the token; without, to a
    process of this user on this host (the uid of the connection's other end, from the
    kernel's socket tables; any other connection is closed at accept).

    Owner: the process that starts it (broker or launcher), which calls `close()` once. One
    daemon thread serves every connection (a selector, non-blocking sockets: threads do not
    grow with connections), at most MAX_METRICS_CONNECTIONS at once, each closed
    `idle_timeout_s` after its last progress or to make room for a new one; `fetch` runs on
    that thread. It has its own registry, not prometheus_client's global one: two servers in
    a process (tests) do not collide and no process metrics slip in. Counters, read by tests:
    `foreign_connections` (closed at accept: not the owner's),
    `evicted_connections` (closed to make room), `timed_out_connections`, `responses` by
    status; and `open_connections`.
    """

    def __init__(self, listener: socket.socket, registry: CollectorRegistry, token: bytes | None,
                 idle_timeout_s: float, eviction_min_age_s: float = EVICTION_MIN_AGE_S) -> None:
        self._listener = listener
        self.port: int = listener.getsockname()[1]
        self._registry = registry
        self._token = token
        self.idle_timeout_s = idle_timeout_s
        self.eviction_min_age_s = eviction_min_age_s
        # While every place is held by connections too young to give it: when the listener is
        # watched again (None: it is watched).
        self._accepts_resume_s: float | None = None
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._connections: dict[socket.socket, _Connection] = {}
        self._stopping = threading.Event()
        self._closed = False
        self.foreign_connections = 0
        self.evicted_connections = 0
        self.timed_out_connections = 0
        self.responses: Counter[int] = Counter()
        self._thread = threading.Thread(target=self._serve, name="metrics-http", daemon=True)

    @classmethod
    def start(cls, port: int | socket.socket, fetch: Callable[[], BrokerStatus], host: str = "127.0.0.1",
              token_file: str | None = None, idle_timeout_s: float = METRICS_IDLE_TIMEOUT_S,
              eviction_min_age_s: float = EVICTION_MIN_AGE_S,
              extra=None) -> MetricsServer:
        """Listen on host:port (port 0: a free port, read back from `port`; MetricsPortError
        where it cannot), or serve a socket of `bind_metrics_port` (`port`), closed with the
        server. The default host is the loopback: a metrics port is opened to the network only
        when asked. A token file is read now (SettingsError if it is not a 0600 file of ours
        holding one token).
        `extra`: another collector served beside the broker's (a batch job's)."""
        token = None if token_file is None else read_token_file(token_file)
        registry = CollectorRegistry()
        registry.register(StatusCollector(fetch))
        if extra is not None:
            registry.register(extra)
        listener = port if isinstance(port, socket.socket) else bind_metrics_port(port, host)
        listener.setblocking(False)
        server = cls(listener, registry, token, idle_timeout_s, eviction_min_age_s)
        server._thread.start()
        return server

    @property
    def open_connections(self) -> int:
        """Connections held now (read from another thread: a moment's count)."""
        return len(self._connections)

    def close(self) -> None:
        """Stop serving, close every connection and the listening socket, join the thread."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self._wake_w.send(b"\0")
        self._thread.join(CLOSE_TIMEOUT_S)
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------ the serving thread

    def _serve(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stopping.is_set():
                self._resume_accepts(time.monotonic())
                events = self._selector.select(self._wait_s(time.monotonic()))
                for key, _ in events:  # the open connections first: a request read is not pushed out by new ones
                    if key.data is not None:
                        self._advance(key.data)
                if any(key.fileobj is self._listener for key, _ in events):
                    self._accept()
                self._expire(time.monotonic())
        finally:
            for conn in list(self._connections.values()):
                self._drop(conn)
            self._selector.close()
            self._listener.close()

    def _wait_s(self, now_s: float) -> float | None:
        """Until the next deadline, or the listener's return (None: no connection, wait for one)."""
        if not self._connections:
            return None
        ends = [conn.deadline_s for conn in self._connections.values()]
        if self._accepts_resume_s is not None:
            ends.append(self._accepts_resume_s)
        return max(0.0, min(ends) - now_s)

    def _resume_accepts(self, now_s: float) -> None:
        """The listener watched again once a place is free or a held one old enough to give it."""
        if self._accepts_resume_s is not None and (now_s >= self._accepts_resume_s
                                                   or len(self._connections) < MAX_METRICS_CONNECTIONS):
            self._accepts_resume_s = None
            self._selector.register(self._listener, selectors.EVENT_READ)

    def _pause_accepts(self, now_s: float) -> None:
        """Every place held by a connection too young to give it: the listener is not watched
        (its queue keeps the newcomers, in order) until the oldest of them is old enough."""
        oldest_s = min(conn.accepted_s for conn in self._connections.values())
        self._accepts_resume_s = max(now_s, oldest_s + self.eviction_min_age_s)
        self._selector.unregister(self._listener)

    def _accept(self) -> None:
        """The connections waiting, as many as can be held without closing one accepted in
        this turn (the rest stay queued, in order): without a token, each whose peer is not
        the owner's closed at once; each other one held, in the place of
        one held before this turn when every place is taken (`_eviction_order`)."""
        now_s = time.monotonic()
        evictable = sorted((conn for conn in self._connections.values()
                            if conn.phase == DRAIN or now_s - conn.accepted_s >= self.eviction_min_age_s),
                           key=_eviction_order)
        # Every one evictable now came in an earlier turn: one accepted in this turn keeps its place.
        room, budget = MAX_METRICS_CONNECTIONS - len(self._connections) + len(evictable), ACCEPTS_PER_TURN
        if not room:
            self._pause_accepts(now_s)
            return
        deadline_s = now_s + self.idle_timeout_s
        while room and budget:
            asked = min(room, budget)
            accepted = self._accept_waiting(asked)
            budget -= asked
            socks = [sock for sock, _ in accepted] if self._token is not None or not accepted else \
                self._owners_only(accepted)
            for sock in socks:
                if len(self._connections) >= MAX_METRICS_CONNECTIONS:
                    assert evictable, "room counts only places free or evictable before this turn"
                    self.evicted_connections += 1
                    self._drop(evictable.pop(0))
                    _log_doubling(self.evicted_connections, "metrics: connections closed to make room so far: %d "
                                  f"(all MAX_METRICS_CONNECTIONS = {MAX_METRICS_CONNECTIONS} places were held; the "
                                  f"one idle the longest gave its place)")
                sock.setblocking(False)
                conn = _Connection(sock, deadline_s, now_s)
                self._connections[sock] = conn
                self._selector.register(sock, selectors.EVENT_READ, conn)
                room -= 1
            if len(accepted) < asked:  # the queue is empty (or an accept failed): the next turn
                return

    def _accept_waiting(self, limit: int) -> list[tuple[socket.socket, tuple]]:
        """Up to `limit` connections from the listener, with their peers' addresses."""
        accepted = []
        for _ in range(limit):
            try:
                accepted.append(self._listener.accept())
            except BlockingIOError:
                break
            except ConnectionError:  # reset before it was accepted
                continue
            except OSError as exc:  # out of descriptors or memory
                log.warning("metrics: cannot accept a connection (%s); trying again in %.1f s", exc, ACCEPT_BACKOFF_S)
                self._stopping.wait(ACCEPT_BACKOFF_S)
                break
        return accepted

    def _owners_only(self, accepted: list[tuple[socket.socket, tuple]]) -> list[socket.socket]:
        """The sockets whose peer is a socket of this user (one read of the kernel's tables for
        them all); each other one closed now, before anything is read from it (counted:
        `foreign_connections`)."""
        uids = peer_uids([_endpoints(sock, peer) for sock, peer in accepted])
        owners = []
        for (sock, _), uid in zip(accepted, uids):
            if uid == os.geteuid():
                owners.append(sock)
                continue
            self.foreign_connections += 1  # counted first: a peer that sees the close may read the count
            sock.close()
            _log_doubling(self.foreign_connections, "metrics: connections not of your processes closed so far: "
                          f"%d (without --metrics-token-file only uid {os.geteuid()}'s processes are served)")
        return owners

    def _advance(self, conn: _Connection) -> None:
        try:
            if conn.phase == ANSWER:
                self._send(conn)
                return
            data = conn.sock.recv(MAX_REQUEST_HEAD_BYTES - len(conn.head) if conn.phase == REQUEST
                                  else MAX_REQUEST_HEAD_BYTES)
            if not data:  # the peer closed (or gave up before its request was whole)
                self._drop(conn)
            elif conn.phase == REQUEST:
                conn.head += data
                if b"\r\n\r\n" in conn.head or len(conn.head) >= MAX_REQUEST_HEAD_BYTES:
                    self._answer(conn)
        except BlockingIOError:
            pass
        except OSError:  # reset by the peer, say: nothing to answer
            self._drop(conn)

    def _answer(self, conn: _Connection) -> None:
        code, response = answer(bytes(conn.head), self._token, self._render)
        self.responses[code] += 1
        if code == 401:
            _log_doubling(self.responses[code], "metrics: requests answered 401 so far: %d (without the token)")
        conn.phase, conn.head, conn.unsent = ANSWER, bytearray(), memoryview(response)
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._send(conn)  # an answer mostly fits the socket's buffer: sent now

    def _send(self, conn: _Connection) -> None:
        sent = conn.sock.send(conn.unsent)
        conn.unsent = conn.unsent[sent:]
        conn.deadline_s = time.monotonic() + self.idle_timeout_s
        if not conn.unsent:
            conn.sock.shutdown(socket.SHUT_WR)
            conn.phase = DRAIN
            self._selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _render(self, accept: str) -> tuple[bytes, str]:
        """The registry's exposition in the format the scraper accepts (text, or OpenMetrics)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self._registry), content_type

    def _expire(self, now_s: float) -> None:
        for conn in [c for c in self._connections.values() if c.deadline_s <= now_s]:
            if conn.phase != DRAIN:  # a drained answer was whole; a peer that never closes is no failure
                self.timed_out_connections += 1
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        self._selector.unregister(conn.sock)
        del self._connections[conn.sock]
        conn.sock.close()


def _eviction_order(conn: _Connection) -> tuple[bool, float]:
    """Which held connection gives its place first: one whose answer was all sent (nothing is
    lost), then the one idle the longest (its last progress the oldest)."""
    return conn.phase != DRAIN, conn.deadline_s


def _endpoints(sock: socket.socket, peer: tuple) -> tuple[tuple, tuple] | None:
    """An accepted connection's peer and local addresses (None: it is gone already)."""
    try:
        return peer, sock.getsockname()
    except OSError:
        return None


def _log_doubling(count: int, message: str) -> None:
    """A warning at the 1st, 2nd, 4th, 8th... occurrence: a flood leaves a few lines, not one
    a connection."""
    if count & (count - 1) == 0:
        log.warning(message, count)
