"""`pipeline run-batch --ray` on a local 3-node Ray cluster (`ray.cluster_utils.Cluster`),
sim consumers, the tiny model's tokenizer: every custom_id answered exactly once, each
shape's items on one node except where the split rule split it, the driver's peak memory
the same for a job four times longer, and a node killed mid-job
(`remove_node(..., allow_graceful=False)`) and brought back loses nothing and duplicates no
line. Nothing is left running or in /dev/shm afterwards.

Each test gets its own RAY_TMPDIR (short: Ray's Unix socket paths must stay under 108
bytes), faster health checks (a dead node is seen in about 2 s, not 15), 128 MiB of object
store per node, and no dashboard. Ray's runtime-env and dashboard agents outlive a raylet
killed with SIGKILL and ignore SIGTERM, so the fixture records every process of the cluster
while it runs and ends what is left by pid.

Skipped with the reason without Ray; `python3 quickstart.py test-ray` builds .venv-ray and
runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest

from tests.support.repo import ROOT

pytestmark = pytest.mark.ray

# Health checks every 500 ms, 4 misses: a killed node is dead to Ray within about 2 s.
HEALTH_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
                 "health_check_initial_delay_ms": 500}
# Per node: enough for the agents' messages (a few MiB each), far below Ray's default (30% of RAM).
OBJECT_STORE_BYTES = 128 << 20
NODES = ("a", "b", "c")
SLOT = "shape_broker_node_"
# A job on 2 shared cores with a 3-node cluster on them.
RUN_TIMEOUT_S = 240
# Each sim batch sleeps this long per padded token, so the killed node is mid-job.
SLOW_CONFIG = "[engine_options]\ncost_s_per_padded_token = 2e-3\n"
# The driver holds what is in flight: up to 2,048 items per consumer (5 consumers here) and a
# batch per node queued. Both sizes are past that, so only what grows with the job differs.
MEMORY_SIZES = (12_000, 48_000)
# The driver's peak RSS at the larger size over the smaller, at most. Measured: 1.14 (159 and
# 181 MB); a driver holding every item it made reached 1.62 (164 and 265 MB).
MEMORY_GROWTH_RATIO = 1.3
# Runs the command given after it and says its peak RSS (its largest child's: the command) on
# stderr's last line.
PEAK_RSS_WRAPPER = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
                    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr); "
                    "sys.exit(code)")
SYSTEMS = ["You answer questions about a hardware store, in two sentences.",
           "You translate short English phrases into French.",
           "You review code snippets and name the worst problem.",
           "You summarise support emails in one line."]
THINGS = ["glue", "a ladder", "rollers", "a hose", "bulbs", "sandpaper", "a drill", "pipe", "tape", "a level"]


def job_records(count: int) -> list[dict]:
    """Chat requests in 24 shapes (4 system prompts x 6 few-shot turns under each)."""
    records = []
    for k in range(count):
        system, shot = k % 4, (k // 4) % 6
        messages = [{"role": "system", "content": SYSTEMS[system]},
                    {"role": "user", "content": f"Example {shot}: tell me about {THINGS[shot]}."},
                    {"role": "assistant", "content": f"Here is example answer number {shot}."},
                    {"role": "user", "content": f"Question {k}: where is {THINGS[k % len(THINGS)]}?"}]
        records.append({"custom_id": f"req-{k}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": "tiny-llama", "messages": messages, "max_completion_tokens": 4}})
    return records


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tools.tiny_llama import build

    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    build(path)
    return str(path)


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


class LocalCluster:
    """A 3-node Ray cluster of this test, and every process it started (recorded as it runs)."""

    def __init__(self, root: str) -> None:
        from ray.cluster_utils import Cluster

        self.root = root
        self.processes: dict[int, psutil.Process] = {}
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {SLOT + "a": 1}, "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False, "_system_config": HEALTH_CONFIG})
        self.nodes = {"a": self.cluster.head_node}
        for name in NODES[1:]:
            self.add(name)
        self.cluster.wait_for_nodes()
        self.record()

    def add(self, name: str) -> None:
        # Node b says it has a GPU (Ray's resource only): its agent gets it, and its node one consumer on it.
        self.nodes[name] = self.cluster.add_node(num_cpus=1, num_gpus=int(name == "b"), resources={SLOT + name: 1},
                                                 object_store_memory=OBJECT_STORE_BYTES)

    def kill(self, name: str) -> None:
        self.record()
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def record(self) -> None:
        """Every process below this test's and every one naming its directory, by pid."""
        for process in psutil.Process().children(recursive=True):
            self.processes.setdefault(process.pid, process)
        for process in self.ours():
            self.processes.setdefault(process.pid, process)

    def ours(self) -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["cmdline"]):
            if any(self.root in arg for arg in process.info["cmdline"] or ()):
                found.append(process)
        return found

    def shutdown(self) -> list[str]:
        """Shut the cluster down, end what is left by recorded pid; what had to be ended."""
        self.record()
        self.cluster.shutdown()
        left = [p for p in self.processes.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for process in left:
            try:
                process.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=10)
        return [" ".join(p.info["cmdline"][:3]) if hasattr(p, "info") else str(p.pid) for p in left]


@pytest.fixture(scope="module")
def cluster():
    """One cluster for the module (5 to 15 s to start here): the node-kill test runs last and
    brings its node back."""
    root = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Unix socket paths under it
    os.makedirs(os.path.join(root, "ray"))
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = root
    before = _shm()
    local = LocalCluster(root)
    try:
        yield local
    finally:
        local.shutdown()
        left = [p.pid for p in local.ours()]
        new = sorted(_shm() - before)
        node_objects = _node_objects(root)
        shutil.rmtree(root, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
    # Other suites may run beside this one: only objects of this cluster's nodes, or Ray's own.
    assert not left, f"processes of the cluster still run: {left}"
    assert not node_objects and not [n for n in new if not n.startswith(("sbrk-", "sem.sbrk-"))], new


def _node_objects(root: str) -> list[str]:
    """/dev/shm objects named for any node data directory under `root`."""
    from pipeline.broker.peers import namespace_for, object_prefix

    nodes = os.path.join(root, "n")
    prefixes = [object_prefix(namespace_for(os.path.join(nodes, d)))
                for d in (os.listdir(nodes) if os.path.isdir(nodes) else [])]
    return sorted(name for name in os.listdir("/dev/shm") for p in prefixes if p in name)


def run_batch_command(cluster: LocalCluster, tmp_path: Path, records: list[dict], model_dir: str,
                      *extra: str) -> list[str]:
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    return [sys.executable, "-m", "pipeline", "run-batch", "--engine", "sim", "-i", str(source),
            "-o", str(tmp_path / "out.jsonl"), "--model", model_dir, "--data-dir", str(tmp_path / "job"),
            "--report", str(tmp_path / "report.json"), "--max-batch", "16",
            "--ray", cluster.cluster.address, "--ray-node-dir", os.path.join(cluster.root, "n", tmp_path.name), *extra]


def check_once(tmp_path: Path, records: list[dict]) -> dict:
    """Exactly one output line per custom_id, in input order, each completed; the report."""
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["custom_id"] for row in rows] == [r["custom_id"] for r in records]
    assert all(row["response"]["status_code"] == 200 for row in rows)
    return json.loads((tmp_path / "report.json").read_text())


def node_rows(tmp_path: Path) -> dict[str, list[dict]]:
    """The rows the driver accepted, by node (its results files on the driver's disk)."""
    runs = sorted((tmp_path / "job" / "results").glob("ray-*"))
    assert len(runs) == 1
    return {path.stem.removeprefix("node-"): [json.loads(line) for line in path.read_text().splitlines()]
            for path in runs[0].glob("node-*.jsonl")}


def test_a_job_is_answered_once_per_custom_id_with_each_shape_on_one_node(cluster, tmp_path, model_dir):
    import base64

    from pipeline.batchjob.workload import job_workload
    from pipeline.batchjob.layout import decode_job_payload
    from pipeline.batchjob.manifest import load_manifest
    from pipeline.cluster.batch import JobSource
    from pipeline.cluster.routing import RoutingPlan
    from pipeline.cluster.stream import tally_items

    records = job_records(240)
    done = subprocess.run(run_batch_command(cluster, tmp_path, records, model_dir), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    cluster.record()
    assert done.returncode == 0, done.stderr
    report = check_once(tmp_path, records)
    assert report["cluster"]["total"]["answered"] == 240 and report["job"]["request_counts"]["completed"] == 240
    # One consumer per GPU where the node has one (b: Ray's CUDA_VISIBLE_DEVICES), else 2 CPU ones.
    assert {slot: node["consumers"] for slot, node in report["cluster"]["nodes"].items()} == {"a": 2, "b": 1, "c": 2}
    by_node = node_rows(tmp_path)
    assert set(by_node) == set(NODES) and all(by_node.values())  # the load is spread
    # Which nodes each shape ran on: one, except a shape the plan split (the driver's plan, made again).
    source = JobSource(job_workload(str(tmp_path / "job"), model_dir), model_dir, str(tmp_path / "scratch"))
    try:
        tally = tally_items(source)
    finally:
        source.close()
    plan = RoutingPlan.build(tally.chains, tally.loads(), nodes=3)
    split_shapes = {key[1] for key in plan.split}
    job_id = load_manifest(str(tmp_path / "job")).job_id
    nodes_of = defaultdict(set)
    for node, rows in by_node.items():
        for row in rows:
            index = decode_job_payload(base64.b64decode(row["payload"]), job_id)[0]
            nodes_of[tally.chains[tally.shape(index)][-1]].add(node)
    assert len(nodes_of) == 24 and report["cluster"]["driver"]["shapes"] == 24
    crossing = {shape for shape, nodes in nodes_of.items() if len(nodes) > 1}
    assert crossing <= split_shapes, "a shape crossed nodes without being split"
    assert report["cluster"]["routing"]["split_shapes"] == plan.splits
    assert report["cluster"]["total"]["cached_tokens"] > 0
    assert "0 nodes lost" in done.stderr


def test_the_drivers_memory_does_not_grow_with_the_job(cluster, tmp_path, model_dir):
    """The same job at two sizes, both past what the driver keeps in flight: its peak RSS
    (the whole command, start to output written) hardly moves."""
    peaks = []
    for count in MEMORY_SIZES:
        run_dir = tmp_path / f"n{count}"
        run_dir.mkdir()
        records = job_records(count)
        command = [sys.executable, "-c", PEAK_RSS_WRAPPER, *run_batch_command(cluster, run_dir, records, model_dir)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
        cluster.record()
        assert done.returncode == 0, done.stderr
        report = check_once(run_dir, records)
        assert report["cluster"]["total"]["answered"] == count and report["cluster"]["driver"]["cursors"] == 3
        peaks.append(int(done.stderr.splitlines()[-1]))
    assert peaks[1] <= MEMORY_GROWTH_RATIO * peaks[0], f"peak RSS {peaks[0]:,} B at {MEMORY_SIZES[0]:,} " \
        f"requests, {peaks[1]:,} B at {MEMORY_SIZES[1]:,}"


def test_launch_routes_a_workload_over_the_nodes(cluster, tmp_path):
    """`pipeline launch --ray`: the demo-chat workload, every item answered once."""
    report_path = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pipeline", "launch", "--workload", "demo-chat", "--items", "150",
                           "--consumers", "1", "--data-dir", str(tmp_path / "data"), "--report", str(report_path),
                           "--ray", cluster.cluster.address, "--ray-node-dir", os.path.join(cluster.root, "n", "l")],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    cluster.record()
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())["cluster"]
    assert report["total"]["answered"] == 150 and report["total"]["unanswered"] == 0
    rows = [json.loads(line) for path in (tmp_path / "data" / "results").glob("ray-*/node-*.jsonl")
            for line in path.read_text().splitlines()]
    assert len(rows) == 150 and len({(r["item_id"], r["payload"]) for r in rows}) == 150
    assert sum(1 for node in report["nodes"].values() if node["answered"]) >= 2


def test_a_node_killed_mid_job_loses_nothing_and_duplicates_nothing(cluster, tmp_path, model_dir):
    records = job_records(300)
    config = tmp_path / "slow.toml"
    config.write_text(SLOW_CONFIG)
    command = run_batch_command(cluster, tmp_path, records, model_dir, "--config", str(config), "--consumers", "1")
    log = open(tmp_path / "stderr.txt", "w+")
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)
    try:
        _wait_for(lambda: any(rows for rows in _rows_so_far(tmp_path).values()), job)
        cluster.record()
        cluster.kill("c")
        _wait_for(lambda: " 1 lost" in (tmp_path / "stderr.txt").read_text(), job)
        cluster.add("c")  # the node comes back with its resource (and its data directory)
        code = job.wait(RUN_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        cluster.record()
        log.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert code == 0, stderr
    report = check_once(tmp_path, records)
    total, c = report["cluster"]["total"], report["cluster"]["nodes"]["c"]
    assert total["answered"] == 300 and total["unanswered"] == 0
    assert c["lost"] == 1 and c["epochs"] >= 2, (c, stderr)
    assert total["resubmitted_from"] > 0, total
    # The accepted rows: one per request over all nodes' files.
    payloads = [row["payload"] for rows in node_rows(tmp_path).values() for row in rows]
    assert len(payloads) == len(set(payloads)) == 300


def _rows_so_far(tmp_path: Path) -> dict[str, int]:
    runs = list((tmp_path / "job" / "results").glob("ray-*")) if (tmp_path / "job" / "results").is_dir() else []
    return {p.name: len(p.read_text().splitlines()) for run in runs for p in run.glob("node-*.jsonl")}


def _wait_for(condition, job: subprocess.Popen) -> None:
    """Until `condition()` holds (the job still running: a job that ended first fails the test)."""
    while not condition():
        assert job.poll() is None, "the job ended before the point the test waits for"
        time.sleep(0.1)
