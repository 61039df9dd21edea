"""`pipeline run-batch ... --ray ADDRESS`: a batch job's requests over a Ray cluster.

    code = run_job_on_cluster(settings, batch_file, plan, model_dir, data_dir, address, node_root)

The driver (this process) makes every request to run into its item, as a producer would
(`pipeline.batchjob.workload.make_item`: the chat template, the tokenizer, the shape's
components), because routing needs each item's shape; a request no prompt can be made of
goes to the job's rejection log as it would in a producer. The cluster run (`driver.py`)
appends each node's accepted rows to DATA_DIR/results/ray-<time>-<pid>/node-NAME.jsonl, a
run directory like a local run's, so the job's state (`pipeline/batchjob/job.py`), its
resume and its output file are the local job's: the same command again submits only what
has no answer, and `finish_job` writes one line per custom_id.
"""

from __future__ import annotations

import json
import os
import sys
import time

import xxhash

from pipeline.batchjob.workload import JOB_MODEL
from pipeline.cluster.driver import ClusterRun
from pipeline.runtime.settings import LaunchSettings

# The whole job's progress line goes to stderr at most this often.
PROGRESS_EVERY_S = 2.0


class ProgressLine:
    """Whole-job progress on stderr: answered of total, nodes alive and lost, resubmitted."""

    def __init__(self, what: str, out=sys.stderr) -> None:
        self.what = what
        self.out = out
        self.next_s = 0.0

    def __call__(self, done: int, total: int, nodes: dict) -> None:
        now_s = time.monotonic()
        if now_s < self.next_s and done < total:
            return
        self.next_s = now_s + PROGRESS_EVERY_S
        alive = sum(1 for n in nodes.values() if n.alive)
        lost = sum(n.counts["lost"] for n in nodes.values())
        moved = sum(n.counts["resubmitted_from"] for n in nodes.values())
        per_node = ", ".join(f"{slot} {n.counts['answered']:,}" for slot, n in sorted(nodes.items()))
        print(f"{self.what}: {done:,} of {total:,} answered; {alive} nodes alive, {lost} lost, {moved:,} items "
              f"resubmitted ({per_node})", file=self.out, flush=True)


def job_items(job) -> tuple[list[int], list]:
    """The items of the job's requests to submit (their keys: the request indices), made in
    the driver as a producer makes them (routing needs each item's shape); a request no item
    can be made of is answered in the driver's rejection log."""
    from pipeline.batchjob.chat import ChatTokenizer
    from pipeline.batchjob.rejections import RejectionLog
    from pipeline.batchjob.workload import JobWorkload

    workload = JobWorkload(job.job_input, job.skip, job.manifest, job.spec.model_dir, job.data_dir, job.spec.limits,
                           job.spec.chat_template)
    tokenizer = workload.tokenizer()
    log = RejectionLog(job.data_dir, f"driver-{os.getpid()}")
    keys, items = [], []
    try:
        for index, line, offset, raw in workload.lines(0, job.manifest.requests):
            if workload.skipped(index):
                continue
            item = workload.make(raw, (index, offset, len(raw), xxhash.xxh3_64_intdigest(raw)), line, tokenizer, log)
            if item is not None:
                keys.append(index)
                items.append(item)
    finally:
        log.close()
    return keys, items


def run_job_on_cluster(job, address: str, node_root: str, route: str = "shape") -> int:
    """Run the job's requests still to submit on the cluster; 0 when each has its answer."""
    keys, items = job_items(job)
    if not items:
        return 0
    settings = job.spec.settings
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    results_dir = os.path.join(job.data_dir, "results", f"ray-{stamp}-{os.getpid()}")
    run = ClusterRun(settings, keys, items, node_root=node_root, results_dir=results_dir, address=address,
                     models=(JOB_MODEL,), on_progress=ProgressLine("run-batch"), route=route)
    report = run.run()
    job.report = {"cluster": report}
    print(summary_line("run-batch", report), file=sys.stderr)
    job.collect_all()
    return 0 if report["total"]["unanswered"] == 0 else 1


def write_cluster_report(settings: LaunchSettings, report: dict) -> None:
    """The cluster run's report under "cluster" in the report file, when one is asked for."""
    if settings.report:
        with open(settings.report, "w") as f:
            json.dump({"cluster": report}, f, indent=1)


def summary_line(what: str, report: dict) -> str:
    """The cluster run in one line: answered, speed, prefix reuse, routing, losses."""
    total, routing = report["total"], report["routing"]
    reuse = total["prefix_reuse"]
    return (f"{what}: ray: {total['answered']:,} answered on {len(report['nodes'])} nodes in {total['wall_s']:.1f} s "
            f"({total['items_per_s'] or 0:.1f} items/s), prefix reuse {'n/a' if reuse is None else f'{reuse:.1%}'}, "
            f"{routing['keys']} routing keys, {routing['split_shapes']} hot shapes split, "
            f"{total['lost']} nodes lost, {total['resubmitted_from']:,} items resubmitted, "
            f"{total['duplicates_dropped'] + total['stale_dropped']:,} duplicate answers dropped, "
            f"{total['unanswered']:,} unanswered")


def run_workload_on_cluster(settings: LaunchSettings, workload, address: str, node_root: str | None) -> int:
    """`pipeline launch --ray`: every item of `workload` on the cluster, routed as a job's
    are (its keys: the items' positions); the rows go to DATA_DIR/results/ray-*/ (a
    temporary data directory where none is given, removed after a run that answered all)."""
    import shutil
    import tempfile

    items = list(workload.items(0, 1))
    own = settings.data_dir is None
    data_dir = settings.data_dir or tempfile.mkdtemp(prefix="shape-broker-")
    node_root = node_root or os.path.join(tempfile.gettempdir(), f"sbrk-ray-{os.path.basename(data_dir)}")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    results_dir = os.path.join(data_dir, "results", f"ray-{stamp}-{os.getpid()}")
    run = ClusterRun(settings, list(range(len(items))), items, node_root=node_root, results_dir=results_dir,
                     address=address, models=tuple(workload.models), on_progress=ProgressLine("launch"))
    report = run.run()
    write_cluster_report(settings, report)
    print(summary_line("launch", report), file=sys.stderr)
    unanswered = report["total"]["unanswered"]
    if own and not unanswered:
        shutil.rmtree(data_dir, ignore_errors=True)
    else:
        print(f"launch: results: {results_dir}", file=sys.stderr)
    return 0 if unanswered == 0 else 1
