"""A consumer's registration with a broker: the connection, the descriptor ring it reads its
batches from, and the heartbeat thread that keeps it alive while the engine runs (a slow GPU
batch never makes the broker declare the consumer dead: heartbeats do not wait for it).

    session = BrokerSession(config)      # register (the four-number contract), attach the ring
    session.send({...}); session.check_open(); session.hand_back(); session.close()
"""

from __future__ import annotations

import os
import threading

from pipeline.consumer.config import ConsumerConfig
from pipeline.wire.errors import ProtocolError, RegistrationRefusedError, ShmError
from pipeline.wire.protocol import DURABILITY_LEVELS, Connection, encode
from shm.ring import RingReader


class BrokerSession:
    """One registration with a broker: the connection, the descriptor ring, the heartbeat
    thread. Owner: the consumer's main thread; the heartbeat thread only sends heartbeats,
    serialised with the main thread's sends by `_send_lock`."""

    def __init__(self, config: ConsumerConfig) -> None:
        self.conn = Connection.connect(config.socket_path)
        self._send_lock = threading.Lock()
        try:
            reply = self._register(config)
            self.ring = RingReader.attach(reply["descriptor_ring"])
        except BaseException:
            self.conn.close()
            raise
        self.consumer_id = reply["consumer_id"]
        self.data_dir = reply["data_dir"]
        # The broker's durability level: at `power` the results a consumer reports complete
        # must be on disk first (the broker's completion record is fdatasync'ed: a result
        # only in the page cache would be lost by a power cut with its item marked done).
        self.durability: str = reply["durability"]
        self._interval_s = float(reply["heartbeat_timeout_s"]) / 4
        self._stop = threading.Event()
        self._broken = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self.in_engine = 0  # batches started and not completed, as the serving loop ended
        self._heartbeat.start()

    def _register(self, config: ConsumerConfig) -> dict:
        """The broker's `registered` reply. RegistrationRefusedError if it answers with an
        error (fatal: the same registration would be refused again); ProtocolError for any
        other reply, TimeoutError, OSError (transient: the caller retries)."""
        self.conn.send({
            "type": "register_consumer", "model": config.model, "max_batch_items": config.max_batch_items,
            "max_batch_tokens": config.max_batch_tokens, "max_input_len": config.max_input_len,
            "pid": os.getpid(), "gpu": config.gpu, "name": config.name,
        })
        reply = self.conn.receive()
        if reply["type"] == "error":
            raise RegistrationRefusedError(f"the broker at {config.socket_path} refused consumer {config.name!r} "
                                           f"(max batch {config.max_batch_items} items, {config.max_batch_tokens} "
                                           f"tokens, max input {config.max_input_len}): {reply['message']}")
        if reply["type"] != "registered":
            raise ProtocolError(f"register_consumer: the broker answered {reply['type']!r}, not 'registered'")
        if reply["durability"] not in DURABILITY_LEVELS:
            raise ProtocolError(f"registered: durability {reply['durability']!r:.40} is not one of {DURABILITY_LEVELS}")
        return reply

    def hand_back(self) -> int:
        """Say goodbye, so the broker returns every batch this consumer holds to dispatch at
        once; how many it held by this side's count: those started (in the engine, or run and
        not completed: `in_engine`, which the serving loop sets as it ends) and those queued
        in the ring. A broker already gone returns them when it notices the disconnect."""
        held = self.in_engine
        try:
            while self.ring.poll() is not None:
                held += 1
        except ShmError:
            pass  # a damaged ring: the broker takes back what it dispatched all the same
        try:
            self.send({"type": "goodbye"})
        except OSError:
            pass
        return held

    def _beat(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.send({"type": "heartbeat"})
            except OSError:
                self._broken.set()  # the main thread finds out at its next check
                return

    def send(self, *messages: dict) -> None:
        """Send messages back to back in one write (one system call, and one read for the
        broker when they arrive together)."""
        data = b"".join(map(encode, messages))
        with self._send_lock:
            self.conn.sock.sendall(data)

    def check_open(self) -> None:
        """ConnectionError if the broker went away (or a heartbeat could not be sent)."""
        if self._broken.is_set():
            raise ConnectionError("a heartbeat could not be sent")
        with self._send_lock:
            self.conn.check_open()

    def close(self) -> None:
        self._stop.set()
        self._heartbeat.join(timeout=2)
        self.ring.close(mark_closed=False)
        self.conn.close()
