"""What every comparison of `pipeline bench` shares: the machine record, alternating repeated
runs with their medians, and the writing of a comparison's JSON file, plot and BENCHMARKS.md
section.

A comparison is one object with a `name` (its subcommand), a `title` and
`run(ctx) -> Outcome`. The harness, not the comparison, records the machine before and
after, the commit and the command line, and writes:

    OUT/NAME.json       {"comparison", "command", "commit", "started_utc", "seconds",
                         "machine_before", "machine_after", "quick", "repeat", "figures",
                         "targets"}
    OUT/NAME.png        the comparison's plot (where matplotlib is installed)
    MARKDOWN            the section between `<!-- pipeline bench NAME -->` and
                        `<!-- /pipeline bench NAME -->`, replaced in place, or appended
                        under SUITE_HEADING when the file lacks it

Owned by the `pipeline bench` command's process; not thread-safe (one comparison at a time).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# How to install the lab's packages (pipeline/cli/lab.py says the same where the lab itself
# cannot be imported; tests/cli/test_lab.py holds the two equal).
LAB_INSTALL = "pip install 'shape-broker[lab]'"
SUITE_HEADING = "## The evaluation suite: `pipeline bench`"
SUITE_PREAMBLE = (
    "Every section below is written by the command in its first line, which also writes the raw figures "
    "(a JSON file) and the plot beside it; rerun it to reproduce the section. Medians are of alternating, "
    "repeated runs, with the minimum and maximum beside them. Baselines are measured in the same run.")
# Where the JSON files and plots go by default: committed beside BENCHMARKS.md, so the page's
# images resolve on a fresh clone.
DEFAULT_OUT_DIR = "docs/bench"
DEFAULT_MARKDOWN = "BENCHMARKS.md"
# `--quick` writes elsewhere by default, so a smoke run never overwrites the published figures.
QUICK_OUT_DIR = "bench-quick"
# Runs of each side when not told otherwise: 3 gives a median that one outlier cannot move.
DEFAULT_REPEAT = 3
# More runs than this per side is a typo, not a benchmark (each run starts real processes).
MAX_REPEAT = 50


@dataclass(slots=True)
class Target:
    """One of the issue's targets, judged on this run's figures."""

    name: str
    met: bool | None  # None: not judged here (a side could not run), with the reason in detail
    detail: str


@dataclass(slots=True)
class Outcome:
    """What a comparison measured: raw figures (JSON-able), its section's body (markdown, no
    heading), the targets it judges, and an optional plot drawn into a given PNG path."""

    figures: dict[str, Any]
    markdown: str
    targets: list[Target] = field(default_factory=list)
    plot: Callable[[Path], None] | None = None


@dataclass(slots=True)
class BenchContext:
    """A run's settings, handed to each comparison. `work_dir` is scratch space (data
    directories, generated workloads), removed by the caller."""

    quick: bool
    repeat: int
    work_dir: Path
    out_dir: Path
    log: Callable[[str], None] = print

    def size(self, full: Any, quick: Any) -> Any:
        """`quick` under --quick, else `full`."""
        return quick if self.quick else full


class Comparison(Protocol):
    name: str
    title: str

    def run(self, ctx: BenchContext) -> Outcome: ...


def machine_info() -> dict[str, Any]:
    """The machine as a reader needs it to compare figures: cores, CPU model, memory,
    Python and numpy versions, and the load average now."""
    model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        model = platform.processor()
    memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cores": os.cpu_count(), "cpu_model": model, "memory_gib": round(memory_bytes / 2**30, 1),
            "python": platform.python_version(), "numpy": np.__version__, "platform": platform.platform(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def alternate(sides: Sequence[tuple[str, Callable[[], dict]]], repeat: int) -> dict[str, list[dict]]:
    """Run every side `repeat` times, interleaved, the first side of each round rotating, so
    a drift of the machine (or a warm page cache) does not always favour one side."""
    runs: dict[str, list[dict]] = {label: [] for label, _ in sides}
    for round_index in range(repeat):
        shift = round_index % len(sides)
        for label, side in list(sides[shift:]) + list(sides[:shift]):
            runs[label].append(side())
    return runs


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median with min and max beside it, and every value (in run order)."""
    assert values, "a spread of no runs"
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


def spread_of(runs: Sequence[dict], key: str) -> dict[str, Any]:
    return spread([float(run[key]) for run in runs])


def fmt_spread(s: dict[str, Any], fmt: str = ",.0f") -> str:
    """`median (min-max)`, or the one value when there was one run."""
    if len(s["values"]) == 1:
        return format(s["median"], fmt)
    return f"{format(s['median'], fmt)} ({format(s['min'], fmt)}-{format(s['max'], fmt)})"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _commit() -> str:
    """The commit the code ran at (with `+dirty` for local changes), or `unknown` outside a
    checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
        # The pages and figures this suite writes do not make the code dirty.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                f":(exclude){DEFAULT_MARKDOWN}", f":(exclude){DEFAULT_OUT_DIR}"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def command_line(name: str, ctx: BenchContext) -> str:
    """The command that reproduces this comparison's figures."""
    parts = ["pipeline", "bench", name]
    if ctx.quick:
        parts.append("--quick")
    if ctx.repeat != (1 if ctx.quick else DEFAULT_REPEAT):
        parts += ["--repeat", str(ctx.repeat)]
    return shlex.join(parts)


def run_comparison(comparison: Comparison, ctx: BenchContext, markdown: Path | None) -> dict[str, Any]:
    """Run one comparison and write its JSON, plot and section; return the JSON record."""
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    before = machine_info()
    started = datetime.datetime.now(datetime.timezone.utc)
    start_s = time.monotonic()
    ctx.log(f"pipeline bench {comparison.name}: {comparison.title}")
    outcome = comparison.run(ctx)
    record = {"comparison": comparison.name, "title": comparison.title, "command": command_line(comparison.name, ctx),
              "commit": _commit(), "started_utc": started.strftime("%Y-%m-%d %H:%M UTC"),
              "seconds": round(time.monotonic() - start_s, 1), "machine_before": before,
              "machine_after": machine_info(), "quick": ctx.quick, "repeat": ctx.repeat,
              "figures": outcome.figures, "targets": [dataclasses.asdict(t) for t in outcome.targets]}
    json_path = ctx.out_dir / f"{comparison.name}.json"
    json_path.write_text(json.dumps(record, indent=1, default=_json_default) + "\n")
    plot_path = _draw(outcome, ctx.out_dir / f"{comparison.name}.png", ctx.log)
    if markdown is not None:
        write_section(markdown, comparison.name, section_text(record, outcome, json_path, plot_path, markdown))
    for target in outcome.targets:
        verdict = {True: "met", False: "MISSED", None: "not judged"}[target.met]
        ctx.log(f"  target {verdict}: {target.name} ({target.detail})")
    return record


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON-able")


def _draw(outcome: Outcome, path: Path, log: Callable[[str], None]) -> Path | None:
    if outcome.plot is None:
        return None
    try:
        outcome.plot(path)
    except ImportError:
        log(f"  no plot ({path.name}): matplotlib is not installed ({LAB_INSTALL})")
        return None
    return path


def section_text(record: dict[str, Any], outcome: Outcome, json_path: Path, plot_path: Path | None,
                 markdown: Path) -> str:
    """The section: heading, command and machine, the comparison's body, targets, plot."""
    before, after = record["machine_before"], record["machine_after"]
    lines = [f"### {record['title']}", "",
             f"Command: `{record['command']}` (at {record['commit']}, {record['started_utc']}, "
             f"{record['seconds']:.0f} s; raw figures: `{_relative(json_path, markdown)}`). Machine: "
             f"{before['cores']} cores ({before['cpu_model'] or 'unknown CPU'}), {before['memory_gib']} GiB, "
             f"Python {before['python']}, numpy {before['numpy']}; load average "
             f"{'/'.join(map(str, before['load_average']))} before, {'/'.join(map(str, after['load_average']))} "
             "after.", "", outcome.markdown.strip(), ""]
    if outcome.targets:
        lines += ["Targets:", ""]
        lines += [f"- {'**met**' if t.met else ('**missed**' if t.met is False else 'not judged')}: "
                  f"{t.name} ({t.detail})" for t in outcome.targets]
        lines.append("")
    if plot_path is not None:
        lines += [f"![{record['title']}]({_relative(plot_path, markdown)})", ""]
    return "\n".join(lines)


def _relative(path: Path, markdown: Path) -> str:
    return os.path.relpath(path.resolve(), markdown.resolve().parent)


def write_section(markdown: Path, name: str, text: str) -> None:
    """Put `text` between the comparison's markers in `markdown`: in place where they are,
    else appended under SUITE_HEADING (added at the end when missing). Written to a
    temporary file and renamed, so an interrupted write leaves the page as it was."""
    begin, end = f"<!-- pipeline bench {name} -->", f"<!-- /pipeline bench {name} -->"
    block = f"{begin}\n{text.strip()}\n{end}"
    page = markdown.read_text() if markdown.exists() else ""
    found = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if found.search(page):
        page = found.sub(lambda _: block, page, count=1)
    else:
        if SUITE_HEADING not in page:
            page = page.rstrip("\n") + ("\n\n" if page else "") + f"{SUITE_HEADING}\n\n{SUITE_PREAMBLE}\n"
        page = page.rstrip("\n") + f"\n\n{block}\n"
    temporary = markdown.with_name(markdown.name + ".tmp")
    temporary.write_text(page)
    os.replace(temporary, markdown)


def python_command() -> list[str]:
    """How a comparison starts this product's `pipeline` in a child process."""
    return [sys.executable, "-m", "pipeline"]
