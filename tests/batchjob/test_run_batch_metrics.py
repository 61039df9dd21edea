"""`pipeline run-batch --metrics-port`: the port is bound before the input is scanned, so a
port in use is refused in one line with no data directory left behind, and the port a 0
picked is said at the start and kept in the job's status (real commands, the sim engine); on
a Ray cluster, where nothing would serve it, the option is refused."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import batch, main
from tests.support.jobs import build_model, chat, rows_by_id, run_batch, write_requests

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def test_a_metrics_port_in_use_is_refused_in_one_line_before_the_input_is_read(tmp_path, model_dir):
    """The input's second line is no JSON: the scan would refuse it; the port is found first."""
    job = tmp_path / "in.jsonl"
    job.write_text(json.dumps(chat("r0")) + "\nnot json\n")
    out = tmp_path / "out.jsonl"
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = run_batch("-i", str(job), "-o", str(out), "--model", model_dir, "--metrics-port", str(port))
    assert done.returncode == 1
    assert done.stderr == (f"Error: metrics port {port} (127.0.0.1:{port}) is in use: another process listens there; "
                           f"give another --metrics-port, or 0 for any free one\n")
    assert not out.exists() and not (tmp_path / "out.jsonl.run").exists()


def test_a_metrics_port_0_is_said_and_kept_in_the_jobs_status(tmp_path, model_dir):
    job = write_requests(tmp_path / "in.jsonl", [chat(f"r{k}") for k in range(4)])
    out, data = tmp_path / "out.jsonl", tmp_path / "data"
    done = run_batch("-i", str(job), "-o", str(out), "--model", model_dir, "--data-dir", str(data),
                     "--metrics-port", "0")
    assert done.returncode == 0, done.stderr
    said = re.findall(r"^run-batch: metrics: http://127\.0\.0\.1:(\d+)/metrics$", done.stderr, re.MULTILINE)
    assert len(said) == 1 and int(said[0]) > 0, done.stderr
    assert done.stderr.index("run-batch: metrics:") < done.stderr.index("requests in")  # said before the scan's line
    status = json.loads(Path(data, "job", "status.json").read_text())
    assert status["metrics_port"] == int(said[0])
    assert sorted(rows_by_id(out)) == [f"r{k}" for k in range(4)]


def test_a_metrics_port_on_a_ray_cluster_run_is_refused_before_anything(tmp_path, model_dir, monkeypatch):
    """A job on Ray serves no metrics: a port would be bound and said, and never answered."""
    monkeypatch.setattr(batch, "check_ray", lambda address: None)  # no cluster needed to be refused
    job = write_requests(tmp_path / "in.jsonl", [chat("r0")])
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run-batch", "--engine", "sim", "-i", str(job), "-o", str(out), "--model",
                                       model_dir, "--ray", "auto", "--metrics-port", "0"])
    assert result.exit_code == 1 and "serves no metrics" in result.output, result.output
    assert not out.exists() and not (tmp_path / "out.jsonl.run").exists()
