"""pipeline.batchjob.jobstatus and `pipeline status` on a job's data directory: each job
file is checked as it is read, and a damaged one is named in one line, never a traceback or
numbers it does not hold; a data directory that is not there is said to be missing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.batchjob.answers import records_path
from pipeline.batchjob.jobstatus import WRITING, answered, saved_view
from pipeline.batchjob.layout import ANSWER_RECORD_SIZE_BYTES, LOG_OUTPUT, answer_record
from pipeline.batchjob.manifest import INPUT_CHANGED_NAME, JOB_DIR, JobManifest, manifest_path, write_manifest
from pipeline.cli import main
from pipeline.batchjob.scan import MAX_BATCH_REQUESTS
from pipeline.wire.errors import JobMismatchError

REQUESTS = 10
GOOD_VIEW = {"state": "stopped", "requests": REQUESTS, "done": 2, "failed": 1, "to_do": 8, "eta_s": None,
             "requests_per_s": 3.5}


def job_dir(tmp_path: Path, records: int = 2, input_path: str = "/jobs/in.jsonl") -> Path:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    write_manifest(str(data), JobManifest(7, 1_700_000_000, input_path, 1000, "ab" * 16, REQUESTS, "tiny",
                                          "/jobs/out.jsonl", "input", None))
    (data / JOB_DIR / "status.json").write_text(json.dumps(GOOD_VIEW))
    Path(records_path(str(data))).write_bytes(b"".join(answer_record(k, 0, 10, 200, LOG_OUTPUT, 1, 1, 0)
                                                        for k in range(records)))
    return data


def status(data: Path | str) -> tuple[int, str]:
    done = CliRunner().invoke(main, ["status", "--data-dir", str(data)])
    assert done.exception is None or isinstance(done.exception, SystemExit), done.exception
    return done.exit_code, done.output


def test_a_stopped_jobs_status_reads_its_files(tmp_path: Path) -> None:
    code, said = status(job_dir(tmp_path))
    assert code == 0 and "job stopped: 2 of 10 requests answered, 1 failed, 8 to do" in said


@pytest.mark.parametrize("text, why", [("[]", "not a JSON object"), ('"x"', "not a JSON object"),
                                       ('{"state": 5}', "state 5 is not a word"),
                                       ('{"state": "stopped", "done": "2"}', "done '2' is not a count"),
                                       ('{"state": "stopped", "to_do": -1}', "to_do -1 is not a count"),
                                       ('{"state": "stopped", "eta_s": "soon"}', "eta_s 'soon' is not a number"),
                                       ("{not json", "not a JSON object"), ("[" * 100_000, "not a JSON object"),
                                       ('{"state": "stopped", "done": 1e400}', "done inf is not a count"),
                                       ('{"state": "stopped", "eta_s": 5000000000.0}', "eta_s 5000000000.0 is not a number")])
def test_a_damaged_saved_view_is_named_in_one_line(tmp_path: Path, text: str, why: str) -> None:
    data = job_dir(tmp_path)
    path = data / JOB_DIR / "status.json"
    path.write_text(text)
    with pytest.raises(JobMismatchError, match=f"damaged \\({why}\\)"):
        saved_view(str(path), REQUESTS)
    code, said = status(data)
    assert code == 1 and f"Error: {path}: damaged ({why})" in said and said.count("\n") == 1


def test_a_missing_saved_view_is_a_job_not_started(tmp_path: Path) -> None:
    assert saved_view(str(tmp_path / "none.json"), 4)["state"] == "not started"


@pytest.mark.parametrize("requests, why", [('"x"', "requests 'x' is not a request count number"),
                                           ("-5", "requests -5 is not a request count number"),
                                           ("0", "requests 0 is not a request count number"),
                                           (str(MAX_BATCH_REQUESTS + 1), f"requests {MAX_BATCH_REQUESTS + 1} is not "
                                                                         f"a request count number"),
                                           (str(2**70), f"requests {2**70} is not a request count number")])
def test_a_damaged_manifest_is_named_in_one_line(tmp_path: Path, requests: str, why: str) -> None:
    data = job_dir(tmp_path)
    path = Path(manifest_path(str(data)))
    path.write_text(path.read_text().replace(f'"requests": {REQUESTS}', f'"requests": {requests}'))
    code, said = status(data)
    assert code == 1 and f"{path}: damaged ({why})" in said and said.count("\n") == 1


def test_answer_records_at_the_jobs_requests_count_and_damaged_ones_are_named(tmp_path: Path) -> None:
    data = job_dir(tmp_path, records=REQUESTS)
    path = records_path(str(data))
    assert answered(path, REQUESTS) == REQUESTS
    with pytest.raises(JobMismatchError, match="more than the job's 9 requests"):
        answered(path, REQUESTS - 1)
    Path(path).write_bytes(os.urandom(100 * ANSWER_RECORD_SIZE_BYTES))
    code, said = status(data)
    assert code == 1 and f"{path}: damaged (" in said and "100" not in said.split(f"{path}: damaged")[0]
    Path(path).write_bytes(os.urandom(5 * ANSWER_RECORD_SIZE_BYTES))
    with pytest.raises(JobMismatchError, match="a record fails its check"):
        answered(path, REQUESTS)
    Path(path).write_bytes(b"\0" * (ANSWER_RECORD_SIZE_BYTES + 1))
    with pytest.raises(JobMismatchError, match="not whole"):
        answered(path, REQUESTS)
    assert answered(str(tmp_path / "none.bin"), REQUESTS) is None


def test_a_data_directory_that_is_not_there_is_said_to_be_missing(tmp_path: Path) -> None:
    code, said = status(tmp_path / "nonexistent")
    assert code == 1 and said == f"Error: no data directory at {tmp_path / 'nonexistent'}\n"


@pytest.mark.parametrize("name", ["status.json", "answers.bin", "lock"])
def test_a_fifo_among_the_jobs_files_is_named_not_waited_on(tmp_path: Path, name: str) -> None:
    data = job_dir(tmp_path)
    path = data / JOB_DIR / name
    if path.exists():
        path.unlink()
    os.mkfifo(path)  # no writer: a blocking open would wait for ever
    code, said = status(data)
    if name == "lock":  # a lock nobody holds: the job stopped
        assert code == 0 and "job stopped" in said
    else:
        assert code == 1 and f"{path}: " in said and "not a regular file" in said and said.count("\n") == 1


def test_a_new_jobs_run_checking_its_input_is_said_so(tmp_path: Path) -> None:
    import fcntl

    data = tmp_path / "data"
    (data / JOB_DIR).mkdir(parents=True, mode=0o700)
    with open(data / JOB_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        code, said = status(data)
    assert code == 0 and said == "job checking its input (its process runs): no request runs before the check ends\n"


def test_a_job_writing_its_output_is_said_so_and_stopped_once_its_process_is_gone(tmp_path: Path) -> None:
    import fcntl

    data = job_dir(tmp_path, records=REQUESTS)
    (data / JOB_DIR / "status.json").write_text(json.dumps({**GOOD_VIEW, "state": WRITING, "done": REQUESTS,
                                                            "to_do": 0}))
    with open(data / JOB_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        code, said = status(data)
    assert code == 0 and said.startswith(f"job {WRITING} (its process runs): 10 of 10 requests answered"), said
    code, said = status(data)  # the lock released: its process is gone before the output was written
    assert code == 0 and said.startswith("job stopped: 10 of 10 requests answered"), said
    assert said.endswith(f"the same run-batch command (with --data-dir {data}) writes its output\n"), said


@pytest.mark.parametrize("change", ["none", "note", "size"])
def test_a_job_whose_input_changed_is_said_so_not_that_the_same_command_finishes_it(tmp_path: Path,
                                                                                     change: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"x" * (1000 if change != "size" else 999))  # the manifest's 1,000 bytes
    data = job_dir(tmp_path, input_path=str(source))
    if change == "note":  # what a producer that read a changed line leaves
        (data / JOB_DIR / INPUT_CHANGED_NAME).write_text(f"{source}:3: request 2 (byte 200) is not the line the job "
                                                         f"read when it started")
    code, said = status(data)
    last = said.splitlines()[-1]
    assert code == 0 and said.startswith("job stopped: 2 of 10 requests answered"), said
    if change == "none":
        assert last == f"the same run-batch command (with --data-dir {data}) finishes it"
        return
    why = (f"{source}:3: request 2 (byte 200) is not the line the job read when it started" if change == "note"
           else f"the input file {source} is 999 bytes now; the job's was 1,000 bytes")
    assert last == (f"its input changed ({why}), and a run refuses it: with the input as it was, the same run-batch "
                    f"command (with --data-dir {data}) finishes the job; to run the file as it is now, give another "
                    f"--data-dir"), last


def test_paths_from_the_jobs_files_are_shown_escaped_never_as_control_characters(tmp_path: Path) -> None:
    hostile = "/jobs/\x1b[31mRED\n\r\x1b]0;title\x07.jsonl"
    data = job_dir(tmp_path, input_path=hostile)
    code, said = status(data)
    assert code == 0 and not any(c in said for c in "\x1b\r\x07") and said.count("\n") == 2, said
    assert f"input {hostile!r}, output /jobs/out.jsonl" in said
