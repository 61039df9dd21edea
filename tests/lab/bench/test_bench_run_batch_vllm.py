"""`pipeline bench run-batch --quick` and `run-batch-mix --quick` with vLLM present (marked
`vllm`): both sides run on the tiny model, every output checked, the figures and targets
written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.repo import ROOT

# Two vLLM engine starts on 2 cores, the tiny model built if missing, then the jobs.
RUN_TIMEOUT_S = 900


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["run-batch", "run-batch-mix"])
def test_quick_run_batch_comparison_with_vllm(name: str, tmp_path: Path):
    out, page = tmp_path / "out", tmp_path / "B.md"
    done = subprocess.run([sys.executable, "-m", "pipeline", "bench", name, "--quick", "--out", str(out),
                           "--markdown", str(page)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / f"{name}.json").read_text())
    figures = record["figures"]
    assert figures["vllm"] == sys.executable
    for side in ("vllm run-batch", "pipeline run-batch"):
        s = figures["sides"][side]
        assert s["prompt_tokens"]["median"] > 0 and s["span_s"]["median"] > 0
    # Both sides served the same prompts.
    assert (figures["sides"]["vllm run-batch"]["prompt_tokens"]["median"]
            == figures["sides"]["pipeline run-batch"]["prompt_tokens"]["median"])
    assert all(t["met"] is not None for t in record["targets"])
    if name == "run-batch-mix":  # every kind's answers compared, request by request
        assert [sum(kind["requests"] for kind in pair.values()) for pair in figures["answers"]["pairs"]] == [
            figures["requests"]]
    assert "vllm run-batch" in page.read_text()
