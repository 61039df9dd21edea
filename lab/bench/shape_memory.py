"""`pipeline bench shape-memory`: a job's memory in the number of its shapes.

`pipeline run-batch --engine sim` (zero cost) on chat requests that each have a system prompt
of their own (`shapes.chat_requests`: a customer's name and id), so every request is a shape
of its own, at two sizes four times apart. Every per-shape structure of the broker, the
producers and the consumers is bounded (ARCHITECTURE.md, broker ingest) or lives only while
its shape does (`broker.max_live_shapes`), so the job's peak total PSS (every process,
sampled as `job-scale` samples it) stays flat past the bounds: the smaller size is past the
largest of them (the first references' 2**20 entries, about 350,000 shapes).

Target: the peak total PSS at 4x the shapes within 1.3x of the smaller's (the job-scale
target's ratio), and one line per custom_id at both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from lab.bench.harness import BenchContext, Outcome, Target, table
from lab.bench.job_scale import MODEL_DIR, PSS_PARTS, ROOT, check_output, run_job
from lab.bench.shapes import chat_requests

SIZES = (640_000, 2_560_000)
QUICK_SIZES = (2_000, 8_000)
PSS_RATIO_MAX = 1.3


def measure(ctx: BenchContext) -> dict[str, Any]:
    subprocess.run([sys.executable, "-c", f"from tools.tiny_llama import build; build({str(MODEL_DIR)!r})"],
                   cwd=ROOT, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    rows = []
    for count in ctx.size(SIZES, QUICK_SIZES):
        source = ctx.work_dir / f"own-{count}.jsonl"
        ctx.log(f"  {count:,} requests, each its own system prompt")
        chat_requests(source, count, own=True, seed=2)
        work = ctx.work_dir / f"job-{count}"
        work.mkdir(parents=True, exist_ok=True)
        row = run_job(source, work)
        row.update(requests=count, requests_per_s=count / row["wall_s"],
                   output_ok=check_output(Path(row["out"]), count))
        subprocess.run(["rm", "-rf", str(work), str(source)], check=True)
        rows.append({key: row[key] for key in ("requests", "wall_s", "requests_per_s", "peak_pss_bytes",
                                               "peak_pss_parts_bytes", "output_ok")})
    return {"sizes": rows}


def judge(figures: dict[str, Any]) -> list[Target]:
    small, large = figures["sizes"][0], figures["sizes"][-1]
    ratio = large["peak_pss_bytes"] / small["peak_pss_bytes"]
    return [
        Target(f"peak total PSS at {large['requests']:,} shapes within {PSS_RATIO_MAX}x of at {small['requests']:,}",
               ratio <= PSS_RATIO_MAX, f"{large['peak_pss_bytes'] / 2**20:,.0f} MiB against "
               f"{small['peak_pss_bytes'] / 2**20:,.0f} MiB: {ratio:.2f}x"),
        Target("one line per custom_id at both sizes", all(row["output_ok"] for row in figures["sizes"]),
               f"{sum(row['output_ok'] for row in figures['sizes'])} of {len(figures['sizes'])} outputs whole"),
    ]


def markdown(figures: dict[str, Any]) -> str:
    rows = [[f"{row['requests']:,}", f"{row['requests_per_s']:,.0f}", f"{row['peak_pss_bytes'] / 2**20:,.0f}",
             " / ".join(f"{row['peak_pss_parts_bytes'].get(part, 0) / 2**20:,.0f}" for part in PSS_PARTS),
             "ok" if row["output_ok"] else "WRONG"] for row in figures["sizes"]]
    return ("`pipeline run-batch --engine sim` (zero cost) of chat requests that each have their own system prompt "
            "(every request a shape of its own), 16 new tokens each, the tiny model; each size a fresh command, total "
            "PSS of the job's processes sampled as in `job-scale`.\n\n"
            + table(["requests (shapes)", "requests/s", "peak total PSS MiB", "of it anon / file / shmem MiB",
                     "output"], rows))


class ShapeMemoryComparison:
    name = "shape-memory"
    title = "A job's memory in the number of its shapes: every request its own system prompt"

    def run(self, ctx: BenchContext) -> Outcome:
        figures = measure(ctx)
        return Outcome(figures, markdown(figures), judge(figures), None)


COMPARISON = ShapeMemoryComparison()
