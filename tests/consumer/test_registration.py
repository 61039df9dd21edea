"""Which registration failures a consumer retries and which stop it, against a scripted
broker on a real Unix socket: a broker that is not there yet, a connection closed without a
reply, a reply that is not a message are transient; an `error` reply is fatal, with the
broker's reason."""

from __future__ import annotations

import socket
import threading

import pytest

from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.process import Consumer
from pipeline.wire.errors import RegistrationRefusedError
from pipeline.wire.protocol import MessageReader, encode

# Connections after which the test stops a consumer that keeps retrying (a regression would
# otherwise retry forever).
MAX_CONNECTIONS = 6


class ScriptedBroker:
    """Accepts connections on a Unix socket and answers the k-th registration with
    `script[k]`: "close" (no reply), "garbage" (bytes that are not a message), or a reason
    (an `error` reply). Owner: the test; serves from one thread."""

    def __init__(self, path: str, script: list[str]) -> None:
        self.script = script
        self.registrations: list[dict] = []
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen(8)
        self._server.settimeout(10)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        for step in self.script:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with conn:
                reader, messages = MessageReader(), []
                while not messages:
                    data = conn.recv(65536)
                    if not data:
                        break
                    messages = list(reader.feed(data))
                self.registrations.extend(messages)
                if step == "garbage":
                    conn.sendall(b"\x04\x00\x00\x00nope")
                elif step != "close":
                    conn.sendall(encode({"type": "error", "message": step}))

    def close(self) -> None:
        self._server.close()
        self._thread.join(5)


def test_transient_failures_are_retried_and_a_refusal_is_fatal_with_the_reason(tmp_path):
    path = str(tmp_path / "broker.sock")
    consumer = Consumer(ConsumerConfig(path, str(tmp_path / "results"), "c0", max_batch_items=20_000))
    attempts = []

    def stop() -> bool:  # the consumer checks before each attempt
        attempts.append(1)
        if len(attempts) == 3:  # not there for two attempts, then it starts
            broker.append(ScriptedBroker(path, ["close", "garbage", "contract: 20000 items do not fit"]))
        return len(attempts) > MAX_CONNECTIONS + 3

    broker: list[ScriptedBroker] = []
    try:
        with pytest.raises(RegistrationRefusedError) as info:
            consumer.run(stop)
    finally:
        for b in broker:
            b.close()
    assert str(info.value).endswith("refused consumer 'c0' (max batch 20000 items, 65536 tokens, max input 8192): "
                                    "contract: 20000 items do not fit")
    assert [m["type"] for m in broker[0].registrations] == ["register_consumer"] * 3
    assert broker[0].registrations[-1]["max_batch_items"] == 20_000
