"""The control protocol: framing, validation, consumer names, and a blocking client over a
real socket that checks whom it talks to."""

from __future__ import annotations

import json
import socket
import struct

import pytest

from pipeline.wire.errors import ConsumerNameError, ProtocolError, UntrustedPeerError
from pipeline.wire.protocol import (
    MAX_CONSUMER_NAME_LENGTH,
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    Connection,
    MessageReader,
    check_consumer_name,
    encode,
)

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


def test_json_that_json_loads_refuses_is_a_protocol_error():
    for body, match in [(b"[" * 50_000, "nested too deep"),  # RecursionError
                        (b'{"type":"request_work","credit":' + b"9" * 5000 + b"}", "not JSON"),  # int digits limit
                        (b'{"type": "\xff"}', "not JSON")]:
        with pytest.raises(ProtocolError, match=match):
            list(MessageReader().feed(struct.pack("<I", len(body)) + body))
    # Nested as deep as json.loads takes: the error names the field, never a repr of the value.
    deep = b'{"type":"request_work","credit":' + b"[" * 500 + b"]" * 500 + b"}"
    with pytest.raises(ProtocolError, match="'credit' must be int, got a JSON array of 1 elements"):
        list(MessageReader().feed(struct.pack("<I", len(deep)) + deep))


def test_a_reader_takes_messages_up_to_its_limit():
    reader = MessageReader(MAX_REQUEST_BYTES)
    body = b'{"type":"status"}'
    at_limit = body + b" " * (MAX_REQUEST_BYTES - len(body))
    assert list(reader.feed(struct.pack("<I", len(at_limit)) + at_limit)) == [{"type": "status"}]
    with pytest.raises(ProtocolError, match=f"message length {MAX_REQUEST_BYTES + 1} exceeds {MAX_REQUEST_BYTES}"):
        list(reader.feed(struct.pack("<I", MAX_REQUEST_BYTES + 1)))
    partial = MessageReader(MAX_REQUEST_BYTES)
    assert list(partial.feed(struct.pack("<I", 100) + b"{" * 50)) == []
    assert partial.buffered_bytes == 54
    partial.release()
    assert partial.buffered_bytes == 0


@pytest.mark.parametrize("name", ["c", "gpu0", "host-1.gpu_3", "n" * MAX_CONSUMER_NAME_LENGTH, "-x", "a..b"])
def test_consumer_names_that_can_name_a_results_file(name):
    assert check_consumer_name(name) == name


@pytest.mark.parametrize("name, match", [
    ("n" * (MAX_CONSUMER_NAME_LENGTH + 1), f"has 65 characters; it must have 1 to {MAX_CONSUMER_NAME_LENGTH}"),
    ("", "has 0 characters"),
    (".hidden", "not starting with '.'"),
    ("..", "not starting with '.'"),
    ("a/b", "must be letters"),
    ("a b", "must be letters"),
    ("gpu0\n", "must be letters"),
    ("gpü", "must be letters"),
    (None, "must be a string, got NoneType"),
])
def test_consumer_names_that_cannot(name, match):
    with pytest.raises(ConsumerNameError, match=match):
        check_consumer_name(name)


def test_connect_refuses_what_is_not_our_socket(tmp_path):
    regular = tmp_path / "file.sock"
    regular.write_bytes(b"")
    with pytest.raises(UntrustedPeerError, match=f"{regular} is not a socket"):
        Connection.connect(str(regular))
    real = str(tmp_path / "real.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(real)
    server.listen(8)
    link = tmp_path / "link.sock"
    link.symlink_to(real)
    with pytest.raises(UntrustedPeerError, match="is not a socket"):  # a link is not followed
        Connection.connect(str(link))
    with pytest.raises(FileNotFoundError):
        Connection.connect(str(tmp_path / "missing.sock"))
    Connection.connect(real).close()  # ours, served by us
    server.close()


def test_connect_waits_for_a_full_backlog_then_times_out(tmp_path):
    path = str(tmp_path / "busy.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)  # and never accepts
    queued = []
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)
        try:
            probe.connect(path)
        except BlockingIOError:
            probe.close()
            break
        queued.append(probe)
    with pytest.raises(TimeoutError, match="backlog stayed full"):
        Connection.connect(path, timeout_s=0.1)
    accepted, _ = server.accept()  # room in the backlog: the next connect goes through
    Connection.connect(path, timeout_s=5.0).close()
    for sock in [accepted, server, *queued]:
        sock.close()
