"""The bench harness: alternating runs, spreads, the JSON / plot / section it writes, and the
`pipeline bench` command around it (with a comparison defined here, so these tests do not
depend on any real comparison's speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.bench.harness import (
    DEFAULT_MARKDOWN,
    SUITE_HEADING,
    BenchContext,
    Outcome,
    Target,
    alternate,
    fmt_spread,
    machine_info,
    run_comparison,
    spread,
    table,
    write_section,
)
from tests.support.repo import ROOT


def test_alternate_rotates_which_side_goes_first():
    order: list[str] = []
    sides = [(label, lambda label=label: order.append(label) or {"v": len(order)}) for label in "abc"]
    runs = alternate(sides, 3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [r["v"] for r in runs["a"]] == [1, 6, 8]


def test_spread_and_its_format():
    s = spread([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["values"]) == (2.0, 1.0, 3.0, [3.0, 1.0, 2.0])
    assert fmt_spread(s, ".1f") == "2.0 (1.0-3.0)"
    assert fmt_spread(spread([5.0]), ".1f") == "5.0"
    with pytest.raises(AssertionError):
        spread([])


@pytest.mark.integration
def test_machine_info_names_what_a_reader_needs():
    info = machine_info()
    assert info["cores"] >= 1 and len(info["load_average"]) == 3
    assert info["python"].count(".") == 2 and info["numpy"]


def test_write_section_appends_under_the_heading_then_replaces_in_place(tmp_path: Path):
    page = tmp_path / "B.md"
    page.write_text("# Benchmarks\n\nold text\n")
    write_section(page, "one", "### One\nalpha-body")
    write_section(page, "two", "### Two\nsecond")
    write_section(page, "one", "### One\nrewritten")
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nold text\n")
    assert text.count(SUITE_HEADING) == 1
    assert "alpha-body" not in text and text.index("rewritten") < text.index("second")
    assert text.count("<!-- pipeline bench one -->") == 1


def test_the_repository_page_holds_the_suite_heading_once():
    # A comparison run for the first time appends its section under this heading; a page
    # without it would grow a second suite heading at its end.
    assert (ROOT / DEFAULT_MARKDOWN).read_text().count(SUITE_HEADING) == 1


class _Fake:
    name = "fake"
    title = "A fake comparison"

    def run(self, ctx: BenchContext) -> Outcome:
        def plot(path: Path) -> None:
            path.write_bytes(b"\x89PNG fake")
        return Outcome({"sides": {"a": 1.5}}, table(["side", "figure"], [["a", 1.5]]),
                       [Target("a beats b", True, "1.5 against 1.0"), Target("c ran", None, "c not installed")], plot)


@pytest.mark.integration
def test_run_comparison_writes_json_plot_and_section(tmp_path: Path):
    ctx = BenchContext(quick=True, repeat=1, work_dir=tmp_path / "w", out_dir=tmp_path / "out", log=lambda _: None)
    page = tmp_path / "BENCHMARKS.md"
    record = run_comparison(_Fake(), ctx, page)
    stored = json.loads((tmp_path / "out" / "fake.json").read_text())
    assert stored["figures"] == {"sides": {"a": 1.5}} == record["figures"]
    assert stored["command"] == "pipeline bench fake --quick"
    assert stored["machine_before"]["cores"] >= 1 and stored["targets"][1]["met"] is None
    text = page.read_text()
    assert "### A fake comparison" in text and "| a | 1.5 |" in text
    assert "**met**: a beats b" in text and "not judged: c ran" in text
    assert "](out/fake.png)" in text and "`out/fake.json`" in text


def test_the_bench_command_lists_every_registered_comparison():
    from click.testing import CliRunner

    from lab.bench import COMPARISON_MODULES
    from pipeline.cli import main
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    for name in [*COMPARISON_MODULES, "all"]:
        assert name in result.output
    bad = CliRunner().invoke(main, ["bench", "all", "--repeat", "51"])
    assert bad.exit_code == 2 and "51" in bad.output
