"""The broker's control socket: accepting connections, reading whole messages, refusing bad
peers, and closing connections (SPEC §6).

Owner: the broker loop (one thread); not thread-safe. `ControlServer` knows connections and
bytes, not what a message means: each whole message goes to its `Handler`, which may
`bind` the connection to a registered owner (a producer or a consumer); every way a
connection ends goes through `disconnect`, which tells the handler.

Bad peers cost bounded memory and descriptors: at most `max_unregistered_peers` connections
that have not registered (the one idle longest is shed for each new one, and any that sends
no whole message within `unregistered_timeout_s`), at most `max_buffered_bytes` of partial
messages summed over every connection (the peer holding the most is refused), and an
accept that fails for want of descriptors or memory pauses accepting, never the loop.
Another user's connection is refused at accept (SO_PEERCRED).
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import time
from typing import Protocol

from pipeline.broker.config import BrokerConfig
from pipeline.broker.peers import ConsumerPeer, Peer, ProducerPeer, Unregistered, peer_of
from pipeline.wire.errors import BadInputError, ProtocolError
from pipeline.wire.protocol import encode, peer_uid

log = logging.getLogger("pipeline.broker")

# When accept fails for want of descriptors (EMFILE, ENFILE) or memory, the listener is not
# watched for this long (a level-triggered listener would otherwise spin the loop), and idle
# unregistered connections are closed to free descriptors.
ACCEPT_BACKOFF_S = 0.2
# Connections accepted per turn at most: a burst of clients is taken in a few turns without
# starving fill and dispatch.
ACCEPTS_PER_TURN = 64
# The listen(2) backlog: clients beyond it wait in connect until the broker accepts.
LISTEN_BACKLOG = 64
# Bytes read from a connection at a time: a request is at most 64 KiB.
RECV_BYTES = 65536

Owner = Peer | ProducerPeer | ConsumerPeer


class Handler(Protocol):
    """What the control server hands whole messages and ended connections to."""

    def handle(self, sock: socket.socket, owner: Owner, message: dict) -> None:
        """One whole message; ProtocolError or BadInputError refuses that peer alone."""

    def disconnected(self, owner: Owner, why: str) -> None:
        """A connection ended (its socket is closed already)."""


class ControlServer:
    """The listening socket, every connection and who owns it, and the selector the loop
    sleeps in (with `wake_fd`, a pipe a doorbell thread writes to, beside the sockets)."""

    def __init__(self, config: BrokerConfig, handler: Handler, wake_fd: int, drain_wake) -> None:
        self.config = config
        self._handler = handler
        self._wake_fd = wake_fd
        self._drain_wake = drain_wake
        self._owners: dict[socket.socket, Owner] = {}
        self._unregistered = Unregistered()  # connections that have not registered
        self._buffered_bytes = 0  # partial messages held, summed over connections
        self.peers_refused = 0  # sent a bad message, another user's, past a limit: refused
        self.peers_shed = 0  # unregistered connections closed: idle too long, too many
        self._accept_paused_until_s: float | None = None  # accept failed: listener not watched
        self._accept_failures = 0  # accepts failed in the current episode (logged once)
        self._selector = selectors.DefaultSelector()
        try:
            self._listener = listen(config.socket_path)
        except BaseException:
            self._selector.close()
            raise
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(wake_fd, selectors.EVENT_READ, None)

    def bind(self, sock: socket.socket, owner: ProducerPeer | ConsumerPeer) -> None:
        """A connection registered: its messages now go to `owner`'s side."""
        self._unregistered.discard(sock)
        self._owners[sock] = owner

    def serve(self, timeout_s: float) -> None:
        """Wait at most `timeout_s` for sockets (or the wake pipe), and serve what is ready."""
        if self._accept_paused_until_s is not None and time.monotonic() >= self._accept_paused_until_s:
            self._accept_paused_until_s = None
            self._selector.register(self._listener, selectors.EVENT_READ, None)
        for key, _mask in self._selector.select(timeout_s):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj == self._wake_fd:
                self._drain_wake()
            else:
                self.read(key.fileobj)

    def _accept(self) -> None:
        """Take up to ACCEPTS_PER_TURN new connections. Another user's is refused at once
        (SO_PEERCRED); past max_unregistered_peers the connection idle longest is closed;
        a failure to accept (no descriptors, no memory) pauses accepting, never the loop."""
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.ECONNABORTED:
                    continue  # the client gave up before we took it
                self._pause_accepting(exc)
                return
            if self._accept_failures:
                log.warning("accepting connections again, after %d failed accepts", self._accept_failures)
                self._accept_failures = 0
            if self._same_user(sock):
                self._add(sock)

    def _same_user(self, sock: socket.socket) -> bool:
        """Whether the connection is of this broker's user; another's is told and closed."""
        try:
            uid = peer_uid(sock)
        except OSError:
            sock.close()  # gone before we could ask the kernel who it was
            return False
        if uid == os.geteuid():
            return True
        self.peers_refused += 1
        log.warning("refusing a connection of uid %d: this broker serves only uid %d", uid, os.geteuid())
        _send_quietly(sock, f"this broker serves only uid {os.geteuid()}, not uid {uid}")
        sock.close()
        return False

    def _add(self, sock: socket.socket) -> None:
        if len(self._unregistered) >= self.config.max_unregistered_peers:
            self._shed(self._unregistered.oldest(1), f"more than {self.config.max_unregistered_peers} "
                                                     f"connections have not registered")
        sock.setblocking(False)
        now = time.monotonic()
        peer = Peer(sock, last_seen_s=now, last_message_s=now)
        self._owners[sock] = peer
        self._unregistered.add(peer)
        self._selector.register(sock, selectors.EVENT_READ, None)

    def _pause_accepting(self, exc: OSError) -> None:
        """accept failed (EMFILE, ENFILE, ENOMEM...): stop watching the listener for
        ACCEPT_BACKOFF_S (clients wait in the backlog), close the idle half of the
        unregistered connections to free descriptors; logged once per episode."""
        if self._accept_failures == 0:
            log.error("cannot accept connections (%s) with %d open: pausing accepts for %.1f s at a time "
                      "and closing idle unregistered connections", exc, len(self._owners), ACCEPT_BACKOFF_S)
        self._accept_failures += 1
        self._selector.unregister(self._listener)
        self._accept_paused_until_s = time.monotonic() + ACCEPT_BACKOFF_S
        self._shed(self._unregistered.oldest(max(1, len(self._unregistered) // 2)), f"accept failed: {exc}")

    def _shed(self, peers: list[Peer], why: str) -> None:
        """Close unregistered connections (counted in peers_shed; not logged one by one: a
        flood of them must not flood the log)."""
        for peer in peers:
            self.peers_shed += 1
            self.disconnect(peer.sock, why)

    def expire_unregistered(self, now_s: float) -> None:
        expired = self._unregistered.expired(now_s, self.config.unregistered_timeout_s)
        if expired:
            log.info("closing %d connections that sent nothing for %.0f s without registering", len(expired),
                     self.config.unregistered_timeout_s)
            self._shed(expired, "did not register in time")

    def read(self, sock: socket.socket) -> None:
        """Read what the connection sent and hand each whole message to the handler; a bad
        message refuses that peer alone."""
        owner = self._owners.get(sock)
        if owner is None:
            return
        peer = peer_of(owner)
        try:
            data = sock.recv(RECV_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:  # every socket error, not only EOF, is a disconnect (SPEC §6)
            self.disconnect(sock, f"socket error: {exc}")
            return
        if not data:
            self.disconnect(sock, "end of file")
            return
        now = time.monotonic()
        peer.last_seen_s = now
        handled = self._handle_all(sock, peer, data)
        if handled is None:
            return  # refused or disconnected
        if handled and owner is peer:  # an unregistered peer that sent a whole message: active now
            self._unregistered.touch(peer, now)
        held = peer.reader.buffered_bytes
        self._buffered_bytes += held - peer.buffered_bytes
        peer.buffered_bytes = held
        if self._buffered_bytes > self.config.max_buffered_bytes:
            self._refuse_largest_buffers()

    def _handle_all(self, sock: socket.socket, peer: Peer, data: bytes) -> bool | None:
        """Hand every whole message in `data` on: whether there was one, or None once the
        connection is gone (refused, or ended by a message)."""
        handled = False
        try:
            for message in peer.reader.feed(data):
                handled = True
                self._handler.handle(sock, self._owners[sock], message)
                if peer.closed:
                    return None
        except (ProtocolError, BadInputError) as exc:
            self.refuse(sock, str(exc))
            return None
        except RecursionError:  # a value nested too deep for a handler: the peer's doing
            self.refuse(sock, "a message nested too deep to handle")
            return None
        return handled

    def _refuse_largest_buffers(self) -> None:
        """Partial messages past max_buffered_bytes in all: refuse the peers holding the most
        until under it. O(peers) a refusal; only a peer that hoards gets here."""
        while self._buffered_bytes > self.config.max_buffered_bytes:
            largest = max((peer_of(owner) for owner in self._owners.values()), key=lambda peer: peer.buffered_bytes)
            assert largest.buffered_bytes > 0, self._buffered_bytes  # the sum is of these
            self.refuse(largest.sock, f"holds {largest.buffered_bytes} bytes of unfinished messages while the "
                                      f"broker buffers at most {self.config.max_buffered_bytes} for all peers")

    def send(self, sock: socket.socket, message: dict) -> None:
        try:
            sock.sendall(encode(message))
        except (BlockingIOError, OSError) as exc:
            self.disconnect(sock, f"send failed: {exc}")

    def refuse(self, sock: socket.socket, why: str) -> None:
        self.peers_refused += 1
        log.warning("refusing a peer: %s", why)
        self.send(sock, {"type": "error", "message": why})
        self.disconnect(sock, why)

    def disconnect(self, sock: socket.socket, why: str) -> None:
        owner = self._owners.pop(sock, None)
        if owner is None:
            return
        peer = peer_of(owner)
        peer.closed = True
        self._unregistered.discard(sock)
        self._buffered_bytes -= peer.buffered_bytes
        peer.buffered_bytes = 0
        peer.reader.release()
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
        self._handler.disconnected(owner, why)

    def disconnect_all(self, why: str) -> None:
        for sock in list(self._owners):
            self.disconnect(sock, why)

    def close(self) -> None:
        """Close the selector and the listener, and remove the socket file (connections are
        the caller's to end first, `disconnect_all`)."""
        self._selector.close()
        self._listener.close()
        os.unlink(self.config.socket_path)


def _send_quietly(sock: socket.socket, why: str) -> None:
    """An error message to a connection that is not (or no longer) a peer, best effort."""
    try:
        sock.setblocking(False)
        sock.send(encode({"type": "error", "message": why}))
    except OSError:
        pass


def listen(path: str) -> socket.socket:
    """The broker's listening socket at `path` (owner-only); on failure nothing is left (no
    descriptor, no socket file)."""
    if os.path.lexists(path):
        os.unlink(path)  # a stale socket of a crashed broker; the lock says none is running
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = False
    try:
        old = os.umask(0o177)  # the socket file is created owner-only (0600)
        try:
            sock.bind(path)
            bound = True
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        if bound:
            os.unlink(path)
        raise
    return sock
