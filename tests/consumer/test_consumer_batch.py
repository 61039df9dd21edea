"""A consumer runs one batch from a descriptor: results written as JSON lines, too-long items
returned empty, the summary it reports."""

from __future__ import annotations

import base64
import json

import numpy as np

from pipeline.storage.segment import scan_segment
from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.engines import Engine, EngineBatch, EngineCounters, EngineResult
from pipeline.consumer.process import CORRUPT_KEY, Consumer
from pipeline.consumer.reader import SegmentReader
from pipeline.wire.layouts.descriptors import (
    DESCRIPTOR_ITEM_DTYPE,
    descriptor_size_bytes,
    parse_descriptor,
    write_descriptor,
)
from pipeline.wire.owners import OWNED_PAYLOAD_MAGIC, EndedOwners, add_ended_owner
from pipeline.wire.status import ConsumerWork
from tests.support.segments import SIG, store


def test_run_batch_writes_a_parseable_line_per_item(tmp_path):
    path, (items, tokens, starts, payloads, pstarts), segment = store(str(tmp_path), 0, 6, 9)
    offsets = scan_segment(path).offsets
    rows = np.zeros(6, dtype=DESCRIPTOR_ITEM_DTYPE)
    rows["lane"], rows["segment_seq"] = 0, 0
    rows["offset"], rows["length"], rows["item_id"] = offsets, items["length"], items["item_id"]
    buf = np.zeros(descriptor_size_bytes(6), dtype=np.uint8)
    write_descriptor(buf, 0, batch_id=7, signature=SIG, model=2, pad_to_tokens=400, dispatch_ns=5, items=rows)
    limit = int(np.sort(items["length"])[3])  # a few items are longer than the contract allows
    config = ConsumerConfig("unused.sock", str(tmp_path / "results"), "gpu0", model=2, max_input_len=limit)
    consumer = Consumer(config)
    consumer._reader = SegmentReader(str(tmp_path))
    summary = consumer.run_batch(parse_descriptor(buf))
    consumer._results.close()
    lines = [json.loads(line) for line in open(consumer.results_path)]
    assert [row["item_id"] for row in sorted(lines, key=lambda r: r["item_id"])] == sorted(items["item_id"].tolist())
    too_long = {int(i) for i, n in zip(items["item_id"], items["length"]) if n > limit}
    for row in lines:
        k = int(np.flatnonzero(items["item_id"] == row["item_id"])[0])
        assert row["batch_id"] == 7 and row["pad_to_tokens"] == 400
        assert base64.b64decode(row["payload"]) == payloads[pstarts[k]:pstarts[k + 1]].tobytes()
        assert row["prompt_tokens"] == int(items["length"][k])
        if row["item_id"] in too_long:
            assert row["status"] == "too_long" and row["output"] == [] and row["output_tokens"] == 0
        else:
            assert row["status"] == "ok" and len(row["output"]) == row["output_tokens"] > 0
    assert summary["items_too_long"] == len(too_long) and summary["items_ok"] == 6 - len(too_long)
    assert summary["prompt_tokens"] == sum(int(n) for n in items["length"] if n <= limit)
    # The engine's busy time for the batch, as it counted it (one batch: its whole total).
    assert summary["busy_ns"] == consumer.engine.counters.busy_ns > 0
    # What it sends in `complete` (the corrupt ids apart) is exactly the status record's counters.
    assert summary.pop(CORRUPT_KEY) == []
    assert ConsumerWork.from_results(summary).items_ok == 6 - len(too_long)
    consumer._reader.close()
    segment.close()


def test_the_items_of_an_ended_owner_are_answered_cancelled_without_running(tmp_path):
    ended_job, live_job = 0xAAAA, 0xBBBB
    owners = [ended_job, live_job, ended_job, live_job, live_job, ended_job]
    payloads = [OWNED_PAYLOAD_MAGIC + bytes(4) + owner.to_bytes(8, "little") + b"rest" for owner in owners]
    path, (items, *_rest), segment = store(str(tmp_path), 0, 6, 9, payloads=payloads)
    rows = np.zeros(6, dtype=DESCRIPTOR_ITEM_DTYPE)
    rows["offset"], rows["length"], rows["item_id"] = scan_segment(path).offsets, items["length"], items["item_id"]
    buf = np.zeros(descriptor_size_bytes(6), dtype=np.uint8)
    write_descriptor(buf, 0, batch_id=7, signature=SIG, model=2, pad_to_tokens=400, dispatch_ns=5, items=rows)
    add_ended_owner(str(tmp_path), ended_job)
    consumer = Consumer(ConsumerConfig("unused.sock", str(tmp_path / "results"), "gpu0", model=2))
    consumer._reader, consumer._ended = SegmentReader(str(tmp_path)), EndedOwners(str(tmp_path))
    summary = consumer.run_batch(parse_descriptor(buf))
    consumer._results.close()
    by_id = {row["item_id"]: row for row in map(json.loads, open(consumer.results_path))}
    for k, owner in enumerate(owners):
        row = by_id[int(items["item_id"][k])]
        assert base64.b64decode(row["payload"]) == payloads[k]  # the job still finds its item by payload
        if owner == ended_job:
            assert (row["status"], row["output"], row["output_tokens"]) == ("cancelled", [], 0)
        else:
            assert row["status"] == "ok" and row["output_tokens"] > 0
    assert (summary["items_cancelled"], summary["items_ok"]) == (3, 3)
    assert summary["prompt_tokens"] == sum(int(n) for n, o in zip(items["length"], owners) if o == live_job)
    assert consumer.counters.items_cancelled == 3
    consumer._reader.close()
    segment.close()


def test_consumer_pins_its_gpu(tmp_path, monkeypatch):
    # setenv, not delenv: delenv of an unset name records nothing to undo, and the variable
    # the consumer sets would leak into later tests (a launch would then see one GPU).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    consumer = Consumer(ConsumerConfig("unused.sock", str(tmp_path), "gpu3", gpu="3"))
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    consumer._results.close()


def test_result_lines_of_outputs_of_any_width_parse_as_json():
    from pipeline.consumer.results import STATUS_OK, STATUS_TOO_LONG, result_lines
    from pipeline.wire.layouts.descriptors import Descriptor

    d = Descriptor(batch_id=3, signature=SIG, model=0, pad_to_tokens=16, dispatch_ns=9, items=np.zeros(0))
    ids, submits, lengths, payloads = [1, 2], [5, 6], [10, 12], [b"", b"x%y"]
    for outputs in ([[7, 8], [9, 10]], [[7], [8, 9, 10]], [[], []]):
        text = result_lines(d, STATUS_OK, ids, submits, lengths, [0, 4], outputs, payloads)
        rows = [json.loads(line) for line in text.split("\n")]
        assert [r["output"] for r in rows] == outputs
        assert [r["output_tokens"] for r in rows] == [len(o) for o in outputs]
        assert [r["item_id"] for r in rows] == [1, 2] and [r["cached_tokens"] for r in rows] == [0, 4]
        assert [base64.b64decode(r["payload"]) for r in rows] == [b"", b"x%y"]
        assert [r["submit_ns"] for r in rows] == submits and {r["batch_id"] for r in rows} == {3}
    text = result_lines(d, STATUS_OK, ids, submits, lengths, [0, 4], [[1], [2]], [b"", b""])
    assert all(json.loads(line)["payload"] == "" for line in text.split("\n"))
    assert all(json.loads(line)["prompt_xxh3"] is None for line in text.split("\n"))  # nothing read
    long = json.loads(result_lines(d, STATUS_TOO_LONG, [7], [8], [9000], [0], [[]], [b"p"], digests=[2**64 - 1]))
    assert (long["status"], long["output"], long["prompt_tokens"], long["payload"]) == ("too_long", [], 9000, "cA==")
    assert long["prompt_xxh3"] == 2**64 - 1
    assert list(long) == ["item_id", "batch_id", "dispatch_ns", "submit_ns", "done_ns", "pad_to_tokens", "status",
                          "prompt_tokens", "prompt_xxh3", "cached_tokens", "output_tokens", "output", "finish_reason",
                          "payload"]
    assert long["finish_reason"] is None
    assert result_lines(d, STATUS_OK, [], [], [], [], [], []) == ""


def test_result_lines_carry_finish_reasons_and_texts_escaped():
    from pipeline.consumer.results import STATUS_OK, result_lines
    from pipeline.wire.layouts.descriptors import Descriptor

    d = Descriptor(batch_id=3, signature=SIG, model=0, pad_to_tokens=16, dispatch_ns=9, items=np.zeros(0))
    # One reason for all, no text: the one-format fast path.
    rows = [json.loads(line) for line in result_lines(d, STATUS_OK, [1, 2], [5, 6], [10, 12], [0, 4], [[7], [8]],
                                                      [b"", b""], ["length", "length"]).split("\n")]
    assert [r["finish_reason"] for r in rows] == ["length", "length"] and "text" not in rows[0]
    texts = ['a "quoted"\n%s %d', "\u00e9\u4e2d\U0001f600"]
    raw = result_lines(d, STATUS_OK, [1, 2], [5, 6], [10, 12], [0, 4], [[7], [8, 9]], [b"", b"p%"], ["stop", "length"],
                       texts)
    assert raw.isascii()
    rows = [json.loads(line) for line in raw.split("\n")]
    assert [r["finish_reason"] for r in rows] == ["stop", "length"] and [r["text"] for r in rows] == texts
    assert list(rows[0])[-3:] == ["finish_reason", "text", "payload"]
    assert [r["output"] for r in rows] == [[7], [8, 9]] and base64.b64decode(rows[1]["payload"]) == b"p%"


class _FailsSome(Engine):
    """An engine that fails every other prompt, with a message that needs JSON escaping."""

    name = "fails-some"

    def run(self, batch: EngineBatch) -> EngineResult:
        count = len(batch.prompts)
        errors = [None if i % 2 else f'prompt {i} too "long"\n\u00e9' for i in range(count)]
        counted = EngineCounters(prompt_tokens=sum(len(p) for i, p in enumerate(batch.prompts) if i % 2))
        self.counters.add(counted)
        return EngineResult([[i] if i % 2 else [] for i in range(count)], [0] * count, ["stop"] * count, counted,
                            errors=errors)


def test_an_engine_error_on_some_items_is_their_result_with_the_message(tmp_path):
    path, (items, *_), segment = store(str(tmp_path), 0, 6, 9)
    rows = np.zeros(6, dtype=DESCRIPTOR_ITEM_DTYPE)
    rows["offset"], rows["length"], rows["item_id"] = scan_segment(path).offsets, items["length"], items["item_id"]
    buf = np.zeros(descriptor_size_bytes(6), dtype=np.uint8)
    write_descriptor(buf, 0, batch_id=8, signature=SIG, model=2, pad_to_tokens=400, dispatch_ns=5, items=rows)
    consumer = Consumer(ConsumerConfig("unused.sock", str(tmp_path / "results"), "gpu0", model=2), engine=_FailsSome())
    consumer._reader = SegmentReader(str(tmp_path))
    summary = consumer.run_batch(parse_descriptor(buf))
    consumer._results.close()
    raw = open(consumer.results_path, "rb").read()
    assert raw.isascii()
    lines = {row["item_id"]: row for row in map(json.loads, raw.decode().splitlines())}
    assert len(lines) == 6
    for k, item in enumerate(items["item_id"].tolist()):
        row = lines[item]
        if k % 2:
            assert row["status"] == "ok" and row["output"] == [k] and "error" not in row
        else:
            assert row["status"] == "error" and row["output"] == [] and row["cached_tokens"] == 0
            assert row["error"] == f'prompt {k} too "long"\n\u00e9'
            assert row["prompt_tokens"] == int(items["length"][k]) and row["batch_id"] == 8
    assert summary["items_ok"] == 3 and summary["items_error"] == 3
    summary.pop(CORRUPT_KEY)
    assert ConsumerWork.from_results(summary).items_error == 3 and consumer.counters.items_error == 3
    # The accounting reads error lines as results like any other, by status.
    from pipeline.reporting.accounting import summarize_results

    assert summarize_results(str(tmp_path / "results")).by_status == {"ok": 3, "error": 3}
    consumer._reader.close()
    segment.close()


def test_a_finish_reason_out_of_the_ordinary_still_makes_a_json_line():
    from pipeline.consumer.results import STATUS_OK, result_lines
    from pipeline.wire.layouts.descriptors import Descriptor

    d = Descriptor(batch_id=1, signature=SIG, model=0, pad_to_tokens=8, dispatch_ns=1, items=np.zeros(0))
    raw = result_lines(d, STATUS_OK, [1], [2], [3], [0], [[5]], [b""], ['abort "by" user\u00e9'])
    assert raw.isascii() and json.loads(raw)["finish_reason"] == 'abort "by" user\u00e9'


def test_result_lines_carry_every_sample_of_an_item_that_asked_for_several_or_for_logprobs():
    from pipeline.consumer.engines.base import Sample
    from pipeline.consumer.results import STATUS_OK, result_lines
    from pipeline.wire.layouts.descriptors import Descriptor

    d = Descriptor(batch_id=3, signature=SIG, model=0, pad_to_tokens=16, dispatch_ns=9, items=np.zeros(0))
    two = [Sample([7, 8], "stop", "a\u00e9"), Sample([9], "length", None, [[(9, -0.5, "x"), (4, -1.25, None)]])]
    text = result_lines(d, STATUS_OK, [1, 2], [5, 6], [10, 12], [0, 4], [[7, 8], [3]], [b"p", b""], ["stop", "length"],
                        ["a\u00e9", "zz"], [11, 12], [two, None])
    assert text.isascii()
    rows = {row["item_id"]: row for row in map(json.loads, text.split("\n"))}
    plain, sampled = rows[2], rows[1]
    assert "samples" not in plain and plain["text"] == "zz" and plain["output_tokens"] == 1
    assert sampled["output"] == [7, 8] and sampled["finish_reason"] == "stop" and sampled["text"] == "a\u00e9"
    assert sampled["output_tokens"] == 3  # every sample's tokens: the usage of all n completions
    assert sampled["samples"] == [{"output": [7, 8], "finish_reason": "stop", "text": "a\u00e9"},
                                  {"output": [9], "finish_reason": "length", "logprobs": [[[9, -0.5, "x"],
                                                                                           [4, -1.25, None]]]}]
    assert list(sampled) == ["item_id", "batch_id", "dispatch_ns", "submit_ns", "done_ns", "pad_to_tokens", "status",
                             "prompt_tokens", "prompt_xxh3", "cached_tokens", "output_tokens", "output",
                             "finish_reason", "text", "samples", "payload"]
    assert base64.b64decode(sampled["payload"]) == b"p" and sampled["prompt_xxh3"] == 11


def test_result_lines_carry_each_inputs_embedding_as_base64_of_little_endian_float32():
    from pipeline.consumer.results import STATUS_OK, result_lines
    from pipeline.wire.layouts.descriptors import Descriptor

    d = Descriptor(batch_id=3, signature=SIG, model=0, pad_to_tokens=16, dispatch_ns=9, items=np.zeros(0))
    vectors = [np.array([0.25, -1.5], dtype=np.float32), np.array([3.0, 0.5], dtype=np.float32)]
    raw = result_lines(d, STATUS_OK, [1, 2], [5, 6], [10, 12], [0, 4], [[], [8, 9]], [b"", b"p"], ["stop", "length"],
                       embeddings=[vectors, None])
    rows = {r["item_id"]: r for r in map(json.loads, raw.split("\n"))}
    decoded = [np.frombuffer(base64.b64decode(e), dtype="<f4") for e in rows[1]["embeddings"]]
    assert all(np.array_equal(x, v) for x, v in zip(decoded, vectors)) and len(decoded) == 2
    assert rows[1]["output"] == [] and rows[1]["output_tokens"] == 0 and "samples" not in rows[1]
    assert "embeddings" not in rows[2] and rows[2]["output"] == [8, 9]
    assert list(rows[1])[-2:] == ["embeddings", "payload"]
