"""`pipeline bench shapes`: any number of shapes. The same work in few shapes and in as many
shapes as items, side by side in one run:

- `pipeline launch` (2 producers, 2 sim consumers at zero cost, the disk tier) of ITEMS items
  of the product's own format (token ids), in FEW_SHAPES shapes against one shape an item
  (ITEMS distinct shapes, nothing shared): items/s over the launcher's wall time, and the
  broker's loop stalls (the run report's `stalls`: gaps of at least half a second);
- `pipeline run-batch --engine sim` of REQUESTS chat requests with one system prompt for all
  against the same requests each with a system prompt of its own (a customer's name and
  id in it): the job's time (its run report's wall time, what the summary line says).

Each side a fresh process, alternating and repeated (harness.alternate); the two files of a
pair hold the same number of items of the same lengths. The tiny model's tokenizer and chat
template make the prompts (tools/tiny_llama.py, built when missing).

Targets: the requests with their own system prompts within 1.5x the time
of those sharing one; the distinct shapes at no less than half the items/s of the few; no
stall of the broker's loop in any run of the distinct shapes.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lab.bench import batch_sides, runs
from lab.bench.charts import Panel, cell, grouped_bars
from lab.bench.harness import (
    BenchContext,
    Outcome,
    Target,
    alternate,
    fmt_spread,
    python_command,
    spread,
    spread_of,
    table,
)
from lab.bench.run_batch import build_model

ITEMS, QUICK_ITEMS = 100_000, 2_000
FEW_SHAPES = 16
REQUESTS, QUICK_REQUESTS = 5_000, 300
# Lengths of the own-format items: a prefix (the shape's one component) and a suffix, uniform.
PREFIX_TOKENS = (24, 64)
SUFFIX_TOKENS = (16, 96)
VOCAB = 32_000
MAX_COMPLETION_TOKENS = 16
# The targets.
TIME_RATIO_MAX = 1.5
RATE_RATIO_MIN = 0.5
SHAPE_SIDES = ("few shapes", "distinct shapes")
PROMPT_SIDES = ("shared system prompt", "own system prompts")
GREEK = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def token_workload(path: Path, items: int, shapes: int, seed: int) -> None:
    """`items` own-format lines in `shapes` shapes (item k in shape k % shapes; `shapes ==
    items`: one shape each), prefixes and suffixes of seeded random lengths and ids."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, VOCAB, int(rng.integers(*PREFIX_TOKENS))).tolist() for _ in range(min(shapes, items))]
    lines = []
    for k in range(items):
        prefix = prefixes[k % shapes] if shapes < items else prefixes[k]
        suffix = rng.integers(0, VOCAB, int(rng.integers(*SUFFIX_TOKENS))).tolist()
        lines.append(json.dumps({"components": [prefix], "suffix": suffix}))
    path.write_text("\n".join(lines) + "\n")


def chat_requests(path: Path, count: int, own: bool, seed: int) -> None:
    """`count` chat requests, each a system prompt and a short question; the system prompt is
    one for all, or each request's own (`own`), the questions the same either way."""
    rng = random.Random(seed)
    with open(path, "w") as out:
        for k in range(count):
            system = (f"You are the assistant of customer {k} (id {k * 7919}). Answer briefly." if own
                      else "You are the assistant of our customers. Answer briefly.")
            question = " ".join(rng.choice(GREEK) for _ in range(rng.randint(8, 14))) + "?"
            body = {"model": batch_sides.MODEL_NAME, "max_tokens": MAX_COMPLETION_TOKENS,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
            out.write(json.dumps({"custom_id": f"req-{k}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": body}) + "\n")


def launch_side(ctx: BenchContext, workload: Path, counter: list[int]) -> Callable[[], dict]:
    def run() -> dict:
        counter[0] += 1
        tag = f"launch-{counter[0]}"
        report = runs.launch(["--workload", str(workload)], ctx.work_dir / f"{tag}.json", ctx.work_dir / tag)
        return {key: report[key] for key in ("items_per_s", "wall_s", "stalls", "stalled_s", "shapes",
                                             "shape_switches", "batches_routed", "mean_batch_fill")}
    return run


def run_batch_side(ctx: BenchContext, requests: Path, counter: list[int]) -> Callable[[], dict]:
    def run() -> dict:
        counter[0] += 1
        out = ctx.work_dir / f"batch-{counter[0]}"
        out.mkdir()
        report = out / "report.json"
        command = [*python_command(), "run-batch", "-i", str(requests), "-o", str(out / "out.jsonl"),
                   "--model", str(batch_sides.MODEL_DIR), "--engine", "sim", "--report", str(report)]
        done = subprocess.run(command, capture_output=True, text=True, env=runs.child_env(), cwd=runs.ROOT,
                              timeout=runs.CHILD_TIMEOUT_S)
        if done.returncode != 0:
            raise runs.BenchRunError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
        figures = json.loads(report.read_text())
        answered = re.search(r"answered in ([0-9.]+) s", done.stderr + done.stdout)
        return {"job_s": figures["wall_s"], "summary_s": float(answered.group(1)) if answered else None,
                "items_per_s": figures["items_per_s"], "stalls": figures["stalls"],
                "shape_switches": figures["shape_switches"], "batches_routed": figures["batches_routed"]}
    return run


def measure(ctx: BenchContext) -> dict[str, Any]:
    items, requests = ctx.size(ITEMS, QUICK_ITEMS), ctx.size(REQUESTS, QUICK_REQUESTS)
    few, distinct = ctx.work_dir / "few.jsonl", ctx.work_dir / "distinct.jsonl"
    token_workload(few, items, FEW_SHAPES, seed=1)
    token_workload(distinct, items, items, seed=1)
    shared, own = ctx.work_dir / "shared.jsonl", ctx.work_dir / "own.jsonl"
    chat_requests(shared, requests, own=False, seed=2)
    chat_requests(own, requests, own=True, seed=2)
    build_model(sys.executable)
    counter = [0]
    ctx.log(f"  launch: {items:,} items in {FEW_SHAPES} shapes against {items:,} distinct shapes")
    launched = alternate([(SHAPE_SIDES[0], launch_side(ctx, few, counter)),
                          (SHAPE_SIDES[1], launch_side(ctx, distinct, counter))], ctx.repeat)
    ctx.log(f"  run-batch: {requests:,} requests sharing a system prompt against each with its own")
    batched = alternate([(PROMPT_SIDES[0], run_batch_side(ctx, shared, counter)),
                         (PROMPT_SIDES[1], run_batch_side(ctx, own, counter))], ctx.repeat)
    rate = [d["items_per_s"] / f["items_per_s"] for f, d in zip(*(launched[s] for s in SHAPE_SIDES))]
    time = [o["job_s"] / s["job_s"] for s, o in zip(*(batched[p] for p in PROMPT_SIDES))]
    return {"items": items, "few_shapes": FEW_SHAPES, "requests": requests,
            "launch": {side: {**{k: spread_of(r, k) for k in ("items_per_s", "wall_s", "stalls", "stalled_s",
                                                              "shape_switches", "batches_routed")}, "runs": r}
                       for side, r in launched.items()},
            "run_batch": {side: {**{k: spread_of(r, k) for k in ("job_s", "items_per_s", "stalls", "shape_switches",
                                                                 "batches_routed")}, "runs": r}
                          for side, r in batched.items()},
            "rate_ratio": spread(rate), "time_ratio": spread(time)}


def judge(figures: dict[str, Any]) -> list[Target]:
    launch, batch = figures["launch"], figures["run_batch"]
    rate, time = figures["rate_ratio"]["median"], figures["time_ratio"]["median"]
    stalls = int(launch[SHAPE_SIDES[1]]["stalls"]["max"])
    return [
        Target(f"{figures['requests']:,} requests with their own system prompts within {TIME_RATIO_MAX}x the "
               "time of the same sharing one", time <= TIME_RATIO_MAX,
               f"{time:.2f}x: {statistics.median(r['job_s'] for r in batch[PROMPT_SIDES[1]]['runs']):.2f} s against "
               f"{statistics.median(r['job_s'] for r in batch[PROMPT_SIDES[0]]['runs']):.2f} s (medians)"),
        Target(f"{figures['items']:,} distinct shapes at no less than {RATE_RATIO_MIN}x the items/s of "
               f"{figures['few_shapes']}", rate >= RATE_RATIO_MIN,
               f"{rate:.2f}x: {launch[SHAPE_SIDES[1]]['items_per_s']['median']:,.0f} against "
               f"{launch[SHAPE_SIDES[0]]['items_per_s']['median']:,.0f} items/s (medians)"),
        Target(f"no stall of the broker's loop with {figures['items']:,} distinct shapes", stalls == 0,
               f"at most {stalls} stalls in a run"),
    ]


def markdown(figures: dict[str, Any]) -> str:
    launch, batch = figures["launch"], figures["run_batch"]
    rows = [[side, fmt_spread(v["items_per_s"]), fmt_spread(v["wall_s"], ".1f"), fmt_spread(v["stalls"]),
             fmt_spread(v["shape_switches"]), fmt_spread(v["batches_routed"])] for side, v in launch.items()]
    batch_rows = [[side, fmt_spread(v["job_s"], ".2f"), fmt_spread(v["items_per_s"]), fmt_spread(v["stalls"]),
                   fmt_spread(v["shape_switches"]), fmt_spread(v["batches_routed"])] for side, v in batch.items()]
    return "\n".join([
        f"`pipeline launch`, 2 producers and 2 sim consumers at zero cost, disk tier: {figures['items']:,} items "
        f"of token ids (a prefix of {PREFIX_TOKENS[0]}-{PREFIX_TOKENS[1] - 1} and a suffix of "
        f"{SUFFIX_TOKENS[0]}-{SUFFIX_TOKENS[1] - 1} tokens) in {figures['few_shapes']} shapes, against one shape "
        f"an item:", "",
        table(["shapes", "items/s", "wall s", "loop stalls", "shape switches", "batches"], rows), "",
        f"Distinct against few, items/s: {fmt_spread(figures['rate_ratio'], '.2f')}x.", "",
        f"`pipeline run-batch --engine sim` of {figures['requests']:,} chat requests (the tiny model's tokenizer "
        "and chat template), one system prompt for all against one each (a customer's name and id):", "",
        table(["system prompt", "job s", "requests/s", "loop stalls", "shape switches", "batches"], batch_rows), "",
        f"Own against shared, time: {fmt_spread(figures['time_ratio'], '.2f')}x."])


def plot(figures: dict[str, Any]) -> Callable[[Path], None]:
    launch, batch = figures["launch"], figures["run_batch"]
    panels = [Panel("pipeline launch: items/s", "items/s", [f"{figures['items']:,} items"], list(SHAPE_SIDES),
                    [[cell(launch[s]["items_per_s"]) for s in SHAPE_SIDES]]),
              Panel("pipeline run-batch: job time", "seconds", [f"{figures['requests']:,} requests"],
                    list(PROMPT_SIDES), [[cell(batch[s]["job_s"]) for s in PROMPT_SIDES]])]
    return lambda path: grouped_bars(path, "Any number of shapes", panels)


class ShapesComparison:
    name = "shapes"
    title = "Any number of shapes: few against distinct, shared against own system prompts"

    def run(self, ctx: BenchContext) -> Outcome:
        figures = measure(ctx)
        return Outcome(figures, markdown(figures), judge(figures), plot(figures))


COMPARISON = ShapesComparison()
