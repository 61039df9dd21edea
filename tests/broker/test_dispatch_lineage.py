"""Shape lineage end to end through the real code: a Producer declares chains (once per
shape per connection), its frames carry them, the Dispatcher's prefix order drains a shape's
extensions before a bigger stranger; most-tokens order does not; a bad chain section is a
FrameError naming its byte."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.broker.dispatch import Dispatcher
from pipeline.broker.ids import ConsumerId
from pipeline.broker.packing import Contract
from pipeline.storage import DiskTier
from pipeline.producer.producer import MAX_DECLARED_SHAPES, Producer, ProducerLimits
from pipeline.producer.signature import chain, signature
from pipeline.wire.errors import FrameError
from pipeline.wire.layouts.frames import MAX_CHAIN_DEPTH, decode_chains, encode_chains, parse_frame
from shm.ring import RingReader

SYSTEM, FEWSHOT, OTHER = (np.arange(k, k + 64, dtype=np.int32) for k in (0, 1000, 5000))
CONTRACT = Contract(model=0, max_batch_items=8, max_batch_tokens=1 << 20, max_input_len=1 << 16)


@pytest.fixture
def pair(shm_name):
    producer = Producer.create(shm_name(), producer_id=3, capacity_bytes=1 << 20,
                               limits=ProducerLimits(max_item_tokens=4096), timeout_s=1.0)
    reader = RingReader.attach(producer.ring.name)
    yield producer, reader
    reader.close()
    producer.close()
    producer.unlink()


def frames(reader: RingReader) -> list:
    got = []
    while (record := reader.poll()) is not None:
        got.append(parse_frame(record.body, where=f"record at {record.start}"))
        reader.release(record.end)
    return got


def submit_shape(producer: Producer, components: list[np.ndarray], items: int, suffix: int) -> int:
    sig = signature(components)
    producer.declare_shape(0, chain(components))
    prompt = np.concatenate([*components, np.full(suffix, 7, dtype=np.int32)])
    for _ in range(items):
        producer.submit(0, sig, prompt, sum(len(c) for c in components))
    return sig


def test_chains_go_once_per_shape_in_the_next_frame(pair):
    producer, reader = pair
    producer.declare_shape(0, chain([SYSTEM]))
    producer.declare_shape(0, chain([SYSTEM]))  # again: nothing new
    producer.declare_shape(0, chain([SYSTEM, FEWSHOT]))
    producer.submit(0, signature([SYSTEM]), SYSTEM, 64)
    producer.submit(0, signature([SYSTEM]), SYSTEM, 64)
    first, second = frames(reader)
    assert decode_chains(first.chain_section) == [(0, chain([SYSTEM])), (0, chain([SYSTEM, FEWSHOT]))]
    assert second.chain_section.size == 0 and first.item_tokens(0).tolist() == SYSTEM.tolist()
    producer.forget_declared_shapes()  # a new broker connection: declared again, once
    producer.declare_shape(0, chain([SYSTEM]))
    producer.submit_many(0, signature([SYSTEM]), np.concatenate([SYSTEM, SYSTEM]), [64, 64], 64)
    (third,) = frames(reader)
    assert decode_chains(third.chain_section) == [(0, chain([SYSTEM]))] and third.items.shape[0] == 2
    assert chain([SYSTEM, FEWSHOT])[-1] == signature([SYSTEM, FEWSHOT])


def test_a_deep_chain_keeps_its_first_levels_and_its_own_signature(pair):
    producer, reader = pair
    deep = tuple(range(1, MAX_CHAIN_DEPTH + 11))
    producer.declare_shape(0, deep)
    producer.submit(0, deep[-1], SYSTEM, 0)
    ((model, sent),) = decode_chains(frames(reader)[0].chain_section)
    assert sent == deep[:MAX_CHAIN_DEPTH - 1] + deep[-1:]


@pytest.mark.parametrize("cut", [1, 9, 17])
def test_a_chain_section_cut_short_is_named(cut):
    raw = np.frombuffer(encode_chains([(0, (5, 6))]), dtype=np.uint8)
    with pytest.raises(FrameError, match="byte 0"):
        decode_chains(raw[:-cut] if cut < raw.size else raw[:1])


@pytest.mark.parametrize("order, after_system", [("prefix", "fewshot"), ("most-tokens", "other")])
def test_the_prefix_order_drains_the_extensions_of_a_shape_first(tmp_path, pair, order, after_system):
    producer, reader = pair
    sigs = {"system": submit_shape(producer, [SYSTEM], items=8, suffix=900),  # the most tokens: first
            "other": submit_shape(producer, [OTHER], items=8, suffix=600),
            "fewshot": submit_shape(producer, [SYSTEM, FEWSHOT], items=8, suffix=10)}
    tier = DiskTier.open(str(tmp_path / "store"))
    try:
        dispatcher = Dispatcher(tier, shape_order=order)
        dispatcher.recover(0.0)
        for frame in frames(reader):
            dispatcher.ingest(frame, 0.0)
        dispatcher.flush()
        served = []
        while (batch := dispatcher.next_batch(ConsumerId(0), CONTRACT, 0.0)) is not None:
            dispatcher.commit(batch)
            if not served or served[-1] != batch.lane.signature:
                served.append(batch.lane.signature)
        names = {v: k for k, v in sigs.items()}
        order_served = [names[s] for s in served]
        assert order_served[0] == "system" and order_served[1] == after_system, order_served
        dispatcher.check_invariants()
    finally:
        tier.close()


def test_a_producer_remembers_its_latest_declarations_and_forgets_older_ones(shm_name):
    """Two generations of MAX_DECLARED_SHAPES: a shape declared lately goes once; one that
    fell out of both goes again (the broker takes it as the same declaration)."""
    producer = Producer.create(shm_name(), producer_id=4, capacity_bytes=8 << 20,
                               limits=ProducerLimits(max_item_tokens=4096), timeout_s=1.0)
    reader = RingReader.attach(producer.ring.name)
    try:
        def declared(shapes) -> list[int]:
            for shape in shapes:
                producer.declare_shape(0, (shape,))
            producer.submit(0, 1, SYSTEM, 0)
            return [sent[-1] for _model, sent in decode_chains(frames(reader)[0].chain_section)]

        limit = MAX_DECLARED_SHAPES
        assert declared(range(1, limit + 1)) == list(range(1, limit + 1))  # the first generation fills
        assert declared([1, limit]) == []  # the generation before: remembered, 1 now a recent one
        assert declared(range(limit + 1, 2 * limit)) == list(range(limit + 1, 2 * limit))
        assert declared([2, 1, 2 * limit - 1]) == [2]  # 2 fell out of both; 1 did not
    finally:
        reader.close()
        producer.close()
        producer.unlink()
