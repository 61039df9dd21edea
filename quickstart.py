#!/usr/bin/env python3
"""The README's two quick-start commands, with nothing needed but python3 and pip.

    python3 quickstart.py demo    run the pipeline on its embedded defaults
    python3 quickstart.py test    run the whole test suite

Both create (or reuse) a virtual environment in ./.venv and install this package into it,
with the `test` extra for `test`. The install is redone only when pyproject.toml changes
(a stamp file in the venv records its hash), so a second run starts at once.

Extra arguments after the command go to the tool it runs:
    python3 quickstart.py test -k ring -x
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".shape-broker-install-stamp"
# pytest's exit code when it collected no test: a suite that ran nothing must not pass.
PYTEST_NO_TESTS_COLLECTED = 5


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


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "test":
        python = _ensure_venv("test")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        rc = subprocess.run([str(python), "-m", "pytest", *rest], cwd=ROOT, env=env).returncode
        if rc == PYTEST_NO_TESTS_COLLECTED:
            print("quickstart: pytest collected no test; treating that as a failure", file=sys.stderr)
            return 1
        return rc
    python = _ensure_venv("")
    return subprocess.run([str(python), "-m", "pipeline", "launch", *rest], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
