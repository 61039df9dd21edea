"""The README's example runs as written (under a unique object name)."""

from __future__ import annotations

import re

from tests.support.repo import ROOT

README = ROOT / "README.md"


def test_readme_python_example_runs(shm_name):
    text = README.read_text()
    (example,) = re.findall(r"```python\n(.*?)```", text, re.S)
    example = example.replace('"/sbrk-demo-producer-0"', repr(shm_name("readme")))
    exec(compile(example, str(README), "exec"), {})


def test_readme_quick_start_is_two_commands():
    block = re.search(r"## Quick start.*?```sh\n(.*?)```", README.read_text(), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["python3 quickstart.py demo", "python3 quickstart.py test"], block
    ci = (README.parent / ".ci" / "run").read_text()
    # CI runs the README's test command itself (under a time limit) first, nothing in its
    # place, then the campaigns, then the optional engines' suites.
    runs = [line.rstrip() for line in ci.splitlines() if "quickstart.py" in line and not line.lstrip().startswith("#")]
    tails = ["python3 quickstart.py test", "python3 quickstart.py test-campaigns",
             "python3 quickstart.py test-vllm -q -p no:cacheprovider", "python3 quickstart.py test-ray -q -p no:cacheprovider"]
    assert len(runs) == len(tails) and all(run.endswith(tail) for run, tail in zip(runs, tails)), runs
