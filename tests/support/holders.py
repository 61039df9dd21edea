"""A hostile client of a metrics endpoint, for the tests of its bounds: a process that keeps
connections open to a port, each sending one byte of a request head (never a whole one)
every TRICKLE_INTERVAL_S, and each replaced by a new connection as soon as the endpoint
closes it. It runs as this user (`holder_command`) or as another one (`HOLDER` under
tests/support/users.py `OtherUser.command`, with the system's Python), and prints "holding"
once its first connections are made.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# How often each held connection sends a byte: progress of a kind, never a whole request.
TRICKLE_INTERVAL_S = 0.5
# How long a holder runs at most: a hang guard (the test stops it when done).
HOLD_LIMIT_S = 120.0

# argv: port, connections, seconds to run, seconds between bytes.
HOLDER = r"""
import select, socket, sys, time
port, count, trickle_interval_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[4])
end_s = time.monotonic() + float(sys.argv[3])

def connect():
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        return None

held = [connect() for _ in range(count)]
print("holding", flush=True)
trickle_s = time.monotonic()
while time.monotonic() < end_s:
    held = [sock if sock is not None else connect() for sock in held]
    if time.monotonic() >= trickle_s:
        trickle_s = time.monotonic() + trickle_interval_s
        for sock in held:
            try:
                if sock is not None:
                    sock.send(b"G")
            except OSError:
                pass  # closed: found below
    live = [sock for sock in held if sock is not None]
    for sock in select.select(live, [], [], max(0.0, trickle_s - time.monotonic()))[0]:
        try:
            closed = sock.recv(65536) == b""
        except OSError:
            closed = True
        if closed:
            held[held.index(sock)] = None
            sock.close()
"""


def holder_args(port: int, connections: int) -> tuple[str, ...]:
    return str(port), str(connections), str(HOLD_LIMIT_S), str(TRICKLE_INTERVAL_S)


def holder_command(port: int, connections: int) -> list[str]:
    """The holder as this user, with this interpreter."""
    return [sys.executable, "-c", HOLDER, *holder_args(port, connections)]


@contextmanager
def holding(command: list[str], started: Callable[[int], None] = lambda pid: None) -> Iterator[subprocess.Popen]:
    """The holder of `command` running for the block (killed after it); `started(pid)` is
    called before it connects."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started(process.pid)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "holding", process.stderr.read() if process.stderr else ""
        yield process
    finally:
        process.kill()
        process.communicate()
