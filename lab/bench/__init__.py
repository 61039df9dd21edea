"""`pipeline bench`: the product side by side with what users would pick instead, every side
measured in the same run.

Each comparison is a module here exposing `COMPARISON` (see `harness.Comparison`); this
registry names them in the order `pipeline bench all` runs them. A module is imported only
when its comparison runs, so an optional dependency of one (redis, vllm, matplotlib) costs
the others nothing.
"""

from __future__ import annotations

import importlib

from lab.bench.harness import Comparison

# Subcommand -> module, in `all`'s order: the cheap, CPU-only comparisons first.
COMPARISON_MODULES: dict[str, str] = {
    "padding": "lab.bench.padding",
    "prefix": "lab.bench.prefix",
    "prefix-vllm": "lab.bench.prefix_vllm",
    "run-batch": "lab.bench.run_batch",
    "run-batch-mix": "lab.bench.run_batch_mix",
    "e2e": "lab.bench.e2e",
    "shapes": "lab.bench.shapes",
    "redis": "lab.bench.redis_peer",
    "scaling": "lab.bench.scaling",
    "memory": "lab.bench.memory",
    "job-scale": "lab.bench.job_scale",
    "job-resume": "lab.bench.job_resume",
    "shape-memory": "lab.bench.shape_memory",
    "serve": "lab.bench.serve",
}


def comparison(name: str) -> Comparison:
    """The comparison behind subcommand `name`."""
    return importlib.import_module(COMPARISON_MODULES[name]).COMPARISON
