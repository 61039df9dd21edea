"""The total-queue checker: a reference model under random histories (hypothesis), its
verdict on each kind of failure, and on a real run's files, untouched and then tampered
with (a changed prompt digest, a foreign item, a duplicate line, a removed line)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.audit.checker import History, ItemKey
from tests.support.repo import ROOT

# One step of a random history: (kind, key index, digest matches?)
_steps = st.lists(st.tuples(st.sampled_from(["ack", "deliver", "corrupt-status", "hold"]),
                            st.integers(0, 11), st.booleans()), max_size=60)


@settings(max_examples=300, deadline=None)
@given(attempted=st.integers(0, 8), steps=_steps, bound=st.none() | st.integers(0, 5))
def test_verdict_matches_a_reference_model(attempted: int, steps, bound):
    history = History()
    for k in range(attempted):
        history.attempt(ItemKey(b"k%d" % k), k)
    acked, good, held, lines, unexpected, corrupt, detected = set(), set(), set(), {}, 0, 0, 0
    for kind, k, matches in steps:
        key = ItemKey(b"k%d" % k)
        known = k < attempted
        if kind == "ack":
            if known:
                history.acknowledge(key)
                acked.add(k)
        elif kind == "hold":
            history.hold(key)
            if known:
                held.add(k)
            else:
                unexpected += 1
        else:
            status = "corrupt" if kind == "corrupt-status" else "ok"
            history.deliver(key, status, k if matches else k + 1000)
            if not known:
                unexpected += 1
                continue
            lines[k] = lines.get(k, 0) + 1
            if status == "corrupt":
                detected += 1
            elif matches:
                good.add(k)
            else:
                corrupt += 1
        history.check_invariants()
    v = history.verdict(bound)
    lost = len(acked - good - held)
    duplicated = sum(n - 1 for n in lines.values())
    assert (v.attempted, v.acknowledged, v.completed, v.held) == (attempted, len(acked), len(good), len(held - good))
    assert (v.lost, v.unexpected, v.corrupt, v.detected, v.duplicated) == (lost, unexpected, corrupt, detected, duplicated)
    assert v.passed == (lost == 0 and unexpected == 0 and corrupt == 0 and (bound is None or duplicated <= bound))


def test_each_failure_fails_the_verdict_and_is_named():
    history = History()
    for k in range(4):
        history.attempt(ItemKey(b"item-%d" % k), 100 + k)
    history.acknowledge_all()
    history.deliver(ItemKey(b"item-0"), "ok", 100)
    history.deliver(ItemKey(b"item-0"), "ok", 100)  # a redelivery: duplicated, not a failure
    history.deliver(ItemKey(b"item-1"), "ok", 999)  # delivered with other tokens
    history.hold(ItemKey(b"item-2"))  # still in the store: not lost
    history.deliver(ItemKey(b"stranger"), "ok", 1)
    v = history.verdict()
    assert (v.completed, v.held, v.lost, v.corrupt, v.unexpected, v.duplicated) == (1, 1, 2, 1, 1, 1)
    assert not v.passed and v.examples["lost"] == ["item-1", "item-3"] and v.examples["unexpected"] == ["stranger"]
    assert "FAIL" in v.line() and "lost 2" in v.line()
    assert history.verdict(duplicate_bound=0).duplicate_bound == 0


def test_duplicates_pass_within_their_bound_only():
    history = History()
    history.attempt(ItemKey(b"a"), 1)
    history.acknowledge_all()
    for _ in range(3):
        history.deliver(ItemKey(b"a"), "ok", 1)
    assert history.verdict().passed and history.verdict(2).passed and not history.verdict(1).passed


def test_an_unacknowledged_item_may_be_missing():
    history = History()
    history.attempt(ItemKey(b"a"), 1)
    history.attempt(ItemKey(b"b"), 2)
    history.acknowledge(ItemKey(b"a"))
    history.deliver(ItemKey(b"a"), "ok", 1)
    v = history.verdict()
    assert v.passed and (v.attempted, v.acknowledged, v.lost) == (2, 1, 0)


def _pipeline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _check(data_dir: Path, *extra: str) -> tuple[int, dict]:
    done = _pipeline("tools", "check", str(data_dir), "--workload", "demo", "--items", "600", "--json", *extra)
    return done.returncode, json.loads(done.stdout)


@pytest.mark.integration
def test_a_real_run_passes_and_each_tampering_is_caught(tmp_path: Path):
    data = tmp_path / "data"
    launched = _pipeline("launch", "--items", "600", "--data-dir", str(data), "--consumers", "2")
    assert launched.returncode == 0, launched.stderr[-2000:]
    code, v = _check(data)
    assert code == 0 and v["passed"] and (v["completed"], v["lost"], v["corrupt"]) == (600, 0, 0)
    results = next(p for p in (data / "results").rglob("*.jsonl") if p.stat().st_size)
    lines = results.read_text().splitlines()
    first, second = json.loads(lines[0]), json.loads(lines[1])
    first["prompt_xxh3"] ^= 1  # the engine was given other tokens than were submitted
    stranger = dict(second, payload=base64.b64encode(b"never-submitted").decode())
    tampered = [json.dumps(first), *lines[2:], lines[2], json.dumps(stranger)]  # line 1 gone, line 2 twice
    results.write_text("\n".join(tampered) + "\n")
    code, v = _check(data, "--duplicate-bound", "0")
    assert code == 1 and not v["passed"]
    assert (v["corrupt"], v["unexpected"], v["duplicated"], v["lost"]) == (1, 1, 1, 2)
    assert set(v["examples"]["lost"]) == {base64.b64decode(first["payload"]).decode(),
                                          base64.b64decode(second["payload"]).decode()}
