"""ResultsFile: owner-only whatever the umask, a torn tail terminated (never cut), and every
write all or nothing, on a real full tmpfs (the short write a disk cannot make on demand is
the one thing faked)."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.process import FullDiskBackoff
from pipeline.consumer.results import ResultsFile
from pipeline.reporting.accounting import summarize_results
from pipeline.wire.errors import ResultsDiskFullError, ResultsFileError, ResultsWriteError
from tests.consumer.tmpfs import fill, small_tmpfs

PAGE_BYTES = 4096


def lines(*item_ids: int) -> bytes:
    return b"".join(json.dumps({"item_id": i, "status": "ok", "prompt_tokens": 10, "cached_tokens": 0,
                                "output": list(range(8))}).encode() + b"\n" for i in item_ids)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_results_file_is_0600_and_its_directory_0700_under_umask_000(tmp_path):
    existing = tmp_path / "old.jsonl"
    existing.write_bytes(lines(1))
    os.chmod(existing, 0o666)  # left by an older version under umask 000
    old = os.umask(0)
    try:
        new = ResultsFile(str(tmp_path / "results" / "c0.jsonl"))
        new.write(lines(1))
        new.close()
        ResultsFile(str(existing)).close()
    finally:
        os.umask(old)
    assert mode(tmp_path / "results" / "c0.jsonl") == 0o600 and mode(tmp_path / "results") == 0o700
    assert mode(existing) == 0o600


def test_a_torn_tail_is_terminated_and_nothing_before_it_is_cut(tmp_path):
    path = tmp_path / "c0.jsonl"
    before = lines(1) + b'{"item_id": 2, "sta'  # a consumer killed in the middle of a write
    path.write_bytes(before)
    results = ResultsFile(str(path))
    assert results.torn_tail_found and results.size_at_open_bytes == len(before)
    results.write(lines(3, 4))
    results.close()
    assert path.read_bytes() == before + b"\n" + lines(3, 4)
    summary = summarize_results(str(tmp_path))
    assert summary.item_ids == {1, 3, 4} and summary.bad_lines == 1 and summary.torn_lines == 0
    assert len(summary.bad_line_examples) == 1
    assert summary.bad_line_examples[0].startswith(f"{path}:2: not JSON (")
    again = ResultsFile(str(path))  # whole now: nothing to repair
    assert not again.torn_tail_found
    again.close()
    empty = ResultsFile(str(tmp_path / "c1.jsonl"))
    assert not empty.torn_tail_found and empty.size_bytes == 0
    empty.close()
    assert path.read_bytes() == before + b"\n" + lines(3, 4)


def test_a_results_file_that_is_a_symlink_is_refused(tmp_path):
    (tmp_path / "elsewhere").write_bytes(b"")
    os.symlink(tmp_path / "elsewhere", tmp_path / "c0.jsonl")
    with pytest.raises(ResultsFileError, match=f"{tmp_path / 'c0.jsonl'}: cannot open the results file: ELOOP"):
        ResultsFile(str(tmp_path / "c0.jsonl"))


def test_a_short_write_is_finished_by_the_next_write(tmp_path, monkeypatch):
    path = tmp_path / "c0.jsonl"
    results = ResultsFile(str(path))
    real_write, sizes = os.write, []

    def short_once(fd: int, data) -> int:
        if fd != results._fd or sizes:
            sizes.append(len(data))
            return real_write(fd, data)
        sizes.append(len(data))
        return real_write(fd, bytes(data[:7]))  # a signal or a filling disk cuts it short

    monkeypatch.setattr(os, "write", short_once)
    batch = lines(1, 2, 3)
    results.write(batch)
    monkeypatch.undo()
    results.close()
    assert sizes == [len(batch), len(batch) - 7]
    assert path.read_bytes() == batch


def test_a_short_write_then_an_error_leaves_nothing_of_the_batch(tmp_path, monkeypatch):
    path = tmp_path / "c0.jsonl"
    results = ResultsFile(str(path))
    results.write(lines(1))
    real_write, calls = os.write, []

    def short_then_eio(fd: int, data) -> int:
        if fd != results._fd:
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:20]))
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "write", short_then_eio)
    with pytest.raises(ResultsWriteError) as info:
        results.write(lines(2, 3))
    monkeypatch.undo()
    error = info.value
    assert not isinstance(error, ResultsDiskFullError) and error.errno_code == errno.EIO
    assert (error.path, error.offset_bytes) == (str(path), len(lines(1)))
    assert str(error).startswith(f"{path}: writing {len(lines(2, 3))} bytes of results at byte {len(lines(1))}: EIO")
    assert path.read_bytes() == lines(1)  # the 20 bytes that landed were cut off
    results.write(lines(4))
    results.close()
    assert path.read_bytes() == lines(1, 4)


@pytest.mark.integration
def test_a_full_tmpfs_keeps_nothing_of_a_batch_and_takes_it_whole_once_space_is_back(tmp_path, monkeypatch):
    with small_tmpfs(str(tmp_path / "disk")) as disk:
        path = os.path.join(disk, "c0.jsonl")
        results = ResultsFile(path)
        results.write(lines(*range(10)))
        before = open(path, "rb").read()
        filler = fill(disk, leave_bytes=2 * PAGE_BYTES)
        batch = lines(*range(100, 300))
        assert len(batch) > 4 * PAGE_BYTES
        real_write, landed = os.write, []

        def watched(fd: int, data) -> int:  # the real write, its count recorded
            count = real_write(fd, data)
            if fd == results._fd:
                landed.append(count)
            return count

        monkeypatch.setattr(os, "write", watched)
        with pytest.raises(ResultsDiskFullError) as info:
            results.write(batch)
        monkeypatch.undo()
        assert 0 < landed[0] < len(batch)  # the disk took part of it: a real short write
        assert info.value.errno_code == errno.ENOSPC and info.value.offset_bytes == len(before)
        assert str(info.value).startswith(f"{path}: writing {len(batch)} bytes of results at byte {len(before)}: "
                                          f"ENOSPC (No space left on device); nothing of it was kept")
        assert open(path, "rb").read() == before
        with pytest.raises(ResultsDiskFullError):  # still full: still nothing
            results.write(batch)
        assert open(path, "rb").read() == before
        os.remove(filler)
        results.write(batch)
        results.close()
        assert open(path, "rb").read() == before + batch


@pytest.mark.integration
def test_a_torn_tail_on_a_full_disk_is_terminated_by_the_next_write(tmp_path):
    with small_tmpfs(str(tmp_path / "disk")) as disk:
        path = os.path.join(disk, "c0.jsonl")
        head = lines(1) + b'{"item_id": 2, "status": "'
        before = head + b"x" * (PAGE_BYTES - len(head))  # torn, and its last page full
        with open(path, "wb") as file:
            file.write(before)
        filler = fill(disk)
        results = ResultsFile(path)  # the newline does not fit: not an error at open
        assert results.torn_tail_found
        with pytest.raises(ResultsDiskFullError):
            results.write(lines(3))
        assert open(path, "rb").read() == before
        os.remove(filler)
        results.write(lines(3))
        results.close()
        assert open(path, "rb").read() == before + b"\n" + lines(3)


@pytest.mark.integration
def test_a_second_writer_is_never_cut(tmp_path):
    # Two processes appending to one results file is a misconfiguration; the writer that
    # fails must then not cut the file back (it would cut the other one's lines).
    with small_tmpfs(str(tmp_path / "disk")) as disk:
        path = os.path.join(disk, "c0.jsonl")
        results = ResultsFile(path)
        results.write(lines(1))
        with open(path, "ab") as other:
            other.write(lines(2))
        filler = fill(disk)
        with pytest.raises(ResultsWriteError, match="another process writes to it") as info:
            results.write(lines(*range(3, 100)))
        assert not isinstance(info.value, ResultsDiskFullError)  # fatal, not a wait for space
        assert open(path, "rb").read().startswith(lines(1, 2))
        results.close()
        os.remove(filler)


def test_full_disk_backoff_doubles_to_its_cap_and_restarts_after_a_write():
    backoff = FullDiskBackoff(first_s=1.0, max_s=30.0)
    assert [backoff.wait_s(batches_written=5) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert [backoff.wait_s(batches_written=6) for _ in range(2)] == [1, 2]  # a batch was written


@pytest.mark.parametrize("first_s, max_s, ok", [(1.0, 1.0, True), (0.01, 30.0, True), (0.0, 30.0, False),
                                                (-1.0, 30.0, False), (2.0, 1.0, False),
                                                (1.0, float("inf"), False), (float("nan"), 1.0, False)])
def test_full_disk_waits_are_checked_in_the_config(first_s, max_s, ok):
    make = lambda: ConsumerConfig("s", "r", "c0", results_full_first_wait_s=first_s,  # noqa: E731
                                  results_full_max_wait_s=max_s)
    if ok:
        make()
    else:
        with pytest.raises(ValueError, match="results full waits"):
            make()


def test_with_fsync_every_write_is_synced_and_a_new_file_s_directory_too(tmp_path, monkeypatch):
    real_fsync, synced = os.fsync, []

    def watched(fd: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", watched)
    results = ResultsFile(str(tmp_path / "c0.jsonl"), fsync=True)
    results.write(lines(1))
    results.write(lines(2))
    results.close()
    ResultsFile(str(tmp_path / "c0.jsonl"), fsync=True).close()  # existing: no directory sync
    unsynced = ResultsFile(str(tmp_path / "c1.jsonl"))  # no fsync asked: none
    unsynced.write(lines(3))
    unsynced.close()
    assert synced == [True, False, False]


def test_a_failed_fsync_undoes_the_write(tmp_path, monkeypatch):
    # A failed fsync cannot be made on demand on a real disk (it takes a failing device): the
    # one thing faked here. The lines reached the page cache but may never reach the disk,
    # so they are cut off and the batch, not completed, comes back.
    results = ResultsFile(str(tmp_path / "c0.jsonl"), fsync=True)
    results.write(lines(1))

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(ResultsWriteError, match="EIO") as info:
        results.write(lines(2))
    monkeypatch.undo()
    assert not isinstance(info.value, ResultsDiskFullError)
    assert (tmp_path / "c0.jsonl").read_bytes() == lines(1)
    results.close()
