"""A stopped batch's files from what its job answered: the run's logs up to their last
recorded answer, and a batch_cancelled / batch_expired line for every request without one,
so every request has one line; a torn record and an unrecorded log tail count for nothing.
The job's files are made here as run-batch lays them out (no process runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.batchjob.answers import records_path
from pipeline.batchjob.layout import LOG_ERRORS, LOG_OUTPUT, answer_record
from pipeline.batchjob.manifest import JOB_DIR
from pipeline.batchjob.output import CODE_CANCELLED, CODE_EXPIRED
from pipeline.service.finalize import write_batch_files
from pipeline.service.runner import DATA_NAME, ERRORS_NAME, OUTPUT_NAME, BatchRun, RunBatchExecutor

TAG = "0123456789ab"


def job_files(work: Path, requests: int, answered: dict[int, int]) -> BatchRun:
    """An input of `requests` requests (a blank line among them), and a job in `work` that
    answered `answered` (request index -> status code), each answer's line and record."""
    source = work.parent / "input.jsonl"
    lines = [json.dumps({"custom_id": f"r{k}", "method": "POST", "url": "/v1/completions", "body": {}})
             for k in range(requests)]
    source.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")
    (work / DATA_NAME / JOB_DIR).mkdir(parents=True)
    logs = {LOG_OUTPUT: bytearray(), LOG_ERRORS: bytearray()}
    records = bytearray()
    for index, status in answered.items():
        log = LOG_OUTPUT if status == 200 else LOG_ERRORS
        line = json.dumps({"custom_id": f"r{index}", "response": {"status_code": status}}).encode() + b"\n"
        records += answer_record(index, len(logs[log]), len(line), status, log, 5, 2 if status == 200 else 0, 1)
        logs[log] += line
    (work / OUTPUT_NAME).write_bytes(bytes(logs[LOG_OUTPUT]))
    (work / ERRORS_NAME).write_bytes(bytes(logs[LOG_ERRORS]))
    Path(records_path(str(work / DATA_NAME))).write_bytes(bytes(records))
    return BatchRun("batch_1", str(source), str(work), requests)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("code", [CODE_CANCELLED, CODE_EXPIRED])
def test_a_stopped_batch_has_one_line_per_request(tmp_path, code):
    run = job_files(tmp_path / "work", 6, {0: 200, 3: 400, 4: 200})
    answers = RunBatchExecutor([]).answers(run)
    assert (answers.completed, answers.failed) == (2, 1)
    assert answers.usage == {"prompt_tokens": 15, "completion_tokens": 4, "cached_tokens": 3}
    sizes = write_batch_files(answers, run.input_path, TAG, code, str(tmp_path / "out"), str(tmp_path / "err"))
    output, errors = lines(tmp_path / "out"), lines(tmp_path / "err")
    assert sizes == ((tmp_path / "out").stat().st_size, (tmp_path / "err").stat().st_size)
    assert [row["custom_id"] for row in output] == ["r0", "r4"]
    assert [row["custom_id"] for row in errors] == ["r3", "r1", "r2", "r5"]
    assert errors[1] == {"id": f"batch_req_{TAG}_1", "custom_id": "r1", "response": None,
                         "error": {"code": code, "message": errors[1]["error"]["message"]}}
    assert {row["error"]["code"] for row in errors[1:]} == {code}


def test_a_completed_batch_copies_its_logs_and_writes_no_empty_file(tmp_path):
    run = job_files(tmp_path / "work", 3, {0: 200, 1: 200, 2: 200})
    sizes = write_batch_files(RunBatchExecutor([]).answers(run), run.input_path, TAG, None, str(tmp_path / "out"),
                              str(tmp_path / "err"))
    assert sizes[1] == 0 and not (tmp_path / "err").exists()
    assert (tmp_path / "out").read_bytes() == (tmp_path / "work" / OUTPUT_NAME).read_bytes()


def test_a_torn_record_and_an_unrecorded_tail_count_for_nothing(tmp_path):
    run = job_files(tmp_path / "work", 4, {0: 200, 1: 200, 2: 200})
    records = Path(records_path(str(tmp_path / "work" / DATA_NAME)))
    whole = records.read_bytes()
    records.write_bytes(whole[:-7])  # the last record torn (a kill)
    with open(tmp_path / "work" / OUTPUT_NAME, "ab") as log:
        log.write(b'{"custom_id": "r3", "unrecorded": true}\n')  # a line whose record was never written
    answers = RunBatchExecutor([]).answers(run)
    assert answers.completed == 2 and not answers.is_answered(2)
    write_batch_files(answers, run.input_path, TAG, CODE_CANCELLED, str(tmp_path / "out"), str(tmp_path / "err"))
    assert [row["custom_id"] for row in lines(tmp_path / "out")] == ["r0", "r1"]
    assert [row["custom_id"] for row in lines(tmp_path / "err")] == ["r2", "r3"]


def test_a_batch_that_never_ran_has_every_request_in_its_error_file(tmp_path):
    source = tmp_path / "input.jsonl"
    source.write_text("".join(json.dumps({"custom_id": f"r{k}", "method": "POST", "url": "/v1/completions",
                                          "body": {}}) + "\n" for k in range(3)))
    run = BatchRun("batch_1", str(source), str(tmp_path / "never"), 3)
    answers = RunBatchExecutor([]).answers(run)
    assert (answers.output_path, answers.error_path, answers.completed) == (None, None, 0)
    sizes = write_batch_files(answers, run.input_path, TAG, CODE_EXPIRED, str(tmp_path / "out"),
                              str(tmp_path / "err"))
    assert sizes[0] == 0 and [row["custom_id"] for row in lines(tmp_path / "err")] == ["r0", "r1", "r2"]
