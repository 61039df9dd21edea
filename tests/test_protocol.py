"""The control protocol: framing, validation, and a blocking client over a real socket."""

from __future__ import annotations

import json
import socket
import struct

import pytest

from pipeline.errors import ProtocolError
from pipeline.protocol import MAX_MESSAGE_BYTES, Connection, MessageReader, encode

REGISTER = {"type": "register_consumer", "model": 0, "max_batch_items": 64,
            "max_batch_tokens": 65536, "max_input_len": 8192, "pid": 1, "gpu": None}


def test_round_trip_in_fragments():
    wire = encode(REGISTER) + encode({"type": "heartbeat"}) + encode({"type": "request_work", "credit": 2})
    reader = MessageReader()
    got = []
    for i in range(len(wire)):  # one byte at a time: every split point
        got.extend(reader.feed(wire[i:i + 1]))
    assert got == [REGISTER, {"type": "heartbeat"}, {"type": "request_work", "credit": 2}]
    assert reader.buffered_bytes == 0


@pytest.mark.parametrize(
    "message, match",
    [
        ({"type": "nope"}, "unknown message type"),
        ({"model": 1}, "unknown message type"),
        ({**REGISTER, "model": "0"}, "'model' must be int"),
        ({**REGISTER, "max_batch_items": True}, "'max_batch_items' must be int"),
        ({"type": "request_work"}, "'credit' must be int"),
        ({"type": "complete", "batch_id": 1, "results": [], "credit": 1}, "'results' must be dict"),
        ({"type": "complete", "batch_id": 1, "results": {}}, "'credit' must be int"),
    ],
)
def test_invalid_messages_are_refused(message, match):
    with pytest.raises(ProtocolError, match=match):
        encode(message)
    body = json.dumps(message).encode()
    with pytest.raises(ProtocolError, match=match):
        list(MessageReader().feed(struct.pack("<I", len(body)) + body))


def test_bad_framing():
    with pytest.raises(ProtocolError, match="exceeds"):
        list(MessageReader().feed(struct.pack("<I", MAX_MESSAGE_BYTES + 1)))
    with pytest.raises(ProtocolError, match="not JSON"):
        list(MessageReader().feed(struct.pack("<I", 3) + b"{x}"))
    with pytest.raises(ProtocolError, match="JSON object"):
        list(MessageReader().feed(struct.pack("<I", 2) + b"[]"))


def test_connection_request_and_errors():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = Connection(ours)
    peer = Connection(theirs)
    client.send(REGISTER)
    assert peer.receive(1.0) == REGISTER
    peer.send({"type": "error", "message": "model 0 is unknown"})
    with pytest.raises(ProtocolError, match="model 0 is unknown"):
        client.request({"type": "status"})
    assert peer.receive(1.0) == {"type": "status"}
    with pytest.raises(TimeoutError):
        client.receive(0.05)
    peer.close()
    with pytest.raises(ConnectionError):
        client.receive(1.0)
    client.close()
