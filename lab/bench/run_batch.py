"""`pipeline bench run-batch`: the engine's own batch runner, `vllm run-batch`, against
`pipeline run-batch --engine vllm --consumers 1` on the same chat batch file with the same
vLLM settings (lab/bench/batch_sides.py): cached prompt tokens (the output files'
usage.prompt_tokens_details.cached_tokens, summed) and processing time (the span: the
product's first dispatch to last completion, vLLM's `run_batch` coroutine), alternating and
repeated, each side a fresh process.

The sides need an interpreter that imports vllm. Full size looks for one: this one, then
the `.venv-vllm` of this checkout and of the repository's main checkout (a worktree's
shares the git directory). --quick looks only at this interpreter, so the quick test under
the plain test environment stays fast; the `vllm`-marked test runs --quick under
.venv-vllm. Where none imports vllm, the figures say why and the targets are not judged.

Target: the product serves at least 2x the cached prompt tokens of `vllm
run-batch` on the same file, and finishes faster (on the span).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.bench import batch_sides
from lab.bench.charts import Panel, cell, grouped_bars
from lab.bench.chat_batch import requests
from lab.bench.harness import BenchContext, Outcome, Target, alternate, fmt_spread, spread_of, table

QUICK_REQUESTS = 60
# The product's cached tokens must be at least this multiple of vLLM's (the comparison's target).
CACHED_RATIO = 2.0
SIDES = ("vllm run-batch", "pipeline run-batch")
# Finding out whether an interpreter imports vllm (find_spec: no import, a second or so).
PROBE_TIMEOUT_S = 60
PROBE = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"


def vllm_python(quick: bool) -> tuple[str | None, list[str]]:
    """An interpreter that has vllm, and what was tried."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, [f"{sys.executable}: has vllm"]
    tried = [f"{sys.executable}: no vllm"]
    if quick:
        return None, tried + ["--quick looks no further (run it under .venv-vllm to include vLLM)"]
    for candidate in candidate_venvs():
        if not candidate.exists():
            tried.append(f"{candidate}: absent")
            continue
        try:
            done = subprocess.run([str(candidate), "-c", PROBE], capture_output=True, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            tried.append(f"{candidate}: {e}")
            continue
        if done.returncode == 0:
            return str(candidate), tried + [f"{candidate}: has vllm"]
        tried.append(f"{candidate}: no vllm")
    return None, tried


def candidate_venvs() -> list[Path]:
    """.venv-vllm/bin/python of this checkout, then of the main checkout behind a worktree."""
    found = [batch_sides.ROOT / ".venv-vllm" / "bin" / "python"]
    try:
        common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
                                cwd=batch_sides.ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        common = ""
    if common:
        main = Path(common).parent / ".venv-vllm" / "bin" / "python"
        if main not in found:
            found.append(main)
    return found


def build_model(python: str) -> None:
    """The tiny model (tools/tiny_llama.py, a no-op when current), built by `python`."""
    done = subprocess.run([python, "-c", f"from tools.tiny_llama import build; build({str(batch_sides.MODEL_DIR)!r})"],
                          cwd=batch_sides.ROOT, capture_output=True, text=True, timeout=batch_sides.RUN_TIMEOUT_S,
                          env={**os.environ, "PYTHONPATH": str(batch_sides.ROOT)})
    if done.returncode != 0:
        raise batch_sides.BenchRunError(f"building the tiny model failed: {done.stderr[-2000:]}")


def measure(ctx: BenchContext) -> dict[str, Any]:
    python, tried = vllm_python(ctx.quick)
    if python is None:
        return {"vllm": None, "tried": tried}
    build_model(python)
    count = ctx.size(batch_sides.REQUESTS, QUICK_REQUESTS)
    reqs = requests(count, batch_sides.SHAPES, batch_sides.MODEL_NAME, seed=0)
    batch = ctx.work_dir / "batch.jsonl"
    batch.write_text("".join(_json_line(r) for r in reqs))
    ids = [r["custom_id"] for r in reqs]
    settings = batch_sides.engine_settings(batch_sides.KV_CACHE_MIB)
    threads = batch_sides.engine_threads()
    counter = [0]

    def side(name: str, run: Callable[[Path], dict]) -> tuple[str, Callable[[], dict]]:
        def once() -> dict:
            counter[0] += 1
            ctx.log(f"  {name}, {count:,} requests (run {counter[0]})")
            row = run(ctx.work_dir / f"run-{counter[0]}")
            row.update(batch_sides.check_output(row["output"], ids))
            return row
        return name, once

    runs = alternate([
        side(SIDES[0], lambda d: batch_sides.run_vllm(batch, d, settings, threads, python)),
        side(SIDES[1], lambda d: batch_sides.run_product(batch, d, settings, 1, threads, python))], ctx.repeat)
    return {"vllm": python, "tried": tried, "requests": count, "shapes": batch_sides.SHAPES, "engine": settings,
            "threads": threads, "sides": {name: {k: spread_of(rows, k) for k in
                                                 ("cached_tokens", "prompt_tokens", "cached_fraction", "span_s",
                                                  "wall_s")} for name, rows in runs.items()},
            "runs": {name: [{k: v for k, v in r.items() if k != "output"} for r in rows]
                     for name, rows in runs.items()}}


def _json_line(record: dict) -> str:
    return json.dumps(record) + "\n"


def judge(figures: dict[str, Any]) -> list[Target]:
    if figures["vllm"] is None:
        reason = "vllm is not importable: " + "; ".join(figures["tried"])
        return [Target(f"the product's cached prompt tokens >= {CACHED_RATIO:g}x vllm run-batch's", None, reason),
                Target("the product finishes faster (span)", None, reason)]
    v, p = (figures["sides"][name] for name in SIDES)
    vc, pc = v["cached_tokens"]["median"], p["cached_tokens"]["median"]
    ratio = pc / vc if vc else float("inf")
    return [Target(f"the product's cached prompt tokens >= {CACHED_RATIO:g}x vllm run-batch's", ratio >= CACHED_RATIO,
                   f"{pc:,.0f} against {vc:,.0f}: {ratio:.2f}x"),
            Target("the product finishes faster (span)", p["span_s"]["median"] < v["span_s"]["median"],
                   f"{p['span_s']['median']:.2f} s against {v['span_s']['median']:.2f} s")]


def markdown(figures: dict[str, Any]) -> str:
    if figures["vllm"] is None:
        return "Not measured: vllm is not importable (" + "; ".join(figures["tried"]) + ")."
    head = ["side", "cached prompt tokens", "prompt tokens", "cached %", "processing span s", "wall s"]
    rows = [[name, fmt_spread(s["cached_tokens"]), fmt_spread(s["prompt_tokens"]),
             fmt_spread({**s["cached_fraction"], **{k: 100 * s["cached_fraction"][k] for k in ("median", "min", "max")}},
                        ".1f"),
             fmt_spread(s["span_s"], ".2f"), fmt_spread(s["wall_s"], ".1f")] for name, s in figures["sides"].items()]
    e = figures["engine"]
    return (f"`vllm run-batch` against `pipeline run-batch --engine vllm --consumers 1` on the same file: "
            f"{figures['requests']:,} chat requests over {figures['shapes']} shapes (Zipf-like, shuffled; "
            "lab/bench/chat_batch.py), the tiny model with random weights, vLLM on CPU "
            f"({figures['threads']} engine threads on both sides: the cores less one), the same vLLM flags on both "
            f"command lines: `{' '.join(batch_sides.vllm_flags(e))}` (KV cache {e['kv_cache_memory_bytes'] >> 20} "
            "MiB: a few of the shapes' prefixes), prefix caching on. Cached tokens: the output files' "
            "usage.prompt_tokens_details.cached_tokens. Span: the product's first dispatch to last completion; "
            "vLLM's run_batch coroutine (file read to output written). Wall: the whole command, engine start "
            f"included. Interpreter: `{figures['vllm']}`.\n\n" + table(head, rows))


def plot(figures: dict[str, Any]) -> Callable[[Path], None] | None:
    if figures["vllm"] is None:
        return None
    sides = list(figures["sides"])

    def draw(path: Path) -> None:
        grouped_bars(path, "vllm run-batch against pipeline run-batch (same file, same engine settings)", [
            Panel("cached prompt tokens", "tokens", ["cached prompt tokens"], sides,
                  [[cell(figures["sides"][s]["cached_tokens"]) for s in sides]]),
            Panel("time", "seconds", ["processing span", "wall"], sides,
                  [[cell(figures["sides"][s][k]) for s in sides] for k in ("span_s", "wall_s")])])
    return draw


class RunBatchComparison:
    name = "run-batch"
    title = "The engine's own batch runner: vllm run-batch against pipeline run-batch"

    def run(self, ctx: BenchContext) -> Outcome:
        figures = measure(ctx)
        return Outcome(figures, markdown(figures), judge(figures), plot(figures))


COMPARISON = RunBatchComparison()
