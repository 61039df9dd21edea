"""feed(): grouping into submit_many calls (by model, item count and token budget), totals,
replay timing on a fake clock, and one real run through a broker process."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.broker.peers import namespace_for
from pipeline.producer.client import BrokerProducer
from pipeline.producer.feed import FeedTotals, feed
from pipeline.producer.signature import chain, signature
from pipeline.producer.workload import WorkItem, load_workload
from pipeline.runtime.local import start_broker, stop_process
from pipeline.wire.client import broker_status

PREFIXES = [np.array([1, 2, 3], dtype=np.int32), np.array([4, 5], dtype=np.int32)]


def item(model: int = 0, suffix_tokens: int = 3, timestamp_ms: float | None = None, k: int = 0,
         shape: int = 0) -> WorkItem:
    """Item k: shape 0 has one component, shape 1 two, shape 2 none."""
    components = [PREFIXES[:1], PREFIXES, []][shape]
    suffix = np.arange(100 * k, 100 * k + suffix_tokens, dtype=np.int32)
    return WorkItem(model, list(components), suffix, f"item-{k}".encode(), timestamp_ms, k + 1)


class FakeClock:
    """A clock that moves only when slept on."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now_s += seconds


class RecordingClient:
    """Records every submit_many call (and the fake time it came at)."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock
        self.calls: list[dict] = []

    def submit_many(self, model, signature, tokens, lengths, prefix_len, payloads=None, params=None):
        self.calls.append(dict(
            at=self.clock() if self.clock else None, model=model, signatures=signature.tolist(),
            tokens=tokens.copy(), lengths=lengths.tolist(), prefix_lens=prefix_len.tolist(),
            payloads=list(payloads), params=params,
        ))
        return np.arange(len(lengths), dtype=np.uint64)

    def declare_shape(self, model, chain):
        self.declared = getattr(self, "declared", [])
        self.declared.append((model, tuple(chain)))


def payload_groups(client: RecordingClient) -> list[list[bytes]]:
    return [call["payloads"] for call in client.calls]


def test_consecutive_items_of_one_model_share_a_call_up_to_the_chunk():
    items = [item(model, k=k, shape=k % 3) for k, model in enumerate([0, 0, 1, 1, 1, 0, 0, 0])]
    client = RecordingClient()
    progress = []
    totals = feed(client, items, chunk_items=2, on_progress=lambda t: progress.append((t.items, t.calls)))
    assert [len(group) for group in payload_groups(client)] == [2, 2, 1, 2, 1]
    assert [call["model"] for call in client.calls] == [0, 1, 1, 0, 0]
    assert totals == FeedTotals(items=8, tokens=sum(i.length for i in items), calls=5)
    assert progress == [(2, 1), (4, 2), (5, 3), (7, 4), (8, 5)]
    sent = iter(items)
    for call in client.calls:  # each call carries its items exactly
        group = [next(sent) for _ in call["payloads"]]
        assert call["payloads"] == [i.payload for i in group]
        assert np.array_equal(call["tokens"], np.concatenate([i.tokens for i in group]))
        assert call["lengths"] == [i.length for i in group]
        assert call["prefix_lens"] == [i.prefix_len for i in group]
        assert call["signatures"] == [i.signature for i in group]
    assert next(sent, None) is None


def test_each_item_is_sent_with_its_shapes_signature_and_chain_known_or_not():
    items = [item(k=k, shape=k % 3) for k in range(6)]
    for known in items[3:]:  # as a chat tokenizer gives them, from its prefix
        known.known_signature = int(signature(known.components))
    client = RecordingClient()
    feed(client, items)
    expected = [int(signature(i.components)) for i in items]
    assert client.calls[0]["signatures"] == expected
    assert set(client.declared) == {(0, tuple(chain(i.components))) for i in items}
    assert all(tuple(chain(i.components))[-1] == s for i, s in zip(items, expected))


def test_token_budget_splits_calls_and_a_long_item_goes_alone():
    items = [item(k=0), item(k=1), item(k=2, suffix_tokens=20), item(k=3), item(k=4)]  # 6, 6, 23, 6, 6 tokens
    client = RecordingClient()
    totals = feed(client, items, chunk_tokens=12)
    assert [len(group) for group in payload_groups(client)] == [2, 1, 2]
    assert totals.tokens == 47 and totals.calls == 3
    client = RecordingClient()
    feed(client, items)  # the defaults: one call
    assert len(client.calls) == 1 and client.calls[0]["lengths"] == [6, 6, 23, 6, 6]


def test_replay_submits_each_item_when_due_and_groups_only_due_items():
    clock = FakeClock()
    client = RecordingClient(clock)
    stamps = [0, 0, 100, None, 100, 250, 40]
    items = [item(timestamp_ms=t, k=k) for k, t in enumerate(stamps)]
    totals = feed(client, items, replay_speed=2.0, clock=clock, sleep=clock.sleep)
    assert payload_groups(client) == [[b"item-0", b"item-1"], [b"item-2", b"item-3", b"item-4"],
                                      [b"item-5", b"item-6"]]
    assert [call["at"] for call in client.calls] == pytest.approx([1000.0, 1000.05, 1000.125])
    assert clock.sleeps == pytest.approx([0.05, 0.075])
    assert totals.items == 7


def test_without_replay_timestamps_are_ignored():
    clock = FakeClock()
    client = RecordingClient(clock)
    feed(client, [item(timestamp_ms=t, k=k) for k, t in enumerate([5000, 0, 90000])],
         clock=clock, sleep=clock.sleep)
    assert clock.sleeps == [] and payload_groups(client) == [[b"item-0", b"item-1", b"item-2"]]


@pytest.mark.parametrize("options", [dict(replay_speed=0), dict(replay_speed=-1.0),
                                     dict(replay_speed=float("inf")), dict(chunk_items=0),
                                     dict(chunk_tokens=0)])
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError):
        feed(RecordingClient(), [item()], **options)


@pytest.mark.integration
def test_a_workload_file_fed_through_a_real_broker(tmp_path):
    lines = [{"model": k % 2, "components": [[7, 8, 9], [k % 3 + 1] * 50], "suffix": list(range(k + 1)),
              "payload": f"job-{k}"} for k in range(120)]
    path = tmp_path / "work.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    workload = load_workload(path)
    data = str(tmp_path / "data")
    config = BrokerConfig(data)
    broker = start_broker(config, "disk", "process")
    try:
        producer = BrokerProducer(config.socket_path, capacity_bytes=4 << 20, timeout_s=30)
        totals = feed(producer, workload, chunk_items=16)
        producer.close(timeout_s=30)  # returns once the broker has stored everything
        counters = broker_status(config.socket_path)
    finally:
        assert stop_process(broker) == 0
    assert totals.items == len(workload) == 120 and totals.tokens == workload.total_tokens
    assert counters.items_received == 120 and counters.tokens_received == workload.total_tokens
    namespace = namespace_for(data)
    assert [name for name in os.listdir("/dev/shm") if namespace in name] == []  # nothing left behind


def test_items_generation_parameters_go_with_them_and_none_costs_nothing():
    from pipeline.wire.generation import GenerationParams

    plain = [item(0, k=k, shape=0) for k in range(3)]
    client = RecordingClient()
    feed(client, plain)
    assert client.calls[0]["params"] is None  # no item has any: nothing to envelope
    given = [item(0, k=k, shape=0) for k in range(3)]
    given[1].params = GenerationParams(max_tokens=5)
    client = RecordingClient()
    feed(client, given)
    assert client.calls[0]["params"] == [None, GenerationParams(max_tokens=5), None]
