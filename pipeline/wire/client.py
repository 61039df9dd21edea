"""Asking a running broker: one request on a connection of its own, and its reply.

    status = broker_status("/data/q/run/broker.sock")     # a BrokerStatus
    status.items_completed, status.backlog_items

    progress = broker_progress("/data/q/run/broker.sock")  # four counters, cheap to ask often

Used by `pipeline status`, the launcher's watch loop, the metrics endpoint's scrapes, the
benchmarks' waits and tests; any thread may call them (each call opens its own connection).
"""

from __future__ import annotations

from typing import NamedTuple

from pipeline.wire.protocol import Connection
from pipeline.wire.status import BrokerStatus


class Progress(NamedTuple):
    """A `progress_reply`: items received (recovered ones apart), completed, and the
    completed items' tokens."""

    items_received: int
    items_recovered: int
    items_completed: int
    tokens_completed: int

# How long a status request waits for its reply by default: a broker answers within a turn
# (tens of milliseconds), and a busy one within a few work slices.
STATUS_TIMEOUT_S = 5.0


def broker_status(socket_path: str, timeout_s: float = STATUS_TIMEOUT_S) -> BrokerStatus:
    """The broker's status (the `status` request); ProtocolError for a reply of another
    version or one this version cannot read."""
    reply = ask_broker(socket_path, {"type": "status"}, timeout_s)
    return BrokerStatus.from_wire(reply["counters"], version=reply["version"])


def broker_progress(socket_path: str, timeout_s: float = STATUS_TIMEOUT_S) -> Progress:
    """The broker's `progress` counters (a poller's cheap question: has the run finished?)."""
    reply = ask_broker(socket_path, {"type": "progress"}, timeout_s)
    return Progress(*(reply[field] for field in Progress._fields))


def ask_broker(socket_path: str, message: dict, timeout_s: float) -> dict:
    """One request on a connection of its own, and the broker's reply."""
    conn = Connection.connect(socket_path, timeout_s)
    try:
        return conn.request(message, timeout_s)
    finally:
        conn.close()
