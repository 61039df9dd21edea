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

MARK = b"0123456789abcdef"


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
    fd = open_log(target, True, MARK)
    os.write(fd, b"line\n")
    own = identity(os.fstat(fd))
    os.close(fd)
    target.close()
    again = Target.open("output file", str(path), OWN, own)
    fd = open_log(again, False, MARK)  # appended to, as it is
    os.write(fd, b"more\n")
    os.close(fd)
    assert path.read_text() == "line\nmore\n"
    os.rename(path, tmp_path / "kept")  # (kept: a new file may get a deleted one's inode number)
    path.write_text("the user's\n")  # another file at the name: not appended to
    with pytest.raises(JobPathError, match="not the file this job wrote"):
        open_log(again, False, MARK)
    assert path.read_text() == "the user's\n"
    again.close()


def test_a_fifo_at_a_completion_logs_name_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    target = Target.open("output file", str(path), REPLACE)
    os.mkfifo(path)  # no reader: a blocking open for writing would hang
    with pytest.raises(JobPathError, match="is not the file this job wrote"):
        open_log(target, True, MARK)
    assert path.is_fifo()
    target.close()
    target = Target.open("output file", str(path), ABSENT)
    with pytest.raises(JobPathError, match="appeared before the job could create it"):
        open_log(target, True, MARK)
    target.close()


def test_own_files_are_remembered_by_path_across_opens(tmp_path: Path) -> None:
    (tmp_path / "job").mkdir()
    own = OwnFiles(str(tmp_path))
    assert own.own(str(tmp_path / "out.jsonl")) is None
    own.made(str(tmp_path / "out.jsonl"), [1, 2])
    assert OwnFiles(str(tmp_path)).own(str(tmp_path / "out.jsonl")) == [1, 2]
    (tmp_path / "job" / "outputs.json").write_text("[not a map")
    assert OwnFiles(str(tmp_path)).own(str(tmp_path / "out.jsonl")) is None


def test_a_file_replaced_after_the_check_is_not_what_overwrite_allowed(tmp_path: Path, tmpfile: bool) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text("the file --overwrite named\n")
    target = Target.open("output file", str(path), REPLACE)
    (tmp_path / "x.tmp").write_text("another, put there since\n")
    os.rename(tmp_path / "x.tmp", path)
    with pytest.raises(JobPathError, match="is not the file this job wrote or was allowed to replace"):
        publish(target)
    assert path.read_text() == "another, put there since\n"


def test_a_fresh_log_never_cuts_the_file_another_job_appends_to(tmp_path: Path) -> None:
    path = tmp_path / "same.jsonl"
    first = Target.open("output file", str(path), ABSENT)
    theirs = open_log(first, True, b"job-a")
    os.write(theirs, b"job a's answer\n")
    second = Target.open("output file", str(path), REPLACE)  # job b, --overwrite
    mine = open_log(second, True, b"job-b")
    os.write(mine, b"job b's answer\n")
    os.write(theirs, b"job a's second answer\n")
    assert os.pread(theirs, 100, 0) == b"job a's answer\njob a's second answer\n"  # its own inode, whole
    assert path.read_bytes() == b"job b's answer\n"
    assert identity(os.fstat(theirs)) != identity(os.stat(path))  # job a sees its file replaced at its end
    for fd in (theirs, mine):
        os.close(fd)
    first.close()
    second.close()
    assert sorted(os.listdir(tmp_path)) == ["same.jsonl"]


def test_a_file_made_on_a_deleted_logs_inode_number_is_not_the_jobs(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    target = Target.open("output file", str(path), ABSENT)
    fd = open_log(target, True, MARK)
    own = identity(os.fstat(fd))
    os.close(fd)
    target.close()
    files = OwnFiles(str(tmp_path), MARK)
    (tmp_path / "job").mkdir()
    files.made(str(path), own)
    assert files.own(str(path)) == own
    os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)  # the user's file: maybe the same inode number
    os.close(fd)
    os.truncate(path, 0)
    if identity(os.stat(path)) == own:  # the case itself: the device and inode say "the job's"
        assert files.own(str(path)) is None
    again = Target.open("output file", str(path), OWN, identity(os.stat(path)))
    with pytest.raises(JobPathError, match="is not the file this job wrote"):
        open_log(again, False, MARK)
    again.close()


def test_temporary_names_beside_the_output_are_never_a_users(tmp_path: Path, tmpfile: bool) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    (tmp_path / ".out.jsonl.partial").write_text("the user's own file of that name\n")
    publish(Target.open("output file", str(path), REPLACE))
    assert path.read_text() == "answers\n"
    assert (tmp_path / ".out.jsonl.partial").read_text() == "the user's own file of that name\n"
    assert sorted(os.listdir(tmp_path)) == [".out.jsonl.partial", "out.jsonl"]


@pytest.mark.parametrize("length", [1, 233, 234, 255])
def test_a_name_as_long_as_the_file_system_allows_is_written_and_replaced(tmp_path: Path, tmpfile: bool,
                                                                          length: int) -> None:
    # The temporary name beside it adds 22 bytes: it is cut to fit, never longer than a name may be.
    path = tmp_path / ("c" * length)
    publish(Target.open("output file", str(path), ABSENT))
    assert path.read_bytes() == b"answers\n"
    publish(Target.open("output file", str(path), REPLACE), b"again\n")
    assert path.read_bytes() == b"again\n" and os.listdir(tmp_path) == [path.name]
    log = Target.open("error file", str(tmp_path / ("e" * length)), ABSENT)
    os.close(open_log(log, True, MARK))  # a completion-order log is made under a temporary name too
    log.close()
    assert sorted(os.listdir(tmp_path)) == sorted([path.name, "e" * length])


def test_a_log_another_run_of_the_job_appends_to_is_refused(tmp_path: Path) -> None:
    # Two runs of one job from copies of its data directory: the same job, the same mark,
    # the same file. The second is refused while the first holds the log open.
    path = tmp_path / "out.jsonl"
    first = Target.open("output file", str(path), ABSENT)
    fd = open_log(first, True, MARK)
    own = identity(os.fstat(fd))
    second = Target.open("output file", str(path), OWN, own)
    with pytest.raises(JobPathError, match="another run of this job appends to it"):
        open_log(second, False, MARK)
    os.close(fd)  # the first run ends: the log is the second's to append to
    os.close(open_log(second, False, MARK))
    first.close()
    second.close()
