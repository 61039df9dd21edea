"""The producer API: frames round-trip, ids and sequences, batch splitting, a second process
reading everything back, and every bad input rejected with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.producer import Producer, ProducerLimits, signature
from pipeline.wire.errors import (
    BadInputError,
    FrameError,
    ItemTooLongError,
    ModelIdError,
    PayloadTooLargeError,
    RingClosedError,
    RingTimeoutError,
    SignatureError,
    StaleObjectError,
    TokenArrayError,
)
from pipeline.wire.generation import GENERATION_MAGIC, decode_payload
from pipeline.wire.layouts.frames import ITEM_ID_SEQ_BITS, parse_frame
from shm.objects import create_shared_memory
from shm.ring import RingReader, RingWriter
from shm.ring_layout import HEADER_SIZE_BYTES

SIG = signature([b"system prompt", b"few-shot block"])
SMALL = ProducerLimits(max_item_tokens=1000, max_payload_bytes=100, max_models=4, frame_items=16)


@pytest.fixture
def pair(shm_name):
    """A producer (id 5) on a 64 KiB ring and a reader of that ring."""
    producer = Producer.create(shm_name(), producer_id=5, capacity_bytes=1 << 16, limits=SMALL, timeout_s=1.0)
    reader = RingReader.attach(producer.ring.name)
    yield producer, reader
    reader.close()
    producer.close()
    producer.unlink()


def read_frames(reader: RingReader) -> list:
    frames = []
    while (record := reader.poll()) is not None:
        frames.append(parse_frame(record.body, where=f"record at {record.start}"))
        reader.release(record.end)
    return frames


def test_single_item_round_trip(pair):
    producer, reader = pair
    tokens = np.array([7, 8, 9, 10], dtype=np.int32)
    item_id = producer.submit(model=2, signature=SIG, tokens=tokens, prefix_len=3, payload=b"job-17")
    (frame,) = read_frames(reader)
    assert frame.producer_id == 5
    (item,) = frame.items
    assert item["item_id"] == item_id == (5 << ITEM_ID_SEQ_BITS) | 0
    assert (item["seq"], item["signature"], item["model"]) == (0, SIG, 2)
    assert (item["length"], item["prefix_len"], item["payload_len"]) == (4, 3, 6)
    assert item["submit_ns"] > 0
    assert np.array_equal(frame.item_tokens(0), tokens)
    assert frame.item_payload(0) == b"job-17"
    assert producer.next_seq == 1


def test_token_view_is_zero_copy_and_aligned(pair):
    producer, reader = pair
    producer.submit(0, SIG, np.arange(33, dtype=np.int32))
    record = reader.poll()
    frame = parse_frame(record.body)
    view = frame.item_tokens(0)
    assert view.base is not None and not view.flags.owndata
    address = view.__array_interface__["data"][0]
    region = reader.data.__array_interface__["data"][0]
    assert region <= address < region + reader.capacity_bytes
    assert address % 16 == 0


def test_submit_many_splits_into_frames_and_keeps_order(pair):
    producer, reader = pair
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 50, size=40)
    tokens = rng.integers(0, 1 << 31, size=int(lengths.sum()), dtype=np.int64)
    payloads = [f"p{i}".encode() for i in range(40)]
    models = np.arange(40) % 4
    ids = producer.submit_many(models, SIG, tokens, lengths, prefix_len=1, payloads=payloads)
    frames = read_frames(reader)
    assert [f.items.shape[0] for f in frames] == [16, 16, 8]  # frame_items = 16
    items = np.concatenate([f.items for f in frames])
    assert np.array_equal(items["item_id"], ids)
    assert np.array_equal(items["seq"], np.arange(40))
    assert np.array_equal(items["model"], models)
    assert np.array_equal(items["length"], lengths)
    got_tokens = np.concatenate([f.tokens for f in frames])
    assert np.array_equal(got_tokens, tokens)
    got_payloads = [f.item_payload(i) for f in frames for i in range(f.items.shape[0])]
    assert got_payloads == payloads
    assert producer.next_seq == 40


def test_frames_are_split_by_bytes_too(shm_name):
    limits = ProducerLimits(max_item_tokens=2000, max_payload_bytes=0, frame_items=4096, frame_bytes=10_000)
    producer = Producer.create(shm_name(), producer_id=1, capacity_bytes=1 << 16, limits=limits)
    reader = RingReader.attach(producer.ring.name)
    try:
        lengths = np.array([1000, 1000, 1000, 2000, 10])
        producer.submit_many(0, SIG, np.zeros(int(lengths.sum()), dtype=np.int32), lengths)
        frames = read_frames(reader)
        # Items take 48 header bytes plus 4 per token, frames 32 more: 2 x 4,048 fit in
        # 10,000 bytes, a third does not; 4,048 + 8,048 does not fit; 8,048 + 88 does.
        assert [f.items.shape[0] for f in frames] == [2, 1, 2]
    finally:
        reader.close()
        producer.close()
        producer.unlink()


def test_item_ids_are_unique_across_producers(shm_name):
    a = Producer.create(shm_name(), producer_id=1, capacity_bytes=1 << 16, limits=SMALL)
    b = Producer.create(shm_name(), producer_id=2, capacity_bytes=1 << 16, limits=SMALL)
    try:
        ones = np.ones(3, dtype=np.int32)
        ids = {a.submit(0, SIG, ones) for _ in range(5)} | {b.submit(0, SIG, ones) for _ in range(5)}
        ids |= set(a.submit_many(0, SIG, np.ones(6, dtype=np.int32), [2, 2, 2]).tolist())
        assert len(ids) == 13
    finally:
        for p in (a, b):
            p.close()
            p.unlink()


@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.binary(max_size=40), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=60,
    )
)
def test_any_mix_of_single_and_batch_submits_round_trips(shm_name, items):
    producer = Producer.create(shm_name(), producer_id=9, capacity_bytes=1 << 16, limits=SMALL)
    reader = RingReader.attach(producer.ring.name)
    try:
        expected = []
        batch: list = []

        def flush() -> None:
            if batch:
                producer.submit_many(
                    np.array([m for _, _, m in batch]), SIG,
                    np.concatenate([t for t, _, _ in batch]), [len(t) for t, _, _ in batch],
                    payloads=[p for _, p, _ in batch],
                )
                batch.clear()

        for i, (length, payload, model, alone) in enumerate(items):
            tokens = (np.arange(length, dtype=np.int32) + i * 1000) % 50_000
            expected.append((tokens, payload, model))
            if alone:
                flush()
                producer.submit(model, SIG, tokens, payload=payload)
            else:
                batch.append((tokens, payload, model))
            if len(batch) == 7 or i == len(items) - 1:
                flush()
            # Keep the ring drained so the test never blocks; compare what came out so far.
            for frame in read_frames(reader):
                for k in range(frame.items.shape[0]):
                    tokens, payload, model = expected.pop(0)
                    assert np.array_equal(frame.item_tokens(k), tokens)
                    # A payload that looks like a generation envelope is stored in one (an empty one):
                    # what the consumer hands back is the payload itself.
                    stored = frame.item_payload(k)
                    assert decode_payload(stored)[1] == payload and frame.items["model"][k] == model
                    assert stored == payload or payload.startswith(GENERATION_MAGIC)
        assert not expected and not batch
    finally:
        reader.close()
        producer.close()
        producer.unlink()


def tokens_of(seq: int, length: int) -> np.ndarray:
    """Item `seq`'s tokens: its own pattern, so the reader checks content and order."""
    return ((np.arange(length) + seq) % 100_000).astype(np.int32)


def producer_proc(name: str, count: int) -> None:
    limits = ProducerLimits(max_item_tokens=4000, max_payload_bytes=0)
    producer = Producer(RingWriter.attach(name), producer_id=3, limits=limits, timeout_s=60)
    rng = np.random.default_rng(5)
    sent = 0
    while sent < count:
        n = int(rng.integers(1, 200))
        lengths = rng.integers(1, 3000, size=n)
        if n == 1:
            producer.submit(0, SIG, tokens_of(sent, int(lengths[0])))
        else:
            tokens = np.concatenate([tokens_of(sent + k, int(lengths[k])) for k in range(n)])
            producer.submit_many(0, SIG, tokens, lengths)
        sent += n
    producer.close()


@pytest.mark.integration
def test_second_process_reads_every_item_across_wraparound(shm_name, ctx):
    # A 1 MiB ring laps many times; every item's tokens are checked against its sequence.
    reader = RingReader.create(shm_name(), 1 << 20)
    child = ctx.Process(target=producer_proc, args=(reader.name, 20_000))
    child.start()
    seen = 0
    try:
        while True:
            try:
                record = reader.peek(timeout_s=20)
            except RingClosedError:
                break
            frame = parse_frame(record.body)
            for k in range(frame.items.shape[0]):
                assert frame.items["seq"][k] == seen
                assert np.array_equal(frame.item_tokens(k), tokens_of(seen, int(frame.items["length"][k])))
                seen += 1
            reader.release(record.end)
    finally:
        child.join(30)
        reader.close()
        reader.unlink()
    assert child.exitcode == 0
    assert seen >= 20_000


# --- bad input: a typed error, and nothing written ----------------------------------------

BAD_SUBMITS = [
    (dict(tokens=np.array([], dtype=np.int32)), TokenArrayError, "empty"),
    (dict(tokens=np.array([1.0, 2.0])), TokenArrayError, "integers"),
    (dict(tokens=np.array(["a", "b"])), TokenArrayError, "integers"),
    (dict(tokens=np.array([[1, 2]], dtype=np.int32)), TokenArrayError, "one-dimensional"),
    (dict(tokens=np.array([1, 1 << 31])), TokenArrayError, "outside int32"),
    (dict(tokens=np.array([-(1 << 31) - 1, 0])), TokenArrayError, "outside int32"),
    (dict(tokens=np.ones(1001, dtype=np.int32)), ItemTooLongError, "limit 1000"),
    (dict(payload=b"x" * 101), PayloadTooLargeError, "limit 100"),
    (dict(payload="text"), BadInputError, "bytes"),
    (dict(model=4), ModelIdError, "outside"),
    (dict(model=-1), ModelIdError, "outside"),
    (dict(model=1.0), ModelIdError, "integer"),
    (dict(model=True), ModelIdError, "integer"),
    (dict(signature=-1), SignatureError, "unsigned 64-bit"),
    (dict(signature=1 << 64), SignatureError, "unsigned 64-bit"),
    (dict(signature=3.5), SignatureError, "integer"),
    (dict(prefix_len=5), BadInputError, "prefix_len"),
    (dict(prefix_len=-1), BadInputError, "prefix_len"),
]


@pytest.mark.parametrize("change, error, match", BAD_SUBMITS, ids=[f"{e.__name__}-{m}" for _, e, m in BAD_SUBMITS])
def test_bad_single_submit_is_refused_and_writes_nothing(pair, change, error, match):
    producer, reader = pair
    args = dict(model=1, signature=SIG, tokens=np.arange(4, dtype=np.int32), prefix_len=0, payload=b"")
    args.update(change)
    before = (producer.ring.write_pos, producer.next_seq)
    with pytest.raises(error, match=match):
        producer.submit(**args)
    assert (producer.ring.write_pos, producer.next_seq) == before
    producer.submit(1, SIG, np.arange(4, dtype=np.int32))  # and the producer still works
    assert len(read_frames(reader)) == 1


BAD_BATCHES = [
    (dict(lengths=[]), BadInputError, "no items"),
    (dict(lengths=[2, 0, 2]), TokenArrayError, "item 1"),
    (dict(lengths=[2, 2, 2000]), ItemTooLongError, "item 2"),
    (dict(lengths=[2.0, 2.0, 2.0]), BadInputError, "integer"),
    (dict(lengths=[2, 2, 3]), TokenArrayError, "sum to 7"),
    (dict(tokens=np.ones(6)), TokenArrayError, "integers"),
    (dict(model=np.array([0, 1, 9])), ModelIdError, "outside"),
    (dict(model=np.array([0, 1])), BadInputError, "2 values for 3 items"),
    (dict(signature=np.array([1, 2])), SignatureError, "3 integers"),
    (dict(signature=np.array([1, -2, 3])), SignatureError, "negative"),
    (dict(prefix_len=3), BadInputError, "prefix_len"),
    (dict(payloads=[b"a", b"b"]), BadInputError, "2 payloads for 3 items"),
    (dict(payloads=[b"a", b"b" * 101, b"c"]), PayloadTooLargeError, "item 1"),
    (dict(payloads=[b"a", "b", b"c"]), BadInputError, "bytes"),
]


@pytest.mark.parametrize("change, error, match", BAD_BATCHES, ids=[f"{e.__name__}-{m}" for _, e, m in BAD_BATCHES])
def test_bad_batch_is_refused_and_writes_nothing(pair, change, error, match):
    producer, reader = pair
    args = dict(model=0, signature=SIG, tokens=np.arange(6, dtype=np.int32), lengths=[2, 2, 2])
    args.update(change)
    before = (producer.ring.write_pos, producer.next_seq)
    with pytest.raises(error, match=match):
        producer.submit_many(**args)
    assert (producer.ring.write_pos, producer.next_seq) == before
    assert read_frames(reader) == []


def test_submit_to_a_closed_ring(shm_name):
    producer = Producer.create(shm_name(), producer_id=1, capacity_bytes=1 << 16, limits=SMALL)
    ring = producer.ring
    ring.close()
    with pytest.raises(RingClosedError):
        ring.write(b"x")
    producer.ring.unlink()


def test_submit_after_producer_close(shm_name):
    producer = Producer.create(shm_name(), producer_id=1, capacity_bytes=1 << 16, limits=SMALL)
    producer.close()
    with pytest.raises(RingClosedError):
        producer.submit(0, SIG, np.ones(3, dtype=np.int32))
    producer.unlink()


def test_stale_ring_with_another_layout_is_refused(shm_name):
    name = shm_name()
    mapping, _ = create_shared_memory(name, HEADER_SIZE_BYTES + (1 << 16))
    mapping[:8] = b"OLDRING0"
    mapping.close()
    try:
        with pytest.raises(StaleObjectError, match="magic"):
            Producer.create(name, producer_id=1, capacity_bytes=1 << 16, reattach=True)
    finally:
        RingWriter.unlink_leftover(name)


def test_ring_too_small_for_the_largest_item_is_a_config_error(shm_name):
    with pytest.raises(ValueError, match="cannot hold the largest item"):
        Producer.create(shm_name(), producer_id=1, capacity_bytes=1 << 16)  # default limits: 1 MiB items


def test_batch_that_times_out_midway_says_how_many_went_in(shm_name):
    limits = ProducerLimits(max_item_tokens=1000, max_payload_bytes=0, frame_items=2)
    producer = Producer.create(shm_name(), producer_id=1, capacity_bytes=1 << 14, limits=limits)
    try:
        lengths = [900] * 6  # three frames of 2 x 3,600 bytes; a 16 KiB ring holds two
        with pytest.raises(RingTimeoutError) as caught:
            producer.submit_many(0, SIG, np.zeros(5400, dtype=np.int32), lengths, timeout_s=0.05)
        assert caught.value.accepted_items == 4
        assert producer.next_seq == 4
    finally:
        producer.close()
        producer.unlink()


def test_each_frame_of_a_call_is_told_as_it_is_published(shm_name):
    """`on_frame` hears `next_seq` after every frame, before the call returns: a ledger fed
    by it counts the frames of a call cut short (here by a full ring; a kill -9 between two
    frames likewise), which a count taken when the call returns never hears of."""
    limits = ProducerLimits(max_item_tokens=1000, max_payload_bytes=0, frame_items=2)
    producer = Producer.create(shm_name(), producer_id=1, capacity_bytes=1 << 14, limits=limits)
    heard = []
    producer.on_frame = heard.append
    try:
        with pytest.raises(RingTimeoutError):
            producer.submit_many(0, SIG, np.zeros(5400, dtype=np.int32), [900] * 6, timeout_s=0.05)
        assert heard == [2, 4]  # the third frame never fitted
    finally:
        producer.close()
        producer.unlink()


def test_parse_frame_refuses_foreign_records():
    body = np.zeros(100, dtype=np.uint8)
    with pytest.raises(FrameError, match="magic"):
        parse_frame(body, where="ring x record 0")
    with pytest.raises(FrameError, match="shorter"):
        parse_frame(body[:10])


def test_parse_frame_cross_checks_sizes(pair):
    producer, reader = pair
    producer.submit_many(0, SIG, np.arange(6, dtype=np.int32), [3, 3])
    record = reader.poll()
    damaged = record.body.copy()
    damaged[32 + 36] = 4  # item 0 claims 4 tokens: the lengths no longer add up
    with pytest.raises(FrameError, match="sum to 7"):
        parse_frame(damaged)
    with pytest.raises(FrameError, match="need"):
        parse_frame(record.body[:-4])


def test_items_sharing_parameters_share_one_envelope_each_payload_its_own():
    from pipeline.producer.producer import _with_params
    from pipeline.wire.generation import GenerationParams, encode_payload

    shared, other = GenerationParams(max_tokens=16, stop=("END",)), GenerationParams(max_tokens=16, seed=3)
    params = [shared, shared, None, other, shared, None]
    payloads = [b"a", bytearray(b"b"), GENERATION_MAGIC + b"lookalike", b"", b"e", b"f"]
    made = _with_params(params, payloads, len(params))
    assert made == [encode_payload(p, bytes(q)) for p, q in zip(params, payloads)]
    assert [decode_payload(m)[1] for m in made] == [bytes(q) for q in payloads]
    assert [decode_payload(m)[0] for m in made[:2]] == [shared, shared]
