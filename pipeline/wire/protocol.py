"""The control protocol between the broker and its producers and consumers (SPEC §6).

A Unix domain socket in the run directory (owner-only) carries length-prefixed messages:

    message:  u32 little-endian body length | body (UTF-8 JSON object with a "type" field)

Control messages are few and small (a registration, a heartbeat, one completion per batch),
so JSON costs nothing that matters and keeps the channel readable with any tool; the hot
data (items, batch descriptors) moves through shared-memory rings, not this socket.

Messages, by sender:

    consumer  register_consumer {model, max_batch_items, max_batch_tokens, max_input_len,
                                 pid, gpu, name}              -> registered | error
                                             name (optional): names its results file, see
                                             check_consumer_name; one connected consumer a name
              heartbeat {}
              request_work {credit}          how many more batches it can take now
              complete {batch_id, results, credit}
                                             results: number of items it wrote, by status;
                                             credit: batches it asks for with it (one
                                             message per batch, not a complete and a
                                             request_work)
              goodbye {}
    producer  register_producer {pid, producer_id}           -> registered_producer | error
                  producer_id: its id when it reconnects after a broker restart, else -1
              producer_ready {ring}          the ring named in the reply now exists
              unregister_producer {}         everything it wrote was published
    anyone    status {}                                      -> status_reply {version, counters}
                                             counters: a BrokerStatus in its wire form, read
                                             only by a client of the same version
                                             (pipeline.wire.status)
              progress {}                    -> progress_reply {items_received, items_recovered,
                                                items_completed, tokens_completed}
                                             four counters in constant time, for a poller
                                             that only waits for a run to finish (a status
                                             is O(shapes + lanes) and a few KiB)
    broker    registered {consumer_id, descriptor_ring, data_dir, heartbeat_timeout_s,
                          durability}  (`power`: the consumer fsyncs its results)
              registered_producer {producer_id, ring, doorbell, next_seq}
              error {message}                then the broker closes the connection

Every malformed message (bad length, bad JSON, JSON nested too deep or with an integer too
long to parse, unknown type, a missing or mistyped field) raises ProtocolError naming what
was wrong; the broker disconnects that peer and keeps serving the others (SPEC §8). The
broker reads requests with a far smaller size limit (MAX_REQUEST_BYTES) than clients read
its replies with (MAX_MESSAGE_BYTES): requests are a few hundred bytes, a status reply a
few KiB.

Whom a client talks to: `Connection.connect` checks that the path is a socket owned by this
user and that the process serving it runs as this user (SO_PEERCRED), and raises
UntrustedPeerError otherwise; the broker likewise refuses connections of other users.
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import stat
import struct
import time
from collections.abc import Iterator

from pipeline.wire.errors import ConsumerNameError, ProtocolError, UntrustedPeerError

# The largest message body: a status reply with per-consumer counters is a few KiB; 1 MiB
# leaves room and still stops a peer from making the broker buffer without bound.
MAX_MESSAGE_BYTES = 1 << 20
# The most batches a consumer may ask for in all (the broker refuses credit past it, a
# consumer's credit window is configured within it): consumers ask for at most 64 by default
# (the credit window's MAX_CREDIT); a bound keeps a hostile count from growing without end (an
# integer of more than 4,300 digits would make the status reply unencodable).
MAX_CREDIT_BATCHES = 1 << 20
# The largest request the broker reads: a registration or a completion (the results
# counters of one batch) is a few hundred bytes. 64 KiB leaves room for engines that report
# many counters, and keeps what a connection can make the broker buffer small (the broker
# also caps the sum over connections: pipeline.broker.config MAX_BUFFERED_BYTES).
MAX_REQUEST_BYTES = 64 << 10
_LENGTH = struct.Struct("<I")
# struct ucred of SO_PEERCRED (Linux): pid, uid, gid.
_UCRED = struct.Struct("3i")
# Clients reconnect to a broker that went away with this backoff: from 50 ms (a restart is
# quick), doubling, at most 2 s (a long outage costs no more than a poll every 2 s).
RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 2.0
# A consumer's name names its results file (`results/NAME.jsonl`) and its rows in status:
# 64 characters are plenty for "host-gpu3-model12" names and keep a path and a table short.
MAX_CONSUMER_NAME_LENGTH = 64
# Letters, digits, '.', '_', '-', not starting with '.': never a path separator, never "..",
# never a hidden file, never a character a shell or a terminal interprets.
_CONSUMER_NAME_RE = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]*")


def check_consumer_name(name: str) -> str:
    """`name` if it can name a results file: 1 to MAX_CONSUMER_NAME_LENGTH letters, digits,
    '.', '_' or '-', not starting with '.'; else ConsumerNameError naming the value."""
    if not isinstance(name, str):
        raise ConsumerNameError(f"consumer name must be a string, got {type(name).__name__} {name!r:.80}")
    if not 1 <= len(name) <= MAX_CONSUMER_NAME_LENGTH:
        raise ConsumerNameError(f"consumer name {name!r:.80} has {len(name)} characters; "
                                f"it must have 1 to {MAX_CONSUMER_NAME_LENGTH}")
    if _CONSUMER_NAME_RE.fullmatch(name) is None:
        raise ConsumerNameError(f"consumer name {name!r} must be letters, digits, '.', '_' or '-', "
                                f"not starting with '.'")
    return name

# The durability levels a `registered` reply names (the values of
# pipeline.storage.Durability; a test keeps the two equal).
DURABILITY_LEVELS = ("process", "power")

# Required fields of each message type and their types (bool is not an int here).
SCHEMAS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "register_consumer": {"model": int, "max_batch_items": int, "max_batch_tokens": int,
                          "max_input_len": int, "pid": int},
    "heartbeat": {},
    "request_work": {"credit": int},
    "complete": {"batch_id": int, "results": dict, "credit": int},
    "goodbye": {},
    "register_producer": {"pid": int, "producer_id": int},
    "producer_ready": {"ring": str},
    "unregister_producer": {},
    "status": {},
    "progress": {},
    "progress_reply": {"items_received": int, "items_recovered": int, "items_completed": int,
                       "tokens_completed": int},
    "registered": {"consumer_id": int, "descriptor_ring": str, "data_dir": str,
                   "heartbeat_timeout_s": (int, float), "durability": str},
    "registered_producer": {"producer_id": int, "ring": str, "doorbell": str, "next_seq": int},
    "status_reply": {"version": int, "counters": dict},  # pipeline.wire.status: the record and its version
    "error": {"message": str},
}


def encode(message: dict) -> bytes:
    """One message on the wire (checked against its schema first)."""
    validate(message)
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _LENGTH.pack(len(body)) + body


def validate(message: object) -> dict:
    """The message if it is a known type with every required field of the right type."""
    if not isinstance(message, dict):
        raise ProtocolError(f"a message must be a JSON object, got {type(message).__name__}")
    kind = message.get("type")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message type {_describe(kind)}")  # never a container's whole repr
    for name, expected in schema.items():
        value = message.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, expected):
            raise ProtocolError(f"{kind}: field {name!r} must be {_type_name(expected)}, got {_describe(value)}")
    return message


def _describe(value: object) -> str:
    """A short account of a value for an error message; never a repr of a container, which
    recurses as deep as a hostile peer nested it."""
    if isinstance(value, (list, dict)):
        return f"a JSON {'array' if isinstance(value, list) else 'object'} of {len(value)} elements"
    return f"{value!r:.80}"


def _type_name(expected: type | tuple[type, ...]) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__


class MessageReader:
    """Incremental decoder for one connection: feed it bytes as they arrive, take whole
    messages out. `max_message_bytes`: the largest body it takes (the broker reads requests
    with MAX_REQUEST_BYTES, clients read replies with MAX_MESSAGE_BYTES). Owner: whoever
    owns the connection. Not thread-safe.

    Example: feed(b"\\x0b\\x00\\x00\\x00{\\"type\\":") yields nothing; feed(b"...") with the
    rest of the 11-byte body yields one message.
    """

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._buffer = bytearray()
        self.max_message_bytes = max_message_bytes

    def feed(self, data: bytes) -> Iterator[dict]:
        self._buffer += data
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer, 0)
            if length > self.max_message_bytes:
                raise ProtocolError(f"message length {length} exceeds {self.max_message_bytes} bytes")
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                return
            body = bytes(self._buffer[_LENGTH.size:end])
            del self._buffer[:end]
            yield validate(_parse_json(body))

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer)

    def release(self) -> None:
        """Drop whatever partial message is buffered (its connection is gone)."""
        self._buffer = bytearray()


def _parse_json(body: bytes) -> object:
    """The JSON value of a message body; ProtocolError for anything json.loads refuses:
    bad JSON or UTF-8 (ValueError), an integer longer than Python parses (ValueError, 4,300
    digits), or arrays nested deeper than the interpreter's recursion limit (RecursionError:
    `[` x 50,000 is 50 KB)."""
    try:
        return json.loads(body)
    except RecursionError as exc:
        raise ProtocolError(f"message body of {len(body)} bytes is nested too deep to parse") from exc
    except ValueError as exc:
        raise ProtocolError(f"message body is not JSON: {str(exc):.200}") from exc


class Connection:
    """A blocking client connection (producer, consumer, or a status query).

    Owner: one thread at a time for sending and one for receiving (the consumer's heartbeat
    thread only sends, under `send`'s lock-free single write). `close()` closes the socket.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._reader = MessageReader()
        self._inbox: list[dict] = []

    @classmethod
    def connect(cls, path: str, timeout_s: float = 5.0) -> Connection:
        """Connect to the broker's socket at `path`, after checking it is a socket of this
        user, and check the process that accepted runs as this user: UntrustedPeerError
        otherwise (another user's socket or process may be posing as the broker). OSError
        as from connect(2) when there is no socket (FileNotFoundError) or nobody listens."""
        check_socket_owner(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            _connect_within(sock, path, timeout_s)
            uid = peer_uid(sock)
            if uid != os.geteuid():
                raise UntrustedPeerError(
                    f"{path}: the process serving this socket runs as uid {uid}, not as you (uid "
                    f"{os.geteuid()}): it is not your broker; nothing was sent. Stop it, remove {path} "
                    f"and start your broker again")
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def send(self, message: dict) -> None:
        self.sock.sendall(encode(message))

    def receive(self, timeout_s: float | None = 5.0) -> dict:
        """The next message; TimeoutError if none came in time, ConnectionError at EOF."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._inbox:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("no message from the broker in time")
                self.sock.settimeout(remaining)
            else:
                self.sock.settimeout(None)
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the broker closed the connection")
            self._inbox.extend(self._reader.feed(data))
        return self._inbox.pop(0)

    def check_open(self) -> None:
        """Without blocking: ConnectionError if the peer closed the connection, ProtocolError
        if it sent an error message; any other message waits in the inbox for `receive`."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        if not readable:
            return
        previous = self.sock.gettimeout()
        self.sock.settimeout(0)
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return
        finally:
            self.sock.settimeout(previous)  # the heartbeat thread's sends block as before
        if not data:
            raise ConnectionError("the broker closed the connection")
        self._inbox.extend(self._reader.feed(data))
        for message in self._inbox:
            if message["type"] == "error":
                raise ProtocolError(f"broker: {message['message']}")

    def request(self, message: dict, timeout_s: float = 5.0) -> dict:
        """Send, then wait for the reply; ProtocolError if the reply is an error."""
        self.send(message)
        reply = self.receive(timeout_s)
        if reply["type"] == "error":
            raise ProtocolError(f"broker refused {message['type']}: {reply['message']}")
        return reply

    def close(self) -> None:
        self.sock.close()


# How long a registering producer waits for the broker's answer. The broker records a new
# producer id durably (its state file, fsynced) before it answers, and on a loaded machine
# an fsync has taken seconds: at the 5 s every other request waits, producers under the
# full test suite failed to register now and then ("2 of 2 producers failed", nothing
# submitted). A registration happens once per producer, so waiting long costs nothing.
REGISTRATION_REPLY_TIMEOUT_S = 60.0
# How often a connect retries while the broker's listen backlog is full.
CONNECT_RETRY_S = 0.01


def _connect_within(sock: socket.socket, path: str, timeout_s: float) -> None:
    """connect(2), waiting up to `timeout_s` while the listener's backlog is full: a Unix
    socket with a timeout fails at once with EAGAIN then (it never reports EINPROGRESS), so
    a busy broker would look absent."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{path}: the broker accepted no connection within {timeout_s} s "
                                   f"(its backlog stayed full)") from None
            time.sleep(CONNECT_RETRY_S)


def check_socket_owner(path: str) -> None:
    """UntrustedPeerError unless `path` is a Unix socket owned by this user (lstat: a
    symbolic link is refused, not followed); FileNotFoundError when nothing is there."""
    info = os.lstat(path)
    if not stat.S_ISSOCK(info.st_mode):
        raise UntrustedPeerError(
            f"{path} is not a socket (mode {stat.filemode(info.st_mode)}, owner uid {info.st_uid}): "
            f"it is not a broker's; remove it and start the broker again")
    if info.st_uid != os.geteuid():
        raise UntrustedPeerError(
            f"{path}: the broker socket belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}): "
            f"another user may be posing as your broker; nothing was sent. Check who owns "
            f"{os.path.dirname(path) or '.'} and its data directory (ls -ld), remove that socket and "
            f"start your broker again")


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED: the
    kernel's record of who connected or listened, which the peer cannot forge)."""
    _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid
