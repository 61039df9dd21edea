"""The segment catalog on real files (once, "a deleted segment went unnoticed"):
missing segments named with their counts, a missing catalog rebuilt and reported, torn and
damaged records, compaction, and the order of catalog writes against the files."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pipeline.broker.ids import LaneId, LaneKey
from pipeline.broker.storage import catalog as catalog_module
from pipeline.broker.storage.catalog import mirror_path, read_catalog, read_missing_note
from pipeline.broker.storage.diskio import Durability
from pipeline.broker.storage.inspect import verify
from pipeline.broker.storage.paths import catalog_path
from pipeline.broker.storage.segment import encode_entries, scan_segment
from pipeline.broker.storage.segments import SegmentStore
from pipeline.wire.errors import DiskFullError
from pipeline.wire.layouts.catalog import CATALOG_RECORD_SIZE_BYTES
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
    assert f"{victim.path}: the catalog holds this segment, the disk does not: {count} entries" in report.summary()
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


def test_a_missing_segment_name_is_never_reused(tmp_path):
    store = rotating_store(str(tmp_path))
    fill(store, 1)
    (only,) = store.segments.values()
    store.close()
    os.unlink(only.path)
    store = rotating_store(str(tmp_path))
    store.recover()
    fill(store, 1)
    (fresh,) = store.segments.values()
    assert fresh.keys.segment_seq == only.keys.segment_seq + 1
    store.close()


def test_no_catalog_while_segments_exist_is_reported_and_rebuilt(tmp_path):
    store = rotating_store(str(tmp_path))
    fill(store, 6)
    store.close()
    os.unlink(catalog_path(str(tmp_path)))
    os.unlink(mirror_path(catalog_path(str(tmp_path))))
    report = rotating_store(str(tmp_path)).recover()
    assert report.damage_counts()["catalog_problems"] == 1 and "no catalog" in report.summary()
    reading = read_catalog(catalog_path(str(tmp_path)))
    assert len(reading.live) == len(report.segments) and all(e.entry_count is not None for e in reading.live.values())
    assert rotating_store(str(tmp_path)).recover().ok
    fresh = tmp_path / "fresh"
    assert SegmentStore(str(fresh)).recover().ok  # an empty store needs no catalog


def last_record_slot(path: str) -> int:
    data = np.fromfile(path, dtype=np.uint8).reshape(-1, CATALOG_RECORD_SIZE_BYTES)
    return int(np.flatnonzero(data.any(axis=1))[-1])


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x99]))


def test_a_torn_last_record_is_tolerated_and_a_damaged_one_reported(tmp_path):
    store = rotating_store(str(tmp_path))
    fill(store, 6)
    store.close()
    path = catalog_path(str(tmp_path))
    slot = last_record_slot(path)
    with open(path, "r+b") as file:  # a record cut by a crash mid-write
        file.seek((slot + 1) * CATALOG_RECORD_SIZE_BYTES)
        file.write(b"SBC1\x01\x00\x02\x00" + b"\x07" * 20)
    report = rotating_store(str(tmp_path)).recover()
    assert report.ok and any("torn append" in note for note in report.catalog_notes)
    for damaged in (path, mirror_path(path)):  # a flipped bit in a record before the last
        flip(damaged, 12)
    report = rotating_store(str(tmp_path)).recover()
    assert not report.ok and report.damage_counts()["catalog_problems"] == 1
    assert f"{path}: offset 0: catalog record fails its checksum" in report.summary()


@pytest.mark.parametrize("which", ["catalog", "mirror"])
def test_damage_in_one_file_of_the_pair_is_healed_by_the_other(tmp_path, which):
    """A torn write damages only the file being written (module docstring): the other holds
    every record whole, so nothing is lost or named a problem, and the pair is rewritten."""
    store = rotating_store(str(tmp_path))
    fill(store, 9)
    keys = {s.keys: s.entry_count if s.sealed else None for s in store.segments.values()}
    store.close()
    path = catalog_path(str(tmp_path))
    damaged = path if which == "catalog" else mirror_path(path)
    with open(damaged, "r+b") as file:  # a garbled sector over the first records
        file.write(os.urandom(512))
    reading = read_catalog(path)
    assert not reading.damaged and any("healed" in note for note in reading.notes), reading.notes
    assert {k: e.entry_count for k, e in reading.live.items()} == keys
    report = rotating_store(str(tmp_path)).recover()
    assert report.ok and not report.missing and not report.adopted, report.summary()
    with open(path, "rb") as one, open(mirror_path(path), "rb") as other:
        assert one.read() == other.read()  # rewritten whole, both


@pytest.mark.parametrize("alone", [False, True])
def test_a_deleted_segment_whose_delete_record_is_damaged_in_one_file_is_not_missing(tmp_path, alone):
    """The finding the mirror fixes: a torn catalog sector took the synced delete record of a
    segment beside it, and recovery named the deleted segment MISSING."""
    store = rotating_store(str(tmp_path), Durability.POWER)
    fill(store, 12)
    state = min((s for s in store.segments.values() if s.sealed), key=lambda s: s.keys.segment_seq)
    store.tombstone_many(state.id, scan_segment(state.path).offsets.tolist())  # deleted, recorded
    store.sync()
    path = catalog_path(str(tmp_path))
    sector = last_record_slot(path) * CATALOG_RECORD_SIZE_BYTES // 512 * 512
    assert sector > 0  # the segment's create record (slot 0) is in another sector
    with open(path, "r+b") as file:  # the sector of the delete record garbled in the catalog
        file.seek(sector)
        file.write(os.urandom(512))
    store.abandon()
    if alone:  # the finding, without the mirror: a false MISSING
        os.unlink(mirror_path(path))
    report = rotating_store(str(tmp_path), Durability.POWER).recover()
    missing = [m.path for m in report.missing]
    if alone:
        assert missing == [state.path] and report.damage_counts()["catalog_problems"] > 0, report.summary()
    else:
        assert not missing and report.damage_counts()["catalog_problems"] == 0, report.summary()


def test_the_catalog_is_compacted_when_it_grows(tmp_path, monkeypatch):
    monkeypatch.setattr(catalog_module, "CATALOG_COMPACT_MIN_RECORDS", 16)
    store = rotating_store(str(tmp_path))
    frame = make_items(10)
    sizes = []
    for turn in range(60):  # every turn: a segment created, sealed and deleted whole
        segment, _ = store.append(LANE, encode_entries(*frame, indices=np.arange(10), producer_id=1), now_s=0.0)
        store.seal(segment)
        offsets = scan_segment(store.segments[segment].path).offsets.tolist()
        store.tombstone_many(segment, offsets)
        store.sync()
        sizes.append(store._catalog.used)
    assert max(sizes) <= 16 + 3 and sizes[-1] < 16  # 180 lifecycle records, never more than the limit
    store.close()
    assert read_catalog(catalog_path(str(tmp_path))).live == {}
    report = rotating_store(str(tmp_path)).recover()
    assert report.ok and not report.missing


def test_power_records_a_delete_durably_before_the_unlink(tmp_path, monkeypatch):
    store = rotating_store(str(tmp_path), Durability.POWER)
    fill(store, 1)
    (state,) = store.segments.values()
    store.seal(state.id)
    store.sync()
    events = []
    real_fdatasync, real_unlink = os.fdatasync, os.unlink

    def fdatasync(fd):
        events.append(("fdatasync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fdatasync(fd)

    def unlink(path, *args, **kwargs):
        events.append(("unlink", str(path)))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "unlink", unlink)
    store.tombstone_many(state.id, scan_segment(state.path).offsets.tolist())
    monkeypatch.undo()
    catalog = os.path.realpath(catalog_path(str(tmp_path)))
    mirror = os.path.realpath(mirror_path(catalog))
    assert events.index(("fdatasync", catalog)) < events.index(("fdatasync", mirror)) < events.index(
        ("unlink", state.path)), events
    store.close()


def test_power_records_a_create_durably_at_the_group_commit(tmp_path, monkeypatch):
    store = rotating_store(str(tmp_path), Durability.POWER)
    synced = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                      real_fdatasync(fd)))
    fill(store, 1)
    synced.clear()
    store.sync()  # before anything of the new segment is acknowledged
    monkeypatch.undo()
    catalog = os.path.realpath(catalog_path(str(tmp_path)))
    assert synced.index(catalog) < synced.index(mirror_path(catalog)), synced  # the mirror after the catalog
    store.close()


@pytest.mark.parametrize("durability", [Durability.PROCESS, Durability.POWER])
def test_catalog_follows_the_store_through_recovery(tmp_path, durability):
    store = rotating_store(str(tmp_path), durability)
    fill(store, 9)
    fill(store, 3, lane=OTHER)
    keys = {s.keys for s in store.segments.values()}
    store.close()
    assert set(read_catalog(catalog_path(str(tmp_path))).live) == keys
    report = rotating_store(str(tmp_path), durability).recover()
    assert report.ok and not report.adopted and not report.missing


def test_a_damaged_pair_with_no_room_to_rewrite_it_still_opens_and_says_so(tmp_path, monkeypatch):
    """The pair is rewritten at open when one file is damaged; with the disk full the store
    opens anyway, appending after every record of either file, and the report says why."""
    store = rotating_store(str(tmp_path))
    fill(store, 6)
    keys = {s.keys for s in store.segments.values()}
    store.close()
    path = catalog_path(str(tmp_path))
    flip(path, 12)

    def full(*_args, **_kwargs):
        raise DiskFullError(f"{path}.tmp: disk full (injected)")

    monkeypatch.setattr(catalog_module, "write_replacements", full)
    store = rotating_store(str(tmp_path))
    report = store.recover()
    assert any("not rewritten at open" in note for note in report.catalog_notes), report.catalog_notes
    assert report.ok and {s.keys for s in store.segments.values()} == keys, report.summary()
    fill(store, 3, lane=OTHER)  # appends after the last record of either file: nothing overwritten
    store.close()
    monkeypatch.undo()
    reading = read_catalog(path)
    assert keys <= set(reading.live) and not reading.damaged, reading.damaged
