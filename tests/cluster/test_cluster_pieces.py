"""The cluster run's pieces that need no Ray: the agent's reading of results files as they
grow, and the command's one-line error where Ray is not installed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cluster.agent import ResultsTail

ROOT = Path(__file__).resolve().parents[2]


def row(item_id: int) -> bytes:
    return json.dumps({"item_id": item_id, "status": "ok"}).encode() + b"\n"


def test_the_tail_reads_whole_lines_once_and_waits_for_a_line_being_written(tmp_path):
    tail = ResultsTail(str(tmp_path / "results"))
    assert tail.rows() == []  # no directory yet: the consumers have not written
    (tmp_path / "results").mkdir()
    path = tmp_path / "results" / "gpu0.jsonl"
    path.write_bytes(row(1) + row(2) + row(3)[:5])  # a batch being appended: its last line cut
    assert [r["item_id"] for r in tail.rows()] == [1, 2]
    assert tail.rows() == []  # nothing new, nothing twice
    with open(path, "ab") as f:
        f.write(row(3)[5:] + row(4))
    assert [r["item_id"] for r in tail.rows()] == [3, 4]
    (tmp_path / "results" / "gpu1.jsonl").write_bytes(b'{"item_id": 9, "sta\n' + row(5))  # a torn line, terminated
    assert [r["item_id"] for r in tail.rows()] == [5] and tail.bad_lines == 1


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")
def test_without_ray_the_command_says_how_to_get_it_and_makes_nothing(tmp_path):
    source = tmp_path / "requests.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "m", "prompt": "hi"}}) + "\n")
    done = subprocess.run([sys.executable, "-m", "pipeline", "run-batch", "--engine", "sim", "-i", str(source),
                           "-o", str(tmp_path / "out.jsonl"), "--model", str(tmp_path), "--ray", "auto"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.strip() == "Error: --ray needs Ray: pip install 'shape-broker[ray]'"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl"]
