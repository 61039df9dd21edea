"""pipeline.runtime.madefiles: what a run makes in a data directory is known by name, and the
removal takes exactly that: never a file of the user's (in whatever folder), never through a
link, never into another file system, each folder only once empty."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from pipeline.broker.config import RUN_DIR, SOCKET_NAME
from pipeline.broker.peers import NAMESPACE_FILE
from pipeline.storage.paths import CREATING_SUFFIX, MISSING_SUFFIX, QUARANTINE_DIR, quarantine_target
from pipeline.runtime.daemon import StageFiles
from pipeline.runtime.madefiles import RESULTS_DIR, RUN_MADE, Made, matching, named, remove_made
from pipeline.runtime.settings import ENGINE_CACHE_DIR
from pipeline.wire.errors import DataDirMovedError
from pipeline.wire.layouts.names import BROKER_STATE_NAME, SEGMENT_JOURNAL_SUFFIX, SEGMENTS_DIR, segment_relpath
from pipeline.wire.layouts.storelog import STORE_LOG_FILE
from tests.consumer.tmpfs import small_tmpfs


def _write(top: Path, relative: str, text: str = "x") -> Path:
    path = top / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _run_tree(data: Path) -> None:
    """A data directory as a run leaves it, every name made by its owner's own function."""
    segment = os.path.join(SEGMENTS_DIR, segment_relpath(3, 0xABCDEF, 2, 17))
    for name in (segment, segment + SEGMENT_JOURNAL_SUFFIX, segment + CREATING_SUFFIX, STORE_LOG_FILE,
                 STORE_LOG_FILE + ".tmp", BROKER_STATE_NAME,
                 BROKER_STATE_NAME + ".damaged-1700000000000000000", NAMESPACE_FILE, NAMESPACE_FILE + ".4242.tmp",
                 f"{RESULTS_DIR}/run-20260101T000000Z-77/consumer0.jsonl",
                 f"{RESULTS_DIR}/ray-20260101T000000Z-7/node-1.jsonl",
                 f"{RESULTS_DIR}/gpu0.jsonl", f"{ENGINE_CACHE_DIR}/vllm-cache/torch_compile_cache/abc/x.py",
                 f"{ENGINE_CACHE_DIR}/tmp/anything"):
        _write(data, name)
    stage = StageFiles.of(str(data / RUN_DIR), "consumer-gpu0")
    for name in (stage.pid_path, stage.log_path, stage.pid_path + ".4242.tmp", str(data / RUN_DIR / "broker.lock"),
                 str(data / RUN_DIR / "launch.lock")):
        _write(data, os.path.relpath(name, data))
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(data / RUN_DIR / SOCKET_NAME))
    listener.close()
    for copy in range(2):  # a second quarantined copy of the same segment is named .1
        target = quarantine_target(str(data), str(data / segment))
        _write(data, os.path.relpath(target, data))
        _write(data, os.path.relpath(target + SEGMENT_JOURNAL_SUFFIX, data))
    _write(data, os.path.relpath(quarantine_target(str(data), str(data / segment), MISSING_SUFFIX), data))


def test_everything_a_run_makes_is_removed_with_the_folder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _run_tree(data)
    assert remove_made(str(data), RUN_MADE) == []
    assert not data.exists()


def test_files_of_the_users_in_the_products_folders_stay_named_with_their_folders(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _run_tree(data)
    theirs = ["notes.txt", f"{SEGMENTS_DIR}/keep.seg", f"{SEGMENTS_DIR}/m00003/mine", f"{RESULTS_DIR}/mydir/x.jsonl",
              f"{RESULTS_DIR}/run-20260101T000000Z-77/mine.txt", f"{QUARANTINE_DIR}/README", f"{RUN_DIR}/my.sock",
              f"{ENGINE_CACHE_DIR}/mine.txt"]
    for name in theirs:
        _write(data, name, "mine")
    kept = remove_made(str(data), RUN_MADE)
    assert sorted(kept) == sorted(["notes.txt", f"{SEGMENTS_DIR}/keep.seg", f"{SEGMENTS_DIR}/m00003/mine",
                                   f"{RESULTS_DIR}/mydir", f"{RESULTS_DIR}/run-20260101T000000Z-77/mine.txt",
                                   f"{QUARANTINE_DIR}/README", f"{RUN_DIR}/my.sock", f"{ENGINE_CACHE_DIR}/mine.txt"])
    assert all((data / name).read_text() == "mine" for name in theirs)
    left = {str(p.relative_to(data)) for p in data.rglob("*") if p.is_file()}
    assert left == set(theirs)  # every file of the product's went; its emptied folders too
    assert not (data / SEGMENTS_DIR / "m00003" / "s0000000000abcdef").exists()


def test_a_link_is_never_followed_nor_removed_and_its_target_stays(tmp_path: Path) -> None:
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    data.mkdir()
    _write(elsewhere, "run-20260101T000000Z-1/consumer0.jsonl", "mine")
    (data / RESULTS_DIR).symlink_to(elsewhere)
    (data / BROKER_STATE_NAME).symlink_to(elsewhere / "run-20260101T000000Z-1" / "consumer0.jsonl")
    assert remove_made(str(data), RUN_MADE) == [BROKER_STATE_NAME, RESULTS_DIR]
    assert (elsewhere / "run-20260101T000000Z-1" / "consumer0.jsonl").read_text() == "mine"
    assert (data / RESULTS_DIR).is_symlink() and (data / BROKER_STATE_NAME).is_symlink()
    assert remove_made(str(data / RESULTS_DIR), RUN_MADE) == ["."]  # the top itself a link: left whole


def test_what_has_a_products_name_but_not_its_kind_stays(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / BROKER_STATE_NAME).mkdir(parents=True)  # a folder named like a file of the product's
    os.mkfifo(data / STORE_LOG_FILE)
    _write(data, f"{SEGMENTS_DIR}/{STORE_LOG_FILE}")  # a product's name in the wrong folder
    assert sorted(remove_made(str(data), RUN_MADE)) == sorted([BROKER_STATE_NAME, STORE_LOG_FILE,
                                                           f"{SEGMENTS_DIR}/{STORE_LOG_FILE}"])


@pytest.mark.integration  # mount(8): a process
def test_a_folder_on_another_file_system_is_not_entered(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _run_tree(data)
    mounted = data / RESULTS_DIR / "run-20260101T000000Z-5"
    with small_tmpfs(str(mounted)):
        _write(mounted, "consumer0.jsonl", "on another disk")
        kept = remove_made(str(data), RUN_MADE)
        assert kept == [f"{RESULTS_DIR}/run-20260101T000000Z-5 (a mount point: not entered)"]
        assert (mounted / "consumer0.jsonl").read_text() == "on another disk"


@pytest.mark.integration  # mount(8): a process
def test_a_bind_mount_of_the_same_disk_is_not_entered(tmp_path: Path) -> None:
    data, theirs = tmp_path / "data", tmp_path / "theirs"
    _write(theirs, "consumer0.jsonl", "the user's")
    target = data / RESULTS_DIR / "run-20260101T000000Z-5"
    target.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("a bind mount needs root")
    bound = subprocess.run(["mount", "--bind", str(theirs), str(target)], capture_output=True, text=True)
    if bound.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {bound.stderr.strip()}")
    try:
        assert os.stat(target).st_dev == os.stat(data).st_dev  # st_dev alone would not tell
        kept = remove_made(str(data), RUN_MADE)
        assert kept == [f"{RESULTS_DIR}/run-20260101T000000Z-5 (a mount point: not entered)"]
        assert (theirs / "consumer0.jsonl").read_text() == "the user's"
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_a_folder_that_is_not_the_pinned_one_is_not_touched(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _run_tree(data)
    info = os.stat(data)
    with pytest.raises(DataDirMovedError, match="nothing of it was removed"):
        remove_made(str(data), RUN_MADE, (info.st_dev, info.st_ino + 1))
    assert (data / STORE_LOG_FILE).exists()
    assert remove_made(str(data), RUN_MADE, (info.st_dev, info.st_ino)) == []


def test_a_gone_folder_leaves_nothing_to_say(tmp_path: Path) -> None:
    assert remove_made(str(tmp_path / "absent"), RUN_MADE) == []
    assert remove_made(str(tmp_path / "absent" / "deeper"), RUN_MADE) == []


def test_a_grammar_takes_names_exactly_and_folders_by_name() -> None:
    made = Made(files=matching(r"ids-\d{3}\.bin"), folders=((named("model"), Made(files=named("config.json"))),))
    assert made.file("ids-007.bin") and not made.file("ids-007.bin.bak") and not made.file("xids-007.bin")
    assert made.folder("model") is not None and made.folder("models") is None
    assert made.knows("model") and not made.knows("config.json")
    anything = Made(anything=True)
    assert anything.file("whatever") and anything.folder("deep") is anything
