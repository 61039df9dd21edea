"""A batch runs in slices by the answers its items may hold: the cut against a reference,
each item's share, and a consumer writing each slice's lines as it ends, the batch
completed once with every slice's counts."""

from __future__ import annotations

import json
import os

import numpy as np

from pipeline.storage.diskio import Durability
from pipeline.storage.paths import make_dirs, segment_path
from pipeline.storage.segment import SegmentFile, SegmentKeys, encode_entries, scan_segment
from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.engines import Engine, EngineCounters, EngineResult
from pipeline.consumer.process import CORRUPT_KEY, Consumer
from pipeline.consumer.reader import SegmentReader
from pipeline.consumer.slices import MAX_SLICE_ANSWER_TOKENS, answer_tokens, cut_slices
from pipeline.wire.generation import GenerationParams, encode_payload
from pipeline.wire.layouts.descriptors import (
    DESCRIPTOR_ITEM_DTYPE,
    descriptor_size_bytes,
    parse_descriptor,
    write_descriptor,
)
from tests.support.segments import SIG, data_dir_of, make_items, shared_log
from tests.support.sessions import FakeSession


def _reference_cut(weights: list[int], budget: int) -> list[range]:
    """The first slice is the longest run from the start whose weights sum to at most the
    budget (at least one item); the rest is cut the same way."""
    slices, start = [], 0
    while start < len(weights):
        end = start + 1
        while end < len(weights) and sum(weights[start:end + 1]) <= budget:
            end += 1
        slices.append(range(start, end))
        start = end
    return slices


def test_cut_slices_matches_the_reference_on_random_batches():
    rng = np.random.default_rng(11)
    for _ in range(2_000):
        count = int(rng.integers(0, 70))
        budget = int(rng.integers(1, 200))
        weights = rng.integers(0, 2 * budget, count).tolist() if rng.random() < 0.3 else \
            rng.integers(0, budget // 4 + 2, count).tolist()
        got = cut_slices(weights, budget)
        assert got == _reference_cut(weights, budget), (weights, budget)
        assert [i for s in got for i in s] == list(range(count))
        assert all(len(s) == 1 or sum(weights[i] for i in s) <= budget for s in got)


def test_a_slice_holds_exactly_its_budget_and_one_token_more_starts_another():
    assert cut_slices([3, 3], 6) == [range(0, 2)]
    assert cut_slices([3, 4], 6) == [range(0, 1), range(1, 2)]
    assert cut_slices([7], 6) == [range(0, 1)]  # an item past the budget runs alone
    assert cut_slices([], 6) == []


def test_an_items_share_is_what_it_may_generate():
    assert answer_tokens(None, 8192) == 8192
    assert answer_tokens(GenerationParams(), 100) == 100
    assert answer_tokens(GenerationParams(max_tokens=16, n=4), 100) == 64
    assert answer_tokens(GenerationParams(max_tokens=16, logprobs=0), 100) == 32  # each token's own entry
    assert answer_tokens(GenerationParams(max_tokens=16, n=2, logprobs=5), 100) == 16 * 2 * 7
    assert answer_tokens(GenerationParams(embed=True, input_lengths=(3,)), 100) == 0


class _Counting(Engine):
    """One token per prompt; records, for each run, its prompts and the result lines
    already in the consumer's results file when it started."""

    name = "counting"

    def __init__(self, results_path: str) -> None:
        super().__init__()
        self.results_path = results_path
        self.runs: list[tuple[int, int]] = []

    def run(self, batch):
        written = sum(1 for _ in open(self.results_path)) if os.path.exists(self.results_path) else 0
        self.runs.append((len(batch.prompts), written))
        n = len(batch.prompts)
        counted = EngineCounters(batches=1, prompts=n, prompt_tokens=sum(map(len, batch.prompts)), output_tokens=n)
        return EngineResult([[7]] * n, [0] * n, ["length"] * n, counted)


def _batch_of(tmp_path, params: list[GenerationParams | None]) -> tuple[np.ndarray, np.ndarray, SegmentFile]:
    """A descriptor of one batch whose items carry `params`, and its items' headers."""
    items, tokens, token_starts, _, _ = make_items(len(params), seed=4)
    own = [encode_payload(p, b"own-%d" % i) for i, p in enumerate(params)]
    items["payload_len"] = [len(p) for p in own]
    payload_starts = np.concatenate([[0], np.cumsum(items["payload_len"])]).astype(np.int64)
    payloads = np.frombuffer(b"".join(own), dtype=np.uint8).copy()
    path = segment_path(str(tmp_path), 2, SIG, 0, 0)
    make_dirs(os.path.dirname(path))
    segment = SegmentFile.create(path, SegmentKeys(2, SIG, 0, 0), Durability.PROCESS, shared_log(data_dir_of(path)))
    segment.append(encode_entries(items, tokens, token_starts, payloads, payload_starts,
                                  indices=np.arange(len(params)), producer_id=1))
    rows = np.zeros(len(params), dtype=DESCRIPTOR_ITEM_DTYPE)
    rows["offset"], rows["length"], rows["item_id"] = scan_segment(path).offsets, items["length"], items["item_id"]
    buf = np.zeros(descriptor_size_bytes(len(params)), dtype=np.uint8)
    write_descriptor(buf, 0, batch_id=9, signature=SIG, model=2, pad_to_tokens=512, dispatch_ns=1, items=rows)
    return buf, items, segment


def _run_one(tmp_path, params: list[GenerationParams | None], max_input_len: int) -> tuple[Consumer, dict, np.ndarray]:
    """A consumer with a _Counting engine runs one batch of items asking `params`: the
    consumer, its summary, the items' headers."""
    buf, items, segment = _batch_of(tmp_path, params)
    results = str(tmp_path / "results")
    config = ConsumerConfig("unused.sock", results, "c0", model=2, max_input_len=max_input_len)
    consumer = Consumer(config, engine=_Counting(os.path.join(results, "c0.jsonl")))
    consumer._reader = SegmentReader(str(tmp_path))
    summary = consumer.run_batch(parse_descriptor(buf))
    consumer._results.close()
    consumer._reader.close()
    segment.close()
    return consumer, summary, items


def test_a_batch_asking_for_more_answer_than_a_slice_holds_is_written_slice_by_slice(tmp_path):
    largest = GenerationParams(max_tokens=8192, n=128)  # 1 Mi tokens: four fill a slice
    per_slice = MAX_SLICE_ANSWER_TOKENS // answer_tokens(largest, 0)
    assert per_slice == 4
    params = [largest] * (per_slice + 2) + [None]  # the last names no max_tokens: max_input_len
    consumer, summary, items = _run_one(tmp_path, params, 3 << 20)
    # Each slice's lines are in the file before the next slice runs.
    assert consumer.engine.runs == [(4, 0), (2, 4), (1, 6)]
    rows = [json.loads(line) for line in open(consumer.results_path)]
    assert sorted(r["item_id"] for r in rows) == sorted(items["item_id"].tolist())
    assert all(r["status"] == "ok" and r["output"] == [7] for r in rows)
    assert summary["items_ok"] == 7 and summary.pop(CORRUPT_KEY) == []
    assert summary["prompt_tokens"] == int(items["length"].sum()) and summary["output_tokens"] == 7


def test_a_batch_of_ordinary_requests_is_one_run(tmp_path):
    consumer, summary, _ = _run_one(tmp_path, [GenerationParams(max_tokens=32_768)] * 64, 1 << 20)
    assert consumer.engine.runs == [(64, 0)] and summary["items_ok"] == 64


class _OneAtATime(_Counting):
    """A pipelined engine of one slice at a time, finished on the next poll."""

    def __init__(self, results_path: str) -> None:
        super().__init__(results_path)
        self.held: list[tuple[int, EngineResult]] = []

    def submit(self, key, batch):
        self.held.append((key, self.run(batch)))

    def wants_more(self):
        return not self.held

    def poll(self):
        done, self.held = self.held, []
        return done

    def abort(self):
        dropped, self.held = [key for key, _ in self.held], []
        return dropped


def test_the_serving_loop_writes_each_slice_as_it_ends_and_completes_the_batch_once(tmp_path):
    params = [GenerationParams(max_tokens=8192, n=128)] * 6
    buf, items, segment = _batch_of(tmp_path, params)
    results = str(tmp_path / "results")
    config = ConsumerConfig("unused.sock", results, "c0", model=2, max_input_len=1 << 20)
    consumer = Consumer(config, engine=_OneAtATime(os.path.join(results, "c0.jsonl")))
    consumer._reader = SegmentReader(str(tmp_path))
    # A session that ends after the first slice: its batch is not completed, the slice
    # waiting is dropped with the session (the broker hands the batch out again).
    first = FakeSession(str(tmp_path), [buf.tobytes()], [])
    turns = iter(range(100))
    consumer._serve(first, lambda: next(turns) >= 1)
    assert consumer.engine.runs == [(4, 0)] and first.events == [] and not consumer._waiting
    assert [m["type"] for m in first.sent] == ["request_work", "goodbye"]
    # Redelivered: every slice runs again, and the batch completes once.
    again = FakeSession(str(tmp_path), [buf.tobytes()], [])
    consumer._serve(again, lambda: again.events != [])
    consumer._results.close()
    consumer._reader.close()
    segment.close()
    assert consumer.engine.runs == [(4, 0), (4, 4), (2, 8)]
    assert again.events == [("complete", 9)]
    done = next(m for m in again.sent if m["type"] == "complete")
    assert done["results"]["items_ok"] == 6 and done["results"]["output_tokens"] == 6
    rows = [json.loads(line) for line in open(consumer.results_path)]
    ids = sorted(items["item_id"].tolist())
    assert sorted({r["item_id"] for r in rows}) == ids and len(rows) == 10  # the first slice's four again
