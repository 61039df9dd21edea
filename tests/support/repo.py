"""Where the repository is: the working directory of the commands the tests run, and the
home of tools/ and .cache/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
