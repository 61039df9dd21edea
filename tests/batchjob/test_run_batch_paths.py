"""`pipeline run-batch` never writes, replaces or deletes a path it did not create: every
output path is checked before anything runs (real commands, real files, the sim engine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.jobs import ROOT, RUN_TIMEOUT_S, build_model, chat, rows_by_id, run_batch, write_requests

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture
def job(tmp_path: Path) -> Path:
    return write_requests(tmp_path / "in.jsonl", [chat(f"r{k}") for k in range(6)])


def refused(done: subprocess.CompletedProcess, *words: str, code: int = 1) -> None:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") <= (2 if code == 1 else 5), done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


def test_a_report_naming_the_output_or_the_input_is_refused_and_nothing_is_touched(tmp_path, job, model_dir):
    out = tmp_path / "out.jsonl"
    refused(run_batch("-i", str(job), "-o", str(out), "--model", model_dir, "--report", str(out)), "is also")
    before = job.read_bytes()
    refused(run_batch("-i", str(job), "-o", str(out), "--model", model_dir, "--report", str(job)), "input file")
    refused(run_batch("-i", str(job), "-o", str(out), "--model", model_dir, "--error-file", str(out)), "is also")
    refused(run_batch("-i", str(job), "-o", str(out), "--model", model_dir, "--summary-file", str(job)),
            "input file")
    assert job.read_bytes() == before and not out.exists() and not (tmp_path / "out.jsonl.run").exists()


def test_an_output_inside_the_data_directory_is_refused(tmp_path, job, model_dir):
    data = tmp_path / "data"
    refused(run_batch("-i", str(job), "-o", str(data / "out.jsonl"), "--model", model_dir, "--data-dir", str(data)),
            "inside the data directory")
    assert not data.exists()


def test_a_default_data_directory_holding_the_users_files_is_refused_and_kept(tmp_path, job, model_dir):
    out = tmp_path / "out.jsonl"
    theirs = tmp_path / "out.jsonl.run"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    refused(run_batch("-i", str(job), "-o", str(out), "--model", model_dir), "is not a batch job's", "notes.txt")
    assert (theirs / "notes.txt").read_text() == "mine" and not out.exists()


def test_a_data_directory_another_command_used_is_refused(tmp_path, job, model_dir):
    data = tmp_path / "data"
    launched = subprocess.run([sys.executable, "-m", "pipeline", "launch", "--items", "200", "--data-dir", str(data)],
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    assert launched.returncode == 0, launched.stderr
    listing = sorted(os.listdir(data))
    refused(run_batch("-i", str(job), "-o", str(tmp_path / "out.jsonl"), "--model", model_dir, "--data-dir", str(data)),
            "not a batch job's", "another run")
    assert sorted(os.listdir(data)) == listing


@pytest.mark.parametrize("kind", ["device", "fifo", "symlink", "directory"])
def test_an_output_that_is_not_a_regular_file_is_refused(tmp_path, job, model_dir, kind):
    if kind == "device":
        target = Path("/dev/null")
        info = os.stat(target)
    elif kind == "fifo":
        target = tmp_path / "pipe"
        os.mkfifo(target)
    elif kind == "symlink":
        target = tmp_path / "link"
        (tmp_path / "real.jsonl").write_text("keep\n")
        target.symlink_to(tmp_path / "real.jsonl")
    else:
        target = tmp_path / "folder"
        target.mkdir()
    refused(run_batch("-i", str(job), "-o", str(target), "--model", model_dir, "--data-dir", str(tmp_path / "d"),
                      "--overwrite"), str(target), code=2 if kind == "directory" else 1)  # click's usage error
    assert not (tmp_path / "d").exists()
    if kind == "device":
        assert os.stat(target).st_rdev == info.st_rdev and not target.is_file()
    if kind == "fifo":
        assert Path(target).is_fifo()
    if kind == "symlink":
        assert target.is_symlink() and (tmp_path / "real.jsonl").read_text() == "keep\n"


def test_an_existing_output_is_replaced_only_when_asked_or_when_the_job_wrote_it(tmp_path, job, model_dir):
    out, data = tmp_path / "out.jsonl", tmp_path / "data"
    out.write_text("the user's\n")
    args = ["-i", str(job), "-o", str(out), "--model", model_dir, "--data-dir", str(data)]
    refused(run_batch(*args), "exists", "--overwrite")
    assert out.read_text() == "the user's\n"
    done = run_batch(*args, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert len(rows_by_id(out)) == 6
    again = run_batch(*args)  # the job's own output, as it wrote it: the same command may write it again
    assert again.returncode == 0, again.stderr
    out.write_text("edited by the user\n")
    refused(run_batch(*args), "exists")
    assert out.read_text() == "edited by the user\n"


def test_an_output_directory_the_job_cannot_write_is_refused_before_anything_runs(tmp_path, job, model_dir):
    locked = tmp_path / "locked"
    locked.mkdir()
    made = subprocess.run(["chattr", "+i", str(locked)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"chattr +i is not available here: {made.stderr.strip()}")
    try:
        refused(run_batch("-i", str(job), "-o", str(locked / "out.jsonl"), "--model", model_dir,
                          "--data-dir", str(tmp_path / "data")), "cannot write in")
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
    assert not (tmp_path / "data").exists()


def test_the_default_data_directory_goes_but_files_the_user_put_in_it_stay(tmp_path, job, model_dir):
    out = tmp_path / "out.jsonl"
    first = run_batch("-i", str(job), "-o", str(out), "--model", model_dir, "--keep-data-dir")
    assert first.returncode == 0, first.stderr
    data = tmp_path / "out.jsonl.run"
    (data / "mine.txt").write_text("keep me")
    again = run_batch("-i", str(job), "-o", str(out), "--model", model_dir)
    assert again.returncode == 0, again.stderr
    assert (data / "mine.txt").read_text() == "keep me" and sorted(os.listdir(data)) == ["mine.txt"]
    assert "was kept" in again.stderr
