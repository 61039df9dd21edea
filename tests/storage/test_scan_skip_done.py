"""A restart's scan takes the answered entries a segment starts with from the store log, unread
(`scan_segment(skip_done=True)`): against the full walk as the reference, on real segment
files written group by group, with completions in any order and damage anywhere."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pipeline.storage.diskio import Durability
from pipeline.storage.segment import SegmentFile, encode_entries, scan_segment
from pipeline.wire.layouts.segments import ENTRY_HEADER_SIZE_BYTES, ENTRY_LIVE, SEGMENT_HEADER_SIZE_BYTES
from tests.support.segments import KEYS, data_dir_of, make_items, segment_at, shared_log

TRIALS = 60


def _write(path: str, groups: list[int], seed: int, durability: Durability = Durability.PROCESS) -> SegmentFile:
    """A segment of `groups` (items per group), each group appended alone: one commit
    boundary per group, as the broker writes them."""
    frame = make_items(sum(groups), seed)
    segment = SegmentFile.create(path, KEYS, durability, shared_log(data_dir_of(path), durability is Durability.POWER))
    start = 0
    for count in groups:
        segment.append(encode_entries(*frame, indices=np.arange(start, start + count), producer_id=4))
        if durability is Durability.POWER:
            segment.sync()
        start += count
    return segment


def _live(report) -> tuple[list[int], np.ndarray]:
    live = report.headers["state"] == ENTRY_LIVE
    return report.offsets[live].tolist(), report.headers[live]


def _same_as_full(path: str) -> tuple:
    """The skipping scan against the full one: the same live entries, every header field the
    same, the same counts; the entries it took unread are completed ones."""
    full, skip = scan_segment(path), scan_segment(path, skip_done=True)
    assert _live(skip)[0] == _live(full)[0]
    for name in _live(full)[1].dtype.names:  # field by field: a copy leaves the padding bytes undefined
        assert np.array_equal(_live(skip)[1][name], _live(full)[1][name]), name
    assert (skip.entry_count, skip.tombstone_count, skip.live_count) == \
        (full.entry_count, full.tombstone_count, full.live_count)
    assert set(skip.done_offsets.tolist()) <= set(full.offsets[full.headers["state"] != ENTRY_LIVE].tolist())
    assert skip.data_end == full.data_end and skip.counts_agree == full.counts_agree
    assert np.array_equal(np.sort(skip.tombstone_offsets), np.sort(full.tombstone_offsets))
    return full, skip


def test_a_completed_front_is_not_read_and_the_rest_is_walked(tmp_path):
    path = segment_at(str(tmp_path / "a"))
    segment = _write(path, [3, 4, 5], seed=1)
    offsets = scan_segment(path).offsets
    segment.tombstone_many(offsets[:7])  # the first two groups, whole
    segment.close()
    full, skip = _same_as_full(path)
    assert skip.done_offsets.tolist() == offsets[:7].tolist()
    assert skip.walk_start == int(offsets[7])  # the second group's boundary: where the walk began
    assert skip.offsets.tolist() == offsets[7:].tolist()


def test_a_live_entry_inside_a_group_stops_the_skip_at_the_boundary_below_it(tmp_path):
    path = segment_at(str(tmp_path / "b"))
    segment = _write(path, [3, 4, 5], seed=2)
    offsets = scan_segment(path).offsets
    segment.tombstone_many(np.delete(offsets, 4))  # everything but the second entry of group two
    segment.close()
    _full, skip = _same_as_full(path)
    assert skip.done_offsets.tolist() == offsets[:3].tolist() and skip.walk_start == int(offsets[3])


def test_nothing_completed_or_a_live_first_entry_skips_nothing(tmp_path):
    path = segment_at(str(tmp_path / "c"))
    segment = _write(path, [2, 2], seed=3)
    offsets = scan_segment(path).offsets
    _full, skip = _same_as_full(path)
    assert skip.done_offsets.size == 0 and skip.walk_start == SEGMENT_HEADER_SIZE_BYTES
    segment.tombstone_many(offsets[1:])
    segment.close()
    _full, skip = _same_as_full(path)
    assert skip.done_offsets.size == 0 and skip.walk_start == SEGMENT_HEADER_SIZE_BYTES


def test_an_answered_entry_damaged_on_disk_costs_nothing_and_a_live_one_is_still_reported(tmp_path):
    path = segment_at(str(tmp_path / "d"))
    segment = _write(path, [4, 4], seed=4)
    offsets = scan_segment(path).offsets
    segment.tombstone_many(offsets[:4])
    segment.close()
    with open(path, "r+b") as f:  # a body byte of an answered entry, then one of a live entry
        for at in (int(offsets[1]), int(offsets[6])):
            f.seek(at + ENTRY_HEADER_SIZE_BYTES)
            byte = f.read(1)
            f.seek(at + ENTRY_HEADER_SIZE_BYTES)
            f.write(bytes([byte[0] ^ 0xFF]))
    full, skip = scan_segment(path), scan_segment(path, skip_done=True)
    assert [r.offset for r in full.damaged] == [int(offsets[1]), int(offsets[6])]
    assert [r.offset for r in skip.damaged] == [int(offsets[6])]  # the answered one was not read
    assert _live(skip)[0] == _live(full)[0] and int(offsets[6]) not in _live(skip)[0]


def test_a_damaged_store_log_turns_the_skip_off(tmp_path):
    path = segment_at(str(tmp_path / "e"))
    segment = _write(path, [3, 3], seed=5)
    offsets = scan_segment(path).offsets
    log = shared_log(data_dir_of(path))
    log.sync()  # group commits between: the first record was synced once later ones were written
    segment.tombstone_many(offsets[:3])
    log.sync()
    segment.tombstone_many(offsets[3:4])
    segment.close()
    log_file = os.path.join(data_dir_of(path), "store.log")
    data = bytearray(open(log_file, "rb").read())
    data[8] ^= 0x01  # the first record: damage before the last valid one
    open(log_file, "wb").write(bytes(data))
    skip = scan_segment(path, skip_done=True)
    assert skip.boundary_damage and skip.done_offsets.size == 0


@pytest.mark.parametrize("durability", [Durability.PROCESS, Durability.POWER])
def test_random_groups_completions_and_damage_against_the_full_walk(tmp_path, durability):
    """Seeded: random groups, completions in random order (whole groups, single entries,
    none), then at random a flipped byte anywhere in the data. Without damage the two scans
    agree in every count and live entry; with it, the skip delivers every live entry the full
    walk delivers, and never an answered one."""
    rng = np.random.default_rng(7 if durability is Durability.PROCESS else 8)
    for trial in range(TRIALS):
        path = segment_at(str(tmp_path / f"{durability.value}-{trial}"))
        groups = rng.integers(1, 6, int(rng.integers(1, 8))).tolist()
        segment = _write(path, groups, seed=trial, durability=durability)
        offsets = scan_segment(path).offsets
        done = offsets[rng.random(offsets.size) < rng.choice([0.0, 0.5, 0.9, 1.0])]
        front = int(rng.integers(0, offsets.size + 1))
        done = np.union1d(done, offsets[:front]) if rng.random() < 0.7 else done
        for part in np.array_split(rng.permutation(done), 3):
            if part.size:
                segment.tombstone_many(np.sort(part))
        segment.close()
        if rng.random() < 0.5:
            _same_as_full(path)
            continue
        end = scan_segment(path).data_end
        at = int(rng.integers(SEGMENT_HEADER_SIZE_BYTES, end))
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ (1 << int(rng.integers(8)))]))
        full, skip = scan_segment(path), scan_segment(path, skip_done=True)
        answered = set(done.tolist())
        assert set(_live(full)[0]) <= set(_live(skip)[0]) | answered, (trial, at)
        assert not set(_live(skip)[0]) & answered, (trial, at)


def _garbage_at(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\x5a" * 40)


def test_bytes_past_a_hole_in_the_preallocation_are_still_found(tmp_path):
    """The end of the data is judged past the preallocation's holes (SEEK_DATA), never by
    skipping bytes: garbage far past the data, beyond never-written blocks, is a torn range
    to the skipping scan as to the full one."""
    path = segment_at(str(tmp_path / "f"))
    segment = _write(path, [3, 3], seed=9)
    offsets = scan_segment(path).offsets
    segment.tombstone_many(offsets[:3])
    segment.close()
    size = len(open(path, "rb").read())
    end = scan_segment(path).data_end
    assert size - end > 8192  # a preallocation with whole blocks past the data
    _garbage_at(path, size - 64)
    full, skip = scan_segment(path), scan_segment(path, skip_done=True)
    assert [(t.offset, t.end) for t in full.torn] == [(t.offset, t.end) for t in skip.torn] != []
    assert _live(skip)[0] == _live(full)[0] == offsets[3:].tolist()


def test_a_sealed_segment_is_read_to_its_boundary_only(tmp_path):
    """Nothing is written past a sealed segment's boundary: a restart does not read its
    preallocation (bytes there are no entry of it); the audit's full walk still names them."""
    path = segment_at(str(tmp_path / "g"))
    segment = _write(path, [3, 3], seed=10)
    segment.seal()
    segment.close()
    size = len(open(path, "rb").read())
    _garbage_at(path, size - 64)
    full, skip = scan_segment(path), scan_segment(path, skip_done=True)
    assert full.torn and not skip.torn
    assert _live(skip)[0] == _live(full)[0] and skip.entry_count == full.entry_count == 6
