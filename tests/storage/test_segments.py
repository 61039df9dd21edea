"""SegmentStore on real files: lanes, sealing by size and age, the open-file cache, whole-file
deletion, and recovery (damage salvaged and named, torn tails kept, a damaged segment
quarantined once it is done)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from pipeline.broker.ids import LaneId, LaneKey
from pipeline.storage.diskio import Durability
from pipeline.storage.paths import QUARANTINE_DIR, iter_segments
from pipeline.storage.segment import DEFAULT_SEGMENT_MAX_BYTES, encode_entries, scan_segment
from pipeline.storage.segments import SegmentStore
from pipeline.storage import storelog
from pipeline.storage.storelog import StoreLog, log_key, read_store_log
from pipeline.wire.errors import DataDirMovedError, SegmentFormatError
from pipeline.wire.layouts.segments import SEGMENT_HEADER_SIZE_BYTES
from tests.support.segments import make_items

LANES = [LaneKey(0, 0xA1, LaneId(0)), LaneKey(0, 0xA1, LaneId(1)), LaneKey(2, 0xB2, LaneId(0))]


def fill(store: SegmentStore, groups: int = 12, per_group: int = 40, seed: int = 0) -> dict:
    """Append `groups` groups round-robin over LANES; return {(segment, offset): lane}."""
    frame = make_items(groups * per_group, seed)
    written = {}
    for g in range(groups):
        lane = LANES[g % len(LANES)]
        encoded = encode_entries(*frame, indices=np.arange(g * per_group, (g + 1) * per_group), producer_id=1)
        segment, base = store.append(lane, encoded, now_s=float(g))
        for offset in encoded.offsets.tolist():
            written[(segment, base + offset)] = lane
    return written


def test_lanes_get_their_own_segments_and_seal_by_size(tmp_path):
    store = SegmentStore(str(tmp_path), segment_max_bytes=40_000, open_files_max=2)
    written = fill(store)
    by_lane = {}
    for (segment, _), lane in written.items():
        assert store.segments[segment].lane == lane  # shape purity: one lane per file
        by_lane.setdefault(lane, set()).add(segment)
    assert all(len(segments) > 1 for segments in by_lane.values())  # sealed and rolled over
    assert len(store._open) <= 2 and store.files_closed_by_cache > 0
    store.close()
    found = list(iter_segments(str(tmp_path)))
    assert len(found) == sum(len(s) for s in by_lane.values())
    assert sum(scan_segment(f.path).entry_count for f in found) == len(written)


def test_fully_tombstoned_sealed_segment_is_deleted_whole(tmp_path):
    store = SegmentStore(str(tmp_path), segment_max_bytes=40_000, open_files_max=2)
    written = fill(store)
    sealed = next(s for s in store.segments.values() if s.sealed)
    for segment, offset in [key for key in written if key[0] == sealed.id]:
        assert store.tombstone_many(segment, [offset]) == 1
    assert not os.path.exists(sealed.path) and sealed.id not in store.segments
    store.close()


@pytest.mark.parametrize("per_group", [2_000, 40])
def test_a_lane_longer_than_many_segments_holds_one_segments_completion_state(tmp_path, per_group):
    """A job's lane streams several segments' worth, completed as it goes: each file seals at
    the default size and is deleted once done, and neither a file nor its completion bitmap
    (a bit per 16 bytes) passes a segment's, whatever the lane's length or its groups' size
    (large groups: few steps of the file's doubling; small ones: many)."""
    store = SegmentStore(str(tmp_path))
    frame = make_items(per_group, seed=3)
    segments_seen = set()
    written = 0
    while len(segments_seen) < 4:
        encoded = encode_entries(*frame, indices=np.arange(per_group), producer_id=1)
        segment, base = store.append(LANES[0], encoded, now_s=0.0)
        written += encoded.data.nbytes
        segments_seen.add(segment)
        assert store.tombstone_many(segment, (base + encoded.offsets).tolist()) == per_group
        assert store._file(segment).allocated <= DEFAULT_SEGMENT_MAX_BYTES
        assert store._file(segment)._done.nbytes <= DEFAULT_SEGMENT_MAX_BYTES // 128 + 1
        assert len(store.segments) == 1  # every sealed, finished file is gone
        assert written < 8 * DEFAULT_SEGMENT_MAX_BYTES, "the lane never rolled over"
    store.close()


def test_seal_by_age(tmp_path):
    store = SegmentStore(str(tmp_path), segment_max_age_s=5.0)
    fill(store, groups=3)
    assert store.seal_aged(now_s=4.0) == []
    aged = store.seal_aged(now_s=6.0)
    assert len(aged) == 2 and all(store.segments[s].sealed for s in aged)  # lanes 0, 1 (created at 0, 1)
    store.close()


def test_recovery_registers_live_entries_and_deletes_finished_segments(tmp_path):
    store = SegmentStore(str(tmp_path), segment_max_bytes=40_000)
    written = fill(store)
    done = next(s for s in store.segments.values() if s.sealed)
    keys = [key for key in written if key[0] == done.id]
    for segment, offset in keys[:-1]:
        store.tombstone_many(segment, [offset])
    store.close()
    # Crash after the last tombstone, before the whole-file delete: a fully tombstoned
    # sealed segment is deleted by recovery.
    with open(done.path, "r+b") as file:
        file.seek(keys[-1][1])
        file.write((0x424D4F54).to_bytes(4, "little"))
    again = SegmentStore(str(tmp_path), segment_max_bytes=40_000)
    report = again.recover()
    assert report.deleted == [done.path] and not os.path.exists(done.path)
    assert sum(r.report.live_count for r in report.segments) == len(written) - len(keys)
    assert report.bytes_scanned > 0 and report.scan_bytes_per_s > 0
    assert all(r.state.sealed for r in report.segments)
    # New appends go to new segments, after the recovered sequence numbers.
    fill(again, groups=3, seed=5)
    names = sorted(os.path.basename(f.path) for f in iter_segments(str(tmp_path)) if f.lane == 0 and f.model == 0)
    assert len(names) == len(set(names))
    again.close()


def test_recovery_salvages_corruption_and_keeps_torn_tails(tmp_path):
    # One flipped byte used to quarantine the whole file (the other entries never
    # delivered), and a damaged last entry was zeroed as a torn write.
    store = SegmentStore(str(tmp_path))
    fill(store, groups=3)
    paths = [s.path for s in store.segments.values()]
    store.close()
    corrupt, torn = paths[0], paths[1]
    whole = scan_segment(corrupt)
    offsets = whole.offsets
    with open(corrupt, "r+b") as file:  # one byte of entry 3's tokens
        file.seek(int(offsets[3]) + 100)
        byte = file.read(1)
        file.seek(int(offsets[3]) + 100)
        file.write(bytes([byte[0] ^ 0xFF]))
    # A torn tail: the last entry's write never finished and was never acknowledged (its
    # logged boundary still says 39 entries, crash point segment.after_write).
    last_torn = scan_segment(torn)
    last = int(last_torn.offsets[-1])
    log = StoreLog.open(str(tmp_path), durable=False)
    log.boundary(log_key(last_torn.keys), 39, last)  # the last boundary record is the one read back
    log.close()
    with open(torn, "r+b") as file:
        file.seek(last + 70)
        file.write(bytes(last_torn.data_end - last - 70))
    torn_bytes = open(torn, "rb").read()[SEGMENT_HEADER_SIZE_BYTES:]
    report = SegmentStore(str(tmp_path)).recover()
    assert not report.quarantined and os.path.exists(corrupt)  # kept in segments/
    (damaged,) = report.damaged
    assert (damaged.path, damaged.offset, damaged.end) == (corrupt, int(offsets[3]), int(offsets[4]))
    assert damaged.item_id == int(whole.headers["item_id"][3]) and "checksum" in damaged.reason
    kept = {r.state.path: r.report for r in report.segments}
    assert kept[corrupt].entry_count == 39 and kept[corrupt].offsets.tolist() == np.delete(offsets, 3).tolist()
    assert [(t.path, t.offset) for t in report.torn_tails] == [(torn, last)]
    assert kept[torn].entry_count == 39 and report.damaged_segments == [corrupt]
    assert open(torn, "rb").read()[SEGMENT_HEADER_SIZE_BYTES:] == torn_bytes  # nothing zeroed
    assert report.damage_counts()["entries_damaged"] == 1 and report.damage_counts()["torn_tails"] == 1
    assert not report.ok and str(int(offsets[3])) in report.summary()


def test_damaged_segment_goes_to_quarantine_once_its_good_entries_are_done(tmp_path):
    store = SegmentStore(str(tmp_path))
    written = fill(store, groups=1)
    (path,) = [s.path for s in store.segments.values()]
    store.close()
    victim = sorted(offset for _, offset in written)[5]
    with open(path, "r+b") as file:
        file.seek(victim + 70)
        file.write(b"\xee")
    store = SegmentStore(str(tmp_path))
    (kept,) = store.recover().segments
    good = kept.report.offsets.tolist()
    assert victim not in good and len(good) == 39
    assert store.tombstone_many(kept.state.id, good[:-1]) == 38 and os.path.exists(path)
    assert store.tombstone_many(kept.state.id, good[-1:]) == 1
    assert not os.path.exists(path) and kept.state.id not in store.segments  # never deleted:
    (moved,), _notes = store.take_quarantined()
    assert moved.path == path and moved.moved_to == os.path.join(str(tmp_path), QUARANTINE_DIR, os.path.relpath(
        path, os.path.join(str(tmp_path), "segments")))
    assert os.path.exists(moved.moved_to) and "damaged" in moved.reason
    store.close()
    again = SegmentStore(str(tmp_path)).recover()  # quarantine/ is evidence, not a segment
    assert again.segments_scanned == 0 and not again.missing


def test_power_durability_syncs_before_entries_are_readable(tmp_path):
    store = SegmentStore(str(tmp_path), Durability.POWER)
    fill(store, groups=2)
    assert store.needs_sync
    for segment in store.segments:
        assert store.readable_end(segment) < store._open[segment].data_end
    store.sync()
    assert not store.needs_sync
    for segment in store.segments:
        assert store.readable_end(segment) == store._open[segment].data_end
    store.close()


def test_damaged_segment_with_nothing_left_to_deliver_is_quarantined_by_recovery(tmp_path):
    store = SegmentStore(str(tmp_path))
    written = fill(store, groups=1)
    (state,) = store.segments.values()
    offsets = sorted(offset for _, offset in written)
    store.tombstone_many(state.id, offsets[:-1])  # everything done but the last entry ...
    store.close()
    with open(state.path, "r+b") as file:  # ... and that one damaged
        file.seek(offsets[-1] + 80)
        file.write(b"\x01\x02")
    report = SegmentStore(str(tmp_path)).recover()
    (moved,) = report.quarantined
    assert moved.path == state.path and moved.offset == offsets[-1] and not moved.identity_refused
    assert os.path.exists(moved.moved_to) and not os.path.exists(state.path) and not report.deleted
    assert report.damage_counts()["entries_damaged"] == 1 and report.damage_counts()["segments_quarantined"] == 1
    assert f"QUARANTINED: {state.path}" in report.summary()


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_segment_of_an_old_layout_stops_recovery_with_one_clear_error(tmp_path, version):
    # Layout version 1 rewrote tombstones and header words in place, version 2 had zeros where
    # an entry names its shape, version 3 kept completions in a journal beside each segment;
    # there is no migration, and quarantining its intact entries would take them from
    # delivery: recovery refuses.
    store = SegmentStore(str(tmp_path))
    fill(store, groups=2)
    path = next(iter(store.segments.values())).path
    store.close()
    data = bytearray(open(path, "rb").read())
    data[8:12] = version.to_bytes(4, "little")
    data[48:56] = xxhash.xxh3_64_intdigest(bytes(data[:48])).to_bytes(8, "little")  # an intact old block
    open(path, "wb").write(bytes(data))
    with pytest.raises(SegmentFormatError,
                       match=f"layout version {version}; this broker reads version 4 only and does not migrate"):
        SegmentStore(str(tmp_path)).recover()
    assert os.path.exists(path)  # left where it is


def test_a_segment_journal_of_an_earlier_release_stops_recovery_before_anything_is_touched(tmp_path):
    # Its completions are in the journal, which this release does not read: going on would
    # deliver every one of them again.
    store = SegmentStore(str(tmp_path))
    fill(store, groups=2)
    path = next(iter(store.segments.values())).path
    store.close()
    with open(path + ".journal", "wb") as file:
        file.write(b"\x01" * 64)
    leftover = os.path.join(str(tmp_path), "store.log.tmp")
    open(leftover, "wb").close()
    with pytest.raises(SegmentFormatError, match="a segment journal of an earlier release"):
        SegmentStore(str(tmp_path)).recover()
    assert os.path.exists(path + ".journal") and os.path.exists(leftover)  # nothing removed


def test_a_data_directory_moved_away_is_written_nowhere_else(tmp_path):
    """The data directory moved and a folder put at its name: a new segment, a quarantine,
    a delete by path would land in that folder, so each stops with DataDirMovedError; the
    moved folder keeps everything, and a store opened there once it is back recovers it."""
    data, other = tmp_path / "data", tmp_path / "data.orig"
    store = SegmentStore(str(data), segment_max_bytes=40_000, open_files_max=1)
    written = fill(store, groups=3)
    data.rename(other)
    data.mkdir()  # someone else's folder under the name
    frame = make_items(40, seed=9)
    with pytest.raises(DataDirMovedError, match=f"the data directory {data} is not the folder"):
        store.append(LaneKey(5, 0xC3, LaneId(0)), encode_entries(*frame, indices=np.arange(40), producer_id=1),
                     now_s=99.0)
    sealed = next(iter(written))[0]
    with pytest.raises(DataDirMovedError):
        store.keep_damaged(sealed, "a test's damage")
    assert os.listdir(data) == []
    store.abandon()
    data.rmdir()
    other.rename(data)
    again = SegmentStore(str(data))
    assert again.recover().live_entries == len(written)
    again.close()


@pytest.mark.parametrize("durability", [Durability.PROCESS, Durability.POWER])
def test_the_store_log_is_compacted_while_running_and_recovery_agrees(tmp_path, monkeypatch, durability):
    # The log is rewritten as the live segments' records when it outgrows them, in place of the
    # file every open segment appends through; what a restart reads back matches what the
    # store counted, segment by segment, and later records land after the rewrite.
    monkeypatch.setattr(storelog, "LOG_COMPACT_MIN_BYTES", 4096)
    store = SegmentStore(str(tmp_path), durability, segment_max_bytes=40_000, open_files_max=2)
    written = fill(store, groups=24)
    store.sync()
    rng = np.random.default_rng(3)
    sizes, done = [], set()
    for round_ in range(6):
        chosen = [key for key in written if key not in done and rng.random() < 0.3]
        for segment, offset in sorted(chosen):
            if segment in store.segments:
                store.tombstone_many(segment, [offset])
            done.add((segment, offset))
        store.sync()
        sizes.append(os.path.getsize(os.path.join(str(tmp_path), "store.log")))
    assert any(b < a for a, b in zip(sizes, sizes[1:])), sizes  # it was compacted
    counts = {s.keys: (s.entry_count, s.deleted_count) for s in store.segments.values()}
    store.close()
    again = SegmentStore(str(tmp_path), durability)
    report = again.recover()
    assert report.ok and not report.catalog_problems, report.summary()
    assert {s.keys: (s.entry_count, s.deleted_count) for s in again.segments.values()} == counts
    again.close()


def test_a_restart_never_reuses_a_sequence_the_log_names(tmp_path):
    # A deleted segment's records stay in the log until it is compacted: a new segment must
    # not take that sequence (its records would read as the new segment's completions).
    store = SegmentStore(str(tmp_path), segment_max_bytes=40_000)
    written = fill(store, groups=3)
    for segment in list(store.segments):
        store.seal(segment)
    for segment, offset in written:
        store.tombstone_many(segment, [offset])
    assert not store.segments
    gone = max(seq for seq, _tag in read_store_log(str(tmp_path)).segments)
    store.abandon()  # no compaction: the deleted segments' records are still in the log
    again = SegmentStore(str(tmp_path))
    again.recover()
    fresh, _offset = again.append(LANES[0], encode_entries(*make_items(3, 9), indices=np.arange(3), producer_id=1),
                                  now_s=0.0)
    assert again.segments[fresh].keys.segment_seq > gone
    again.close()


def test_a_file_closed_by_the_cache_keeps_what_it_completed(tmp_path):
    # One open file for three lanes: every turn closes the others. Completions made before a
    # file was closed still count after it is opened again (a duplicate is not counted
    # twice), and a restart reads the same counts back.
    store = SegmentStore(str(tmp_path), open_files_max=1)
    written = fill(store, groups=6, per_group=20)
    by_segment: dict = {}
    for segment, offset in written:
        by_segment.setdefault(segment, []).append(offset)
    for segment, offsets in sorted(by_segment.items()):
        assert store.tombstone_many(segment, offsets[:5]) == 5
    for segment, offsets in sorted(by_segment.items()):  # each reopened: its first five are done
        assert store.tombstone_many(segment, offsets[:7]) == 2
        assert store.segments[segment].deleted_count == 7
    assert store.files_closed_by_cache > 0
    closed = [s.progress for s in store.segments.values() if s.progress is not None]
    # What a closed file keeps of its completions: its bitmap compressed, well below the
    # bitmap's 1/128 of the file for completions in file order.
    assert closed and all(p.done is not None and len(p.done) * 4 < os.path.getsize(s.path) // 128
                          for s in store.segments.values() if (p := s.progress) is not None)
    store.close()
    again = SegmentStore(str(tmp_path))
    again.recover()
    assert sorted(s.deleted_count for s in again.segments.values()) == [7] * len(by_segment)
    again.close()
