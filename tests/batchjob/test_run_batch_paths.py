"""`pipeline run-batch` never writes, replaces or deletes a path it did not create: every
output path is checked before anything runs (real commands, real files, the sim engine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.jobs import (
    ROOT,
    RUN_TIMEOUT_S,
    answered_lines,
    build_model,
    chat,
    rows_by_id,
    run_batch,
    start_batch,
    wait_until,
    write_requests,
)

# The sim's cost where a test changes a path while the job runs: it lasts seconds.
SLOW_COST = "[engine_options]\ncost_s_per_padded_token = 1e-3\n"

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


def test_files_the_user_put_inside_the_data_directorys_folders_stay_and_are_named(tmp_path, job, model_dir):
    out = tmp_path / "out.jsonl"
    first = run_batch("-i", str(job), "-o", str(out), "--model", model_dir, "--keep-data-dir")
    assert first.returncode == 0, first.stderr
    data = tmp_path / "out.jsonl.run"
    (run,) = (data / "results").iterdir()
    theirs = {"job/notes.txt": "mine2", "results/mydir/x": "m3", "segments/keep.seg": "m4",
              f"results/{run.name}/mine.txt": "m5"}
    for name, text in theirs.items():
        (data / name).parent.mkdir(exist_ok=True)
        (data / name).write_text(text)
    again = run_batch("-i", str(job), "-o", str(out), "--model", model_dir)
    assert again.returncode == 0, again.stderr
    assert {name: (data / name).read_text() for name in theirs} == theirs
    left = sorted(str(p.relative_to(data)) for p in data.rglob("*"))
    assert left == sorted({*theirs, "job", "results", "results/mydir", f"results/{run.name}", "segments"})
    assert "was kept: it holds" in again.stderr and "job/notes.txt" in again.stderr, again.stderr
    assert len(rows_by_id(out)) == 6


def _slow_job(tmp_path: Path, folder: Path) -> list[str]:
    """A job of 400 requests lasting seconds, its output (and default data directory) in `folder`."""
    source = write_requests(tmp_path / "in.jsonl", [chat(f"r{k}", f"question {k} " + "word " * (k % 7))
                                                    for k in range(400)])
    config = tmp_path / "slow.toml"
    config.write_text(SLOW_COST)
    return ["-i", str(source), "-o", str(folder / "out.jsonl"), "--config", str(config)]


def _answers(path: Path) -> dict[str, object]:
    return {key: (row["response"]["status_code"], row["response"]["body"]["choices"])
            for key, row in rows_by_id(path).items()}


def _tree(top: Path) -> list[str]:
    return sorted(str(p.relative_to(top)) for p in top.rglob("*"))


def test_an_output_folder_moved_away_mid_run_for_a_link_stops_the_job_writing_nothing_there(tmp_path, model_dir):
    folder, moved, victim = tmp_path / "d", tmp_path / "d.orig", tmp_path / "victim"
    folder.mkdir()
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    args = [*_slow_job(tmp_path, folder), "--model", model_dir]
    job = start_batch(*args)
    try:
        wait_until(lambda: answered_lines(folder / "out.jsonl.run") >= 20 or job.poll() is not None, "answers")
        assert job.poll() is None, "the job ended before the folder moved"
        folder.rename(moved)
        folder.symlink_to(victim)
        _out, err = job.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 1, err
    assert _tree(victim) == ["keep.txt"] and (victim / "keep.txt").read_text() == "precious"
    assert "Traceback" not in err, err
    said = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(said) == 1 and "not the folder this run started in" in said[0], err
    assert "the same command continues" in said[0] and str(folder / "out.jsonl.run") in said[0]
    folder.unlink()
    moved.rename(folder)
    again = run_batch(*args)
    assert again.returncode == 0, again.stderr
    reference = tmp_path / "reference"
    reference.mkdir()
    assert run_batch(*_slow_job(reference, reference), "--model", model_dir).returncode == 0
    assert _answers(folder / "out.jsonl") == _answers(reference / "out.jsonl")


def test_a_folder_link_pointed_elsewhere_mid_run_changes_nothing_for_the_job(tmp_path, model_dir):
    first, second, link = tmp_path / "a", tmp_path / "b", tmp_path / "link"
    first.mkdir()
    second.mkdir()
    link.symlink_to(first)
    args = [*_slow_job(tmp_path, link), "--model", model_dir]
    job = start_batch(*args)
    try:
        wait_until(lambda: answered_lines(first / "out.jsonl.run") >= 20 or job.poll() is not None, "answers")
        assert job.poll() is None, "the job ended before the link changed"
        (tmp_path / "link.new").symlink_to(second)
        (tmp_path / "link.new").rename(link)  # as `ln -sfn b link` does
        _out, err = job.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err
    assert _tree(second) == []  # the job went on in the folder it checked, and only there
    assert len(rows_by_id(first / "out.jsonl")) == 400 and not (first / "out.jsonl.run").exists()


def test_paths_with_control_characters_are_said_escaped_and_one_request_is_one(tmp_path, model_dir):
    source = write_requests(tmp_path / "in\x1b[31m.jsonl", [chat("only")])
    out = tmp_path / "out\x1b]0;title\x07\r.jsonl"
    done = run_batch("-i", str(source), "-o", str(out), "--model", model_dir)
    assert done.returncode == 0, done.stderr
    assert not any(c in done.stderr for c in "\x1b\r\x07"), done.stderr
    assert f"run-batch: 1 request in {str(source)!r}: 0 answered already" in done.stderr
    assert f"run-batch: wrote {str(out)!r}, {str(out) + '.summary.json'!r}" in done.stderr
    again = run_batch("-i", str(source), "-o", str(out), "--model", model_dir)  # exists: refused naming it
    refused(again, "exists: pass --overwrite")
    assert not any(c in again.stderr for c in "\x1b\r\x07") and "out\\x1b]0;title\\x07\\r.jsonl" in again.stderr
