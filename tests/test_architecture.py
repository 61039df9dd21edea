"""ARCHITECTURE.md's dependency rules, checked against the code: every import (top-level or
inside a function; not those only for type checking) of every module under pipeline/, shm/
and lab/ must follow the arrows the document's `dependencies` block declares, or be one of
its `lazy` block's imports and made inside a function; the module graph must have no cycle,
type-only imports included, and the modules the document calls pure must import no clock,
process, socket or shared memory."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.repo import ROOT

DOCUMENT = ROOT / "ARCHITECTURE.md"
PACKAGES = ("pipeline", "shm", "lab")
# What a pure module may not import: the side effects its process loop owns instead.
IMPURE_MODULES = frozenset({"time", "os", "socket", "selectors", "threading", "multiprocessing", "subprocess",
                            "signal", "mmap", "posix_ipc", "psutil", "shm"})


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _nodes(path: Path, type_only: bool = False) -> list[ast.AST]:
    """Every node of the file but those under `if TYPE_CHECKING:` (names for annotations
    only, never imported when the code runs), unless `type_only`."""
    tree = ast.parse(path.read_text())
    skipped = set() if type_only else {
        id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
        for child in block.body for node in ast.walk(child)}
    return [node for node in ast.walk(tree) if id(node) not in skipped]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: dict[str, Path], top_level_only: bool = False, type_only: bool = False) -> set[str]:
    """Every module of ours that `path` imports, anywhere in the file (or outside every
    function: what importing the module itself imports; with `type_only`, the imports for
    annotations too)."""
    nodes = _nodes(path, type_only)
    if top_level_only:
        inside = {id(node) for function in nodes if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for node in ast.walk(function)}
        nodes = [node for node in nodes if id(node) not in inside]
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            out.update(name for name in names if name in modules)
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {name for name in out if name in modules}


def _external(path: Path) -> set[str]:
    """The top-level names of every module `path` imports."""
    out: set[str] = set()
    for node in _nodes(path):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
    return out


def _block(name: str) -> list[str]:
    match = re.search(rf"```{name}\n(.*?)```", DOCUMENT.read_text(), re.S)
    assert match, f"ARCHITECTURE.md has no ```{name} block"
    return [line.split("#")[0].strip() for line in match.group(1).splitlines() if line.split("#")[0].strip()]


def _rules(block: str = "dependencies") -> dict[str, set[str]]:
    rules = {}
    for line in _block(block):
        unit, _, allowed = line.partition("->")
        rules[unit.strip()] = set(allowed.split())
    return rules


def _unit_of(module: str, units: dict[str, set[str]]) -> str:
    """The most specific unit the document declares for `module`."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in units:
            return ".".join(parts[:end])
    raise AssertionError(f"{module} belongs to no unit of ARCHITECTURE.md's dependencies block")


def _allowed(unit: str, arrows: set[str]) -> bool:
    """An arrow to a unit includes the units nested in it."""
    return any(unit == to or unit.startswith(to + ".") for to in arrows)


def test_every_import_follows_the_documented_arrows():
    modules, rules, lazy = _modules(), _rules(), _rules("lazy")
    wrong = []
    for name, path in modules.items():
        source = _unit_of(name, rules)
        eager = _imports(path, modules, top_level_only=True)
        for target in _imports(path, modules):
            unit = _unit_of(target, rules)
            if target in lazy.get(name, set()) and target not in eager:
                continue
            if unit != source and not _allowed(unit, rules[source]):
                wrong.append(f"{name} imports {target}: {source} -> {unit} is not an arrow of ARCHITECTURE.md")
    assert not wrong, "\n".join(wrong)


def test_each_lazy_import_is_made_and_only_inside_a_function():
    modules, lazy = _modules(), _rules("lazy")
    for name, targets in lazy.items():
        assert name in modules, f"ARCHITECTURE.md's lazy block names {name}, which is no module"
        assert targets <= _imports(modules[name], modules), f"{name} no longer imports {targets}: drop the line"
        assert not targets & _imports(modules[name], modules, top_level_only=True), \
            f"{name} imports {targets} when it is imported itself, not only inside a function"


def test_every_documented_unit_exists_and_arrows_point_one_way():
    modules, rules = _modules(), _rules()
    for unit, allowed in rules.items():
        assert any(m == unit or m.startswith(unit + ".") for m in modules), f"no module is in {unit}"
        assert allowed <= set(rules), f"{unit} -> {allowed - set(rules)}: not units"
        for other in allowed:
            assert not _allowed(unit, rules[other]), f"{unit} and {other} may import each other"


def test_the_module_graph_has_no_cycle():
    """Type-only imports count: a circle through them is two modules that cannot be read or
    changed apart, whatever runs first."""
    modules = _modules()
    graph = {name: _imports(path, modules, type_only=True) - {name} for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target] if target in path else [name, target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_pure_modules_import_no_side_effects():
    modules = _modules()
    for prefix in _block("pure"):
        chosen = [name for name in modules if name == prefix or name.startswith(prefix + ".")]
        assert chosen, f"ARCHITECTURE.md calls {prefix} pure, but no module is there"
        for name in chosen:
            bad = _external(modules[name]) & IMPURE_MODULES
            assert not bad, f"{name} is declared pure but imports {sorted(bad)}"
