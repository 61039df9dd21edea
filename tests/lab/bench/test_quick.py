"""Every registered comparison, run as a user would (`pipeline bench NAME --quick`) in a
child process, at tiny size: a benchmark that no longer runs fails here, not on the day its
figures are wanted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab.bench import COMPARISON_MODULES
from tests.support.repo import ROOT

pytestmark = pytest.mark.campaign


@pytest.mark.parametrize("name", list(COMPARISON_MODULES))
def test_quick_run_writes_its_figures_and_section(name: str, tmp_path: Path):
    out, page = tmp_path / "out", tmp_path / "B.md"
    done = subprocess.run([sys.executable, "-m", "pipeline", "bench", name, "--quick", "--out", str(out),
                           "--markdown", str(page)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / f"{name}.json").read_text())
    assert record["quick"] is True and record["figures"]
    assert f"<!-- pipeline bench {name} -->" in page.read_text()
