"""The comparisons of `pipeline bench NAME|all` as click commands: run them, write their
JSON, plots and BENCHMARKS.md sections (lab/bench/). `pipeline/cli/lab.py` serves them
under `pipeline bench`, importing this module when that command runs."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import click

from lab.bench import COMPARISON_MODULES, comparison
from lab.bench.harness import (
    DEFAULT_MARKDOWN,
    DEFAULT_OUT_DIR,
    DEFAULT_REPEAT,
    MAX_REPEAT,
    QUICK_OUT_DIR,
    BenchContext,
    run_comparison,
)


def _options(command):
    command = click.option("--quick", is_flag=True,
                           help=f"Every side at tiny size, once (a smoke run; writes to {QUICK_OUT_DIR}/ "
                                "unless --out/--markdown say otherwise).")(command)
    command = click.option("--repeat", type=click.IntRange(1, MAX_REPEAT), default=None,
                           help=f"Runs of each side, alternating [default: {DEFAULT_REPEAT}; 1 with --quick].")(command)
    command = click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
                           help=f"Where the JSON files and plots go [default: {DEFAULT_OUT_DIR}].")(command)
    command = click.option("--markdown", type=click.Path(dir_okay=False), default=None,
                           help=f"The page whose sections are rewritten [default: {DEFAULT_MARKDOWN}].")(command)
    return click.option("--no-markdown", is_flag=True, help="Write no markdown section.")(command)


def _run(names: list[str], quick: bool, repeat: int | None, out_dir: str | None, markdown: str | None,
         no_markdown: bool) -> None:
    out = Path(out_dir or (QUICK_OUT_DIR if quick else DEFAULT_OUT_DIR))
    page = None if no_markdown else Path(markdown or (out / DEFAULT_MARKDOWN if quick else DEFAULT_MARKDOWN))
    work = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    try:
        for name in names:
            ctx = BenchContext(quick=quick, repeat=repeat or (1 if quick else DEFAULT_REPEAT),
                               work_dir=work / name, out_dir=out, log=click.echo)
            ctx.work_dir.mkdir(parents=True)
            run_comparison(comparison(name), ctx, page)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@click.group("bench")
def bench() -> None:
    """The comparisons (their help is `pipeline bench`'s, pipeline/cli/lab.py)."""


def _subcommand(name: str) -> click.Command:
    @_options
    def command(quick: bool, repeat: int | None, out_dir: str | None, markdown: str | None, no_markdown: bool) -> None:
        _run([name], quick, repeat, out_dir, markdown, no_markdown)

    command.__doc__ = f"The `{name}` comparison (lab/bench/)."
    return click.command(name)(command)


for _name in COMPARISON_MODULES:
    bench.add_command(_subcommand(_name))


@bench.command("all")
@_options
def bench_all(quick: bool, repeat: int | None, out_dir: str | None, markdown: str | None, no_markdown: bool) -> None:
    """Every comparison, in order."""
    _run(list(COMPARISON_MODULES), quick, repeat, out_dir, markdown, no_markdown)
