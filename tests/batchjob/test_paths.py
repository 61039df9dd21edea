"""pipeline.batchjob.paths: each rule of the module at its case. A job never writes, replaces
or deletes a path it did not create, never a device, FIFO, socket, directory or a symlink's
target; its outputs are apart from each other, from the input and from the data directory;
a file is replaced whole or not at all, owner-only, leaving nothing when it fails."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import pytest

from pipeline.batchjob.paths import (
    PARTIAL_SUFFIX,
    WRITE_CHUNK_BYTES,
    OutputPath,
    ReplacingFile,
    check_input,
    check_outputs,
    partial_path,
    remove_partial,
    replace_file,
)
from pipeline.wire import fileops
from pipeline.wire.errors import JobPathError
from tests.batchjob.batchfiles import without_tmpfile
from tests.support.jobs import ROOT
from tests.support.users import effective, other_user


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """A folder with an input file and, beside it, where a data directory goes."""
    (tmp_path / "in.jsonl").write_text("{}\n")
    return tmp_path


def check(job: Path, *paths: str | Path, own: tuple[str, ...] = (), overwrite: bool = False) -> None:
    """check_outputs of an output file and more outputs, for the job in `job`."""
    roles = ["output file", "error file", "run report", "job summary"]
    outputs = [OutputPath(role, os.path.abspath(path)) for role, path in zip(roles, paths)]

    def stored(path: str) -> list[int] | None:  # the identity the job stored for its own files
        if path not in own:
            return None
        info = os.stat(path)
        return [info.st_dev, info.st_ino]

    check_outputs(outputs, str(job / "in.jsonl"), str(job / "data"), stored, overwrite)


@pytest.fixture
def unix_socket(job: Path) -> Iterator[Path]:
    path = job / "sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    yield path
    server.close()


# --- the input --------------------------------------------------------------------------------


def test_the_input_is_an_existing_regular_file(job: Path) -> None:
    assert check_input(str(job / "in.jsonl")) == str(job / "in.jsonl")
    (job / "link.jsonl").symlink_to(job / "in.jsonl")
    assert check_input(str(job / "link.jsonl")) == str(job / "link.jsonl")  # read through, never written
    with pytest.raises(JobPathError, match="does not exist"):
        check_input(str(job / "absent.jsonl"))
    os.mkfifo(job / "fifo")
    for path, kind in ((job, "a directory"), (job / "fifo", "a FIFO"), (Path("/dev/null"), "a character device")):
        with pytest.raises(JobPathError, match=f"input file {path}: not a regular file \\({kind}\\)"):
            check_input(str(path))


# --- the outputs ------------------------------------------------------------------------------


def test_new_outputs_in_a_writable_directory_pass_and_leave_nothing(job: Path) -> None:
    before = sorted(os.listdir(job))
    check(job, job / "out.jsonl", job / "errors.jsonl", job / "report.json", job / "summary.json")
    with without_tmpfile():
        check(job, job / "out.jsonl", job / "errors.jsonl")
    assert sorted(os.listdir(job)) == before


@pytest.mark.parametrize("kind", ["fifo", "device", "socket", "directory"])
def test_an_output_that_is_not_a_regular_file_is_refused(job: Path, request: pytest.FixtureRequest,
                                                         kind: str) -> None:
    if kind == "fifo":
        path, words = job / "out.jsonl", "is a FIFO, not a regular file"
        os.mkfifo(path)
    elif kind == "device":
        path, words = Path("/dev/null"), "is a character device, not a regular file"
    elif kind == "socket":
        path, words = request.getfixturevalue("unix_socket"), "is a socket, not a regular file"
    else:
        path, words = job / "out.jsonl", "is a directory, not a regular file"
        path.mkdir()
    for overwrite in (False, True):
        with pytest.raises(JobPathError, match=f"output file {path} {words}"):
            check(job, path, overwrite=overwrite)
    with pytest.raises(JobPathError, match=f"error file {path} {words}"):
        check(job, job / "other.jsonl", path, overwrite=True)


@pytest.mark.parametrize("target", ["a file", "nothing"])
def test_an_output_that_is_a_symlink_is_refused(job: Path, target: str) -> None:
    victim = job / "victim.txt"
    if target == "a file":
        victim.write_text("mine\n")
    (job / "out.jsonl").symlink_to(victim)
    for overwrite in (False, True):
        with pytest.raises(JobPathError, match="is a symbolic link: give the path it points to"):
            check(job, job / "out.jsonl", overwrite=overwrite)
    assert (victim.read_text() == "mine\n") if target == "a file" else not victim.exists()


def test_an_output_that_is_the_input_is_refused(job: Path) -> None:
    with pytest.raises(JobPathError, match="output file .* is also the input file"):
        check(job, job / "in.jsonl", overwrite=True)
    with pytest.raises(JobPathError, match="run report .* is also the input file"):
        check(job, job / "out.jsonl", job / "errors.jsonl", job / "sub" / ".." / "in.jsonl", overwrite=True)
    (job / "link.jsonl").symlink_to(job / "in.jsonl")
    with pytest.raises(JobPathError, match="is also the input file"):
        check(job, job / "link.jsonl", overwrite=True)
    os.link(job / "in.jsonl", job / "hard.jsonl")  # another name of the same file
    with pytest.raises(JobPathError, match="output file .*hard.jsonl is also the input file"):
        check(job, job / "hard.jsonl", overwrite=True)


def test_two_outputs_the_same_are_refused(job: Path) -> None:
    with pytest.raises(JobPathError, match="error file .* is also the output file: give each its own path"):
        check(job, job / "out.jsonl", job / "out.jsonl")
    with pytest.raises(JobPathError, match="job summary .* is also the run report"):
        check(job, job / "out.jsonl", job / "errors.jsonl", job / "report.json", job / "." / "report.json")


def test_two_outputs_that_are_hard_links_of_one_file_are_one_file(job: Path) -> None:
    (job / "out.jsonl").write_text("the user's\n")
    os.link(job / "out.jsonl", job / "errors.jsonl")
    with pytest.raises(JobPathError, match="error file .*errors.jsonl is also the output file"):
        check(job, job / "out.jsonl", job / "errors.jsonl", overwrite=True)


# Run in a private mount namespace where TOP/bm is TOP bind-mounted: every path below names
# a file of TOP by another spelling, which no real path resolves.
_THROUGH_A_BIND_MOUNT = """
import json, os, subprocess, sys
from pipeline.batchjob.paths import OutputPath, check_outputs
from pipeline.wire.errors import JobPathError
top = sys.argv[1]
subprocess.run(["mount", "--bind", top, os.path.join(top, "bm")], check=True)
found = []
for paths in (["out.jsonl", "bm/out.jsonl"], ["bm/in.jsonl"], ["bm/data/out.jsonl"]):
    outputs = [OutputPath(role, os.path.join(top, path)) for role, path in zip(("output file", "error file"), paths)]
    try:
        check_outputs(outputs, os.path.join(top, "in.jsonl"), os.path.join(top, "data"), lambda path: None, True)
        found.append(None)
    except JobPathError as exc:
        found.append(str(exc))
print(json.dumps([found, sorted(os.listdir(top))]))
"""


@pytest.mark.integration  # mount(8): a process
def test_outputs_that_are_one_file_through_a_bind_mount_are_refused_before_anything_is_made(job: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("a bind mount needs root")
    (job / "bm").mkdir()
    (job / "data").mkdir()
    private = ["unshare", "--mount", "--propagation", "private"]
    done = subprocess.run([*private, sys.executable, "-c", _THROUGH_A_BIND_MOUNT, str(job)], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"no private mount namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    (error_file, output_file, inside), left = json.loads(done.stdout)
    assert error_file.startswith(f"error file {job}/bm/out.jsonl is also the output file"), error_file
    assert output_file.startswith(f"output file {job}/bm/in.jsonl is also the input file"), output_file
    assert inside.startswith(f"output file {job}/bm/data/out.jsonl is inside the data directory"), inside
    assert left == ["bm", "data", "in.jsonl"]


@pytest.mark.parametrize("where", ["data/out.jsonl", "data/job/out.jsonl", "data", "link/out.jsonl"])
def test_an_output_inside_the_data_directory_is_refused(job: Path, where: str) -> None:
    (job / "data" / "job").mkdir(parents=True)
    (job / "link").symlink_to(job / "data")
    with pytest.raises(JobPathError, match="is inside the data directory .*, where the job keeps its own files"):
        check(job, job / where, overwrite=True)


def test_an_existing_file_is_replaced_only_with_overwrite_or_when_it_is_the_jobs_own(job: Path) -> None:
    (job / "out.jsonl").write_text("the user's\n")
    with pytest.raises(JobPathError, match="output file .* exists: pass --overwrite to replace it"):
        check(job, job / "out.jsonl")
    check(job, job / "out.jsonl", overwrite=True)
    check(job, job / "out.jsonl", own=(str(job / "out.jsonl"),))
    with pytest.raises(JobPathError, match="exists"):
        check(job, job / "out.jsonl", own=(str(job / "other.jsonl"),))
    assert (job / "out.jsonl").read_text() == "the user's\n"


def test_an_output_in_a_missing_directory_is_refused_before_the_job(job: Path) -> None:
    with pytest.raises(JobPathError, match=r"output file .*: cannot write in .*absent: ENOENT"):
        check(job, job / "absent" / "out.jsonl")


@pytest.mark.integration
@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "a probe file"])
def test_an_output_in_a_directory_the_job_cannot_write_is_refused_before_the_job(tmpfile: bool) -> None:
    with other_user() as user:
        top = tempfile.mkdtemp(prefix="sbrk-paths-", dir="/tmp")
        try:
            os.chmod(top, 0o755)  # others may look, not write
            Path(top, "in.jsonl").write_text("{}\n")
            Path(top, "in.jsonl").chmod(0o644)
            with effective(user), nullcontext() if tmpfile else without_tmpfile():
                with pytest.raises(JobPathError, match=r"output file .*out.jsonl: cannot write in .*: EACCES"):
                    check(Path(top), Path(top, "out.jsonl"))
            assert sorted(os.listdir(top)) == ["in.jsonl"]
        finally:
            shutil.rmtree(top)


# --- replacing a file -------------------------------------------------------------------------


@pytest.fixture(params=[True, False], ids=["O_TMPFILE", "a named temporary file"])
def tmpfile(request: pytest.FixtureRequest) -> Iterator[bool]:
    with nullcontext() if request.param else without_tmpfile():
        yield request.param


def test_a_file_is_replaced_whole_and_owner_only(job: Path, tmpfile: bool) -> None:
    path = job / "out.jsonl"
    path.write_text("old\n")
    os.chmod(path, 0o644)
    previous = os.umask(0)
    try:
        replace_file(str(path), [b"a\n", b"b" * (WRITE_CHUNK_BYTES + 3), b"\n"])
    finally:
        os.umask(previous)
    assert path.read_bytes() == b"a\n" + b"b" * (WRITE_CHUNK_BYTES + 3) + b"\n"
    assert os.stat(path).st_mode & 0o777 == 0o600
    replace_file(str(job / "new.json"), [])
    assert (job / "new.json").read_bytes() == b"" and os.stat(job / "new.json").st_mode & 0o777 == 0o600
    assert sorted(os.listdir(job)) == ["in.jsonl", "new.json", "out.jsonl"]


def test_a_failure_midway_leaves_the_older_file_and_nothing_else(job: Path, tmpfile: bool) -> None:
    path = job / "out.jsonl"
    path.write_text("the older output\n")

    def chunks() -> Iterator[bytes]:
        yield b"{}\n"
        yield b"x" * (2 * WRITE_CHUNK_BYTES)  # some bytes reach the temporary file
        raise RuntimeError("the answers went away")

    with pytest.raises(RuntimeError, match="went away"):
        replace_file(str(path), chunks())
    assert path.read_text() == "the older output\n"
    assert sorted(os.listdir(job)) == ["in.jsonl", "out.jsonl"]
    with pytest.raises(KeyboardInterrupt):
        replace_file(str(job / "new.jsonl"), (b"x" if k == 0 else _interrupt() for k in range(2)))
    assert sorted(os.listdir(job)) == ["in.jsonl", "out.jsonl"]


def _interrupt() -> bytes:
    raise KeyboardInterrupt


class _Failing(fileops.FileIO):
    """A file system that fails one operation with `error`."""

    def __init__(self, op: str, error: int) -> None:
        self.op, self.error = op, error

    def _maybe_fail(self, op: str) -> None:
        if op == self.op:
            raise OSError(self.error, os.strerror(self.error))

    def write(self, fd: int, data) -> int:
        self._maybe_fail("write")
        return super().write(fd, data)

    def fsync(self, fd: int) -> None:
        self._maybe_fail("fsync")
        super().fsync(fd)

    def rename(self, source: str, target: str) -> None:
        self._maybe_fail("rename")
        super().rename(source, target)


@pytest.mark.parametrize(("op", "error"), [("write", errno.ENOSPC), ("fsync", errno.EIO), ("rename", errno.EXDEV)])
def test_a_failing_file_system_leaves_the_older_file_and_nothing_else(job: Path, tmpfile: bool, op: str,
                                                                      error: int) -> None:
    path = job / "out.jsonl"
    path.write_text("the older output\n")
    previous = fileops.install(_Failing(op, error))
    try:
        with pytest.raises(OSError) as caught:
            replace_file(str(path), [b"y" * 1000] * 3)
    finally:
        fileops.install(previous)
    assert caught.value.errno == error
    assert path.read_text() == "the older output\n"
    assert sorted(os.listdir(job)) == ["in.jsonl", "out.jsonl"]


def test_a_temporary_file_a_kill_left_is_removed_by_the_next_replace(job: Path) -> None:
    path = job / "out.jsonl"
    Path(partial_path(str(path))).write_text("torn")
    assert partial_path(str(path)) == str(job / f".out.jsonl{PARTIAL_SUFFIX}")
    with without_tmpfile():
        replace_file(str(path), [b"whole\n"])
    assert path.read_text() == "whole\n" and sorted(os.listdir(job)) == ["in.jsonl", "out.jsonl"]
    Path(partial_path(str(path))).write_text("torn")
    replace_file(str(path), [b"again\n"])  # O_TMPFILE: the name it links under is cleared first
    assert path.read_text() == "again\n" and sorted(os.listdir(job)) == ["in.jsonl", "out.jsonl"]


def test_a_temporary_name_that_is_a_link_is_never_written_through(job: Path, tmpfile: bool) -> None:
    victim = job / "victim.txt"
    victim.write_text("mine\n")
    path = job / "out.jsonl"
    Path(partial_path(str(path))).symlink_to(victim)
    with pytest.raises(FileExistsError):
        replace_file(str(path), [b"answers\n"])
    assert victim.read_text() == "mine\n" and not path.exists()
    remove_partial(str(path))  # a link is not ours to remove
    assert os.path.islink(partial_path(str(path)))


def test_abandon_is_idempotent_and_does_nothing_after_commit(job: Path, tmpfile: bool) -> None:
    out = ReplacingFile(str(job / "out.jsonl"))
    out.write(b"kept\n")
    out.commit()
    out.abandon()
    out.abandon()
    assert (job / "out.jsonl").read_text() == "kept\n"
    dropped = ReplacingFile(str(job / "dropped.jsonl"))
    dropped.write(b"x" * (WRITE_CHUNK_BYTES + 1))
    dropped.abandon()
    dropped.abandon()
    assert sorted(os.listdir(job)) == ["in.jsonl", "out.jsonl"]
