"""quickstart.py's tiers: a `-m` given after a test command narrows the tier it runs, never
replaces it (pytest keeps only the last -m it is given)."""

from __future__ import annotations

import pytest

from quickstart import UNIT_AND_INTEGRATION, _with_marks


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

