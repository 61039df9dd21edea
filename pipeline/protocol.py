"""The control protocol between the broker and its producers and consumers (SPEC §6).

A Unix domain socket in the run directory (owner-only) carries length-prefixed messages:

    message:  u32 little-endian body length | body (UTF-8 JSON object with a "type" field)

Control messages are few and small (a registration, a heartbeat, one completion per batch),
so JSON costs nothing that matters and keeps the channel readable with any tool; the hot
data (items, batch descriptors) moves through shared-memory rings, not this socket.

Messages, by sender:

    consumer  register_consumer {model, max_batch_items, max_batch_tokens, max_input_len,
                                 pid, gpu}                    -> registered | error
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
    anyone    status {}                                      -> status_reply {counters...}
              dispatched_segments {}                         -> dispatched_segments_reply {paths}
                                             segment files holding dispatched, unfinished
                                             entries (what a stopped run's accounting reads)
    broker    registered {consumer_id, descriptor_ring, data_dir, heartbeat_timeout_s}
              registered_producer {producer_id, ring, doorbell, next_seq}
              error {message}                then the broker closes the connection

Every malformed message (bad length, bad JSON, unknown type, a missing or mistyped field)
raises ProtocolError naming what was wrong; the broker disconnects that peer and keeps
serving the others (SPEC §8).
"""

from __future__ import annotations

import json
import select
import socket
import struct
import time
from collections.abc import Iterator

from pipeline.errors import ProtocolError

# The largest message body: a status reply with per-consumer counters is a few KiB; 1 MiB
# leaves room and still stops a peer from making the broker buffer without bound.
MAX_MESSAGE_BYTES = 1 << 20
_LENGTH = struct.Struct("<I")
# Clients reconnect to a broker that went away with this backoff: from 50 ms (a restart is
# quick), doubling, at most 2 s (a long outage costs no more than a poll every 2 s).
RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 2.0

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
    "dispatched_segments": {},
    "registered": {"consumer_id": int, "descriptor_ring": str, "data_dir": str,
                   "heartbeat_timeout_s": (int, float)},
    "registered_producer": {"producer_id": int, "ring": str, "doorbell": str, "next_seq": int},
    "status_reply": {"counters": dict},
    "dispatched_segments_reply": {"paths": list},
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
        raise ProtocolError(f"unknown message type {kind!r}")
    for name, expected in schema.items():
        value = message.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, expected):
            raise ProtocolError(f"{kind}: field {name!r} must be {_type_name(expected)}, got {value!r:.80}")
    return message


def _type_name(expected: type | tuple[type, ...]) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__


class MessageReader:
    """Incremental decoder for one connection: feed it bytes as they arrive, take whole
    messages out. Owner: whoever owns the connection. Not thread-safe.

    Example: feed(b"\\x0b\\x00\\x00\\x00{\\"type\\":") yields nothing; feed(b"...") with the
    rest of the 11-byte body yields one message.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[dict]:
        self._buffer += data
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer, 0)
            if length > MAX_MESSAGE_BYTES:
                raise ProtocolError(f"message length {length} exceeds {MAX_MESSAGE_BYTES}")
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                return
            body = bytes(self._buffer[_LENGTH.size:end])
            del self._buffer[:end]
            try:
                message = json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ProtocolError(f"message body is not JSON: {exc}") from exc
            yield validate(message)

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer)


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
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError:
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
