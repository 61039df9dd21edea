"""A producer attached to a running broker: registration, its ring, reconnection, goodbye.

    with BrokerProducer("/data/run/broker.sock") as producer:
        producer.submit_many(...)          # the Producer API
    # on exit: unregister, wait until the broker has stored everything, unlink the ring

The broker names the ring and the doorbell; the producer creates the ring (it owns it and
unlinks it at the end). If the broker restarts, the ring stays: the producer re-registers
with its producer id and the new broker reattaches the ring and ingests what it had not
stored yet, exactly once.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from pipeline.producer.producer import DEFAULT_RING_CAPACITY_BYTES, Producer, ProducerLimits
from pipeline.wire.errors import ProducerRefusedError, ProducerStoppedError, ProtocolError
from pipeline.wire.protocol import RECONNECT_FIRST_S, RECONNECT_MAX_S, REGISTRATION_REPLY_TIMEOUT_S, Connection
from shm.ring import RingWriter

# How often `wait_stored` looks at the ring's read position.
DRAIN_POLL_S = 0.005
# How long a producer's first registration keeps asking a broker that does not answer
# (stopped, or restarting: restart-to-serving p99 7.5 s in a soak on 2 loaded cores,
# RELIABILITY.md) before it fails. Without it a broker killed while `pipeline produce`'s
# producer registers fails the whole command (3 of 12 runs), though the command waits for a
# restarting broker once registered (`_reconnect`, without a bound).
FIRST_REGISTRATION_TIMEOUT_S = 120.0
# What a broker that is away looks like to a registration: no socket file (between a
# broker's exit and its successor's bind), nobody listening, the connection cut, no reply.
_BROKER_AWAY = (FileNotFoundError, ConnectionError, TimeoutError)


class BrokerProducer(Producer):
    """A `Producer` registered with a broker over its control socket.

    Owner: one producer process (one thread submits). `close()` unregisters, waits for the
    broker to store everything published, then unlinks the ring.
    """

    def __init__(self, socket_path: str, *, capacity_bytes: int = DEFAULT_RING_CAPACITY_BYTES,
                 limits: ProducerLimits = ProducerLimits(), timeout_s: float | None = None,
                 register_timeout_s: float = FIRST_REGISTRATION_TIMEOUT_S,
                 give_up: Callable[[], bool] = lambda: False) -> None:
        """Registered with the broker on `socket_path`, asking again while it is away, for
        up to `register_timeout_s`; ProducerStoppedError as soon as `give_up()` (this process
        is stopping: its parent is gone, or it was told to stop) finds it away."""
        self.socket_path = socket_path
        deadline_s = time.monotonic() + register_timeout_s
        backoff = RECONNECT_FIRST_S
        while True:
            try:
                self._register(capacity_bytes, limits, timeout_s)
                break
            except _BROKER_AWAY as exc:  # a broker stopping or restarting: ask again
                if give_up():
                    raise ProducerStoppedError(f"{socket_path}: this producer stopped before a broker took its "
                                               f"registration ({exc}); it published nothing") from exc
                if time.monotonic() + backoff > deadline_s:
                    raise type(exc)(f"{socket_path}: no broker took this producer's registration within "
                                    f"{register_timeout_s:g} s: {exc}") from exc
                time.sleep(backoff)
                backoff = min(2 * backoff, RECONNECT_MAX_S)
        self._conn_lock = threading.Lock()
        self._closing = threading.Event()
        # Why the broker refused this producer, once it has (set by the watcher thread, read
        # by the submitting one: a str reference, replaced whole).
        self.refused: str | None = None
        self._monitor = threading.Thread(target=self._watch_broker, name="broker-watch", daemon=True)
        self._monitor.start()

    def _register(self, capacity_bytes: int, limits: ProducerLimits, timeout_s: float | None) -> None:
        """One registration: connect, register (a new producer id), create the ring the
        broker names, say ready. On any failure nothing was published: the ring and the
        connection are removed and the error raised (a broker that went away meanwhile
        leaves at most a half-made registration it forgets with the connection)."""
        self.conn = Connection.connect(self.socket_path)
        try:
            reply = self.conn.request({"type": "register_producer", "pid": os.getpid(), "producer_id": -1},
                                      timeout_s=REGISTRATION_REPLY_TIMEOUT_S)
            ring = RingWriter.create(reply["ring"], capacity_bytes, doorbell=reply["doorbell"], reattach=True)
        except BaseException:
            self.conn.close()
            raise
        try:
            super().__init__(ring, reply["producer_id"], limits=limits, timeout_s=timeout_s)
            self.conn.send({"type": "producer_ready", "ring": reply["ring"]})
        except BaseException:
            # Nothing was published: the ring is this producer's to remove (a ring too small
            # for the largest item, say, or a broker gone mid-registration). The views of the
            # ring's memory go first: closing a mapping they still use raises BufferError,
            # which hid the real error ("cannot close exported pointers exist").
            if hasattr(self, "_tokens_view"):
                del self._tokens_view
            self._buf = None  # type: ignore[assignment]
            ring.close()
            ring.unlink()
            self.conn.close()
            raise

    def _watch_broker(self) -> None:
        """Notice the broker going away (end of file on the socket) and register again with
        the same producer id, so the next broker reattaches this ring. Submits never wait
        for this: records keep landing in the ring (until it is full: backpressure)."""
        while not self._closing.is_set() and self.refused is None:
            try:
                message = self.conn.receive(timeout_s=None)
            except (OSError, ConnectionError, ProtocolError):
                if not self._closing.is_set():
                    self._reconnect()
                continue
            if message["type"] == "error":
                self.refused = message["message"]  # the broker closes the connection next

    def _reconnect(self) -> None:
        backoff = RECONNECT_FIRST_S
        while not self._closing.is_set():
            conn = None
            try:
                conn = Connection.connect(self.socket_path)
                conn.request({"type": "register_producer", "pid": os.getpid(), "producer_id": self.producer_id},
                             timeout_s=REGISTRATION_REPLY_TIMEOUT_S)
                conn.send({"type": "producer_ready", "ring": self.ring.name})
            except ProtocolError as exc:
                if conn is not None:
                    conn.close()
                self.refused = self.refused or str(exc)
                return  # the broker refused this producer: stop asking
            except (OSError, TimeoutError):
                if conn is not None:
                    conn.close()  # a half-made registration must not linger at the broker
                time.sleep(backoff)
                backoff = min(2 * backoff, RECONNECT_MAX_S)
                continue
            with self._conn_lock:
                if self._closing.is_set():  # close() ran meanwhile: do not stay registered
                    conn.close()
                    return
                # A broker that restarted knows the chains of the shapes it recovered items of
                # (its store log's), not those it had retired or could not keep: declare
                # again (a chain it knows writes nothing and moves nothing).
                self.forget_declared_shapes()
                old, self.conn = self.conn, conn
            old.close()
            return

    def wait_stored(self, timeout_s: float | None = None) -> None:
        """Block until the broker has stored (and released) everything this producer
        published; TimeoutError if that takes longer than `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.ring.read_pos != self.ring.write_pos:
            self._check_refused()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"producer {self.producer_id}: {self.ring.write_pos - self.ring.read_pos} bytes "
                    f"still unstored after {timeout_s} s"
                )
            time.sleep(DRAIN_POLL_S)

    def _check_refused(self) -> None:
        if self.refused is not None:
            raise ProducerRefusedError(
                f"producer {self.producer_id}: the broker refused it ({self.refused}); "
                f"{self.ring.write_pos - self.ring.read_pos} bytes of records it published were not "
                f"stored and stay in its ring {self.ring.name}")

    def submit_many(self, *args, **kwargs) -> np.ndarray:
        """`Producer.submit_many`, refused at once (ProducerRefusedError) once the broker has
        refused this producer: nothing it submits would be stored."""
        self._check_refused()
        return super().submit_many(*args, **kwargs)

    def close(self, timeout_s: float | None = None) -> None:
        """Wait until the broker has stored everything published, unregister, then remove
        the ring. (Waiting first: a broker that restarts meanwhile must still find the ring
        registered to drain it.) If the wait fails (TimeoutError, ProducerRefusedError), the
        ring stays, with what was not stored, and the connection is closed."""
        try:
            self.wait_stored(timeout_s)
        except BaseException:
            self._closing.set()
            self._hang_up()
            del self._tokens_view
            self._buf = None  # type: ignore[assignment]
            self.ring.close(mark_closed=False)  # not done: a later broker may still store it
            raise
        self._closing.set()
        with self._conn_lock:
            try:
                self.conn.send({"type": "unregister_producer"})
            except OSError:
                pass  # the broker is gone; nothing is left in the ring for it
        self._hang_up()
        super().close()
        self.unlink()

    def _hang_up(self) -> None:
        """Close the connection and stop the watcher (shutdown wakes its blocked receive)."""
        with self._conn_lock:
            try:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # never connected, or already reset by the broker
            self.conn.close()
        self._monitor.join(timeout=5)

    def __enter__(self) -> BrokerProducer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
