"""Whom the control plane talks to, with a real second local user: a client refuses a socket
(or a server process) of another user, the broker refuses connections of another user, and
a semaphore another user created under our name is refused, never used (SPEC §7, §12).

The hostile side runs as a throwaway user made for the test (`tests/support/users.py`); skipped,
with the reason, where that user cannot be made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.broker.peers import doorbell_name, ensure_namespace, namespace_for
from pipeline.runtime.local import start_broker as start_broker_process
from pipeline.wire.errors import UntrustedPeerError
from pipeline.wire.protocol import Connection
from shm.errors import StaleObjectError
from shm.objects import Doorbell, open_semaphore, semaphore_path, unlink_quietly
from tests.pipeline.harness import status, stop
from tests.support.users import CREATE_SEMAPHORE
from tests.support.users import other_user as make_other_user

pytestmark = pytest.mark.integration

SERVE_SOCKET = """
import socket, sys
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen()
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    conn.settimeout(2)
    try:
        print("got", len(conn.recv(65536)), flush=True)
    except OSError as exc:
        print("got", 0, exc, flush=True)
    conn.close()
"""

ASK_STATUS = """
import json, socket, struct, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(5)
sock.connect(sys.argv[1])
body = json.dumps({"type": "status"}).encode()
try:
    sock.sendall(struct.pack("<I", len(body)) + body)
except OSError as exc:  # the broker may have closed it already
    print("send:", exc)
data = b""
try:
    while chunk := sock.recv(65536):
        data += chunk
except OSError as exc:
    print("recv:", exc)
print(data.decode(errors="replace"))
"""


@pytest.fixture
def other_user():
    with make_other_user() as user:
        yield user


@pytest.fixture
def shared_dir():
    """A directory every user may write in (where a hostile user plants its socket)."""
    path = tempfile.mkdtemp(prefix="sbrk-users-", dir="/tmp")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_client_refuses_a_socket_or_a_server_of_another_user(other_user, shared_dir):
    path = os.path.join(shared_dir, "broker.sock")
    server = subprocess.Popen(other_user.command(SERVE_SOCKET, path), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        with pytest.raises(UntrustedPeerError, match=f"{path}: the broker socket belongs to uid {other_user.uid}, "
                                                     f"not to you"):
            Connection.connect(path)
        # The socket file made to look like ours: the process behind it is still not ours.
        os.chown(path, os.geteuid(), os.getegid())
        with pytest.raises(UntrustedPeerError, match=f"serving this socket runs as uid {other_user.uid}"):
            Connection.connect(path)
        assert server.stdout.readline().split()[:2] == ["got", "0"]  # nothing was sent to it
    finally:
        server.kill()
        server.wait()


def test_the_broker_refuses_connections_of_another_user(other_user):
    base = tempfile.mkdtemp(prefix="sbrk-users-", dir="/tmp")
    config = BrokerConfig(os.path.join(base, "data"))
    broker = start_broker_process(config)
    try:
        # Modes as loose as a careless operator could make them: only the uid check is left.
        for path, mode in ((base, 0o755), (config.data_dir, 0o711), (config.run_dir, 0o711),
                           (config.socket_path, 0o666)):
            os.chmod(path, mode)
        reply = other_user.run(ASK_STATUS, config.socket_path)
        assert f"this broker serves only uid {os.geteuid()}, not uid {other_user.uid}" in reply
        assert "status_reply" not in reply
        assert status(config.socket_path).consumers_lost == 0  # and it serves its own user
    finally:
        assert stop(broker) == 0
        shutil.rmtree(base, ignore_errors=True)


def test_a_semaphore_another_user_created_under_our_name_is_refused(other_user, shm_name):
    name = shm_name("bell")
    other_user.run(CREATE_SEMAPHORE, name)
    try:
        assert os.stat(semaphore_path(name)).st_uid == other_user.uid
        with pytest.raises(StaleObjectError, match=f"belongs to uid {other_user.uid}, not to you"):
            open_semaphore(name, create=False)
        with pytest.raises(StaleObjectError, match=f"belongs to uid {other_user.uid}"):
            Doorbell.attach(name)
    finally:
        unlink_quietly([], [name])


def test_a_broker_refuses_a_doorbell_another_user_planted(other_user, tmp_path):
    # A fresh data directory's names are random, so a squatter cannot guess them; a data
    # directory a broker ran on keeps its namespace, which another user may have read.
    config = BrokerConfig(str(tmp_path / "data"))
    os.makedirs(config.data_dir, mode=0o700)
    bell = doorbell_name(ensure_namespace(config.data_dir, ran_before=False))
    other_user.run(CREATE_SEMAPHORE, bell)
    try:
        with pytest.raises(RuntimeError, match="exited at start"):
            broker = start_broker_process(config)
            stop(broker)  # it must not start; stopped so that a failure cannot hang the run
        assert os.stat(semaphore_path(bell)).st_uid == other_user.uid  # not used, not removed
    finally:
        unlink_quietly([], [bell])


def test_a_squatter_cannot_guess_a_fresh_data_directorys_names(other_user, tmp_path):
    config = BrokerConfig(str(tmp_path / "data"))
    guessed = doorbell_name(namespace_for(config.data_dir))  # what the path alone would give
    other_user.run(CREATE_SEMAPHORE, guessed)
    try:
        broker = start_broker_process(config)
        try:
            assert namespace_for(config.data_dir) != guessed.split("-")[1]
            assert status(config.socket_path).consumers_lost == 0
        finally:
            assert stop(broker) == 0
    finally:
        unlink_quietly([], [guessed])
