"""A batch job's state on its data directory: the manifest that ties it to one input file,
the answers read back from every run's results files, the producers' rejection logs."""

from __future__ import annotations

import base64
import json
import os

import pytest

from pipeline.batchjob.job import (
    JobManifest,
    RejectionLog,
    pending_requests,
    read_answers,
    request_index,
    request_payload,
)
from pipeline.wire.errors import JobMismatchError
from pipeline.wire.generation import GenerationParams, decode_payload, encode_payload

MANIFEST = JobManifest(input_sha256="ab" * 32, input_path="/jobs/a.jsonl", served_model="tiny", requests=9,
                       created_s=1_700_000_000)


def test_the_first_run_writes_the_manifest_and_a_later_one_must_be_the_same_job(tmp_path):
    data = str(tmp_path)
    assert JobManifest.load_or_create(data, MANIFEST) == MANIFEST
    later = JobManifest(MANIFEST.input_sha256, "/elsewhere/a.jsonl", "tiny", 9, created_s=1_800_000_000)
    assert JobManifest.load_or_create(data, later) == MANIFEST  # the first run's start time stays
    with pytest.raises(JobMismatchError, match="holds another job"):
        JobManifest.load_or_create(data, JobManifest("cd" * 32, "/jobs/b.jsonl", "tiny", 9, 1))
    with pytest.raises(JobMismatchError, match="model 'other'"):
        JobManifest.load_or_create(data, JobManifest(MANIFEST.input_sha256, "/jobs/a.jsonl", "other", 9, 1))
    with open(tmp_path / "job" / "manifest.json", "w") as f:
        f.write("{not json")
    with pytest.raises(JobMismatchError, match="not a job manifest"):
        JobManifest.load_or_create(data, MANIFEST)


@pytest.mark.parametrize("index", [0, 7, (1 << 63) - 1])
def test_a_request_index_rides_in_the_payload_under_its_generation_parameters(index):
    stored = encode_payload(GenerationParams(max_tokens=3), request_payload(index))
    assert request_index(decode_payload(stored)[1]) == index
    assert request_index(b"") is None and request_index(b"job-17") is None and request_index(b"1" * 21) is None


def _row(index: int, status: str = "ok", item: int = 1) -> str:
    return json.dumps({"item_id": item, "status": status, "prompt_tokens": 5, "cached_tokens": 0,
                       "payload": base64.b64encode(request_payload(index)).decode()})


def test_answers_of_every_run_are_read_back_and_a_corrupt_one_is_no_answer(tmp_path):
    for run, lines in (("run-1", [_row(0), _row(1, "error"), _row(2, "corrupt"), _row(3, "too_long")]),
                       ("run-2", [_row(1, "ok"), _row(0, "ok"), _row(4), '{"item_id": 9, "sta'])):
        os.makedirs(tmp_path / "results" / run)
        (tmp_path / "results" / run / "c0.jsonl").write_text("\n".join(lines) + "\n")
    log = RejectionLog(str(tmp_path), "p0")
    log.reject(5, "the chat template refused the conversation")
    log.reject(0, "answered already: ignored")
    log.close()
    answers = read_answers(str(tmp_path))
    assert answers.order == [0, 1, 3, 4]  # first answers first; request 2's corrupt line is none
    assert answers.rows[1]["status"] == "ok"  # a redelivered batch's ok answer wins over the error
    assert answers.rows[0]["item_id"] == 1 and answers.rejected == {5: "the chat template refused the conversation"}
    assert answers.answered() == {0, 1, 3, 4, 5} and answers.bad_lines == 1


def test_pending_items_name_their_requests():
    payloads = [encode_payload(GenerationParams(seed=1), request_payload(4)), request_payload(2), b"other"]
    assert pending_requests(decode_payload(p)[1] for p in payloads) == {2, 4}
