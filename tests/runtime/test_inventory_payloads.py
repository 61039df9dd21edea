"""What a stopped run left unfinished, with payloads: a resumed job reads its own request
numbers from them (store entries and ring records never stored)."""

from __future__ import annotations

import os

import numpy as np

from pipeline.storage.diskio import Durability
from pipeline.storage.paths import make_dirs, segment_path
from pipeline.storage.segment import SegmentFile, SegmentKeys, encode_entries, scan_segment
from pipeline.runtime.inventory import pending_payloads
from tests.support.segments import data_dir_of, make_items, shared_log


def test_the_live_entries_payloads_are_read_back_and_completed_ones_are_not(tmp_path):
    frame = make_items(5, seed=2)
    items, payloads, starts = frame[0], frame[3], frame[4]
    path = segment_path(str(tmp_path), 0, 77, 0, 0)
    make_dirs(os.path.dirname(path))
    segment = SegmentFile.create(path, SegmentKeys(0, 77, 0, 0), Durability.PROCESS, shared_log(data_dir_of(path)))
    segment.append(encode_entries(*frame, indices=np.arange(5), producer_id=1))
    segment.tombstone_many([int(scan_segment(path).offsets[2])])  # completed: not pending
    segment.close()
    found = dict(pending_payloads(str(tmp_path), []))
    expected = {int(items["item_id"][k]): payloads[starts[k]:starts[k + 1]].tobytes() for k in (0, 1, 3, 4)}
    assert found == expected
    assert dict(pending_payloads(str(tmp_path / "nothing here"), [])) == {}
