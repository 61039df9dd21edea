"""pipeline.batchjob.jobfiles: a job takes a data directory that is absent, empty or a job's
own; at its end it removes what the product made there, by name, and keeps every file of the
user's, in whatever folder, naming it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pipeline.batchjob.answers import LOG_NAME, RECORDS_NAME
from pipeline.batchjob.jobfiles import (
    JOB_MADE,
    STORE_ENTRIES,
    check_data_dir_is_the_jobs,
    remove_data_dir,
    remove_job_dir,
)
from pipeline.batchjob.manifest import JOB_DIR, MANIFEST_NAME, MODEL_COPY_DIR, MODEL_FILES, STATUS_NAME
from pipeline.batchjob.paths import partial_path
from pipeline.wire.errors import DataDirError, JobPathError

# Every name a run or a job makes at the top of a data directory, one of each.
TOP_ENTRIES = ("segments", "store.log",
               "broker-state.json", "shm-namespace", "run", "results", "job", "quarantine", "engine-cache")


def _write(top: Path, relative: str, text: str = "x") -> None:
    path = top / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _job_tree(data: Path) -> None:
    """A job's data directory as a run of it leaves it."""
    for name in ("segments/m00000/s00000000000000aa/l0000-0000000000.seg",
                 "results/run-20260101T000000Z-9/consumer0.jsonl",
                 "broker-state.json", "store.log", f"{JOB_DIR}/{MANIFEST_NAME}", f"{JOB_DIR}/{RECORDS_NAME}",
                 f"{JOB_DIR}/{LOG_NAME}", f"{JOB_DIR}/rejected/p0-123.jsonl", f"{JOB_DIR}/rejected/supervisor.jsonl",
                 f"{JOB_DIR}/merge/bucket-0000.bin", f"{JOB_DIR}/scan/ids-017.bin",
                 *(f"{JOB_DIR}/{MODEL_COPY_DIR}/{name}" for name in MODEL_FILES),
                 os.path.relpath(partial_path(str(data / JOB_DIR / STATUS_NAME)), data)):
        _write(data, name)


def test_a_data_directory_absent_empty_or_a_jobs_own_is_taken(tmp_path: Path) -> None:
    check_data_dir_is_the_jobs(str(tmp_path / "data"), has_manifest=False)
    (tmp_path / "data").mkdir()
    check_data_dir_is_the_jobs(str(tmp_path / "data"), has_manifest=False)
    (tmp_path / "data" / "segments").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("x")
    check_data_dir_is_the_jobs(str(tmp_path / "data"), has_manifest=True)


@pytest.mark.parametrize("entry", sorted(STORE_ENTRIES))
def test_a_data_directory_holding_a_store_of_another_run_is_refused_saying_so(tmp_path: Path, entry: str) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / entry).mkdir()
    (tmp_path / "data" / "results").mkdir()
    held = re.escape(", ".join(sorted([entry, "results"])))
    with pytest.raises(JobPathError, match=f"is not empty and is not a batch job's data directory .*: it holds "
                                           f"{held}; they are a store of another run"):
        check_data_dir_is_the_jobs(str(tmp_path / "data"), has_manifest=False)


@pytest.mark.parametrize("entry", sorted(set(TOP_ENTRIES) - STORE_ENTRIES) + ["photo"])
def test_a_data_directory_of_the_users_files_is_refused_as_not_empty_not_as_another_runs(tmp_path: Path,
                                                                                          entry: str) -> None:
    (tmp_path / "data" / entry / "mine").mkdir(parents=True)  # results/mine/x: the user's folder, not a run's
    (tmp_path / "data" / entry / "mine" / "x").write_text("x")
    with pytest.raises(JobPathError) as refused:
        check_data_dir_is_the_jobs(str(tmp_path / "data"), has_manifest=False)
    said = str(refused.value)
    assert f"is not empty and is not a batch job's data directory (it has no job manifest): it holds {entry}; " \
           f"give another --data-dir" in said, said
    assert "another run" not in said and "store" not in said


def test_a_data_directory_of_the_users_files_is_refused_naming_them(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    for k in range(7):
        (tmp_path / "data" / f"photo-{k}.jpg").write_text("x")
    with pytest.raises(JobPathError, match=r"it holds photo-0.jpg, .*photo-4.jpg, \.\.\.; give another"):
        check_data_dir_is_the_jobs(str(tmp_path / "data"), has_manifest=False)


def test_a_data_directory_that_is_not_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data").write_text("x")
    with pytest.raises(JobPathError, match="is a regular file, not a directory"):
        check_data_dir_is_the_jobs(str(tmp_path / "data"), has_manifest=False)
    (tmp_path / "data").unlink()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "data").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(JobPathError, match="is a symbolic link, not a directory"):
        check_data_dir_is_the_jobs(str(tmp_path / "data"), has_manifest=False)


def test_a_shared_system_directory_is_refused_as_a_jobs_data_directory_before_its_entries_are_read(
        tmp_path: Path) -> None:
    with pytest.raises(DataDirError, match="is the root directory"):
        check_data_dir_is_the_jobs("/", has_manifest=False)  # not "holds a store of another run" for its /run
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "run").mkdir()
    with pytest.raises(DataDirError, match=f"such as {shared / 'run1'}"):
        check_data_dir_is_the_jobs(str(shared), has_manifest=True)


def test_removing_a_data_directory_removes_what_the_product_made(tmp_path: Path) -> None:
    _job_tree(tmp_path / "data")
    assert remove_data_dir(str(tmp_path / "data")) == []
    assert not (tmp_path / "data").exists()


def test_removing_a_data_directory_keeps_every_file_of_the_users_in_whatever_folder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _job_tree(data)
    theirs = {"notes.txt": "mine", "photos/a.jpg": "mine", f"{JOB_DIR}/notes.txt": "mine2",
              "results/mydir/x": "m3", "segments/keep.seg": "m4", f"{JOB_DIR}/{MODEL_COPY_DIR}/weights.bin": "m5"}
    for name, text in theirs.items():
        _write(data, name, text)
    assert sorted(remove_data_dir(str(data))) == sorted(["notes.txt", "photos", f"{JOB_DIR}/notes.txt",
                                                         "results/mydir", "segments/keep.seg",
                                                         f"{JOB_DIR}/{MODEL_COPY_DIR}/weights.bin"])
    assert {name: (data / name).read_text() for name in theirs} == theirs
    assert {str(p.relative_to(data)) for p in data.rglob("*") if p.is_file()} == set(theirs)


def test_removing_a_new_jobs_folder_keeps_what_the_user_put_in_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _job_tree(data)
    _write(data, f"{JOB_DIR}/rejected/mine.txt", "mine")
    assert remove_job_dir(str(data)) == ["rejected/mine.txt"]
    assert (data / JOB_DIR / "rejected" / "mine.txt").read_text() == "mine"
    assert sorted(os.listdir(data / JOB_DIR)) == ["rejected"] and (data / "broker-state.json").exists()


def test_every_name_of_the_jobs_folder_is_the_jobs() -> None:
    assert all(JOB_MADE.file(name) for name in (MANIFEST_NAME, RECORDS_NAME, LOG_NAME, f".{STATUS_NAME}.partial"))
    assert not any(JOB_MADE.file(name) for name in ("notes.txt", ".notes.txt.partial", ".partial", f"{STATUS_NAME}~"))
