"""`pipeline launch` as a user runs it: a real command in a subprocess, real processes under it.

Each run checks what the issue asks of the launcher: the report's accounting matches the
results files, nothing is left in /dev/shm, Ctrl-C stops everything in order, and a bad
workload line refuses the run before anything starts.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import psutil
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from pipeline.cli import main
from pipeline.reporting.accounting import summarize_results
from pipeline.runtime.processes import memory_tier_dir
from pipeline.wire.client import broker_status
from tests.runtime.runs import free_port, shm_objects_of
from tests.support.commands import interrupt, launch, while_running
from tests.support.repo import ROOT

pytestmark = pytest.mark.integration

TRACE = ROOT.parent / "shared" / "workloads" / "mooncake_synthetic_trace.jsonl"
# The sim's cost per batch in the GPU-bound run: 30 ms, long beside the broker's work on a batch.
BATCH_COST_S = 0.03


def run_results_dir(data_dir: str) -> str:
    (found,) = glob.glob(os.path.join(data_dir, "results", "run-*"))
    return found


def check_report_against_results(report: dict, results_dir: str, items: int) -> None:
    """The report's accounting is what the results files hold."""
    summary = summarize_results(results_dir)
    assert report["accounting_ok"] is True and report["lost"] == 0 and report["outcome"] == "completed"
    assert report["items_received"] == report["items_completed"] == summary.items == items
    assert report["tokens_received"] == report["tokens_routed"] == report["tokens_completed"]
    assert report["duplicates"] == summary.duplicates == 0
    per_line = {name: figures["lines"] for name, figures in summary.per_consumer.items()}
    assert {name: row["items"] for name, row in report["per_consumer"].items()} == per_line
    rows = [json.loads(line) for path in glob.glob(os.path.join(results_dir, "*.jsonl")) for line in open(path)]
    assert sum(row["prompt_tokens"] for row in rows) == report["tokens_completed"]
    ran = sum(row["prompt_tokens"] for row in rows if row["status"] == "ok")  # too_long ones are not run
    assert sum(row["prompt_tokens"] for row in report["per_consumer"].values()) == ran
    assert report["items_empty"] == sum(row["status"] == "too_long" for row in rows)
    for key in ("padding_efficiency", "mean_batch_fill", "cache_hit_rate"):
        assert 0 < report[key] <= 1, key
    assert report["lanes"]["opened"] >= report["shapes"] > 0
    # Every hit over the prompt tokens run: the results' cached tokens over their prompt tokens.
    assert report["prefix_reuse"] == sum(row["cached_tokens"] for row in rows) / ran
    # A consumer runs one batch at a time, each between its dispatch and its results: busy
    # within the makespan, never more.
    assert report["makespan_s"] == summary.makespan_s > 0
    for name, row in report["per_consumer"].items():
        assert 0 < row["busy_fraction"] <= 1, name


def test_demo_run_report_matches_results_and_leaves_nothing(tmp_path):
    data, report_path, plots = tmp_path / "data", tmp_path / "report.json", tmp_path / "plots"
    config = tmp_path / "run.toml"
    config.write_text("items = 3000\nproducers = 1\n[engine_options]\nblock_size_tokens = 32\n")
    done = launch("--config", str(config), "--producers", "2", "--data-dir", str(data), "--report", str(report_path),
                  "--plots", str(plots))
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    check_report_against_results(report, run_results_dir(str(data)), 3000)
    assert "Accounting" in done.stdout and "OK" in done.stdout  # the table on stdout
    assert sorted(os.listdir(plots)) == ["cache_hit_rate.png", "lanes.png", "padding.png", "queued_tokens.png"]
    assert shm_objects_of(str(data)) == []
    assert not os.path.exists(os.path.join(str(data), "run", "broker.sock"))


def test_a_gpu_bound_run_reports_the_engines_busy_time(tmp_path):
    # BATCH_COST_S a batch in the sim's cost model: the consumers, not the broker, bound the run.
    data, report_path = tmp_path / "data", tmp_path / "report.json"
    config = tmp_path / "run.toml"
    config.write_text(f"items = 600\n[engine_options]\ncost_s_per_batch = {BATCH_COST_S}\n")
    done = launch("--config", str(config), "--data-dir", str(data), "--report", str(report_path))
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    check_report_against_results(report, run_results_dir(str(data)), 600)
    for name, row in report["per_consumer"].items():
        assert row["busy_s"] >= row["batches"] * BATCH_COST_S, name  # each batch slept its cost at least
    assert "busy fraction" in done.stdout


def test_own_format_workload_on_the_memory_tier(tmp_path):
    workload = tmp_path / "jobs.jsonl"
    system = list(range(100, 164))
    lines = [{"model": 0, "components": [system], "suffix": list(range(k % 40 + 1)), "payload": f"job-{k}"}
             for k in range(400)]
    workload.write_text("".join(json.dumps(line) + "\n" for line in lines))
    data, report_path = tmp_path / "data", tmp_path / "report.json"
    done = launch("--workload", str(workload), "--storage", "memory", "--consumers", "1", "--data-dir", str(data),
                  "--report", str(report_path))
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    check_report_against_results(report, run_results_dir(str(data)), 400)
    rows = [json.loads(line) for line in open(glob.glob(os.path.join(run_results_dir(str(data)), "*.jsonl"))[0])]
    assert sorted(base64.b64decode(row["payload"]).decode() for row in rows) == sorted(f"job-{k}" for k in range(400))
    assert not os.path.exists(os.path.join(str(data), "segments"))  # the memory tier wrote no segment file
    assert shm_objects_of(str(data)) == [] and not os.path.exists(memory_tier_dir(str(data)))


@pytest.mark.skipif(not TRACE.exists(), reason=f"the Mooncake trace is not at {TRACE}")
def test_mooncake_trace_runs_with_long_prompts(tmp_path):
    head = tmp_path / "trace.jsonl"
    with open(TRACE) as source:
        head.write_text("".join(next(source) for _ in range(120)))
    data, report_path = tmp_path / "data", tmp_path / "report.json"
    done = launch("--workload", str(head), "--max-input-len", "16384", "--max-batch-tokens", "262144",
                  "--data-dir", str(data), "--report", str(report_path))
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    check_report_against_results(report, run_results_dir(str(data)), 120)
    longest = max(json.loads(line)["input_length"] for line in head.read_text().splitlines())
    assert longest > 16384 and report["items_empty"] > 0  # too long for the contract: empty, not dropped


def test_a_malformed_workload_line_refuses_the_run_before_anything_starts(tmp_path):
    workload = tmp_path / "jobs.jsonl"
    workload.write_text('{"components": [[1, 2]], "suffix": [3]}\n{"components": [[1, 2]], "suffix": "x"}\n')
    data = tmp_path / "data"
    result = CliRunner().invoke(main, ["launch", "--workload", str(workload), "--data-dir", str(data)])
    assert result.exit_code == 1
    assert f"{workload}:2" in result.output and "nothing was submitted" in result.output
    assert not data.exists()  # refused before the broker (or anything) started


def test_a_metrics_port_in_use_refuses_the_run_in_one_line_before_anything_starts(tmp_path):
    data = tmp_path / "data"
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["launch", "--items", "200", "--data-dir", str(data),
                                           "--metrics-port", str(port)])
    assert result.exit_code == 1
    assert result.output.endswith(f"Error: metrics port {port} (127.0.0.1:{port}) is in use: another process "
                                  f"listens there; give another --metrics-port, or 0 for any free one\n")
    assert not data.exists()  # refused before the data directory (or anything) was made


def test_a_metrics_port_0_is_said_and_in_the_report(tmp_path):
    report_path = tmp_path / "report.json"
    done = launch("--items", "200", "--metrics-port", "0", "--report", str(report_path))
    assert done.returncode == 0, done.stderr
    said = re.findall(r"^metrics: http://127\.0\.0\.1:(\d+)/metrics$", done.stderr, re.MULTILINE)
    assert len(said) == 1 and int(said[0]) > 0, done.stderr
    assert json.loads(report_path.read_text())["metrics_port"] == int(said[0])


def completed_items(socket_path: str) -> int:
    try:
        return broker_status(socket_path, timeout_s=1.0).items_completed
    except (OSError, TimeoutError):
        return 0


def test_ctrl_c_stops_everything_in_order_and_a_rerun_finishes_the_rest(tmp_path):
    """SIGINT to the launcher, as a terminal's Ctrl-C sends it (children run in their own
    process groups): exit status 130, a report, no process, no shared-memory object; what was
    stored stays in the data directory and the next launch on it completes it. The metrics
    endpoint is scraped while the run is going (with the token of its token file)."""
    data, port, report_path = str(tmp_path / "data"), free_port(), tmp_path / "stopped.json"
    slow = tmp_path / "slow.toml"  # consumers that cannot finish before the Ctrl-C
    slow.write_text("items = 20000\nconsumers = 2\n[engine_options]\ncost_s_per_padded_token = 2e-6\n")
    token = tmp_path / "token"
    token.write_text("launch-token\n")
    token.chmod(0o600)
    launcher = subprocess.Popen([sys.executable, "-m", "pipeline", "launch", "--config", str(slow), "--data-dir", data,
                                 "--metrics-port", str(port), "--metrics-token-file", str(token),
                                 "--report", str(report_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    children: list = []
    try:
        while_running(launcher, lambda: completed_items(os.path.join(data, "run", "broker.sock")) > 0, "items completed")
        # broker, 2 consumers, and the producers that have not finished feeding yet
        children = psutil.Process(launcher.pid).children(recursive=True)
        assert len(children) >= 3
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
        scrape = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                        headers={"Authorization": "Bearer launch-token"})
        body = urllib.request.urlopen(scrape, timeout=10).read().decode()
        metrics = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples if not s.labels}
        assert metrics["shape_broker_up"] == 1 and metrics["shape_broker_items_received_total"] > 0
    finally:
        out = interrupt(launcher, children, signals=1)
    assert "stopped early" in out
    assert shm_objects_of(data) == []
    stopped = json.loads(report_path.read_text())
    assert stopped["outcome"] == "interrupted" and stopped["lost"] == 0 and stopped["items_unfinished"] > 0
    assert stopped["items_received"] == stopped["items_completed"] + stopped["items_unfinished"]

    rerun = launch("--items", "100", "--data-dir", data, "--report", str(report_path))
    assert rerun.returncode == 0, rerun.stderr
    finished = json.loads(report_path.read_text())
    assert finished["accounting_ok"] is True and finished["lost"] == 0
    assert finished["items_received"] == stopped["items_unfinished"] + 100 == finished["items_completed"]
    assert shm_objects_of(data) == []


def test_a_second_ctrl_c_kills_but_still_reports_and_cleans_up(tmp_path):
    """Two SIGINTs in a row on a run with a temporary data directory: the stop turns
    forceful, yet the report is printed, nothing is left running or in /dev/shm, and the
    temporary directory is removed (its unfinished items are reported as discarded)."""
    temp, report_path = tmp_path / "tmp", tmp_path / "report.json"
    temp.mkdir()
    slow = tmp_path / "slow.toml"
    slow.write_text("items = 20000\nconsumers = 2\n[engine_options]\ncost_s_per_padded_token = 2e-6\n")
    launcher = subprocess.Popen([sys.executable, "-m", "pipeline", "launch", "--config", str(slow), "--report",
                                 str(report_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=ROOT, env={**os.environ, "TMPDIR": str(temp)})
    children: list = []
    try:
        socket_path = while_running(launcher, lambda: glob.glob(str(temp / "shape-broker-*" / "run" / "broker.sock")),
                                    "socket")[0]
        data = os.path.dirname(os.path.dirname(socket_path))
        while_running(launcher, lambda: completed_items(socket_path) > 0, "items completed")
        children = psutil.Process(launcher.pid).children(recursive=True)
    finally:
        out = interrupt(launcher, children, signals=2)
    assert "Accounting" in out
    assert shm_objects_of(data) == [] and os.listdir(temp) == []
    report = json.loads(report_path.read_text())
    assert report["outcome"] == "interrupted" and report["items_discarded"] == report["items_unfinished"]


def test_process_settings_reach_the_broker_and_the_report(tmp_path):
    # One lane per shape at most: the demo's 16 shapes open 16 lanes, not the hundreds their
    # lengths ask for with the default budget (499 in a 2,000-item demo).
    report_path = tmp_path / "report.json"
    done = launch("--items", "2000", "--set", "broker.lanes.max_lanes=1", "--set", "consumer.credit_max_batches=3",
                  "--report", str(report_path))
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    assert report["accounting_ok"] and report["lanes"]["max_in_use"] == report["shapes"]
    assert report["settings"]["changed"] == {"broker.lanes.max_lanes": 1, "consumer.credit_max_batches": 3}
    assert report["settings"]["broker"]["lanes"]["max_lanes"] == 1
    assert "settings: broker.lanes.max_lanes=1, consumer.credit_max_batches=3" in done.stdout
