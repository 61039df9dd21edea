"""pipeline.batchjob.workload: the producers' side of a job. Shares cover every request to
submit once and are balanced; a producer reads its lines by offset exactly as the scan
counted them; every request either becomes its item (its payload naming the job and the
line) or is answered by the producer, naming why."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash

from pipeline.batchjob import layout
from pipeline.batchjob.layout import decode_job_payload
from pipeline.batchjob.manifest import JobManifest
from pipeline.batchjob.params import COMPLETION_DEFAULT_MAX_TOKENS
from pipeline.batchjob.scan import scan_input
from pipeline.wire.errors import InputChangedError
from pipeline.batchjob.workload import JobInput, JobWorkload, PromptLimits, bits_set, block_todo, set_bits
from tests.support.jobs import build_model, chat, completion


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama")


class Log:
    """A rejection log that keeps what it is told."""

    def __init__(self) -> None:
        self.rejected: list[tuple] = []

    def reject(self, where, status, message, param=None, code=None) -> None:
        self.rejected.append((where[0], status, message, param, code))


def workload(tmp_path: Path, model_dir: str, records: list[dict], blank_every: int = 0, skip: set[int] = frozenset(),
             limits: PromptLimits | None = None) -> JobWorkload:
    path = tmp_path / "in.jsonl"
    with open(path, "w") as f:
        for k, record in enumerate(records):
            f.write(json.dumps(record) + "\n")
            if blank_every and k % blank_every == 0:
                f.write("\n   \n")
    scan = scan_input(str(path), str(tmp_path / "scan"), str(tmp_path / "lines.bin"))
    bits = np.zeros((scan.requests + 7) // 8, dtype=np.uint8)
    for index in skip:
        bits[index >> 3] |= np.uint8(1 << (index & 7))
    manifest = JobManifest.new(created_s=0, input_path=str(path), input_bytes=scan.input_bytes,
                               input_xxh3=scan.input_xxh3, requests=scan.requests, served_model="tiny-llama",
                               output_path=str(tmp_path / "out"), output_order="input", error_file=None)
    job_input = JobInput(str(path), scan.requests, scan.index, str(tmp_path / "lines.bin"))
    return JobWorkload(job_input, bits, manifest, model_dir, str(tmp_path), limits or PromptLimits())


@pytest.mark.parametrize("seed", range(6))
def test_shares_cover_every_request_to_submit_once_and_are_balanced(tmp_path, model_dir, monkeypatch, seed):
    monkeypatch.setattr(layout, "INDEX_STRIDE", 16)
    import pipeline.batchjob.scan as scan_module
    import pipeline.batchjob.workload as workload_module

    monkeypatch.setattr(scan_module, "INDEX_STRIDE", 16)
    monkeypatch.setattr(workload_module, "INDEX_STRIDE", 16)
    rng = random.Random(seed)
    count = rng.randrange(1, 400)
    skip = {k for k in range(count) if rng.random() < rng.choice((0.0, 0.3, 0.9))}
    job = workload(tmp_path, model_dir, [completion(f"c{k}", [1, 2]) for k in range(count)], skip=skip)
    for producers in (1, 2, 3, 7):
        shares = job.shares(producers)
        assert len(shares) == producers and shares[0][0] == 0 and shares[-1][1] == count
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))  # contiguous, disjoint, whole
        todo = [sum(1 for k in range(a, b) if k not in skip) for a, b in shares]
        assert sum(todo) == len(job) == count - len(skip)
        assert max(todo) - min(todo) <= 1  # balanced to a request, whatever the blocks
        made = [[decode_job_payload(item.payload, job.manifest.job_id)[0] for item in job.items(k, producers)]
                for k in range(producers)]
        assert made == [[i for i in range(a, b) if i not in skip] for a, b in shares]  # each reads its share


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 4095, 4096, 4097, 3 * 4096 + 5])
def test_bits_are_counted_from_their_bytes_as_one_a_request_would_count_them(count):
    rng = np.random.default_rng(count)
    bits = rng.integers(0, 256, size=(count + 7) // 8 + 1, dtype=np.uint8)  # set bits past `count` too
    each = np.unpackbits(bits, bitorder="little")[:count].astype(np.int64)
    assert bits_set(bits, count) == int(each.sum())
    blocks = -(-count // layout.INDEX_STRIDE)
    padded = np.ones(blocks * layout.INDEX_STRIDE, dtype=np.int64)
    padded[:count] = each
    expected = layout.INDEX_STRIDE - padded.reshape(blocks, layout.INDEX_STRIDE).sum(axis=1)
    assert block_todo(bits, count).tolist() == expected.tolist()


def test_setting_bits_counts_only_those_not_set_before_and_each_once():
    bits = np.zeros(3, dtype=np.uint8)
    assert set_bits(bits, np.array([0, 7, 8, 23, 8], dtype=np.int64)) == 4
    assert np.unpackbits(bits, bitorder="little").nonzero()[0].tolist() == [0, 7, 8, 23]
    assert set_bits(bits, np.array([7, 9], dtype=np.int64)) == 1
    assert set_bits(bits, np.zeros(0, dtype=np.int64)) == 0
    assert bits_set(bits, 24) == 5


def test_a_producer_reads_its_lines_by_offset_as_the_scan_counted_them(tmp_path, model_dir, monkeypatch):
    import pipeline.batchjob.scan as scan_module
    import pipeline.batchjob.workload as workload_module

    monkeypatch.setattr(scan_module, "INDEX_STRIDE", 8)
    monkeypatch.setattr(workload_module, "INDEX_STRIDE", 8)
    records = [chat(f"r{k}", f"q {k}") for k in range(60)]
    job = workload(tmp_path, model_dir, records, blank_every=7)
    raw = (tmp_path / "in.jsonl").read_bytes()
    for first, end in ((0, 60), (13, 29), (8, 9), (59, 60), (30, 30)):
        got = list(job.lines(first, end))
        assert [index for index, *_ in got] == list(range(first, end))
        for index, line, offset, text in got:
            assert raw[offset:offset + len(text)] == text and json.loads(text)["custom_id"] == f"r{index}"
            assert raw.splitlines()[line - 1] == text


@pytest.mark.parametrize("seed", range(8))
def test_the_lines_to_do_are_every_line_not_skipped_read_only_from_blocks_that_hold_one(tmp_path, model_dir,
                                                                                     monkeypatch, seed):
    import pipeline.batchjob.scan as scan_module
    import pipeline.batchjob.workload as workload_module

    monkeypatch.setattr(scan_module, "INDEX_STRIDE", 8)
    monkeypatch.setattr(workload_module, "INDEX_STRIDE", 8)
    rng = random.Random(seed)
    count = rng.randrange(1, 90)
    done_to = rng.randrange(count + 1)  # a resumed job: a prefix answered, then a few here and there
    skip = set(range(done_to)) | {k for k in range(count) if rng.random() < 0.2}
    job = workload(tmp_path, model_dir, [chat(f"r{k}", f"q {k}") for k in range(count)], blank_every=rng.choice((0, 5)),
                   skip=skip)
    read_blocks: list[tuple[int, int]] = []
    lines = job.lines
    monkeypatch.setattr(job, "lines", lambda first, end: (read_blocks.append((first, end)), lines(first, end))[1])
    for first, end in ((0, count), (rng.randrange(count), count), (0, rng.randrange(count + 1)), (count, count)):
        read_blocks.clear()
        got = list(job.to_do_lines(first, end))
        assert got == [found for found in lines(first, end) if found[0] not in skip]
        for start, stop in read_blocks:  # every block read holds a request to do
            assert all(any(k not in skip for k in range(b * 8, min(count, b * 8 + 8)))
                       for b in range(start // 8, -(-stop // 8)))


def test_an_item_names_its_job_and_line_and_carries_the_requests_parameters(tmp_path, model_dir):
    job = workload(tmp_path, model_dir, [chat("a", "hi", temperature=0.5, max_tokens=7)])
    (index, _line, offset, raw) = next(job.lines(0, 1))
    items = list(job.items())
    (item,) = items
    assert decode_job_payload(item.payload, job.manifest.job_id)[:4] == (0, offset, len(raw), xxhash.xxh3_64_intdigest(raw))
    assert decode_job_payload(item.payload, job.manifest.job_id + 1) is None
    assert item.params.max_tokens == 7 and item.params.temperature == 0.5
    assert item.components and item.prefix_len < item.length  # the system prompt is a component


def test_what_a_request_does_not_give_is_vllms_servers_default(tmp_path, model_dir):
    """max_tokens the rest of the context (a completion: 16), temperature 1 and vLLM's
    neutral values, or the model's generation config's where it sets them."""
    limits = PromptLimits(max_prompt_tokens=2047, context_tokens=2048)
    job = workload(tmp_path, model_dir, [chat("a", "hi", max_tokens=None), completion("b", max_tokens=None)],
                   limits=limits)
    first, second = job.items()
    assert first.params.max_tokens == 2048 - first.length
    assert (first.params.temperature, first.params.top_p, first.params.top_k, first.params.min_p) == (1.0, 1.0, 0, 0.0)
    assert (first.params.repetition_penalty, first.params.presence_penalty, first.params.frequency_penalty) == (
        1.0, 0.0, 0.0)
    assert second.params.max_tokens == COMPLETION_DEFAULT_MAX_TOKENS
    tuned = tmp_path / "tuned"
    shutil.copytree(model_dir, tuned)
    (tuned / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                              "max_new_tokens": 64, "eos_token_id": [1, 5]}))
    (tmp_path / "t").mkdir()
    job = workload(tmp_path / "t", str(tuned), [chat("a", "hi", max_tokens=None), chat("b", "hi", temperature=0)],
                   limits=limits)
    first, second = job.items()
    assert (first.params.max_tokens, first.params.temperature, first.params.top_p, first.params.top_k) == (
        64, 0.6, 0.9, 20)
    assert second.params.temperature == 0 and second.params.top_p == 0.9  # the request's own first


@pytest.mark.parametrize("record, param, words", [
    (chat("x", model="other"), "model", "The model `other` does not exist"),
    (chat("x", "a \ud800 b"), "messages", ""),
    (completion("x", [5] * 300), "prompt", "more than the 100"),
    (chat("x", max_tokens=5000), "max_tokens", "maximum context length is 2048"),
    (chat("x", temperature=3), "temperature", "must be in [0, 2]"),
    (chat("x", logit_bias={"4096": 5}), "logit_bias", "token_id(s) [4096] in logit_bias contain out-of-vocab"),
    (chat("x", stop_token_ids=[1, 99999]), "stop_token_ids", "Vocabulary size: 4096"),
    (chat("x", max_tokens=None, min_tokens=2040), "min_tokens", "max_tokens=the rest of the context"),
])
def test_a_request_no_item_can_be_made_of_is_answered_by_the_producer(tmp_path, model_dir, record, param, words):
    job = workload(tmp_path, model_dir, [record], limits=PromptLimits(max_prompt_tokens=100, context_tokens=2048))
    log = Log()
    (index, line, offset, raw) = next(job.lines(0, 1))
    from pipeline.batchjob.chat import ChatTokenizer

    assert job.make(raw, (index, offset, len(raw), 0), line, ChatTokenizer.load(model_dir), log) is None
    ((rejected, status, message, named, _code),) = log.rejected
    assert (rejected, status) == (0, 400) and (named == param or param in message) and words in message


def test_a_request_the_launcher_stopped_on_is_answered_and_skipped(tmp_path, model_dir):
    job = workload(tmp_path, model_dir, [chat(f"r{k}") for k in range(5)])
    job.on_stuck(3, "it ran past the limit")
    assert job.skipped(3) and not job.skipped(2)
    (line,) = (tmp_path / "job" / "rejected" / "supervisor.jsonl").read_text().splitlines()
    row = json.loads(line)
    assert row["index"] == 3 and row["status"] == 400 and "ran past the limit" in row["message"]
    assert [decode_job_payload(i.payload, job.manifest.job_id)[0] for i in job.items()] == [0, 1, 2, 4]


def test_a_line_edited_in_place_after_the_scan_is_no_request(tmp_path, model_dir):
    records = [completion(f"c{k}", f"prompt number {k}") for k in range(30)]
    job = workload(tmp_path, model_dir, records)
    assert len(list(job.items())) == 30
    raw = (tmp_path / "in.jsonl").read_bytes()
    at = raw.index(b"prompt number 17")
    (tmp_path / "in.jsonl").write_bytes(raw[:at] + b"PROMPT" + raw[at + 6:])  # same size, same offsets
    made = []
    with pytest.raises(InputChangedError, match=r"in.jsonl:18: request 17 \(byte \d+\) is not the line the job read"):
        made.extend(item.payload for item in job.items())
    assert len(made) == 17  # the requests before it
