"""The `pipeline` command group."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from pipeline.cli import main


def test_group_help_lists_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "launch" in result.output


@pytest.mark.integration
def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "pipeline", "--version"], capture_output=True, text=True)
    assert done.returncode == 0
    assert "version" in done.stdout


@pytest.mark.integration
def test_the_shape_order_is_an_option_and_the_report_shows_it(tmp_path):
    import json

    report = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "pipeline", "launch", "--items", "300", "--shape-order", "most-tokens",
                           "--report", str(report)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    settings = json.loads(report.read_text())["settings"]
    assert settings["broker"]["shape_order"] == "most-tokens" and settings["changed"]["broker.shape_order"] == "most-tokens"


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["fifo", "round-robin", "no-lanes"])
def test_each_baseline_dispatch_policy_runs_a_launch_that_balances(tmp_path, policy):
    import json

    report = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "pipeline", "launch", "--items", "600", "--dispatch", policy,
                           "--report", str(report)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    figures = json.loads(report.read_text())
    assert figures["accounting_ok"] is True and figures["settings"]["changed"]["broker.dispatch"] == policy
    if policy == "round-robin":
        assert figures["shape_switches_by_reason"]["order"] > 0


def test_broker_start_refuses_a_token_file_others_can_read_in_one_line_before_anything_starts(tmp_path):
    token, data = tmp_path / "token", tmp_path / "data"
    token.write_text("abc\n")
    token.chmod(0o644)
    result = CliRunner().invoke(main, ["broker", "start", "--data-dir", str(data), "--metrics-port", "0",
                                       "--metrics-token-file", str(token)])
    assert result.exit_code == 1
    assert result.output == (f"Error: metrics_token_file {token}: mode 0644 lets other users at the token: "
                             f"chmod 600 {token}\n")
    assert not data.exists()
    result = CliRunner().invoke(main, ["broker", "start", "--data-dir", str(data), "--metrics-token-file", str(token)])
    assert result.exit_code == 1 and "--metrics-token-file is given without --metrics-port" in result.output
