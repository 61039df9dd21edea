"""Bad peers on the control socket, against a real broker process: a malformed message, idle
connections by the thousand, a broker out of descriptors, partial messages that would make it
buffer without bound. Each is refused or shed alone; the broker keeps serving the others."""

from __future__ import annotations

import errno
import os
import resource
import socket
import struct

import psutil
import pytest

from pipeline.broker.config import MAX_BUFFERED_BYTES, BrokerConfig
from pipeline.runtime.local import CTX, own_process_group
from pipeline.runtime.local import start_broker as start_broker_process
from pipeline.runtime.processes import serve_broker
from pipeline.wire.protocol import MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES, Connection
from pipeline.wire.status import BrokerStatus
from tests.pipeline.harness import status, stop, wait_until

pytestmark = pytest.mark.integration

REGISTER = {"type": "register_consumer", "model": 0, "max_batch_items": 8, "max_batch_tokens": 4096,
            "max_input_len": 512, "pid": 1}


def framed(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def raw_connect(socket_path: str, blocking: bool = True) -> socket.socket:
    """A bare connection; non-blocking: BlockingIOError while the broker's backlog is full."""
    if blocking:
        return Connection.connect(socket_path).sock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect(socket_path)
    except BlockingIOError:
        sock.close()
        raise
    return sock


def closed_by_broker(sock: socket.socket, timeout_s: float = 5.0) -> bytes:
    """Everything the broker sent before it closed the connection (TimeoutError if it did not)."""
    sock.settimeout(timeout_s)
    received = b""
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not data:
            return received
        received += data


def registered_consumer(socket_path: str) -> Connection:
    conn = Connection.connect(socket_path)
    assert conn.request(REGISTER)["type"] == "registered"
    return conn


@pytest.fixture
def broker(tmp_path):
    config = BrokerConfig(str(tmp_path / "data"))
    process = start_broker_process(config)
    yield config.socket_path
    assert stop(process) == 0


@pytest.mark.parametrize("body, match", [
    (b"[" * 50_000, b"nested too deep"),  # RecursionError in json.loads, 50 KB
    (b'{"type":"request_work","credit":' + b"7" * 5000 + b"}", b"not JSON"),  # int longer than 4,300 digits
    (b"\xff\xfe{}", b"not JSON"),
])
def test_a_malformed_message_refuses_only_its_peer(broker, body, match):
    socket_path = broker
    consumer = registered_consumer(socket_path)
    bad = raw_connect(socket_path)
    bad.sendall(framed(body))
    assert match in closed_by_broker(bad)
    bad.close()
    counters = status(socket_path)
    assert len(counters.consumers) == 1 and counters.consumers_lost == 0  # the others are served
    consumer.close()


def test_requests_are_taken_up_to_the_request_limit_and_refused_past_it(broker):
    socket_path = broker
    request = b'{"type":"status"}'
    at_limit = raw_connect(socket_path)
    at_limit.sendall(framed(request + b" " * (MAX_REQUEST_BYTES - len(request))))
    reply = Connection(at_limit).receive(5.0)
    assert reply["type"] == "status_reply"
    at_limit.close()
    past = raw_connect(socket_path)
    past.sendall(struct.pack("<I", MAX_REQUEST_BYTES + 1))  # refused on the length alone
    assert b"exceeds" in closed_by_broker(past)
    past.close()
    assert MAX_REQUEST_BYTES < MAX_MESSAGE_BYTES  # replies may be larger than requests


def test_connections_that_never_register_time_out(tmp_path):
    config = BrokerConfig(str(tmp_path / "data"), unregistered_timeout_s=1.0)
    process = start_broker_process(config)
    try:
        consumer = registered_consumer(config.socket_path)  # heartbeats: a consumer is judged by those
        producer = Connection.connect(config.socket_path)  # registered producers never time out
        producer.request({"type": "register_producer", "pid": os.getpid(), "producer_id": -1})
        silent = raw_connect(config.socket_path)
        trickling = raw_connect(config.socket_path)
        trickling.sendall(struct.pack("<I", 100) + b"{")  # a partial message is no activity
        assert closed_by_broker(silent, timeout_s=10.0) == b""
        assert closed_by_broker(trickling, timeout_s=10.0) == b""
        consumer.send({"type": "heartbeat"})
        counters = status(config.socket_path)
        assert len(counters.consumers) == 1 and counters.consumers_lost == 0
        producer.check_open()  # still connected
        for conn in (consumer, producer, silent, trickling):
            conn.close()
    finally:
        assert stop(process) == 0


def test_unregistered_connections_are_capped_by_shedding_the_oldest_idle(tmp_path):
    config = BrokerConfig(str(tmp_path / "data"), max_unregistered_peers=8)
    process = start_broker_process(config)
    try:
        consumer = registered_consumer(config.socket_path)
        idle = [raw_connect(config.socket_path) for _ in range(8)]
        status(config.socket_path)  # one more connection: the oldest idle one goes
        assert closed_by_broker(idle[0]) == b""
        newer = [raw_connect(config.socket_path) for _ in range(4)]
        status(config.socket_path)  # and once it is served, there is room again
        for sock in idle[1:5]:  # the four next oldest went for the four newer ones
            assert closed_by_broker(sock) == b""
        for sock in idle[5:] + newer:  # the rest are still open: nothing to read, no EOF
            with pytest.raises(TimeoutError):
                sock.settimeout(0.05)
                sock.recv(1)
        assert len(status(config.socket_path).consumers) == 1  # registered peers are never shed
        for sock in idle + newer:
            sock.close()
        consumer.close()
    finally:
        assert stop(process) == 0


def _serve_with_few_descriptors(config: BrokerConfig, spare: int, ready) -> None:
    """A broker child whose descriptor limit, once it serves, leaves `spare` free (as
    `prlimit --nofile` on a running broker would): a flood of connections exhausts it. The
    limit is lowered after start because a broker refuses to start with too few."""
    own_process_group()

    def lower_the_limit_then_report() -> None:
        limit = len(os.listdir("/proc/self/fd")) + spare
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
        ready.send("ready")

    os._exit(serve_broker(config, on_ready=lower_the_limit_then_report))


def test_a_broker_out_of_descriptors_backs_off_and_keeps_serving(tmp_path):
    # The unregistered cap above what the descriptors allow: accept itself fails (EMFILE).
    config = BrokerConfig(str(tmp_path / "data"), max_unregistered_peers=1_000)
    ready, child_end = CTX.Pipe(duplex=False)
    process = CTX.Process(target=_serve_with_few_descriptors, args=(config, 48, child_end))
    process.start()
    child_end.close()
    flood: list[socket.socket] = []
    try:
        assert ready.poll(30) and ready.recv() == "ready"
        consumer = registered_consumer(config.socket_path)
        for _ in range(400):  # far more than the broker has descriptors for
            try:
                flood.append(raw_connect(config.socket_path, blocking=False))
            except BlockingIOError:
                pass  # the backlog is full while the broker pauses its accepts
        # It sheds idle unregistered connections to free descriptors and answers again.
        counters = wait_until(lambda: _status_or_none(config.socket_path), 30, "a status reply during the flood")
        assert process.is_alive()
        assert len(counters.consumers) == 1 and counters.consumers_lost == 0
        shed = sum(1 for sock in flood if _was_closed(sock))
        assert shed > 0
        for sock in flood:
            sock.close()
        consumer.send({"type": "heartbeat"})
        assert len(status(config.socket_path).consumers) == 1
        consumer.close()
    finally:
        for sock in flood:
            sock.close()
        assert stop(process) == 0


def _status_or_none(socket_path: str) -> BrokerStatus | None:
    try:
        return status(socket_path, timeout_s=1.0)
    except (OSError, TimeoutError):
        return None


def _was_closed(sock: socket.socket) -> bool:
    """Whether the broker closed this non-blocking connection (after its error reply, if any)."""
    while True:
        try:
            if sock.recv(65536) == b"":
                return True
        except BlockingIOError:
            return False
        except OSError as exc:
            return exc.errno in (errno.ECONNRESET, errno.EPIPE)


def _rss_bytes(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


@pytest.mark.parametrize("partial_bytes, connections", [
    (MAX_MESSAGE_BYTES - 1, 400),  # what a client may read; the broker takes far less
    (MAX_REQUEST_BYTES - 1, 200),  # each within the request limit; together past the global cap
])
def test_partial_messages_cannot_grow_the_broker(tmp_path, partial_bytes, connections):
    config = BrokerConfig(str(tmp_path / "data"), max_unregistered_peers=1_000)
    process = start_broker_process(config)
    chunk = b" " * partial_bytes
    socks = []
    try:
        consumer = registered_consumer(config.socket_path)
        status(config.socket_path)
        before = _rss_bytes(process.pid)
        for _ in range(connections):
            sock = raw_connect(config.socket_path)
            try:
                sock.sendall(struct.pack("<I", partial_bytes + 1) + chunk)  # one byte short
            except OSError:
                pass  # refused (and closed) while sending
            socks.append(sock)
        status(config.socket_path)  # every byte sent is read by now
        grown = _rss_bytes(process.pid) - before
        # 400 connections holding 1 MiB grew it by 414 MB before the limits; the cap is 4 MiB.
        assert grown < 16 * MAX_BUFFERED_BYTES, f"the broker grew by {grown} bytes"
        assert sum(1 for sock in socks if _closed_now(sock)) >= connections // 2
        for sock in socks:
            sock.close()
        status(config.socket_path)
        assert _rss_bytes(process.pid) - before < 16 * MAX_BUFFERED_BYTES  # nothing kept after they left
        assert len(status(config.socket_path).consumers) == 1
        consumer.close()
    finally:
        for sock in socks:
            sock.close()
        assert stop(process) == 0


def _closed_now(sock: socket.socket) -> bool:
    sock.setblocking(False)
    return _was_closed(sock)
