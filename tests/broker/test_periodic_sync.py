"""`sync_interval_s` at durability `process` (pipeline/broker/periodic_sync.py): the
setting's limits, and on real files that what the broker and others wrote under the data
directory leaves the page cache's dirty list within a few intervals (cachestat(2), Linux
6.5+, reads the kernel's own count of a file's dirty pages)."""

from __future__ import annotations

import ctypes
import os

import pytest

from pipeline.broker.config import MAX_SYNC_INTERVAL_S, MIN_SYNC_INTERVAL_S, BrokerConfig
from pipeline.broker.periodic_sync import PeriodicSync
from lab.reliability.procs import Stages, pipeline, wait_until, write_workload
from pipeline.wire.errors import ConfigError

SYS_CACHESTAT = 451  # x86-64 and arm64


class _Range(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_uint64), ("length", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def dirty_pages(path: str) -> int | None:
    """Dirty or under-writeback pages of the file (None where cachestat is missing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        found = _Stat()
        if libc.syscall(SYS_CACHESTAT, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(found), 0) != 0:
            return None
        return found.dirty + found.writeback
    finally:
        os.close(fd)


def _files(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names
            if os.path.isfile(os.path.join(d, n)) and not os.path.islink(os.path.join(d, n))]


@pytest.mark.parametrize("value", [MIN_SYNC_INTERVAL_S, 1.0, MAX_SYNC_INTERVAL_S, None])
def test_sync_intervals_at_the_limits_are_taken(tmp_path, value):
    assert BrokerConfig(str(tmp_path), sync_interval_s=value).sync_interval_s == value


@pytest.mark.parametrize("value", [MIN_SYNC_INTERVAL_S * 0.9, MAX_SYNC_INTERVAL_S * 1.001, 0, -1.0, True,
                                   float("nan"), "1"])
def test_sync_intervals_past_the_limits_are_refused_with_the_value(tmp_path, value):
    with pytest.raises(ConfigError, match="sync_interval_s"):
        BrokerConfig(str(tmp_path), sync_interval_s=value)


def test_a_periodic_sync_writes_back_what_was_written_in_its_directory(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * (1 << 20))
    if dirty_pages(str(path)) is None:
        pytest.skip("cachestat(2) is not available (Linux 6.5+)")
    sync = PeriodicSync(str(tmp_path), 0.02)
    try:
        wait_until(lambda: sync.syncs >= 2, 30, "two syncs")
        assert dirty_pages(str(path)) == 0 and sync.failures == 0
    finally:
        sync.close()
    sync.close()  # idempotent


@pytest.mark.integration
def test_a_broker_at_process_with_a_sync_interval_leaves_nothing_dirty_after_two_syncs(tmp_path):
    stages = Stages(str(tmp_path / "data"), consumers=(), broker_settings=("sync_interval_s=0.05",))
    stages.start()
    try:
        workload = write_workload(str(tmp_path / "w.jsonl"), 500, seed=4, key="s")
        pipeline("produce", workload, "--data-dir", stages.data_dir)
        files = _files(stages.data_dir)
        if dirty_pages(files[0]) is None:
            pytest.skip("cachestat(2) is not available (Linux 6.5+)")
        base = stages.status().periodic_syncs
        wait_until(lambda: stages.status().periodic_syncs >= base + 2, 60, "two syncs after the last write")
        assert sum(dirty_pages(f) or 0 for f in _files(stages.data_dir)) == 0
        assert stages.status().periodic_sync_failures == 0
    finally:
        stages.close()


@pytest.mark.integration
def test_no_sync_interval_no_syncs(tmp_path):
    stages = Stages(str(tmp_path / "data"), consumers=())
    stages.start()
    try:
        assert stages.status().periodic_syncs == 0
    finally:
        stages.close()


def test_closing_syncs_once_more_what_was_written_since(tmp_path):
    sync = PeriodicSync(str(tmp_path), MAX_SYNC_INTERVAL_S)  # the thread never wakes in this test
    path = tmp_path / "late"
    path.write_bytes(b"y" * (1 << 20))
    if dirty_pages(str(path)) is None:
        sync.close()
        pytest.skip("cachestat(2) is not available (Linux 6.5+)")
    sync.close()
    assert (sync.syncs, dirty_pages(str(path))) == (1, 0)


@pytest.mark.integration
def test_at_power_the_setting_starts_no_thread(tmp_path):
    stages = Stages(str(tmp_path / "data"), consumers=(), durability="power",
                    broker_settings=("sync_interval_s=0.05",))
    stages.start()
    try:
        assert stages.status().periodic_syncs == 0  # power fdatasyncs before it acknowledges
    finally:
        stages.close()
