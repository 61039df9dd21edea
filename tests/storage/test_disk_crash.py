"""Crash tests of the disk tier with real processes and real files: kill -9 at random
moments, and a crash at each named step boundary, under the driver and the checks of
tests/support/disk_crash.py (its docstring says what they check: nothing lost, nothing
unexpected, nothing corrupt delivered, duplicates bounded by one batch a crash); and the
`power` logged boundary never ahead of an fdatasync.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from pipeline.broker.ids import LaneId, LaneKey
from pipeline.storage import AppendGroup, DiskTier, Durability, crashpoints
from pipeline.storage.inspect import verify
from pipeline.storage.paths import iter_segments
from pipeline.storage.segment import scan_segment
from pipeline.wire.layouts.segments import SYNC_ALIGN_BYTES, entry_size_bytes
from tests.support.frames import make_frame
from tests.support.disk_crash import check_after_recovery, drain_and_check, kill_loop, run_child, wait

pytestmark = pytest.mark.campaign


def test_kill_9_at_random_moments(tmp_path):
    """60 kills of a child driving the disk tier under load, checked after each recovery."""
    kill_loop(tmp_path, seed=1, kills=60)


def test_kill_9_at_random_moments_with_the_solitary_pool(tmp_path):
    """The same with 43 shapes, most of them pooled: the pool's segments, its shapes' items
    found again by their own signatures, those that outgrow it."""
    kill_loop(tmp_path, seed=11, kills=40, pooled=True)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4, 5])
def test_kill_9_at_random_moments_long(tmp_path, seed):
    kill_loop(tmp_path, seed=seed, kills=250)


# A named step boundary, how many times the child passes it first, and what recovery must
# find because of the crash there.
CRASH_POINTS = [
    ("segment.after_write", 0), ("segment.after_write", 40),
    ("commit.after_verify", 3), ("commit.after_advance", 3),
    ("tombstone.before_record", 0), ("tombstone.before_record", 20),
    ("delete.before_unlink", 0), ("delete.before_unlink", 2),
    ("rotate.after_seal", 0), ("rotate.after_seal", 3),
    ("create.after_rename", 0), ("create.after_rename", 5),
]


# The same with the solitary pool on, but rotation: its lanes, recycled at every tick of the
# driver, hold too few items between two to fill a segment.
POOLED_CRASH_POINTS = [(point, skip) for point, skip in CRASH_POINTS if point != "rotate.after_seal"]


@pytest.mark.parametrize("point,skip,pooled", [(p, k, False) for p, k in CRASH_POINTS]
                         + [(p, k, True) for p, k in POOLED_CRASH_POINTS])
def test_crash_at_each_step_boundary(tmp_path, point, skip, pooled):
    data_dir, log_path = str(tmp_path / "data"), str(tmp_path / "log")
    pid = run_child(data_dir, log_path, seed=7, durability=Durability.PROCESS, turns=150, pooled=pooled)
    assert wait(pid, log_path) == 0  # a store with history first
    pid = run_child(data_dir, log_path, seed=8, durability=Durability.PROCESS, turns=1000,
                    crash_point=(point, skip), pooled=pooled)
    assert wait(pid, log_path) == crashpoints.CRASH_EXIT_CODE, f"{point} was never reached"
    tier = DiskTier.open(data_dir)
    report = tier.recovery
    tier.close()
    if point == "segment.after_write":
        # The logged boundary lags the entries: the scan is authoritative and records its own.
        assert report.repaired_counts, report.summary()
    if point == "delete.before_unlink":
        assert report.deleted, report.summary()  # sealed, all tombstoned: deleted by recovery
    if point == "create.after_rename":
        assert report.adopted and report.ok, report.summary()  # on disk, not in the store log yet
    assert not report.missing, report.summary()  # the store log is never ahead of the files
    check_after_recovery(data_dir, log_path, crashes=1, pooled=pooled)
    drain_and_check(data_dir, log_path, crashes=1, pooled=pooled)


@pytest.mark.parametrize("point", ["segment.after_write", "sync.before_fdatasync", "sync.after_fdatasync"])
def test_power_header_words_never_run_ahead_of_the_fdatasync(tmp_path, point):
    """The logged boundary (data_end) tells corruption from a torn tail; in `power` it
    must never claim bytes no fdatasync has made durable. A child stores group A (synced),
    then group B, and dies at `point` before B's commit. B starts on a fresh sector: no
    write shares one with A's synced bytes."""
    data_dir = str(tmp_path / "data")
    lane = LaneKey(0, 0x51, LaneId(0))
    pid = os.fork()
    if not pid:
        status = 1
        try:
            tier = DiskTier.open(data_dir, Durability.POWER)
            tier.append(AppendGroup(lane, make_frame(1, 0, [(0, 0x51)] * 10, [40] * 10), np.arange(10)))
            tier.flush()
            crashpoints.arm(point)
            tier.append(AppendGroup(lane, make_frame(1, 10, [(0, 0x51)] * 10, [40] * 10), np.arange(10)))
            tier.flush()
        finally:
            os._exit(status)  # never reached past the crash point
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == crashpoints.CRASH_EXIT_CODE, point
    (seg,) = iter_segments(data_dir)
    scan = scan_segment(seg.path)
    group_a_end = int(scan.offsets[9]) + entry_size_bytes(40, 0)
    assert int(scan.offsets[10]) == -(-group_a_end // SYNC_ALIGN_BYTES) * SYNC_ALIGN_BYTES > group_a_end, point
    assert (scan.header_entry_count, scan.header_data_end) == (10, group_a_end), point
    assert scan.entry_count == 20 and scan.is_damaged is False  # B is whole in the page cache
    # Damage in B's bytes is then a torn tail of an unacknowledged write, never corruption.
    with open(seg.path, "r+b") as file:
        file.seek(int(scan.offsets[15]) + 70)
        file.write(b"\xff\xff")
    tier = DiskTier.open(data_dir, Durability.POWER)
    report = tier.recovery
    assert report.ok and not report.damaged and [t.offset for t in report.torn_tails] == [int(scan.offsets[15])]
    assert tier.queued_items(lane) == 19  # whole entries past the bad range are kept too
    tier.close()
    assert verify(data_dir).ok
