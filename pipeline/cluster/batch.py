"""`pipeline run-batch ... --ray ADDRESS`: a batch job's requests over a Ray cluster.

    code = run_job_on_cluster(job, address, node_root)      # a prepared BatchJob

The driver (this process) makes each request to run into its item, as a producer would
(`JobWorkload.make`: the chat template, the tokenizer, the shape's components), because
routing needs each item's shape: twice, streaming (`JobSource`: once for the routing plan,
once as the items are sent; `stream.py`), holding only the items in flight; a request no
prompt can be made of goes to the job's rejection log as it would in a producer. The
cluster run (`driver.py`) appends each node's accepted rows to
DATA_DIR/results/ray-<time>-<pid>/node-NAME.jsonl, a run directory like a local run's, so
the job's state (`pipeline/batchjob/job.py`), its resume and its output file are the local
job's: the same command again submits only what has no answer, and the job's finish writes
one line per custom_id.
"""

from __future__ import annotations

import json
import os
import sys
import time

import xxhash

from collections.abc import Callable, Iterator

from pipeline.batchjob.workload import JOB_MODEL, JobWorkload
from pipeline.cluster.driver import ClusterRun
from pipeline.producer.workload import WorkItem, Workload
from pipeline.runtime.settings import LaunchSettings

# The whole job's progress line goes to stderr at most this often.
PROGRESS_EVERY_S = 2.0


class ProgressLine:
    """Whole-job progress on stderr: answered of total, nodes alive and lost, resubmitted."""

    def __init__(self, what: str, out=sys.stderr) -> None:
        self.what = what
        self.out = out
        self.next_s = 0.0

    def planning(self, read: int) -> None:
        """Pass 1 (the routing plan) has read `read` items."""
        now_s = time.monotonic()
        if now_s >= self.next_s:
            self.next_s = now_s + PROGRESS_EVERY_S
            print(f"{self.what}: routing plan: {read:,} items read", file=self.out, flush=True)

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


class JobSource:
    """A job's requests to submit, as an item source (`stream.ItemSource`) read twice: each
    read makes the items in this process as a producer makes them (keys: request indices).
    A request no item can be made of is answered in the driver's rejection log (pass 2 only
    makes the items pass 1 made). `close()` is explicit."""

    def __init__(self, workload: JobWorkload, model_dir: str, data_dir: str) -> None:
        from pipeline.batchjob.rejections import RejectionLog

        self.workload = workload
        self.keys = workload.job_input.requests
        self.tokenizer = workload.tokenizer()
        self.log = RejectionLog(data_dir, f"driver-{os.getpid()}")

    @classmethod
    def of(cls, job) -> JobSource:
        """The source of a prepared `BatchJob`'s requests still to submit."""
        workload = JobWorkload(job.job_input, job.skip, job.manifest, job.spec.model_dir, job.data_dir,
                               job.spec.limits, job.spec.chat_template)
        return cls(workload, job.spec.model_dir, job.data_dir)

    def scan(self) -> Iterator[tuple[int, WorkItem]]:
        return self.items(lambda index: not self.workload.skipped(index))

    def items(self, wanted: Callable[[int], bool]) -> Iterator[tuple[int, WorkItem]]:
        workload = self.workload
        for index, line, offset, raw in workload.lines(0, self.keys):
            if wanted(index):
                where = (index, offset, len(raw), xxhash.xxh3_64_intdigest(raw))
                item = workload.make(raw, where, line, self.tokenizer, self.log)
                if item is not None:
                    yield index, item

    def close(self) -> None:
        self.log.close()


class WorkloadSource:
    """A workload's items as an item source (keys: their positions).
    NOTE: a Workload makes its items only in order (`items`), so each of pass 2's cursors
    makes every item and keeps its own; `launch --ray` runs demo and trace workloads, whose
    items are cheap to make."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.keys = len(workload)

    def scan(self) -> Iterator[tuple[int, WorkItem]]:
        return enumerate(self.workload.items(0, 1))

    def items(self, wanted: Callable[[int], bool]) -> Iterator[tuple[int, WorkItem]]:
        return ((k, item) for k, item in enumerate(self.workload.items(0, 1)) if wanted(k))


def run_job_on_cluster(job, address: str, node_root: str, route: str = "shape") -> int:
    """Run the job's requests still to submit on the cluster; 0 when each has its answer."""
    job.find_pending()
    if not job.to_submit:
        return 0
    settings = job.spec.settings
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    results_dir = os.path.join(job.data_dir, "results", f"ray-{stamp}-{os.getpid()}")
    progress = ProgressLine("run-batch")
    source = JobSource.of(job)
    try:
        run = ClusterRun(settings, source, node_root=node_root, results_dir=results_dir, address=address,
                         models=(JOB_MODEL,), on_progress=progress, on_planning=progress.planning, route=route)
        report = run.run()
    finally:
        source.close()
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

    own = settings.data_dir is None
    data_dir = settings.data_dir or tempfile.mkdtemp(prefix="shape-broker-")
    node_root = node_root or os.path.join(tempfile.gettempdir(), f"sbrk-ray-{os.path.basename(data_dir)}")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    results_dir = os.path.join(data_dir, "results", f"ray-{stamp}-{os.getpid()}")
    progress = ProgressLine("launch")
    run = ClusterRun(settings, WorkloadSource(workload), node_root=node_root, results_dir=results_dir,
                     address=address, models=tuple(workload.models), on_progress=progress,
                     on_planning=progress.planning)
    report = run.run()
    write_cluster_report(settings, report)
    print(summary_line("launch", report), file=sys.stderr)
    unanswered = report["total"]["unanswered"]
    if own and not unanswered:
        shutil.rmtree(data_dir, ignore_errors=True)
    else:
        print(f"launch: results: {results_dir}", file=sys.stderr)
    return 0 if unanswered == 0 else 1
