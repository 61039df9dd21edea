"""Ids that end up in segment file names: checked where they enter the
storage (the lane budget, a segment's creation), and anything under segments/ that does not
parse is reported as a stray by recovery and verify, never skipped without a word."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from pipeline.broker.ids import LaneId, LaneKey
from pipeline.broker.lanes import LaneConfig
from pipeline.storage.inspect import verify
from pipeline.storage.paths import list_store
from pipeline.storage.segment import encode_entries
from pipeline.storage.segments import SegmentStore
from pipeline.wire.errors import BadInputError, SegmentNameError
from pipeline.wire.layouts.names import LANE_ID_LIMIT, MODEL_ID_LIMIT, SEGMENT_SEQ_LIMIT
from tests.support.segments import make_items


def group(count: int = 3):
    return encode_entries(*make_items(count), indices=np.arange(count), producer_id=1)


def test_lane_budget_at_the_limit_and_one_past():
    assert LaneConfig(max_lanes=LANE_ID_LIMIT).max_lanes == LANE_ID_LIMIT
    with pytest.raises(BadInputError, match=f"max_lanes must be <= {LANE_ID_LIMIT}.*got {LANE_ID_LIMIT + 1}"):
        LaneConfig(max_lanes=LANE_ID_LIMIT + 1)


@pytest.mark.parametrize("lane,what", [(LaneKey(MODEL_ID_LIMIT, 5, LaneId(0)), f"model id {MODEL_ID_LIMIT}"),
                                       (LaneKey(123456, 5, LaneId(0)), "model id 123456"),
                                       (LaneKey(0, 5, LaneId(LANE_ID_LIMIT)), f"lane id {LANE_ID_LIMIT}")])
def test_a_segment_past_a_name_limit_is_refused_before_anything_is_written(tmp_path, lane, what):
    store = SegmentStore(str(tmp_path))
    with pytest.raises(SegmentNameError, match=what):
        store.append(lane, group(), now_s=0.0)
    assert not store.segments and not list_store(str(tmp_path)).segments
    assert not os.listdir(tmp_path / "segments")
    at_limit = LaneKey(MODEL_ID_LIMIT - 1, 5, LaneId(LANE_ID_LIMIT - 1))
    store.append(at_limit, group(), now_s=0.0)  # the largest ids that fit
    store.close()
    report = SegmentStore(str(tmp_path)).recover()
    assert [r.state.lane for r in report.segments] == [at_limit] and report.ok


def test_the_segment_sequence_limit(tmp_path):
    store = SegmentStore(str(tmp_path))
    lane = LaneKey(1, 5, LaneId(2))
    store._next_seq = SEGMENT_SEQ_LIMIT
    with pytest.raises(SegmentNameError, match=f"segment sequence {SEGMENT_SEQ_LIMIT}"):
        store.append(lane, group(), now_s=0.0)
    store._next_seq = SEGMENT_SEQ_LIMIT - 1
    store.append(lane, group(), now_s=0.0)
    store.close()


def test_everything_that_does_not_parse_is_a_stray(tmp_path):
    # Seen: a model directory m123456 placed by hand (as a producer past the limit would
    # have made it) was skipped at restart without a word; so was any other odd name.
    store = SegmentStore(str(tmp_path))
    store.append(LaneKey(3, 0xAB, LaneId(1)), group(), now_s=0.0)
    (path,) = [s.path for s in store.segments.values()]
    store.close()
    segments = tmp_path / "segments"
    shutil.copytree(os.path.dirname(os.path.dirname(path)), segments / "m123456")
    (segments / "notes.txt").write_text("x")
    (segments / "m00003" / "s-not-hex").mkdir()
    shape = os.path.dirname(path)
    shutil.copy(path, os.path.join(shape, "l10000-0000000000.seg"))
    os.mkdir(os.path.join(shape, "l0002-0000000000.seg"))  # a directory under a segment's name
    os.symlink(path, os.path.join(shape, "l0003-0000000000.seg"))
    expected = sorted([str(segments / "m123456"), str(segments / "notes.txt"), str(segments / "m00003" / "s-not-hex"),
                       os.path.join(shape, "l10000-0000000000.seg"), os.path.join(shape, "l0002-0000000000.seg"),
                       os.path.join(shape, "l0003-0000000000.seg")])
    report = SegmentStore(str(tmp_path)).recover()
    assert sorted(s.path for s in report.strays) == expected
    assert report.damage_counts()["strays"] == 6 and not report.ok
    # (the segment)
    assert "a directory holding 1 files" in next(s.reason for s in report.strays if s.path.endswith("m123456"))
    assert "symbolic link" in next(s.reason for s in report.strays if s.path.endswith("l0003-0000000000.seg"))
    assert all(f"STRAY: {p}" in report.summary() for p in expected)
    assert report.live_entries == 3  # the real segment is recovered, the strays are not read
    result = verify(str(tmp_path))
    assert not result.ok and result.counts["strays"] == 6
