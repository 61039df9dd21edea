"""`pipeline bench` (pipeline/cli/lab.py): the lab's commands under the product's, the lab
imported only when the command runs, one line saying what to install where it cannot be; the
package shipping the lab, and the test extra installing the lab's packages."""

from __future__ import annotations

import sys
import tomllib

import pytest
from click.testing import CliRunner

from pipeline.cli import lab as cli_lab
from pipeline.cli import main
from tests.support.repo import ROOT


@pytest.fixture
def lab_missing(monkeypatch):
    """`import lab.cli` fails, as where the lab or a package it imports is not installed."""
    monkeypatch.setitem(sys.modules, "lab.cli", None)


def test_the_product_help_lists_bench_without_the_lab(lab_missing):
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    assert "bench" in result.output and "launch" in result.output


@pytest.mark.parametrize("args", [["bench", "--help"], ["bench", "e2e", "--quick"]])
def test_bench_without_the_lab_says_what_to_install_in_one_line(lab_missing, args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"Error: `pipeline bench` needs the lab and its packages: {cli_lab.LAB_INSTALL} (")


def test_bench_serves_the_lab_commands():
    from lab.cli import bench

    assert cli_lab.bench.list_commands(None) == bench.list_commands(None)
    assert cli_lab.bench.get_command(None, "e2e") is bench.get_command(None, "e2e")


def test_the_install_line_is_the_labs_own():
    from lab.bench.harness import LAB_INSTALL

    assert cli_lab.LAB_INSTALL == LAB_INSTALL == "pip install 'shape-broker[lab]'"


def test_the_package_ships_the_lab_and_the_test_extra_holds_its_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "lab*" in project["tool"]["setuptools"]["packages"]["find"]["include"]
    extras = project["project"]["optional-dependencies"]
    assert set(extras["lab"]) <= set(extras["test"])
