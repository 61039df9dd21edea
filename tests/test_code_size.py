"""The size rules of the developers' guide, checked over the product and the laboratory: no
module of pipeline/, shm/ or lab/ over MODULE_LINES_MAX lines, no function or method over
FUNCTION_LINES_MAX (from its `def` line to its last, decorators not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.repo import ROOT

PACKAGES = ("pipeline", "shm", "lab")
# A module holds one idea; past this it holds two, and splits along their seam.
MODULE_LINES_MAX = 600
# A function reads in one screen; past this a part of it has a name of its own.
FUNCTION_LINES_MAX = 70


def _sources() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def _line_count(text: str) -> int:
    return len(text.splitlines())


def _long_functions(text: str, limit: int) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function in `text` longer than `limit` lines."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_module_is_over_the_limit():
    long = [f"{path.relative_to(ROOT)}: {lines} lines" for path in _sources()
            if (lines := _line_count(path.read_text())) > MODULE_LINES_MAX]
    assert not long, f"modules over {MODULE_LINES_MAX} lines (split each along a seam):\n" + "\n".join(long)


def test_no_function_is_over_the_limit():
    long = [f"{path.relative_to(ROOT)}:{line}: {name} is {length} lines" for path in _sources()
            for name, line, length in _long_functions(path.read_text(), FUNCTION_LINES_MAX)]
    assert not long, f"functions over {FUNCTION_LINES_MAX} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("body_lines, too_long", [(FUNCTION_LINES_MAX - 1, False), (FUNCTION_LINES_MAX, True)])
def test_a_function_at_the_limit_passes_and_one_past_it_is_named(body_lines, too_long):
    text = "@decorator\ndef f():\n" + "    x = 1\n" * body_lines  # the def line counts, the decorator not
    found = _long_functions(text, FUNCTION_LINES_MAX)
    assert found == ([("f", 2, FUNCTION_LINES_MAX + 1)] if too_long else [])


@pytest.mark.parametrize("lines, too_long", [(MODULE_LINES_MAX, False), (MODULE_LINES_MAX + 1, True)])
def test_a_module_at_the_limit_passes_and_one_past_it_does_not(lines, too_long):
    assert (_line_count("x = 1\n" * lines) > MODULE_LINES_MAX) is too_long
