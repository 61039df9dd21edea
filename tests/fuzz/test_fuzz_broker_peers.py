"""Bad peers against a real broker process: garbage frames in some
producers' rings and fuzzed bytes on control connections. The bad peer alone is refused,
told why (the broker's reason names the field and byte offset); the broker keeps serving
the good producer and the consumer, and stores exactly what the good producer sent."""

from __future__ import annotations

import json
import os
import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from pipeline.broker.config import BrokerConfig
from pipeline.producer.client import BrokerProducer
from pipeline.runtime.local import start_consumer
from pipeline.wire.layouts.descriptors import parse_descriptor
from pipeline.wire.layouts.frames import CHAIN_HEADER_DTYPE, FRAME_HEADER_SIZE_BYTES, ITEM_HEADER_DTYPE
from pipeline.wire.protocol import Connection
from pipeline.wire.status import ConsumerWork
from shm.ring import RingReader, RingWriter
from tests.fuzz import mutations, strategies
from tests.fuzz.targets import TARGETS, frame_bytes
from tests.pipeline.harness import read_results, start_broker, status, stop, wait_until
from tests.support.contracts import consumer_config

pytestmark = pytest.mark.campaign

TOKENS = np.arange(40, dtype=np.int32)
GOOD_ITEMS = 30
# Fuzzed control streams sent, each on its own connection, per kind (arbitrary, mutants).
CONTROL_EXAMPLES = 60
# The model the hand-made consumer serves, so the real consumer (model 0) takes none of its items.
HELD_MODEL = 1


def _seq_field(index: int, name: str) -> tuple[int, int]:
    return (FRAME_HEADER_SIZE_BYTES + index * 48 + ITEM_HEADER_DTYPE.fields[name][1],
            ITEM_HEADER_DTYPE.fields[name][0].itemsize)


def _chain_depth(frame: bytes, depth: int) -> bytes:
    """The frame with its one chain's depth word (CHAIN_HEADER_DTYPE, 4 bytes at 4) set."""
    chain_bytes = int.from_bytes(frame[28:32], "little")
    return mutations.overwrite(frame, len(frame) - chain_bytes + CHAIN_HEADER_DTYPE.fields["depth"][1], 4, depth)


def bad_records(own_id: int, good_id: int) -> list[tuple[bytes, str]]:
    """Records a producer with id `own_id` might write, none a frame the broker may store,
    with what the broker's reason must say."""
    items = [(0, 0xA1, 3, 1, b""), (0, 0xA1, 4, 0, b"p")]
    return [
        (b"not a frame at all, just bytes", "shorter than a frame header"),
        (frame_bytes(good_id, 0, items), f"names producer {good_id}"),  # the good producer's seqs 0, 1
        (mutations.overwrite(frame_bytes(own_id, 0, items), *_seq_field(1, "item_id"), 99), "item_id 99 at offset 80"),
        (mutations.overwrite(frame_bytes(own_id, 0, items), *_seq_field(0, "prefix_len"), 4), "prefix_len 4 at offset 72"),
        (_chain_depth(frame_bytes(own_id, 0, items, chains=[(0, (1, 2))]), 2**32 - 1), "has depth 4294967295"),
        (mutations.truncate(frame_bytes(own_id, 0, items), 100), "the record has 100"),
    ]


@pytest.fixture
def served(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    consumer = start_consumer(consumer_config(tmp_path, socket_path, 0))
    try:
        # Registered before any bad peer comes (a loaded machine starts it in seconds).
        wait_until(lambda: "c0" in status(socket_path).consumers, 60, "the consumer registering")
        yield socket_path, str(tmp_path / "results")
    finally:
        stop(consumer)
        assert stop(broker) == 0  # it never crashed: a clean stop


def test_garbage_frames_refuse_their_producers_alone(served):
    socket_path, results = served
    good = BrokerProducer(socket_path, capacity_bytes=16 << 20, timeout_s=30)
    bad_ones = []
    for k in range(len(bad_records(0, 0))):
        bad = BrokerProducer(socket_path, capacity_bytes=16 << 20)
        record, expect = bad_records(bad.producer_id, good.producer_id)[k]
        RingWriter.write(bad.ring, record)
        bad_ones.append((bad, expect))
    for bad, expect in bad_ones:
        wait_until(lambda: bad.refused is not None, 30, f"the broker refusing a producer ({expect})")
        assert bad.refused.startswith("bad frame: ") and expect in bad.refused, bad.refused
    for _ in range(GOOD_ITEMS):
        good.submit(0, 9, TOKENS)
    good.close(timeout_s=30)
    wait_until(lambda: status(socket_path).items_completed == GOOD_ITEMS, 30, "the good producer's items")
    counters = status(socket_path)
    # Nothing of the spoofed frame was stored under the good producer's id (its seqs 0 and 1
    # would have been skipped as already stored, and its own items 0 and 1 lost).
    assert counters.items_received == GOOD_ITEMS and counters.duplicate_items == 0
    assert sorted(row["item_id"] >> 40 for row in read_results(results)) == [good.producer_id] * GOOD_ITEMS
    for bad, _ in bad_ones:
        assert str(bad.producer_id) not in counters.producers
        bad.ring.close()
        bad.unlink()


def _send_and_close(socket_path: str, data: bytes) -> None:
    sock = Connection.connect(socket_path).sock
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(10)
        while sock.recv(65536):  # until the broker refuses or answers and we hang up
            pass
    except (ConnectionResetError, BrokenPipeError, TimeoutError):
        pass
    finally:
        sock.close()


_SETTINGS = dict(deadline=None, derandomize=True, database=None, max_examples=CONTROL_EXAMPLES,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])


def test_fuzzed_control_connections_leave_the_broker_serving(served):
    socket_path, _results = served
    target = TARGETS["control"]

    @settings(**_SETTINGS)
    @given(data=strategies.mutants(target) | strategies.arbitrary())
    def one_connection(data: bytes) -> None:
        _send_and_close(socket_path, data)

    one_connection()
    counters = status(socket_path)  # it answers, and its consumer is still served
    assert list(counters.consumers) == ["c0"] and counters.consumers_lost == 0
    producer = BrokerProducer(socket_path, capacity_bytes=16 << 20, timeout_s=30)
    for _ in range(10):
        producer.submit(0, 9, TOKENS)
    producer.close(timeout_s=30)
    wait_until(lambda: status(socket_path).items_completed == 10, 30, "items submitted after the fuzzing")


_WORK = {name: 0 for name in ConsumerWork.__dataclass_fields__}
BAD_COMPLETIONS = [
    ("corrupt", [[1]]),  # a TypeError (unhashable list) out of the broker's loop before the fix
    ("corrupt", [{"a": 1}]),
    ("corrupt", [True]),
    ("corrupt", [2**64]),
    ("corrupt", "all"),
    ("results", {**_WORK, "items_ok": [1]}),
    ("results", {**_WORK, "bogus": 1}),
    ("results", []),
]


def test_a_bad_completion_of_a_held_batch_refuses_that_consumer_alone(served):
    socket_path, _results = served
    producer = BrokerProducer(socket_path, capacity_bytes=16 << 20, timeout_s=30)
    for _ in range(4):
        producer.submit(HELD_MODEL, 5, TOKENS)
    producer.close(timeout_s=30)
    for key, value in [*BAD_COMPLETIONS, (None, None)]:
        conn = Connection.connect(socket_path)
        reply = conn.request({"type": "register_consumer", "model": HELD_MODEL, "max_batch_items": 4,
                              "max_batch_tokens": 1 << 16, "max_input_len": 1 << 12, "pid": os.getpid()})
        ring = RingReader.attach(reply["descriptor_ring"])
        conn.send({"type": "request_work", "credit": 1})
        batch = parse_descriptor(ring.peek(timeout_s=10).body)
        ids = batch.items["item_id"].tolist()
        message = {"type": "complete", "batch_id": batch.batch_id, "results": {**_WORK, "items_ok": len(ids)},
                   "credit": 0}
        if key is not None:
            message[key] = value
        body = json.dumps(message).encode()  # not `encode`: it checks the schema, as a bad peer does not
        conn.sock.sendall(len(body).to_bytes(4, "little") + body)
        if key is None:  # a good completion of the batch every bad one handed back
            wait_until(lambda: status(socket_path).items_completed >= len(ids), 30, "the good completion")
            conn.send({"type": "goodbye"})
        else:
            refusal = conn.receive(10)
            assert refusal["type"] == "error" and key in refusal["message"], refusal
            with pytest.raises(ConnectionError):
                conn.receive(10)
        ring.close(mark_closed=False)
        conn.close()
    counters = status(socket_path)
    assert counters.items_completed == 4 and counters.items_returned == 4 * len(BAD_COMPLETIONS)
    assert list(counters.consumers) == ["c0"]  # the real consumer was served throughout
