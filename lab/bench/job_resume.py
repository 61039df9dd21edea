"""`pipeline bench job-resume`: the resume of `job-scale`'s largest job alone.

The SIZE-request job of `job-scale`'s requests (`job_scale.write_requests`) through
`pipeline run-batch --engine sim` at zero cost, killed (kill -9 of the command) once half
its answers are recorded, then the same command again. Figures: the time from the second
command's start to its first new batch dispatched, against the time to read every file of
the job's answers once right before it (`job_scale.read_answers_once_s`: page-cache speed,
the read a resume cannot do without); and whether the job ends with one line per custom_id.
The first new batch may hold work the killed run left in the store (the broker dispatches it
while the job reads what it holds): it is the resumed job's first work, as the target
means it. One run (`--repeat` is not used: a run at SIZE takes half an hour).

Target (`job-scale`'s resume target, measured without its other sizes): the first new
batch within 2x the read, and one line per custom_id.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from lab.bench.harness import BenchContext, Outcome, Target, table
from lab.bench.job_scale import MODEL_DIR, ROOT, resume_at_half, write_requests

SIZE = 10_000_000
QUICK_SIZE = 20_000


def measure(ctx: BenchContext) -> dict[str, Any]:
    count = ctx.size(SIZE, QUICK_SIZE)
    subprocess.run([sys.executable, "-c", f"from tools.tiny_llama import build; build({str(MODEL_DIR)!r})"],
                   cwd=ROOT, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    source = ctx.work_dir / f"requests-{count}.jsonl"
    ctx.log(f"  writing {count:,} requests")
    write_requests(source, count)
    return {"resume": resume_at_half(ctx, source, count)}


def judge(figures: dict[str, Any]) -> list[Target]:
    resume = figures["resume"]
    first = resume["first_new_dispatch_s"]
    return [Target("resume at half: first new batch within 2x the time to read the answers once, and one line per "
                   "custom_id", first is not None and first <= 2 * resume["read_once_s"] and resume["output_ok"],
                   "no new batch dispatched" if first is None else
                   f"{first:.2f} s against a read of {resume['read_once_s']:.2f} s ({first / resume['read_once_s']:.2f}x)")]


def markdown(figures: dict[str, Any]) -> str:
    resume = figures["resume"]
    first = resume["first_new_dispatch_s"]
    rows = [[f"{resume['requests']:,}", "yes" if resume["killed"] else "no (it finished first)",
             f"{resume['read_once_s']:.2f}", "-" if first is None else f"{first:.2f}",
             f"{resume['second_wall_s']:.1f}", "one line per custom_id" if resume["output_ok"] else "WRONG"]]
    return ("`pipeline run-batch --engine sim` (zero cost) on `job-scale`'s chat requests, killed (kill -9) at half "
            "its answers, then the same command; one run. The first new batch is the resumed run's first dispatch "
            "(work the killed run left in the store included).\n\n"
            + table(["requests", "killed at half", "read of the answers once s", "first new dispatch s",
                     "second command s", "output"], rows))


class JobResumeComparison:
    name = "job-resume"
    title = "A job killed at half resumes: its first new batch against one read of its answers"

    def run(self, ctx: BenchContext) -> Outcome:
        figures = measure(ctx)
        return Outcome(figures, markdown(figures), judge(figures), None)


COMPARISON = JobResumeComparison()
