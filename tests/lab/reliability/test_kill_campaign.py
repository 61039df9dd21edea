"""Kill campaigns through the real commands: the broker killed -9 at random
moments and at named crash points under `pipeline produce` and the stage daemons, consumers
killed, paused past the heartbeat timeout and cut off from their socket, producers killed
while they write frames, `pipeline launch` and `pipeline run-batch` killed and run again.
Each campaign is judged by `pipeline tools check`: lost = unexpected = corrupt = 0,
duplicates within faults x items in flight. A few faults of each kind here; the 1,000-kill
version runs with --run-slow (and `tools/kill_campaign.py` prints the figures)."""

from __future__ import annotations

import json

import pytest

from pipeline.storage.crashpoints import POINTS
from lab.reliability import kills, runs

pytestmark = pytest.mark.campaign

# Points every run passes while it ingests and completes (the rest need rotation or a
# deletion, which a short run may not reach: --run-slow arms every point).
BUSY_POINTS = ("segment.after_write", "commit.after_verify", "tombstone.before_record")


def _assert_passed(out: kills.Outcome, faults: int) -> None:
    assert out.verdict["passed"], (out.verdict, out.notes)
    assert (out.verdict["lost"], out.verdict["unexpected"], out.verdict["corrupt"]) == (0, 0, 0)
    assert sum(out.faults.values()) == faults, out.faults


def test_broker_kills_and_crash_points_through_the_stage_commands(tmp_path):
    out = kills.broker_kills(str(tmp_path), 4, seed=1, rounds=3, items_per_round=1500, points=BUSY_POINTS,
                             point_rounds=1)
    # A crash point costs two deaths: the kill before the armed start, and the point itself.
    _assert_passed(out, 4 + 2 * len(BUSY_POINTS))
    assert all(counts["hit"] == 1 for counts in out.crash_points.values()), out.crash_points
    assert len(out.restart_s) == 4 + 2 * len(BUSY_POINTS) - sum(c["hit_before_serving"]
                                                                for c in out.crash_points.values())


def test_consumer_kill_pause_and_closed_socket(tmp_path):
    out = kills.consumer_faults(str(tmp_path), per_kind=1, seed=2, heartbeat_timeout_s=1.0)
    _assert_passed(out, len(kills.CONSUMER_FAULTS))
    assert {r["kind"] for r in out.redelivery} == set(kills.CONSUMER_FAULTS)
    # Read off the results files, never more than the broker returned; something each time
    # (each consumer holds its credit of 4 batches).
    assert all(0 < r["items"] <= r["returned_by_broker"] for r in out.redelivery), out.redelivery


def test_producer_kills_then_what_produce_says_was_never_submitted(tmp_path):
    out = kills.producer_kills(str(tmp_path), kills=2, seed=3)
    _assert_passed(out, 2)


def test_launch_killed_then_taken_over_by_the_next_launch(tmp_path):
    out = runs.launch_kills(str(tmp_path), kills=2, seed=4, items=2500)
    assert out.verdict["passed"], (out.verdict, out.notes)
    assert sum(out.faults.values()) >= 1, out.notes


def test_run_batch_killed_then_finished_by_the_same_command(tmp_path):
    from tools.make_batch_example import requests
    from tools.tiny_llama import build

    model = str(build(tmp_path / "tiny-llama"))
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests(300, "tiny-llama")))
    out = runs.run_batch_kills(str(tmp_path / "work"), kills=2, seed=5, requests_path=str(source), model_dir=model)
    assert out.verdict["passed"], (out.verdict, out.notes)
    assert out.verdict["completed"] == 300 and sum(out.faults.values()) >= 1


@pytest.mark.slow
def test_a_thousand_broker_kills_and_every_crash_point(tmp_path):
    out = kills.broker_kills(str(tmp_path / "random"), 1000, seed=10, rounds=334, items_per_round=2000)
    _assert_passed(out, 1000)
    points = kills.broker_kills(str(tmp_path / "points"), 0, seed=11, rounds=4 * len(POINTS), items_per_round=2000,
                                points=POINTS, point_rounds=4, durability="power")
    _assert_passed(points, 2 * 4 * len(POINTS))


@pytest.mark.slow
def test_many_faults_of_every_other_kind(tmp_path):
    _assert_passed(kills.consumer_faults(str(tmp_path / "c"), per_kind=10, seed=12), 10 * len(kills.CONSUMER_FAULTS))
    _assert_passed(kills.producer_kills(str(tmp_path / "p"), kills=10, seed=13), 10)
    assert runs.launch_kills(str(tmp_path / "l"), kills=10, seed=14, items=2500).verdict["passed"]


@pytest.mark.slow
def test_a_short_soak_passes_the_checker(tmp_path):
    """tools/soak.py runs it for 10 minutes; a minute here."""
    from lab.reliability.soak import soak

    out, extra = soak(str(tmp_path), duration_s=60, seed=15)
    assert out.verdict["passed"], (out.verdict, out.notes)
    assert sum(out.faults.values()) >= 10 and extra["workloads"] >= 2
