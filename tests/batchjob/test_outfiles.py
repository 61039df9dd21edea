"""pipeline.batchjob.outfiles: a file the job writes for the user replaces nothing the user
made while the job ran. Whatever appears at the name after the check (a file, a FIFO, a
hard link, an edit of the job's own file) is left as it is and named in the error; a
directory swapped for a symlink mid-run does not redirect the write; completion-order logs
open only the job's own file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import pytest

from pipeline.batchjob.outfiles import ABSENT, OWN, REPLACE, OwnFiles, Publish, Target, identity, open_log
from pipeline.wire.errors import JobPathError
from tests.batchjob.batchfiles import without_tmpfile


@pytest.fixture(params=[True, False], ids=["O_TMPFILE", "a named temporary file"])
def tmpfile(request: pytest.FixtureRequest) -> Iterator[bool]:
    with nullcontext() if request.param else without_tmpfile():
        yield request.param


def publish(target: Target, data: bytes = b"answers\n") -> list[int]:
    out = Publish(target)
    try:
        out.write(data)
        return out.commit()
    finally:
        out.abandon()
        target.close()


def test_an_absent_file_is_made_whole_and_its_identity_returned(tmp_path: Path, tmpfile: bool) -> None:
    made = publish(Target.open("output file", str(tmp_path / "out.jsonl"), ABSENT))
    info = os.stat(tmp_path / "out.jsonl")
    assert (tmp_path / "out.jsonl").read_bytes() == b"answers\n" and info.st_mode & 0o777 == 0o600
    assert made == [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns]
    assert os.listdir(tmp_path) == ["out.jsonl"]


@pytest.mark.parametrize("appeared", ["file", "fifo", "symlink"])
def test_what_appears_at_an_absent_name_while_the_job_runs_is_left_as_it_is(tmp_path: Path, tmpfile: bool,
                                                                           appeared: str) -> None:
    path = tmp_path / "out.jsonl"
    target = Target.open("output file", str(path), ABSENT)
    if appeared == "file":
        path.write_text("the user's\n")
    elif appeared == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(JobPathError, match="output file .* appeared while the job ran .* same command"):
        publish(target)
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl"]
    if appeared == "file":
        assert path.read_text() == "the user's\n"
    assert path.is_symlink() == (appeared == "symlink") and path.is_fifo() == (appeared == "fifo")


def test_a_replaced_file_must_still_be_a_regular_file_of_one_link(tmp_path: Path, tmpfile: bool) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    publish(Target.open("output file", str(path), REPLACE))
    assert path.read_text() == "answers\n"
    target = Target.open("output file", str(path), REPLACE)
    os.link(path, tmp_path / "second-name")
    with pytest.raises(JobPathError, match="hard link"):
        publish(target)
    assert (tmp_path / "second-name").read_text() == "answers\n"
    os.unlink(tmp_path / "second-name")
    target = Target.open("output file", str(path), REPLACE)
    os.unlink(path)
    os.mkfifo(path)
    with pytest.raises(JobPathError, match="is not the file this job wrote or was allowed to replace"):
        publish(target)
    assert path.is_fifo() and sorted(os.listdir(tmp_path)) == ["out.jsonl"]


def test_the_jobs_own_file_is_replaced_only_while_it_is_unchanged(tmp_path: Path, tmpfile: bool) -> None:
    path = tmp_path / "out.jsonl"
    made = publish(Target.open("output file", str(path), ABSENT))
    publish(Target.open("output file", str(path), OWN, made), b"again\n")
    assert path.read_text() == "again\n"  # `made` named the file before: now another inode
    made = publish(Target.open("output file", str(path), REPLACE))
    target = Target.open("output file", str(path), OWN, made)
    with path.open("a") as edit:  # the user edits it in place
        edit.write("a note\n")
    with pytest.raises(JobPathError, match="not the file this job wrote"):
        publish(target)
    assert path.read_text() == "answers\na note\n"


def test_a_directory_swapped_for_a_symlink_mid_run_does_not_redirect_the_write(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    target = Target.open("output file", str(tmp_path / "runs" / "out.jsonl"), ABSENT)
    os.rename(tmp_path / "runs", tmp_path / "runs.moved")
    (tmp_path / "runs").symlink_to(tmp_path / "elsewhere")
    publish(target)
    assert os.listdir(tmp_path / "elsewhere") == []
    assert (tmp_path / "runs.moved" / "out.jsonl").read_text() == "answers\n"


def test_a_completion_log_is_the_jobs_own_file_or_a_fresh_one(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    target = Target.open("output file", str(path), ABSENT)
    fd = open_log(target, fresh=True)
    os.write(fd, b"line\n")
    own = identity(os.fstat(fd))
    os.close(fd)
    target.close()
    again = Target.open("output file", str(path), OWN, own)
    fd = open_log(again, fresh=False)  # appended to, as it is
    os.write(fd, b"more\n")
    os.close(fd)
    assert path.read_text() == "line\nmore\n"
    os.rename(path, tmp_path / "kept")  # (kept: a new file may get a deleted one's inode number)
    path.write_text("the user's\n")  # another file at the name: not appended to
    with pytest.raises(JobPathError, match="not the file this job wrote"):
        open_log(again, fresh=False)
    assert path.read_text() == "the user's\n"
    again.close()


def test_a_fifo_at_a_completion_logs_name_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    target = Target.open("output file", str(path), REPLACE)
    os.mkfifo(path)  # no reader: a blocking open for writing would hang
    with pytest.raises(JobPathError, match="is not the file this job wrote"):
        open_log(target, fresh=True)
    assert path.is_fifo()
    target.close()
    target = Target.open("output file", str(path), ABSENT)
    with pytest.raises(JobPathError, match="appeared before the job could create it"):
        open_log(target, fresh=True)
    target.close()


def test_own_files_are_remembered_by_path_across_opens(tmp_path: Path) -> None:
    (tmp_path / "job").mkdir()
    own = OwnFiles(str(tmp_path))
    assert own.own(str(tmp_path / "out.jsonl")) is None
    own.made(str(tmp_path / "out.jsonl"), [1, 2])
    assert OwnFiles(str(tmp_path)).own(str(tmp_path / "out.jsonl")) == [1, 2]
    (tmp_path / "job" / "outputs.json").write_text("[not a map")
    assert OwnFiles(str(tmp_path)).own(str(tmp_path / "out.jsonl")) is None
