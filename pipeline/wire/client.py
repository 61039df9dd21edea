"""Asking a running broker: one request on a connection of its own, and its reply.

    status = broker_status("/data/q/run/broker.sock")     # a BrokerStatus
    status.items_completed, status.backlog_items

Used by `pipeline status`, the launcher's watch loop, the metrics endpoint's scrapes and
tests; any thread may call it (each call opens its own connection).
"""

from __future__ import annotations

from pipeline.wire.protocol import Connection
from pipeline.wire.status import BrokerStatus

# How long a status request waits for its reply by default: a broker answers within a turn
# (tens of milliseconds), and a busy one within a few work slices.
STATUS_TIMEOUT_S = 5.0


def broker_status(socket_path: str, timeout_s: float = STATUS_TIMEOUT_S) -> BrokerStatus:
    """The broker's status (the `status` request); ProtocolError for a reply of another
    version or one this version cannot read."""
    reply = ask_broker(socket_path, {"type": "status"}, timeout_s)
    return BrokerStatus.from_wire(reply["counters"], version=reply["version"])


def ask_broker(socket_path: str, message: dict, timeout_s: float) -> dict:
    """One request on a connection of its own, and the broker's reply."""
    conn = Connection.connect(socket_path, timeout_s)
    try:
        return conn.request(message, timeout_s)
    finally:
        conn.close()
