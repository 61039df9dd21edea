"""Walking a segment's back-to-back entries (pipeline/storage/walk.py), against a
reference read off the recovery scan: runs of equal-size entries (taken by the strided
gather), mixed sizes, completed entries, `power` padding, and too few entries."""

from __future__ import annotations

import tempfile
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.storage import walk
from pipeline.storage.diskio import Durability
from pipeline.storage.segment import SegmentFile, SegmentKeys, encode_entries, scan_segment
from pipeline.wire.errors import SegmentCorruptError
from pipeline.wire.layouts.frames import ITEM_HEADER_DTYPE
from pipeline.wire.layouts.segments import entry_size_bytes
from tests.support.segments import data_dir_of, shared_log

KEYS = SegmentKeys(model=1, signature=0x5EED_0000_1234_5678, lane=2, segment_seq=9)

# A group of entries: how many, one length for all (or None: each its own), one payload size.
GROUPS = st.lists(st.tuples(st.integers(1, 40), st.one_of(st.none(), st.integers(1, 70)), st.integers(0, 20)),
                  min_size=1, max_size=5)


def frame(groups: list[tuple[int, int | None, int]], seed: int):
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([np.full(n, length) if length else rng.integers(1, 70, size=n) for n, length, _ in groups])
    payload_lens = np.concatenate([np.full(n, p) for n, _length, p in groups])
    count = lengths.shape[0]
    items = np.zeros(count, dtype=ITEM_HEADER_DTYPE)
    items["item_id"] = np.arange(count) + 1
    items["seq"] = np.arange(count)
    items["signature"] = KEYS.signature
    items["length"], items["payload_len"] = lengths, payload_lens
    token_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    payload_starts = np.concatenate([[0], np.cumsum(payload_lens)]).astype(np.int64)
    tokens = rng.integers(0, 50_000, size=int(token_starts[-1]), dtype=np.int32)
    payloads = rng.integers(0, 256, size=int(payload_starts[-1]), dtype=np.uint8)
    return items, tokens, token_starts, payloads, payload_starts


@settings(max_examples=80, deadline=None)
@given(groups=GROUPS, power=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_the_walk_matches_the_scan(groups, power, seed, data):
    items = frame(groups, seed)
    with tempfile.TemporaryDirectory() as root:
        path = f"{root}/w.seg"
        durability = Durability.POWER if power else Durability.PROCESS
        segment = SegmentFile.create(path, KEYS, durability, shared_log(data_dir_of(path), power))
        bounds = np.cumsum([0] + [n for n, _length, _p in groups])
        for a, b in pairwise(bounds):  # one append (and, at power, one synced group) each
            segment.append(encode_entries(*items, indices=np.arange(a, b), producer_id=3))
            segment.sync()
        every = scan_segment(path).offsets
        sizes = entry_size_bytes(items[0]["length"].astype(np.int64), items[0]["payload_len"].astype(np.int64))
        total = every.shape[0]
        done = sorted(data.draw(st.sets(st.integers(0, total - 1), max_size=total // 3)))
        if done:
            segment.tombstone_many([int(every[i]) for i in done])
        first = data.draw(st.integers(0, total - 1))
        live = [i for i in range(first, total) if i not in set(done)]
        count = data.draw(st.integers(1, len(live) + 2))
        end = segment.readable_end
        if count > len(live):
            with pytest.raises(SegmentCorruptError, match=f"{path}: offset"):
                segment.entry_offsets(int(every[first]), end, count)
        else:
            got, after = segment.entry_offsets(int(every[first]), end, count)
            last = live[count - 1]
            assert got.tolist() == [int(every[i]) for i in live[:count]]
            assert after == int(every[last]) + int(sizes[last])
        segment.close()


def test_an_equal_size_run_is_taken_in_one_gather_and_the_walk_goes_on_where_it_ends(tmp_path, monkeypatch):
    groups = [(30, 16, 0), (5, None, 3), (20, 16, 0)]
    items = frame(groups, seed=1)
    path = str(tmp_path / "r.seg")
    segment = SegmentFile.create(path, KEYS, Durability.PROCESS, shared_log(data_dir_of(path)))
    segment.append(encode_entries(*items, indices=np.arange(55), producer_id=3))
    every = scan_segment(path).offsets
    runs: list[tuple[int, int]] = []
    strided = walk._strided

    def counted(mapped, done, start, limit, count, out):
        got = strided(mapped, done, start, limit, count, out)
        runs.append(got)
        return got
    monkeypatch.setattr(walk, "_strided", counted)
    got, _after = segment.entry_offsets(int(every[0]), segment.readable_end, 55)
    assert got.tolist() == every.tolist()
    assert runs == [(30, int(every[30]))]  # the first run in one gather, the rest walked
    runs.clear()
    got, _after = segment.entry_offsets(int(every[35]), segment.readable_end, 20)
    assert got.tolist() == every[35:].tolist() and runs == [(20, segment.readable_end)]
    segment.close()


def test_a_run_shorter_than_the_gathers_minimum_is_walked(tmp_path):
    items = frame([(walk.STRIDED_MIN_ENTRIES, 16, 0)], seed=2)
    path = str(tmp_path / "s.seg")
    segment = SegmentFile.create(path, KEYS, Durability.PROCESS, shared_log(data_dir_of(path)))
    segment.append(encode_entries(*items, indices=np.arange(walk.STRIDED_MIN_ENTRIES), producer_id=3))
    every = scan_segment(path).offsets
    out = np.empty(8, dtype=np.int64)
    mapped, limit = segment._map, segment.readable_end
    # At the minimum: one gather; one short of it: none, the walk does it.
    assert walk._strided(mapped, None, int(every[0]), limit, walk.STRIDED_MIN_ENTRIES, out) == (
        walk.STRIDED_MIN_ENTRIES, limit)
    assert walk._strided(mapped, None, int(every[1]), limit, walk.STRIDED_MIN_ENTRIES, out) == (0, int(every[1]))
    assert segment.entry_offsets(int(every[1]), limit, walk.STRIDED_MIN_ENTRIES - 1)[0].tolist() == every[1:].tolist()
    segment.close()
