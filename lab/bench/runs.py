"""Running the product as a user does, for the comparisons that measure real processes:
`pipeline launch` with a dispatch policy and the sim engine's cost model, its --json run
report, and `pipeline tools analyze`'s prefix-reuse bound. Shared by `pipeline bench
padding`, `prefix`, `prefix-vllm` and `shapes`.

Functions only; each call starts and waits for one child process (not thread-safe with
respect to the data directory it is given).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.bench.harness import python_command
from pipeline.wire.errors import PipelineError

ROOT = Path(__file__).resolve().parents[2]
# The dispatch policies compared, each as `pipeline launch` options: the product's default
# (sticky, prefix order, affinity: no options), the design note's rule, and the baselines of
# pipeline/broker/baselines.py. no-lanes is the design note's broker without length lanes
# (one FIFO queue per shape, drained sticky, most tokens next, no affinity): what a user gets
# from per-shape queues alone.
# NOTE: no-lanes with the product's order and affinity (`--dispatch no-lanes` alone) was
# rejected as the baseline: it tied the default on prefix reuse within 0.1 point on 5 of 6
# lines of `pipeline bench prefix`, by construction (the same shape order and consumers, one lane
# per shape), so it measured what lanes do for padding and makespan, not a policy a user
# would pick instead; the padding comparison still shows that (both have one lane a shape).
DISPATCH_POLICIES: dict[str, list[str]] = {
    "default": [],
    "sticky+most-tokens": ["--dispatch", "sticky", "--shape-order", "most-tokens", "--set", "broker.affinity=false"],
    "fifo": ["--dispatch", "fifo"],
    "round-robin": ["--dispatch", "round-robin"],
    "no-lanes": ["--dispatch", "no-lanes", "--shape-order", "most-tokens", "--set", "broker.affinity=false"],
}
DEFAULT_POLICY = "default"
# cost_s_per_batch / cost_s_per_padded_token: the ratio of the sim's GPU figures (5 ms a step
# against 0.1 ms a token), so a batch's fixed cost keeps its weight as X changes.
BATCH_COST_PER_TOKEN_COST = 50
# A launch or analyze that takes longer than this is stuck (the longest full-size run takes
# well under a minute).
CHILD_TIMEOUT_S = 900


class BenchRunError(PipelineError):
    """A child process of a comparison failed; the message carries its command and output."""


def child_env() -> dict[str, str]:
    """The environment of a child: this tree first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def sim_cost_options(cost_s_per_padded_token: float, capacity_tokens: int | None, block_tokens: int) -> str:
    """--engine-options for a GPU-bound sim: X a padded token, 50 X a batch, a cache of
    `capacity_tokens` (None: the sim's default) in blocks of `block_tokens`."""
    options = [f"cost_s_per_padded_token={cost_s_per_padded_token:g}",
               f"cost_s_per_batch={cost_s_per_padded_token * BATCH_COST_PER_TOKEN_COST:g}",
               f"block_size_tokens={block_tokens}"]
    if capacity_tokens is not None:
        options.append(f"capacity_tokens={capacity_tokens}")
    return ",".join(options)


def launch(args: Sequence[str], report: Path, data_dir: Path, consumers: int = 2,
           python: Sequence[str] | None = None, keep: bool = False) -> dict[str, Any]:
    """`pipeline launch --consumers N --report REPORT --data-dir DIR ARGS`; its run report.
    The data directory is removed after unless `keep`. Raises BenchRunError when it fails or
    its accounting does not balance."""
    command = [*(python or python_command()), "launch", "--consumers", str(consumers), "--report", str(report),
               "--data-dir", str(data_dir), *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=child_env(), cwd=ROOT,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise BenchRunError(f"{' '.join(command)}: no end after {CHILD_TIMEOUT_S} s") from e
    finally:
        if not keep:
            shutil.rmtree(data_dir, ignore_errors=True)
    if done.returncode != 0:
        raise BenchRunError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}"
                            f"{done.stdout[-1000:]}")
    figures = json.loads(report.read_text())
    if not figures.get("accounting_ok"):
        raise BenchRunError(f"{' '.join(command)}: the run's accounting does not balance ({report})")
    return figures


def analyze(args: Sequence[str], block_tokens: int, cache_tokens: Sequence[int], caches: int) -> dict[str, Any]:
    """`pipeline tools analyze ARGS --json` at these cache sizes, `caches` caches side by side:
    per cache size the bound (the better of its orders: what a scheduler could reach), the
    arrival-order figure, the shape count and the input tokens."""
    command = [*python_command(), "tools", "analyze", *args, "--block-tokens", str(block_tokens),
               "--caches", str(caches), "--cache-tokens", ",".join(map(str, cache_tokens)), "--top", "0", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, env=child_env(), cwd=ROOT,
                          timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise BenchRunError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
    return bounds_of(json.loads(done.stdout), cache_tokens, caches)


def bounds_of(data: dict[str, Any], cache_tokens: Sequence[int], caches: int) -> dict[str, Any]:
    """The figures `analyze` returns, from analyze's JSON."""
    bounds, arrival = {}, {}
    for cache in cache_tokens:
        rows = [r for r in data["reuse"] if r["cache_tokens"] == cache and r["caches"] == caches]
        if not rows:
            raise BenchRunError(f"tools analyze gave no row for {cache} tokens and {caches} caches")
        bounds[cache] = max(r["reuse"] for r in rows)
        arrival[cache] = next((r["reuse"] for r in rows if r["order"] == "arrival"), None)
    return {"bounds": bounds, "arrival": arrival, "shapes": data["shapes"]["count"],
            "input_tokens": data["input_tokens"], "items": data["items"]}


def mooncake_trace() -> Path | None:
    """The Mooncake synthetic trace in ../shared/workloads beside the repository, or None."""
    path = ROOT.parent / "shared" / "workloads" / "mooncake_synthetic_trace.jsonl"
    return path if path.is_file() else None
