"""The store log as the store's catalog, on real files: missing segments named with their
counts, a missing log rebuilt and reported, damaged life records named, compaction, the
order of life records against the files, and a store of the earlier release refused."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pipeline.broker.ids import LaneId, LaneKey
from pipeline.storage.diskio import Durability
from pipeline.storage.inspect import verify
from pipeline.storage.segment import encode_entries, scan_segment
from pipeline.storage.segments import SegmentStore
from pipeline.storage.recovery import read_missing_note
from pipeline.storage.storelog import StoreLog, log_path, read_store_log
from pipeline.wire import fileops
from pipeline.wire.errors import DiskFullError, SegmentFormatError
from pipeline.wire.layouts.segments import SYNC_ALIGN_BYTES
from pipeline.wire.layouts.storelog import LOG_CREATED, LOG_DELETED, LOG_RECORD_SIZE_BYTES
from tests.support.segments import make_items

LANE = LaneKey(0, 0xC1, LaneId(0))
OTHER = LaneKey(0, 0xC1, LaneId(1))


def fill(store: SegmentStore, groups: int, lane: LaneKey = LANE, per_group: int = 10) -> None:
    frame = make_items(groups * per_group)
    for g in range(groups):
        store.append(lane, encode_entries(*frame, indices=np.arange(g * per_group, (g + 1) * per_group),
                                          producer_id=1), now_s=0.0)


def rotating_store(data_dir: str, durability: Durability = Durability.PROCESS) -> SegmentStore:
    return SegmentStore(data_dir, durability, segment_max_bytes=12 << 10)


def finish(store: SegmentStore, state) -> None:
    store.tombstone_many(state.id, scan_segment(state.path).offsets.tolist())


def test_a_deleted_sealed_segment_is_missing_with_its_entry_count(tmp_path):
    store = rotating_store(str(tmp_path))
    fill(store, 12)
    sealed = [s for s in store.segments.values() if s.sealed]
    victim = sealed[1]
    store.close()
    count = scan_segment(victim.path).entry_count
    os.unlink(victim.path)
    result = verify(str(tmp_path))  # before any restart
    assert not result.ok and any(f"MISSING: {victim.path}" in p and f"{count} entries" in p for p in result.problems)
    report = rotating_store(str(tmp_path)).recover()
    (missing,) = report.missing
    assert (missing.path, missing.entry_count) == (victim.path, count)
    assert report.damage_counts()["segments_missing"] == 1 and report.damage_counts()["entries_missing"] == count
    assert f"{victim.path}: the store log holds this segment, the disk does not: {count} entries" in report.summary()
    note = read_missing_note(missing.note)
    assert note.keys == victim.keys and note.entry_count == count
    again = rotating_store(str(tmp_path)).recover()  # noted once, in quarantine/ ...
    assert not again.missing
    assert not verify(str(tmp_path)).ok  # ... where verify keeps failing until someone looks
    os.unlink(missing.note)
    assert verify(str(tmp_path)).ok


def test_a_deleted_open_segment_is_missing_with_an_unknown_count(tmp_path):
    store = rotating_store(str(tmp_path))
    fill(store, 2)
    fill(store, 1, lane=OTHER)
    (open_one,) = [s for s in store.segments.values() if s.lane == OTHER]
    store.close()
    os.unlink(open_one.path)
    report = rotating_store(str(tmp_path)).recover()
    (missing,) = report.missing
    assert missing.path == open_one.path and missing.entry_count is None
    assert "entry count unknown, it was still open" in report.summary()
    assert report.damage_counts()["segments_missing_count_unknown"] == 1 and not report.ok
    assert read_missing_note(missing.note).entry_count is None


def test_a_note_that_is_not_one_is_named(tmp_path):
    path = tmp_path / "x.seg.missing"
    path.write_bytes(bytes(LOG_RECORD_SIZE_BYTES))
    assert "not a missing-segment note" in read_missing_note(str(path))
    path.write_bytes(bytes(LOG_RECORD_SIZE_BYTES + 1))
    assert "not a missing-segment note" in read_missing_note(str(path))


def test_a_missing_segment_name_is_never_reused(tmp_path):
    """Recovery's compaction drops a missing segment's records (it is noted once): the log's
    SEQUENCE record keeps its number from being taken again, over any number of restarts."""
    store = rotating_store(str(tmp_path))
    fill(store, 1)
    fill(store, 1, lane=OTHER)  # sequence 1: not a number a LINEAGE record's 0 could stand for
    only = max(store.segments.values(), key=lambda s: s.keys.segment_seq)
    store.close()
    os.unlink(only.path)
    for _restart in range(3):
        again = rotating_store(str(tmp_path))
        again.recover()
        again.close()
    store = rotating_store(str(tmp_path))
    store.recover()
    fill(store, 1, lane=OTHER)
    fresh = max(store.segments.values(), key=lambda s: s.keys.segment_seq)
    assert fresh.keys.segment_seq == only.keys.segment_seq + 1 == 2
    store.close()


def test_no_log_while_segments_exist_is_reported_and_rebuilt(tmp_path):
    store = rotating_store(str(tmp_path))
    fill(store, 6)
    store.close()
    os.unlink(log_path(str(tmp_path)))
    report = rotating_store(str(tmp_path)).recover()
    assert report.damage_counts()["catalog_problems"] == 1 and "no store log" in report.summary()
    live = read_store_log(str(tmp_path)).live()
    assert len(live) == len(report.segments) and all(r.sealed for r in live.values())
    assert rotating_store(str(tmp_path)).recover().ok
    fresh = tmp_path / "fresh"
    assert SegmentStore(str(fresh)).recover().ok  # an empty store needs no log


def test_a_damaged_synced_life_record_is_named(tmp_path):
    store = rotating_store(str(tmp_path), Durability.POWER)
    fill(store, 6)
    store.close()
    path = log_path(str(tmp_path))
    with open(path, "r+b") as file:  # a bit flipped in the first record (a CREATED), synced long ago
        head = file.read(LOG_RECORD_SIZE_BYTES)
        assert int.from_bytes(head[6:8], "little") == LOG_CREATED
        file.seek(30)
        file.write(bytes([head[30] ^ 0x99]))
    report = rotating_store(str(tmp_path), Durability.POWER).recover()
    assert not report.ok and report.damage_counts()["catalog_problems"] >= 1
    assert f"{path}: offset 0: store log record fails its checks" in report.summary()


def test_a_synced_delete_record_is_never_in_a_sector_written_again(tmp_path):
    """Why no mirror: a power cut may garble the sectors written since the last sync, and a
    DELETED record is synced before the unlink, after which the log writes from the next
    SYNC_ALIGN_BYTES boundary. So its sector reads back as it was synced, whatever follows."""
    store = rotating_store(str(tmp_path), Durability.POWER)
    fill(store, 12)
    state = min((s for s in store.segments.values() if s.sealed), key=lambda s: s.keys.segment_seq)
    finish(store, state)  # deleted: recorded and synced, then unlinked
    path = log_path(str(tmp_path))
    data = open(path, "rb").read()
    words = np.frombuffer(data[:len(data) // 64 * 64], dtype="<u8").reshape(-1, 8)
    deleted = int(np.flatnonzero((words[:, 0] >> np.uint64(48)) == np.uint64(LOG_DELETED))[-1]) * 64
    sector = slice(deleted // SYNC_ALIGN_BYTES * SYNC_ALIGN_BYTES, (deleted // SYNC_ALIGN_BYTES + 1) * SYNC_ALIGN_BYTES)
    before = data[sector]
    for other in [s for s in store.segments.values() if s.sealed][:3]:
        finish(store, other)
    fill(store, 6, lane=OTHER)
    store.sync()
    after = open(path, "rb").read()[sector]
    assert after[:len(before)] == before and not any(after[len(before):])  # the rest never written
    store.close()
    report = rotating_store(str(tmp_path), Durability.POWER).recover()
    assert report.ok and not report.missing, report.summary()


@pytest.mark.parametrize("durability", [Durability.PROCESS, Durability.POWER])
def test_the_log_is_compacted_as_segments_live_and_die(tmp_path, monkeypatch, durability):
    # At `power` every sync starts a fresh 4 KiB block: each life below takes a few.
    monkeypatch.setattr("pipeline.storage.storelog.LOG_COMPACT_MIN_BYTES", 64 << 10)
    store = rotating_store(str(tmp_path), durability)
    frame = make_items(10)
    sizes = []
    for _turn in range(120):  # every turn: a segment created, sealed and deleted whole
        segment, _ = store.append(LANE, encode_entries(*frame, indices=np.arange(10), producer_id=1), now_s=0.0)
        store.seal(segment)
        finish(store, store.segments[segment])
        store.sync()
        sizes.append(os.path.getsize(log_path(str(tmp_path))))
    assert max(sizes) <= (64 << 10) + 4 * 4096, max(sizes)  # compacted on the way
    assert sum(sizes) < 120 * (64 << 10)  # not once and for all at the end either
    store.close()
    assert read_store_log(str(tmp_path)).live() == {}
    report = rotating_store(str(tmp_path), durability).recover()
    assert report.ok and not report.missing


def test_power_records_a_delete_durably_before_the_unlink(tmp_path, monkeypatch):
    store = rotating_store(str(tmp_path), Durability.POWER)
    fill(store, 1)
    (state,) = store.segments.values()
    store.seal(state.id)
    store.sync()
    events = []
    real_fdatasync, real_unlink = os.fdatasync, os.unlink

    def fdatasync(fd):  # what the log holds as each fdatasync begins
        gone = state.keys not in read_store_log(str(tmp_path)).live()
        events.append(("fdatasync", os.readlink(f"/proc/self/fd/{fd}"), gone))
        return real_fdatasync(fd)

    def unlink(path, *args, **kwargs):
        events.append(("unlink", str(path), None))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "unlink", unlink)
    finish(store, state)
    monkeypatch.undo()
    log = os.path.realpath(log_path(str(tmp_path)))
    assert events.index(("fdatasync", log, True)) < events.index(("unlink", state.path, None)), events
    store.close()


def test_power_records_a_create_durably_at_the_group_commit(tmp_path, monkeypatch):
    store = rotating_store(str(tmp_path), Durability.POWER)
    synced = []
    real_fdatasync = os.fdatasync
    fill(store, 1)
    (state,) = store.segments.values()
    # what the log holds as each fdatasync begins: the CREATED record is in it by the log's
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(
        (os.readlink(f"/proc/self/fd/{fd}"), state.keys in read_store_log(str(tmp_path)).live())), real_fdatasync(fd)))
    store.sync()  # before anything of the new segment is acknowledged
    monkeypatch.undo()
    assert (os.path.realpath(log_path(str(tmp_path))), True) in synced, synced
    store.close()


@pytest.mark.parametrize("durability", [Durability.PROCESS, Durability.POWER])
def test_the_log_follows_the_store_through_recovery(tmp_path, durability):
    store = rotating_store(str(tmp_path), durability)
    fill(store, 9)
    fill(store, 3, lane=OTHER)
    keys = {s.keys for s in store.segments.values()}
    store.close()
    assert set(read_store_log(str(tmp_path)).live()) == keys
    report = rotating_store(str(tmp_path), durability).recover()
    assert report.ok and not report.adopted and not report.missing


def test_a_delete_the_disk_has_no_room_to_record_waits_for_the_next_sync(tmp_path, monkeypatch):
    """A DELETED record refused for space: the segment stays (never unlinked unrecorded) and
    is deleted at the next group commit once the log takes it."""
    store = rotating_store(str(tmp_path), Durability.POWER)
    fill(store, 1)
    (state,) = store.segments.values()
    store.seal(state.id)
    real = StoreLog.lifecycle

    def full(self, kind, keys):
        raise DiskFullError(f"{self.path}: disk full (injected)")

    monkeypatch.setattr(StoreLog, "lifecycle", full)
    finish(store, state)
    assert os.path.exists(state.path) and state.id in store.segments
    _moved, notes = store.take_quarantined()
    assert any("not deleted" in note for note in notes), notes
    store.sync()  # still full: still kept
    assert os.path.exists(state.path)
    monkeypatch.setattr(StoreLog, "lifecycle", real)
    store.sync()
    assert not os.path.exists(state.path) and not store.segments
    store.close()
    assert rotating_store(str(tmp_path), Durability.POWER).recover().ok


@pytest.mark.parametrize("name", ["segments.catalog", "segments.catalog.mirror"])
def test_a_store_holding_the_earlier_catalog_is_refused_before_anything_is_touched(tmp_path, name):
    store = rotating_store(str(tmp_path))
    fill(store, 3)
    store.close()
    (tmp_path / name).write_bytes(bytes(64))
    before = sorted((p, p.stat().st_size) for p in tmp_path.rglob("*"))
    with pytest.raises(SegmentFormatError, match="segment catalog of an earlier release"):
        rotating_store(str(tmp_path)).recover()
    assert sorted((p, p.stat().st_size) for p in tmp_path.rglob("*")) == before


def test_a_create_the_log_has_no_room_for_leaves_no_file(tmp_path, monkeypatch):
    """A CREATED record refused for space is backpressure: the new, empty file goes (no
    descriptor, no orphan), its number is not taken, and appends go on once space is back."""
    store = rotating_store(str(tmp_path))
    real = StoreLog.lifecycle

    def full(self, kind, keys):
        raise DiskFullError(f"{self.path}: disk full (injected)")

    monkeypatch.setattr(StoreLog, "lifecycle", full)
    with pytest.raises(DiskFullError):
        fill(store, 1)
    fds = len(os.listdir("/proc/self/fd"))  # the log's own descriptor is open by now
    for _retry in range(3):
        with pytest.raises(DiskFullError):
            fill(store, 1)
    assert not list((tmp_path / "segments").rglob("*.seg")) and len(os.listdir("/proc/self/fd")) == fds
    monkeypatch.setattr(StoreLog, "lifecycle", real)
    fill(store, 1)
    (state,) = store.segments.values()
    assert state.keys.segment_seq == 0
    store.close()
    assert rotating_store(str(tmp_path)).recover().ok


@pytest.mark.parametrize("refused", ["record", "move"])
def test_a_damaged_segment_the_disk_will_not_quarantine_keeps_its_completions(tmp_path, monkeypatch, refused):
    """A done, damaged segment whose QUARANTINED record (or move) is refused stays on disk
    and registered, its completions in the log through compactions, and is tried again at
    each sync (a record written once costs no other): never taken back with its completed
    entries live. After a restart, one whose record was written is moved to quarantine/;
    one whose record was refused reads as a clean finished segment (its damage was a
    consumer's finding, in memory) and is deleted."""
    store = rotating_store(str(tmp_path))
    fill(store, 1)
    (state,) = store.segments.values()
    store.seal(state.id)
    store.keep_damaged(state.id, "found damaged by a consumer (injected)")
    if refused == "record":
        def fail(self, kind, keys):
            raise DiskFullError(f"{self.path}: disk full (injected)")
        monkeypatch.setattr(StoreLog, "lifecycle", fail)
    else:
        real_rename = fileops.rename

        def fail(source, target):
            if "quarantine" in target:
                raise OSError(13, "Permission denied (injected)")
            real_rename(source, target)
        monkeypatch.setattr(fileops, "rename", fail)
    finish(store, state)
    assert os.path.exists(state.path) and state.id in store.segments
    store._compact_log()  # the records of a segment still registered are kept
    store.sync()
    size = os.path.getsize(log_path(str(tmp_path)))
    for _sync in range(3):
        store.sync()
    assert os.path.getsize(log_path(str(tmp_path))) == size  # no record, no sync a retry
    _moved, notes = store.take_quarantined()
    assert sum("not moved to quarantine/" in note for note in notes) == 1, notes  # named once
    store.abandon()  # a crash while it waits
    monkeypatch.undo()
    again = rotating_store(str(tmp_path))
    report = again.recover()
    assert report.live_entries == 0, report.summary()
    if refused == "move":
        assert [q.path for q in report.quarantined] == [state.path] and not report.deleted, report.summary()
    else:
        assert report.deleted == [state.path] and not report.quarantined, report.summary()
    again.close()


def test_a_recovery_with_no_room_to_compact_the_log_goes_on_with_it(tmp_path, monkeypatch):
    """Recovery rewrites the log as the live set; with no room for the new file the old one
    stays in use, named in the report, and what it says still holds at the next start."""
    store = rotating_store(str(tmp_path), Durability.POWER)
    fill(store, 9)
    keys = {s.keys for s in store.segments.values()}
    store.close()

    def full(*_args, **_kwargs):
        raise DiskFullError("store.log.tmp: disk full (injected)")

    monkeypatch.setattr("pipeline.storage.storelog.write_replacement", full)
    store = rotating_store(str(tmp_path), Durability.POWER)
    report = store.recover()
    assert report.ok and any("not compacted" in note for note in report.catalog_notes), report.summary()
    assert {s.keys for s in store.segments.values()} == keys
    fill(store, 3, lane=OTHER)  # appends after the old log's last record
    store.close()
    monkeypatch.undo()
    again = rotating_store(str(tmp_path), Durability.POWER)
    report = again.recover()
    assert report.ok and not report.missing and not report.adopted, report.summary()
    assert {s.keys for s in again.segments.values()} >= keys
    again.close()
