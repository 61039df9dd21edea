"""Power cuts on a real kernel (`lab.reliability.powercuts`): the window arithmetic,
and behind --run-slow a short campaign at each durability level on a loop-device ext4 (root
only): at `power` no acknowledged item is lost, at `process` the loss is counted."""

from __future__ import annotations

import pytest

from pipeline.audit.checker import ItemKey
from lab.reliability.powercuts import PowerCutCampaign, available, lost_window


def test_the_window_runs_from_the_oldest_and_newest_lost_items_submit_to_the_cut():
    submits = {ItemKey(b"a"): 1_000_000, ItemKey(b"b"): 3_000_000, ItemKey(b"c"): 9_000_000}
    assert lost_window(10_000_000, [ItemKey(b"a"), ItemKey(b"b")], submits) == (9.0, 7.0)
    assert lost_window(10_000_000, [], submits) == (None, None)


@pytest.mark.campaign
@pytest.mark.slow
@pytest.mark.parametrize("durability", ["power", "process"])
def test_a_short_power_cut_campaign(tmp_path, durability):
    why = available()
    if why is not None:
        pytest.skip(f"the power-cut campaign {why}")
    report = PowerCutCampaign(str(tmp_path), durability=durability, seed=2, feeds=3, items_per_feed=1500,
                              feed_gap_s=2.0, cut_gap_s=(1.0, 2.0), max_cuts=3).run()
    figures = report.figures()
    assert figures["cuts"] >= 2  # unexpected = corrupt = 0 is asserted per cut as it is judged
    if durability == "power":
        assert figures["items_lost"] == 0, report.to_json()


def test_only_whole_frames_of_the_current_feed_count_as_acknowledged():
    from lab.reliability.powercuts import acknowledged_prefix

    assert acknowledged_prefix(4000, 2000, 256) == 4000  # two whole feeds
    assert acknowledged_prefix(4000 + 255, 2000, 256) == 4000  # a frame being stored
    assert acknowledged_prefix(4000 + 256, 2000, 256) == 4256
    assert acknowledged_prefix(5999, 2000, 256) == 4000 + 1792
