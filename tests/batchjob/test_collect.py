"""pipeline.batchjob.collect: results rows and producers' refusals become the job's answer
lines, each matched to its own request of its own job by its payload and the request's line
read back from the input; nothing else ever answers, and each file is read once, whole
lines only, across polls and runs."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash

from pipeline.batchjob import collect as collect_module
from pipeline.batchjob import decoding as decoding_module
from pipeline.batchjob.answers import AnswerLog
from pipeline.batchjob.collect import Collector
from pipeline.batchjob.layout import LOG_ERRORS, LOG_OUTPUT, encode_job_payload
from pipeline.batchjob.manifest import JobManifest
from pipeline.batchjob.rejections import RejectionLog
from pipeline.batchjob.scan import scan_input
from pipeline.wire.errors import JobMismatchError
from tests.batchjob.batchfiles import MODEL, chat, completion, write

CREATED = 1_760_000_000
REQUESTS = 6


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


@dataclass
class Job:
    data: Path
    input_path: Path
    manifest: JobManifest
    where: list[tuple[int, int, int, int]]  # (index, offset, length, line_xxh3) of each request
    logs: dict[int, str]
    input_fd: int
    log: AnswerLog | None = None

    def collector(self) -> Collector:
        """A fresh run's collector (its answer log reopened)."""
        if self.log is not None:
            self.log.close()
        self.log = AnswerLog.open(str(self.data), self.manifest.requests, self.logs)
        return Collector(str(self.data), self.manifest, self.input_fd, decode, self.log,
                         LOG_ERRORS if LOG_ERRORS in self.logs else LOG_OUTPUT)

    def payload(self, index: int, job_id: int | None = None) -> str:
        index, offset, length, digest = self.where[index]
        raw = encode_job_payload(self.manifest.job_id if job_id is None else job_id, index, offset, length, digest)
        return base64.b64encode(raw).decode()

    def lines(self, log: int = LOG_OUTPUT) -> list[dict]:
        return [json.loads(text) for text in Path(self.logs[log]).read_bytes().splitlines()]


def _job(tmp_path: Path, errors_apart: bool) -> Iterator[Job]:
    lines = ["", chat("alpha"), completion("beta"), "  ", chat("gamma", max_completion_tokens=3), completion("delta"),
             chat("eps\ud800"), completion("zeta")]
    path = write(tmp_path / "in.jsonl", *lines)
    data = tmp_path / "data"
    (data / "job").mkdir(parents=True)
    found = scan_input(str(path), str(data / "job" / "scan"), str(data / "job" / "lines.bin"))
    assert found.requests == REQUESTS
    manifest = JobManifest.new(created_s=CREATED, input_path=str(path), input_bytes=found.input_bytes,
                               input_xxh3=found.input_xxh3, requests=found.requests, served_model=MODEL,
                               output_path=str(tmp_path / "out.jsonl"), output_order="input", error_file=None)
    where, offset = [], 0
    for raw in path.read_bytes().split(b"\n")[:-1]:
        if raw.strip():
            where.append((len(where), offset, len(raw), xxhash.xxh3_64_intdigest(raw)))
        offset += len(raw) + 1
    logs = {LOG_OUTPUT: str(data / "job" / "answers.jsonl")}
    if errors_apart:
        logs[LOG_ERRORS] = str(tmp_path / "errors.jsonl")
    fd = os.open(path, os.O_RDONLY)
    job = Job(data, path, manifest, where, logs, fd)
    try:
        yield job
    finally:
        if job.log is not None:
            job.log.close()
        os.close(fd)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    yield from _job(tmp_path, errors_apart=False)


@pytest.fixture
def job_with_error_file(tmp_path: Path) -> Iterator[Job]:
    yield from _job(tmp_path, errors_apart=True)


def row(payload: str, status: str = "ok", item_id: int = 1, **fields: object) -> dict:
    base = {"item_id": item_id, "batch_id": 1, "dispatch_ns": 10, "submit_ns": 11, "done_ns": 12,
            "pad_to_tokens": 32, "status": status, "prompt_tokens": 20, "prompt_xxh3": 5, "cached_tokens": 16,
            "output_tokens": 3, "output": [0, 1, 2], "finish_reason": "stop", "payload": payload}
    return {**base, **fields}


def append(path: Path, *rows: object, newline: bool = True) -> None:
    """Rows (dicts as JSON, or raw bytes) appended to a results file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"\n".join(r if isinstance(r, bytes) else json.dumps(r).encode() for r in rows)
    with open(path, "ab") as f:
        f.write(data + (b"\n" if newline else b""))


def results(job: Job, run: str = "run-1", consumer: str = "c0") -> Path:
    return job.data / "results" / run / f"{consumer}.jsonl"


def test_rows_of_this_job_become_lines_of_their_own_requests(job: Job) -> None:
    append(results(job), row(job.payload(4)), row(job.payload(0), text="given text", output_tokens=5),
           row(job.payload(1), finish_reason="length"))
    collector = job.collector()
    assert collector.collect() == 3
    assert collector.collect() == 0
    job.log.check_invariants()
    eps, alpha, beta = job.lines()
    assert eps["custom_id"] == "eps\ud800" and eps["id"] == f"batch_req_{job.manifest.id_tag}_4"
    assert eps["response"]["body"]["choices"][0]["message"]["content"] == decode([0, 1, 2])
    assert eps["response"]["body"]["created"] == CREATED and eps["response"]["body"]["model"] == MODEL
    assert alpha["custom_id"] == "alpha"
    assert alpha["response"]["body"]["choices"][0]["message"]["content"] == "given text"
    assert alpha["response"]["body"]["usage"] == {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
                                                  "prompt_tokens_details": {"cached_tokens": 16}}
    assert beta["custom_id"] == "beta" and beta["response"]["body"]["object"] == "text_completion"
    assert beta["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert (job.log.done, job.log.by_status, job.log.usage.prompt_tokens) == (3, {200: 3}, 60)
    assert collector.counts.foreign_rows == collector.counts.bad_lines == 0


def test_rows_that_are_not_this_jobs_never_answer(job: Job) -> None:
    other = base64.b64encode(b"".join([b"SBJR", bytes(44)])).decode()
    append(results(job, "run-2"), row(job.payload(0, job_id=job.manifest.job_id ^ 1)),
           row(base64.b64encode(b"0").decode()), row(base64.b64encode(b"3").decode()),  # `pipeline launch` items
           row(base64.b64encode(b"17" * 24).decode()), row(""), row(other), row(job.payload(2), status="corrupt"))
    collector = job.collector()
    assert collector.collect() == 0
    assert collector.counts.foreign_rows == 6 and collector.counts.corrupt == 1
    assert job.log.done == 0 and Path(job.logs[LOG_OUTPUT]).read_bytes() == b""


def test_results_of_consumers_the_job_did_not_start_are_not_read(job: Job) -> None:
    joined = job.data / "results" / "joined.jsonl"  # `pipeline consumer start --data-dir` writes here
    append(joined, row(job.payload(0)))
    append(results(job, "staged-run"), row(job.payload(1)))
    append(results(job, "ray-20261205T000000Z-1", "node-a"), row(job.payload(2)))
    assert job.collector().collect() == 1 and job.log.is_done(2) and not job.log.is_done(0) and not job.log.is_done(1)


def test_a_payload_past_the_jobs_requests_answers_nothing(job: Job) -> None:
    raw = encode_job_payload(job.manifest.job_id, REQUESTS, *job.where[0][1:])
    append(results(job), row(base64.b64encode(raw).decode()))
    collector = job.collector()
    assert collector.collect() == 0 and job.log.done == 0 and job.log.duplicates == 0


def test_a_changed_input_line_stops_the_job(job: Job) -> None:
    append(results(job), row(job.payload(2)))
    raw = job.input_path.read_bytes()
    job.input_path.write_bytes(raw.replace(b'"gamma"', b'"GAMMA"'))  # same length, other bytes
    with pytest.raises(JobMismatchError, match="the input file changed while the job ran"):
        job.collector().collect()
    job.input_path.write_bytes(raw[:job.where[2][1] + 5])  # cut short
    with pytest.raises(JobMismatchError, match=f"the line of request 2 at byte {job.where[2][1]}"):
        job.collector().collect()
    job.input_path.write_bytes(raw)
    assert job.collector().collect() == 1


def test_a_duplicate_row_is_dropped_and_counted(job: Job) -> None:
    append(results(job), row(job.payload(3)), row(job.payload(3), text="second"))
    append(results(job, consumer="c1"), row(job.payload(3), status="error", error="boom"))
    collector = job.collector()
    assert collector.collect() == 1
    assert job.log.duplicates == 2 and job.log.done == 1
    (only,) = job.lines()
    assert only["custom_id"] == "delta" and only["response"]["body"]["choices"][0]["text"] == decode([0, 1, 2])


def test_a_corrupt_row_answers_nothing_and_a_later_row_answers(job: Job) -> None:
    append(results(job), row("", status="corrupt"), row(job.payload(5), status="corrupt"))
    collector = job.collector()
    assert collector.collect() == 0 and not job.log.is_done(5) and collector.counts.corrupt == 1
    assert collector.counts.foreign_rows == 1  # a corrupt row without its payload names no request
    append(results(job, "run-2"), row(job.payload(5)))
    assert collector.collect() == 1 and job.log.is_done(5)


def test_a_cancelled_row_answers_nothing_and_a_later_row_answers(job: Job) -> None:
    append(results(job), row(job.payload(5), status="cancelled", output=[], output_tokens=0))
    collector = job.collector()
    assert collector.collect() == 0 and not job.log.is_done(5)  # not run: the batch ended first
    append(results(job, "run-2"), row(job.payload(5)))
    assert collector.collect() == 1 and job.log.is_done(5)


def test_a_new_job_on_a_node_reads_the_results_from_their_last_whole_line(job: Job, tmp_path: Path) -> None:
    node = tmp_path / "node"
    earlier = node / "results" / "run-1" / "c0.jsonl"
    append(earlier, *[row(job.payload(k, job_id=99)) for k in range(3)])  # another job's rows
    being_written = json.dumps(row(job.payload(0, job_id=99))).encode()
    append(earlier, being_written[:30], newline=False)  # another's row, half written
    collector = Collector(str(job.data), job.manifest, job.input_fd, decode,
                          AnswerLog.open(str(job.data), job.manifest.requests, job.logs), LOG_OUTPUT,
                          results_root=str(node))
    collector.skip_results_so_far()
    append(earlier, being_written[30:], row(job.payload(2)))  # the row's end, then this job's own
    assert collector.collect() == 1 and collector.log.is_done(2)
    assert collector.counts.foreign_rows == 1 and collector.counts.bad_lines == 0  # the whole row, once
    collector.log.close()


@pytest.mark.parametrize("apart", [False, True], ids=["inline", "error file"])
def test_rows_that_did_not_run_and_refusals_become_error_lines(request: pytest.FixtureRequest, apart: bool) -> None:
    job = request.getfixturevalue("job_with_error_file" if apart else "job")
    append(results(job), row(job.payload(0), status="too_long", output=[], output_tokens=0, prompt_tokens=9999),
           row(job.payload(1), status="error", error="CUDA out of memory", output=[]))
    rejections = RejectionLog(str(job.data), "producer-0")
    rejections.reject(job.where[2], 400, "unsupported parameter 'top_k'", "top_k")
    rejections.reject(job.where[3], 400, "the chat template failed", "prompt", code="template_error")
    rejections.close()
    collector = job.collector()
    assert collector.collect() == 4
    log = LOG_ERRORS if apart else LOG_OUTPUT
    errors = {line["custom_id"]: line["response"] for line in job.lines(log)}
    assert errors["alpha"]["status_code"] == 400
    assert errors["alpha"]["body"]["error"]["code"] == "context_length_exceeded"
    assert errors["beta"]["status_code"] == 500 and "CUDA out of memory" in errors["beta"]["body"]["error"]["message"]
    assert errors["gamma"]["status_code"] == 400
    assert errors["gamma"]["body"]["error"] == {"message": "unsupported parameter 'top_k'",
                                                "type": "invalid_request_error", "param": "top_k", "code": None}
    assert errors["delta"]["body"]["error"]["code"] == "template_error"
    assert job.log.by_status == {400: 3, 500: 1} and job.log.failed == 4
    if apart:
        assert Path(job.logs[LOG_OUTPUT]).read_bytes() == b""


def test_a_refusal_of_an_answered_request_is_dropped(job: Job) -> None:
    append(results(job), row(job.payload(0)))
    rejections = RejectionLog(str(job.data), "producer-0")
    rejections.reject(job.where[0], 400, "late")
    rejections.close()
    collector = job.collector()
    assert collector.collect() == 1
    (line,) = job.lines()
    assert line["response"]["status_code"] == 200


def test_saved_offsets_make_the_next_run_read_only_new_lines(job: Job) -> None:
    append(results(job), row(job.payload(0)), row(job.payload(1)), row(job.payload(2)))
    first = job.collector()
    assert first.collect() == 3
    first.save()
    assert (job.data / "job" / "collected.json").stat().st_mode & 0o777 == 0o600
    append(results(job), row(job.payload(3)), row(job.payload(4)))
    second = job.collector()
    assert second.collect() == 2
    assert job.log.duplicates == 0  # the first three rows were not read again
    (job.data / "job" / "collected.json").write_text("{not json")
    third = job.collector()  # a lost record of offsets: everything read again, nothing answered twice
    assert third.collect() == 0 and job.log.duplicates == 5 and job.log.done == 5


def test_a_torn_last_line_is_left_for_the_next_poll(job: Job) -> None:
    path = results(job)
    text = json.dumps(row(job.payload(1))).encode()
    append(path, row(job.payload(0)), text[:40], newline=False)
    collector = job.collector()
    assert collector.collect() == 1
    assert collector.collect() == 0
    with open(path, "ab") as f:
        f.write(text[40:] + b"\n")
    assert collector.collect() == 1
    assert job.log.done == 2 and collector.counts.bad_lines == 0


def test_lines_that_are_not_rows_are_counted_and_named(job: Job) -> None:
    append(results(job), b"{not json", b"[1, 2]", b"\xff\xfe", row(job.payload(0)), row(job.payload(1), output="x"))
    collector = job.collector()
    assert collector.collect() == 1
    assert collector.counts.bad_lines == 4 and len(collector.counts.examples) == 4
    assert all(example.startswith(str(results(job))) for example in collector.counts.examples)


def test_a_poll_reads_at_most_its_limit_and_the_next_goes_on(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [json.dumps(row(job.payload(k))).encode() for k in range(REQUESTS)]
    monkeypatch.setattr(collect_module, "READ_LIMIT_BYTES", len(rows[0]) * 2 + 5)
    append(results(job), *rows)
    collector = job.collector()
    polls = []
    while added := collector.collect():
        polls.append(added)
    assert polls == [2, 2, 2] and job.log.done == REQUESTS


def test_this_runs_rows_are_tallied_for_its_summary(job: Job) -> None:
    append(results(job, "run-1"), row(job.payload(0)))
    append(results(job, "run-2"), row(job.payload(0), item_id=7), row(job.payload(1), item_id=8, cached_tokens=4),
           row(job.payload(2), status="too_long", item_id=9))
    collector = job.collector()
    collector.tally(str(job.data / "results" / "run-2"))
    summary = collector.summary(str(job.data / "results" / "run-2"))
    assert summary.lines == 3 and summary.duplicates == 1 and summary.items == 2
    assert summary.by_status == {"ok": 2, "too_long": 1} and summary.cached_tokens == 36
    assert summary.per_consumer["c0"]["lines"] == 3


class PanicException(BaseException):
    """What a Rust panic in the tokenizer's decoder reaches Python as (pyo3's, by its name)."""


def test_a_decoder_that_fails_or_expands_answers_its_request_500_and_the_job_goes_on(
        job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoding_module, "MAX_ANSWER_TEXT_CHARS", 100)

    def hostile(ids: list[int]) -> str:
        if 7 in ids:
            raise PanicException("called `Result::unwrap()` on an `Err` value: RetryLimitInMatch")
        return "y" * (1000 if 8 in ids else 1) * len(ids)

    append(results(job), row(job.payload(0), output=[1, 7]), row(job.payload(1), output=[8, 1]),
           row(job.payload(4), output=[1, 2]),
           row(job.payload(5), output=[1], samples=[{"output": [8], "finish_reason": "stop"}]))
    job.log = AnswerLog.open(str(job.data), job.manifest.requests, job.logs)
    collector = Collector(str(job.data), job.manifest, job.input_fd, hostile, job.log, LOG_OUTPUT, vocab_size=100)
    assert collector.collect() == 4 and collector.counts.bad_lines == 0
    lines = {line["custom_id"]: line for line in job.lines()}
    assert lines["eps\ud800"]["response"]["body"]["choices"][0]["message"]["content"] == "yy"
    for custom_id, words in [("alpha", "failed to decode this answer's tokens: PanicException: called"),
                             ("beta", "decodes this answer's tokens to more than 100 characters"),
                             ("zeta", "more than 100 characters")]:
        response = lines[custom_id]["response"]
        assert response["status_code"] == 500 and words in response["body"]["error"]["message"]
        assert response["body"]["error"]["type"] == "server_error"
    assert job.log.by_status == {200: 1, 500: 3}


def test_a_full_disk_keeps_the_answers_in_the_results_files_until_there_is_room(job: Job,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer log's disk full (ENOSPC on its append): the poll takes nothing and says
    which file found no room; the same rows are read again once there is room, each once.
    Another write error is no full disk: it is raised."""
    import errno

    from pipeline.wire.errors import AnswerLogWriteError

    append(results(job), row(job.payload(0)), row(job.payload(1)))
    collector = job.collector()
    append_for_real = job.log.append
    full = str(job.data / "job" / "answers.jsonl")

    def no_room(answers):
        raise AnswerLogWriteError("no room", errno.ENOSPC, full)

    monkeypatch.setattr(job.log, "append", no_room)
    assert collector.collect() == 0 and collector.collect() == 0
    assert collector.disk_full and collector.disk_full_path == full and job.log.done == 0
    monkeypatch.setattr(job.log, "append", append_for_real)
    assert collector.collect() == 2 and not collector.disk_full
    assert collector.collect() == 0 and job.log.done == 2
    append(results(job), row(job.payload(2)))
    monkeypatch.setattr(job.log, "append", lambda answers: (_ for _ in ()).throw(
        AnswerLogWriteError("bad block", errno.EIO, full)))
    with pytest.raises(AnswerLogWriteError, match="bad block"):
        collector.collect()
