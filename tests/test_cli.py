"""The `pipeline` command group."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from pipeline.cli import main


def test_group_help_lists_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "launch" in result.output


def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "pipeline", "--version"], capture_output=True, text=True)
    assert done.returncode == 0
    assert "version" in done.stdout
