"""SegmentStore on real files: lanes, sealing by size and age, the open-file cache, whole-file
deletion, and recovery (torn tails dropped, corrupt segments quarantined)."""

from __future__ import annotations

import os

import numpy as np

from pipeline.broker.ids import LaneId, LaneKey
from pipeline.broker.storage.paths import QUARANTINE_DIR, iter_segments
from pipeline.broker.storage.segment import Durability, encode_entries, scan_segment
from pipeline.broker.storage.segments import SegmentStore
from tests.broker.test_segment import make_items

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
        assert store.tombstone(segment, offset)
    assert not os.path.exists(sealed.path) and sealed.id not in store.segments
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
        store.tombstone(segment, offset)
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


def test_recovery_quarantines_corruption_and_drops_torn_tails(tmp_path):
    store = SegmentStore(str(tmp_path))
    fill(store, groups=3)
    paths = [s.path for s in store.segments.values()]
    store.close()
    corrupt, torn = paths[0], paths[1]
    offsets = scan_segment(corrupt).offsets
    data = np.fromfile(corrupt, dtype=np.uint8)
    data[int(offsets[3]) + 100] ^= 0xFF
    data.tofile(corrupt)
    whole = scan_segment(torn)
    data = np.fromfile(torn, dtype=np.uint8)
    data[int(whole.offsets[-1]) + 70:whole.data_end] = 0
    data.tofile(torn)
    report = SegmentStore(str(tmp_path)).recover()
    assert [(q.path, q.offset) for q in report.quarantined] == [(corrupt, int(offsets[3]))]
    assert "checksum" in report.quarantined[0].reason and os.path.exists(report.quarantined[0].moved_to)
    assert not os.path.exists(corrupt)
    assert any(QUARANTINE_DIR in root for root, _, files in os.walk(tmp_path) if files)
    assert [(p, o) for p, o, _ in report.torn_tails] == [(torn, int(whole.offsets[-1]))]
    assert scan_segment(torn).torn_at is None  # dropped
    assert scan_segment(torn).entry_count == whole.entry_count - 1


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
