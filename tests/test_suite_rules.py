"""The test suite's own rules: no test module imports another test module (a helper two of
them share lives in tests/support/), anywhere in the file, in any form of import; and a
unit test (one marked with no tier) that starts a process fails (tests/conftest.py)."""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import subprocess

import pytest

from tests.support.repo import ROOT

TESTS = ROOT / "tests"


def is_test_module(name: str) -> bool:
    """A module of this suite pytest collects tests from (its default python_files): under
    `tests`, or a bare name (pytest puts each test file's folder on sys.path, so
    `from test_x import y` reaches a sibling)."""
    parts = name.split(".")
    return (parts[0] == "tests" or len(parts) == 1) and (parts[-1].startswith("test_") or parts[-1].endswith("_test"))


def imported_test_modules(source: str, module: str) -> list[str]:
    """The test modules that `source` (the text of module `module`, a dotted name) imports:
    `import a.test_b`, `from a.test_b import c`, `from a import test_b` and their relative
    forms, at the top of the file or inside a function."""
    package = module.rsplit(".", 1)[0] if "." in module else ""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if any(map(is_test_module, _prefixes(alias.name)))]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module or "", node.level, package)
            if any(map(is_test_module, _prefixes(base))):
                found.append(base)
            else:
                found += [f"{base}.{alias.name}" for alias in node.names if is_test_module(f"{base}.{alias.name}")]
    return found


def _prefixes(dotted: str) -> list[str]:
    parts = dotted.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1)]


def _absolute(name: str, level: int, package: str) -> str:
    if level == 0:
        return name
    parts = package.split(".") if package else []
    base = parts[:len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def test_no_test_module_imports_another_test_module():
    wrong = []
    for path in sorted(TESTS.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for target in imported_test_modules(path.read_text(), module):
            wrong.append(f"{path.relative_to(ROOT)} imports the test module {target}: move what it uses to "
                         "tests/support/")
    assert not wrong, "\n".join(wrong)



@pytest.mark.parametrize("source, found", [
    ("from tests.broker.test_segment import make_items", ["tests.broker.test_segment"]),
    ("import tests.test_metrics", ["tests.test_metrics"]),
    ("import tests.test_metrics as metrics", ["tests.test_metrics"]),
    ("from tests.broker import test_segment", ["tests.broker.test_segment"]),
    ("from .test_launch import launch", ["tests.runtime.test_launch"]),
    ("from . import test_launch", ["tests.runtime.test_launch"]),
    ("from ..broker.test_segment import KEYS", ["tests.broker.test_segment"]),
    ("def helper():\n    from tests.test_progress import status_at", ["tests.test_progress"]),
    ("from tests.support.segments import make_items", []),
    ("from tests.pipeline.harness import wait_until", []),
    ("from test_disk_crash import Driver", ["test_disk_crash"]),
    ("from hypothesis.stateful import run_state_machine_as_test", []),
    ("import pytest\nfrom pipeline.storage.segment import SegmentFile", []),
])
def test_every_form_of_importing_a_test_module_is_found(source, found):
    assert imported_test_modules(source, "tests.runtime.test_x") == found


def _fork_and_exit() -> None:
    if os.fork() == 0:  # only where the guard is missing: the child leaves at once
        os._exit(0)


def _reaped(pid: int) -> None:
    os.waitpid(pid, 0)


STARTS = {
    "subprocess.run": lambda: subprocess.run(["true"], check=True),
    "os.system": lambda: os.system("true"),
    "os.fork": _fork_and_exit,
    "os.posix_spawn": lambda: _reaped(os.posix_spawn("/bin/true", ["true"], os.environ)),
    "a fork context's Process": lambda: mp.get_context("fork").Process(target=int).start(),
    "a spawn context's Process": lambda: mp.get_context("spawn").Process(target=int).start(),
}


@pytest.mark.parametrize("start", list(STARTS))
def test_a_unit_test_that_starts_a_process_fails(start):
    with pytest.raises(pytest.fail.Exception, match="a unit test started a process"):
        STARTS[start]()


@pytest.mark.integration
def test_an_integration_test_may_start_a_process():
    assert subprocess.run(["true"]).returncode == 0


def test_every_test_module_has_a_name_of_its_own():
    # Test folders are not packages: pytest imports each test file by its bare name (its
    # folder on sys.path), so two files of one name in two folders fail the collection.
    by_name: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        by_name.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert not {name: paths for name, paths in by_name.items() if len(paths) > 1}
