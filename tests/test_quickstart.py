"""quickstart.py's tiers: a `-m` given after a test command narrows the tier it runs, never
replaces it (pytest keeps only the last -m it is given); the tests' environment."""

from __future__ import annotations

import pytest

from quickstart import NO_BYTECODE_ENV, UNIT_AND_INTEGRATION, _test_env, _with_marks, _with_workers


@pytest.mark.parametrize("rest, want", [
    ([], ["-m", "not campaign"]),
    (["-k", "ring", "-x"], ["-m", "not campaign", "-k", "ring", "-x"]),
    (["-m", "integration"], ["-m", "(not campaign) and (integration)"]),
    (["-mintegration", "-q"], ["-m", "(not campaign) and (integration)", "-q"]),
    (["-m", "a", "-m", "b or c"], ["-m", "(not campaign) and (b or c)"]),  # pytest's last one
    (["-q", "--", "-m", "x"], ["-m", "not campaign", "-q", "--", "-m", "x"]),  # after --: not an option
    (["--maxfail=1"], ["-m", "not campaign", "--maxfail=1"]),
])
def test_a_users_marks_narrow_the_tier(rest, want):
    assert _with_marks(UNIT_AND_INTEGRATION, rest) == want


@pytest.mark.parametrize("rest, want", [
    ([], ["-n", "4"]),
    (["-k", "ring"], ["-n", "4", "-k", "ring"]),
    (["-n", "1"], ["-n", "1"]),
    (["-n0", "-x"], ["-n0", "-x"]),
    (["--numprocesses=2"], ["--numprocesses=2"]),
    (["-p", "no:xdist"], ["-p", "no:xdist"]),
    (["--", "-n", "1"], ["-n", "4", "--", "-n", "1"]),  # after --: not an option
])
def test_the_workers_are_the_users_when_they_choose_them(rest, want):
    assert _with_workers("4", rest) == want


def test_the_tests_write_bytecode_caches_whatever_the_environment_says():
    inherited = {NO_BYTECODE_ENV: "1", "HOME": "/h", "PYTHONUNBUFFERED": "0"}
    env = _test_env(inherited, {"SHAPE_BROKER_REQUIRE_VLLM": "1"})
    assert env == {"HOME": "/h", "PYTHONUNBUFFERED": "1", "SHAPE_BROKER_REQUIRE_VLLM": "1"}
    assert NO_BYTECODE_ENV in inherited  # the caller's own environment is left as it was
