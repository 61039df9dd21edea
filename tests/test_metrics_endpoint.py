"""The metrics endpoint's access and bounds, over real sockets: this user's processes are
answered and a connection whose peer's uid is not ours (or cannot be found) is closed at
accept; with a token file, only requests carrying the token; at most
MAX_METRICS_CONNECTIONS at once (one past it takes the place of the one idle the longest, so
a client holding every place starves no scrape; a burst of connects waits in the listener's
queue) on one thread, however many connect; a connection that sends nothing, or not all of
its request, is closed after the idle timeout; a request head of at most
MAX_REQUEST_HEAD_BYTES; a port in use is refused in one line. Another user's connections, for
real: tests/security/test_metrics_users.py.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.reporting import metrics_endpoint
from pipeline.reporting.metrics_endpoint import (
    MAX_METRICS_CONNECTIONS,
    MAX_REQUEST_HEAD_BYTES,
    MAX_TOKEN_FILE_BYTES,
    MetricsServer,
    bind_metrics_port,
    peer_uids,
    proc_addresses,
    read_token_file,
    socket_uids,
)
from pipeline.runtime.local import start_broker, stop_process
from pipeline.wire.errors import MetricsPortError, SettingsError
from pipeline.wire.status import BrokerStatus
from tests.runtime.runs import free_port, wait_for
from tests.support.holders import holder_command, holding

TOKEN = b"0123456789abcdef0123456789abcdef"
# A hang guard for one exchange with the endpoint (each takes milliseconds).
EXCHANGE_TIMEOUT_S = 30.0
# The idle timeout of the endpoints the timeout tests start: short, so that they end soon.
SHORT_IDLE_TIMEOUT_S = 0.2
# Idle connections opened against an endpoint: several times its bound (a broker's endpoint
# turns over MAX_METRICS_CONNECTIONS places an EVICTION_MIN_AGE_S, so each past the bound
# costs the broker's test that much).
IDLE_CONNECTIONS = 3 * MAX_METRICS_CONNECTIONS
# Threads a broker may add while that many connections are open: none is needed; one of
# slack for a thread of its own that starts meanwhile.
THREADS_SLACK = 1
# A hang guard for the endpoint to notice a connection closed by its peer.
SETTLE_TIMEOUT_S = 10.0
# Scrapes made while a hostile client holds every place, one every SCRAPE_INTERVAL_S: the
# holder's bytes trickle in meanwhile.
HOSTILE_SCRAPES = 30
SCRAPE_INTERVAL_S = 0.1


def write_token(tmp_path, data: bytes = TOKEN + b"\n", mode: int = 0o600, name: str = "token") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


def get(port: int, headers: dict | None = None, path: str = "/metrics") -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=EXCHANGE_TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def exchange(port: int, request: bytes) -> bytes:
    """Everything the endpoint sends for `request`, up to its close."""
    with socket.create_connection(("127.0.0.1", port), timeout=EXCHANGE_TIMEOUT_S) as sock:
        sock.sendall(request)
        return read_to_end(sock)


def read_to_end(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def idle(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=EXCHANGE_TIMEOUT_S)


def still_open(sock: socket.socket) -> bool:
    """Nothing to read and no end of stream: the endpoint holds the connection."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(EXCHANGE_TIMEOUT_S)


def closed_by_endpoint(sock: socket.socket) -> bool:
    """Blocks until the endpoint closes the connection (or the hang guard)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def server():
    with MetricsServer.start(0, lambda: BrokerStatus()) as endpoint:
        yield endpoint


# ---------------------------------------------------------------------- who is answered


def test_a_request_of_this_user_is_answered(server):
    code, body = get(server.port)
    assert code == 200 and b"shape_broker_up 1.0" in body
    assert server.responses == {200: 1}


def test_the_uid_of_a_loopback_peer_is_found_in_the_kernel_tables_ipv4_and_ipv4_mapped():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client, listener.accept()[0] as accepted:
            assert peer_uids([(accepted.getpeername(), accepted.getsockname())]) == [os.geteuid()]
            assert client  # kept open while looked up
        if not socket.has_ipv6:
            return
        with socket.socket(socket.AF_INET6) as client6:  # listed in tcp6, as ::ffff:127.0.0.1
            client6.connect(("::ffff:127.0.0.1", port))
            with listener.accept()[0] as accepted:
                assert peer_uids([(accepted.getpeername(), accepted.getsockname())]) == [os.geteuid()]


def test_a_peer_with_no_row_has_no_uid():
    assert peer_uids([(("127.0.0.1", 1), ("127.0.0.1", 2)), None]) == [None, None]


def test_a_connection_whose_peer_is_not_ours_is_closed_at_accept_before_anything_is_read(server, monkeypatch):
    """A peer of another user is told apart from ours by the kernel's tables alone: here the
    tables' answer is made "no uid" (tests/security/test_metrics_users.py has a real user)."""
    monkeypatch.setattr(metrics_endpoint, "peer_uids", lambda endpoints: [None] * len(endpoints))
    with idle(server.port) as sock:
        assert closed_by_endpoint(sock)  # closed with nothing sent: no request was waited for
    assert server.foreign_connections == 1 and server.open_connections == 0 and server.responses == {}


@pytest.mark.integration
def test_without_a_token_another_users_connections_hold_no_place_and_starve_no_scrape(server, monkeypatch):
    """The hostile client of the test with a token below, its sockets made another user's in
    the kernel's tables as the endpoint reads them: each of its connections is closed at
    accept (it reconnects at once, again and again), and every scrape of ours is answered."""
    holders: list[int] = []
    real_peer_uids = metrics_endpoint.peer_uids

    def faked(endpoints: list) -> list:
        try:
            theirs = {conn.laddr for pid in holders for conn in psutil.Process(pid).net_connections("tcp")}
        except psutil.NoSuchProcess:  # killed at the block's end
            theirs = set()
        return [None if pair is not None and pair[0] in theirs else uid
                for pair, uid in zip(endpoints, real_peer_uids(endpoints))]

    monkeypatch.setattr(metrics_endpoint, "peer_uids", faked)
    with holding(holder_command(server.port, MAX_METRICS_CONNECTIONS), started=holders.append):
        wait_for(lambda: server.foreign_connections > MAX_METRICS_CONNECTIONS, SETTLE_TIMEOUT_S, "reconnects refused")
        codes = []
        for _ in range(HOSTILE_SCRAPES):
            codes.append(get_or_none(server.port))
            time.sleep(SCRAPE_INTERVAL_S)
    assert codes == [200] * HOSTILE_SCRAPES
    assert server.responses == {200: HOSTILE_SCRAPES} and server.evicted_connections == 0


def test_socket_rows_match_both_addresses_and_skip_time_wait():
    local, remote = proc_addresses(("127.0.0.1", 40000)), proc_addresses(("127.0.0.1", 9464))
    (peer,), (ours,) = [sorted(forms, key=len)[:1] for forms in (local, remote)]
    row = "   7: {} {} {} 00000000:00000000 00:00000000 00000000  {}        0 123 1 0 20 4 30 10 -1\n"
    lines = ["  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n",
             row.format(peer, ours, "06", 0),       # TIME_WAIT lists uid 0, whoever it was
             row.format(ours, peer, "01", 1000),    # our end of the connection, not theirs
             row.format(peer, ours, "01", 1234)]
    assert socket_uids("".join(lines), local, remote) == {1234}
    assert socket_uids("".join(lines[:3]), local, remote) == set()
    assert socket_uids("".join(lines).rstrip("\n"), local, remote) == {1234}  # a last row without its newline


# ---------------------------------------------------------------------- a bearer token


def test_with_a_token_only_requests_carrying_it_are_answered(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_endpoint, "peer_uids", lambda endpoints: [None] * len(endpoints))  # not asked
    with MetricsServer.start(0, lambda: BrokerStatus(), token_file=write_token(tmp_path)) as server:
        assert get(server.port)[0] == 401
        assert get(server.port, {"Authorization": "Bearer wrong"})[0] == 401
        assert get(server.port, {"Authorization": "Basic " + TOKEN.decode()})[0] == 401
        assert get(server.port, {"Authorization": "Bearer " + TOKEN.decode()})[0] == 200
        assert get(server.port, {"Authorization": "bearer " + TOKEN.decode()})[0] == 200  # the scheme in any case
        response = exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert status_of(response) == 401 and b"\r\nWWW-Authenticate: Bearer\r\n" in response
        assert server.foreign_connections == 0


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_token_file_other_users_could_read_or_change_is_refused(tmp_path, mode):
    path = write_token(tmp_path, mode=mode)
    with pytest.raises(SettingsError, match=rf"metrics_token_file {path}: mode 0{mode:o} .*: chmod 600 {path}$"):
        MetricsServer.start(0, lambda: BrokerStatus(), token_file=path)


def test_a_token_file_of_another_owner_or_not_a_file_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    path = write_token(tmp_path)
    os.chown(path, 65534, -1)
    with pytest.raises(SettingsError, match=r"owned by uid 65534, not by you"):
        read_token_file(path)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo, 0o600)
    with pytest.raises(SettingsError, match="not a regular file"):
        read_token_file(fifo)  # and it did not hang on the FIFO's open


@pytest.mark.parametrize("data", [b"", b"\n", b"two words", b"tok\xc3\xa9n", b"=leading"])
def test_a_token_file_without_one_token_is_refused(tmp_path, data):
    with pytest.raises(SettingsError, match="not one bearer token"):
        read_token_file(write_token(tmp_path, data))


def test_a_token_file_at_its_size_limit_is_read_and_one_byte_past_it_refused(tmp_path):
    assert read_token_file(write_token(tmp_path, b"a" * MAX_TOKEN_FILE_BYTES)) == b"a" * MAX_TOKEN_FILE_BYTES
    with pytest.raises(SettingsError, match=f"at most {MAX_TOKEN_FILE_BYTES:,} bytes"):
        read_token_file(write_token(tmp_path, b"a" * (MAX_TOKEN_FILE_BYTES + 1)))


# ---------------------------------------------------------------------- bounds


def test_connections_at_the_bound_are_held_and_one_past_it_takes_the_place_of_the_idlest(server):
    held = [idle(server.port) for _ in range(MAX_METRICS_CONNECTIONS)]
    try:
        wait_for(lambda: server.open_connections == MAX_METRICS_CONNECTIONS, SETTLE_TIMEOUT_S, "all held")
        assert all(still_open(sock) for sock in held)
        for sock in held:
            sock.sendall(b"GET /metr")  # bytes of a request are no progress: the first accepted is the idlest
        past = idle(server.port)
        held.append(past)
        assert closed_by_endpoint(held.pop(0))
        assert server.evicted_connections == 1
        assert all(still_open(sock) for sock in held)
        past.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")  # the last one in is served
        assert status_of(read_to_end(past)) == 200
        held.pop().close()  # its place is freed once the client closes too
        wait_for(lambda: server.open_connections < MAX_METRICS_CONNECTIONS, SETTLE_TIMEOUT_S, "a place freed")
        assert get(server.port)[0] == 200
        assert server.evicted_connections == 1
    finally:
        for sock in held:
            sock.close()
    assert server.timed_out_connections == 0


def test_a_burst_of_connects_waits_in_the_queue_and_pushes_out_none_accepted_with_it():
    """Connections that arrive while the serving thread is busy are accepted, at most
    MAX_METRICS_CONNECTIONS a turn, in the places of those held before (an answered one
    first); the one past that waits in the listener's queue to the next turn, where the
    idlest of the burst, whose request had its turn to be read, gives its place."""
    release = threading.Event()

    def slow_fetch() -> BrokerStatus:
        release.wait(EXCHANGE_TIMEOUT_S)
        return BrokerStatus()

    with MetricsServer.start(0, slow_fetch) as server, idle(server.port) as first:
        first.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        wait_for(lambda: server.open_connections == 1, SETTLE_TIMEOUT_S, "the first held")
        burst = [idle(server.port) for _ in range(MAX_METRICS_CONNECTIONS + 1)]  # queued: the thread is in fetch
        try:
            release.set()
            assert status_of(read_to_end(first)) == 200  # answered, then closed to make room
            assert closed_by_endpoint(burst[0])
            wait_for(lambda: server.open_connections == MAX_METRICS_CONNECTIONS, SETTLE_TIMEOUT_S, "the last placed")
            assert server.evicted_connections == 2
            assert all(still_open(sock) for sock in burst[1:])
            burst[-1].sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            assert status_of(read_to_end(burst[-1])) == 200
        finally:
            for sock in burst:
                sock.close()


@pytest.mark.integration
def test_with_a_token_a_client_holding_every_place_and_trickling_bytes_starves_no_scrape(tmp_path):
    """The hostile client sends a byte on each of MAX_METRICS_CONNECTIONS connections every
    half second and opens a new one whenever the endpoint closes one; each scrape, with the
    token, takes the place of the idlest and is answered."""
    bearer = {"Authorization": "Bearer " + TOKEN.decode()}
    with MetricsServer.start(0, lambda: BrokerStatus(), token_file=write_token(tmp_path)) as server:
        with holding(holder_command(server.port, MAX_METRICS_CONNECTIONS)):
            wait_for(lambda: server.open_connections == MAX_METRICS_CONNECTIONS, SETTLE_TIMEOUT_S, "every place held")
            codes = []
            for _ in range(HOSTILE_SCRAPES):
                codes.append(get_or_none(server.port, bearer))
                time.sleep(SCRAPE_INTERVAL_S)
        assert codes == [200] * HOSTILE_SCRAPES
        assert server.evicted_connections >= HOSTILE_SCRAPES and server.responses == {200: HOSTILE_SCRAPES}


@pytest.mark.parametrize("sent", [b"", b"GET /metrics HTTP/1.1\r\nHost: x\r\n"])
def test_a_connection_that_sends_no_whole_request_is_closed_after_the_idle_timeout(sent):
    with MetricsServer.start(0, lambda: BrokerStatus(), idle_timeout_s=SHORT_IDLE_TIMEOUT_S) as server:
        with idle(server.port) as sock:
            sock.sendall(sent)
            assert closed_by_endpoint(sock)
        assert server.timed_out_connections == 1 and server.responses == {}
        assert get(server.port)[0] == 200


def test_one_thread_serves_however_many_connect():
    server = MetricsServer.start(0, lambda: BrokerStatus(), eviction_min_age_s=0.0)  # places turn over at once
    threads = threading.active_count()
    sockets = [idle(server.port) for _ in range(IDLE_CONNECTIONS)]
    try:
        closed = IDLE_CONNECTIONS - MAX_METRICS_CONNECTIONS
        wait_for(lambda: server.evicted_connections == closed, SETTLE_TIMEOUT_S, "each past the bound closed")
        assert threading.active_count() <= threads + THREADS_SLACK
        assert server.open_connections == MAX_METRICS_CONNECTIONS
        assert sum(not still_open(sock) for sock in sockets) == closed
    finally:
        for sock in sockets:
            sock.close()
        server.close()


@pytest.mark.integration
def test_idle_connections_add_no_thread_to_a_broker(tmp_path):
    port = free_port()
    broker = start_broker(BrokerConfig(str(tmp_path / "data")), metrics_port=port)
    sockets = []
    try:
        assert get(port)[0] == 200
        threads = psutil.Process(broker.pid).num_threads()
        sockets = [idle(port) for _ in range(IDLE_CONNECTIONS)]
        wait_for(lambda: sum(not still_open(sock) for sock in sockets) == IDLE_CONNECTIONS - MAX_METRICS_CONNECTIONS,
                 SETTLE_TIMEOUT_S, "every connection past the bound closed")
        assert psutil.Process(broker.pid).num_threads() <= threads + THREADS_SLACK
        for sock in sockets:
            sock.close()
        wait_for(lambda: get_or_none(port) == 200, SETTLE_TIMEOUT_S, "the endpoint serves again")
    finally:
        for sock in sockets:
            sock.close()
        assert stop_process(broker) == 0


# ---------------------------------------------------------------------- the port


def test_a_port_in_use_is_refused_in_one_line_naming_it():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(MetricsPortError) as refused:
            bind_metrics_port(port)
        assert str(refused.value) == (f"metrics port {port} (127.0.0.1:{port}) is in use: another process listens "
                                      f"there; give another --metrics-port, or 0 for any free one")
        with pytest.raises(MetricsPortError, match=f"metrics port {port} "):
            MetricsServer.start(port, lambda: BrokerStatus())


def test_a_port_bound_first_is_the_one_served():
    listener = bind_metrics_port(0)
    port = listener.getsockname()[1]
    assert port != 0
    with MetricsServer.start(listener, lambda: BrokerStatus()) as server:
        assert server.port == port and get(port)[0] == 200
    assert listener.fileno() == -1  # closed with the server


def get_or_none(port: int, headers: dict | None = None) -> int | None:
    """The status of a scrape; None when the endpoint closed the connection."""
    try:
        return get(port, headers)[0]
    except (ConnectionError, urllib.error.URLError):
        return None


def test_a_request_head_at_the_size_limit_is_answered_and_one_byte_past_it_431(server):
    start, end = b"GET /metrics HTTP/1.1\r\nX-Pad: ", b"\r\n\r\n"
    at_limit = start + b"a" * (MAX_REQUEST_HEAD_BYTES - len(start) - len(end)) + end
    assert len(at_limit) == MAX_REQUEST_HEAD_BYTES
    assert status_of(exchange(server.port, at_limit)) == 200
    past = start + b"a" * (MAX_REQUEST_HEAD_BYTES - len(start) - len(end) + 1) + end
    assert status_of(exchange(server.port, past)) == 431


@pytest.mark.parametrize("request_head, code", [
    (b"HEAD /metrics HTTP/1.1\r\n\r\n", 200),
    (b"GET / HTTP/1.0\r\n\r\n", 200),
    (b"GET /metrics?name[]=x HTTP/1.1\r\n\r\n", 200),
    (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
    (b"GET /other HTTP/1.1\r\n\r\n", 404),
    (b"hello\r\n\r\n", 400),
    (b"GET /metrics SPDY/3\r\n\r\n", 400),
])
def test_requests_other_than_a_scrape_are_answered_with_their_status(server, request_head, code):
    response = exchange(server.port, request_head)
    assert status_of(response) == code
    if request_head.startswith(b"HEAD"):
        assert response.endswith(b"\r\n\r\n") and b"Content-Length: 0\r\n" not in response


def test_a_bug_in_fetch_fails_its_scrape_with_500_and_the_endpoint_keeps_serving():
    with MetricsServer.start(0, lambda: {}["counters"]) as server:
        assert get(server.port)[0] == 500
        assert get(server.port)[0] == 500
        assert server.responses == {500: 2}


# A short minimum age for the test of it: the newcomer's wait is measured against it.
SHORT_MIN_AGE_S = 0.3


def test_a_place_held_younger_than_the_minimum_age_is_not_given_and_the_newcomer_waits_for_it():
    """Every place held by connections just accepted: a newcomer is not accepted (it waits in
    the listener's queue) until the oldest is SHORT_MIN_AGE_S old, then takes its place, and
    its scrape is answered."""
    with MetricsServer.start(0, lambda: BrokerStatus(), eviction_min_age_s=SHORT_MIN_AGE_S) as server:
        started = time.monotonic()  # every held one is accepted after this
        held = [idle(server.port) for _ in range(MAX_METRICS_CONNECTIONS)]
        try:
            wait_for(lambda: server.open_connections == MAX_METRICS_CONNECTIONS, SETTLE_TIMEOUT_S, "every place held")
            assert get(server.port)[0] == 200
            assert time.monotonic() - started >= SHORT_MIN_AGE_S  # a lower bound: it holds however slow the machine
            assert server.evicted_connections == 1 and closed_by_endpoint(held[0])
            assert all(still_open(sock) for sock in held[1:])
        finally:
            for sock in held:
                sock.close()
