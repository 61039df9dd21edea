"""A full store disk in staged mode, on a real small tmpfs: `produce` says
the items wait in the rings and keeps waiting, never "producers failed" while everything is
safe; a Ctrl-C says exactly how many are stored and how many wait; and the broker drains a
disk it filled itself as consumers complete (sealing open segments so finished ones go)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from pipeline.reporting.accounting import summarize_results
from tests.consumer.tmpfs import fill, small_tmpfs
from tests.runtime.runs import shm_objects_of, wait_for
from tests.support.commands import RUN_TIMEOUT_S
from tests.support.repo import ROOT

pytestmark = pytest.mark.integration

ITEMS = 3000
TOKENS_PER_ITEM = 400


def pipeline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=ROOT)


def write_workload(path, items: int = ITEMS) -> str:
    """`items` prompts of 400 tokens in 4 shapes (about 1.7 KB each in a segment)."""
    with open(path, "w") as file:
        for k in range(items):
            file.write(json.dumps({"components": [[k % 4 + 1] * 100], "suffix": [(k * 7 + j) % 30000 + 1
                                                                               for j in range(TOKENS_PER_ITEM - 100)]})
                       + "\n")
    return str(path)


def status(data: str) -> dict:
    done = pipeline("status", "--data-dir", data, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def start_produce(request, workload: str, data: str) -> subprocess.Popen:
    """`pipeline produce` in the background, killed with its producers if the test fails."""
    produce = subprocess.Popen([sys.executable, "-m", "pipeline", "produce", workload, "--data-dir", data],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    def kill() -> None:
        if produce.poll() is None:
            for child in psutil.Process(produce.pid).children(recursive=True):
                child.kill()
            produce.kill()
            produce.wait()

    request.addfinalizer(kill)
    return produce


def read_stderr_until(process: subprocess.Popen, text: str) -> str:
    """Lines of the process's stderr up to the first holding `text` (fails if it ends first)."""
    seen = []
    for line in process.stderr:
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"the process ended ({process.wait()}) without saying {text!r}:\n{''.join(seen)}")


def complete_everything(tmp_path, data: str, expected: int) -> None:
    """A consumer completes all that is stored: every item gets a result."""
    consumer = pipeline("consumer", "start", "--data-dir", data, "--name", "c0", "--max-batch", "64", "--detach")
    assert consumer.returncode == 0, consumer.stderr
    try:
        wait_for(lambda: status(data)["items_completed"] >= expected, 120, "every item completed")
    finally:
        pipeline("consumer", "stop", "--data-dir", data)
    assert summarize_results(os.path.join(data, "results")).items == expected


def test_produce_waits_for_space_and_says_so_and_nothing_is_lost(tmp_path, request):
    workload = write_workload(tmp_path / "jobs.jsonl")
    with small_tmpfs(str(tmp_path / "mnt"), 16 << 20) as mount:
        data = os.path.join(mount, "data")
        assert pipeline("broker", "start", "--data-dir", data, "--detach").returncode == 0
        try:
            filler = fill(mount, leave_bytes=1 << 20)  # room for a fraction of the workload
            produce = start_produce(request, workload, data)
            said = read_stderr_until(produce, "the broker's disk is full")
            assert "nothing submitted is lost" in said and "failed" not in said
            assert status(data)["disk_full"] is True and produce.poll() is None  # still waiting
            os.unlink(filler)  # space comes back
            out, err = produce.communicate(timeout=RUN_TIMEOUT_S)
            assert produce.returncode == 0, err
            assert f"submitted {ITEMS:,} items" in out and "all stored" in out
            assert status(data)["items_received"] == ITEMS
            complete_everything(tmp_path, data, ITEMS)
        finally:
            pipeline("consumer", "stop", "--data-dir", data)
            pipeline("broker", "stop", "--data-dir", data)
        assert shm_objects_of(data) == []


def test_ctrl_c_on_a_full_disk_says_what_waits_in_the_rings_and_it_is_stored_later(tmp_path, request):
    workload = write_workload(tmp_path / "jobs.jsonl")
    with small_tmpfs(str(tmp_path / "mnt"), 16 << 20) as mount:
        data = os.path.join(mount, "data")
        assert pipeline("broker", "start", "--data-dir", data, "--detach").returncode == 0
        try:
            filler = fill(mount, leave_bytes=1 << 20)
            produce = start_produce(request, workload, data)
            read_stderr_until(produce, "the broker's disk is full")
            produce.send_signal(signal.SIGINT)  # stop submitting: the producers still wait
            read_stderr_until(produce, "Ctrl-C again leaves the rest in the producer rings")
            produce.send_signal(signal.SIGINT)  # and stop waiting: the rings keep the rest
            _out, err = produce.communicate(timeout=RUN_TIMEOUT_S)
            assert produce.returncode == 130, err
            stored = int(err.split("interrupted: ")[1].split(" of ")[0].replace(",", ""))
            waiting = int(err.split("items stored; ")[1].split(" wait")[0].replace(",", ""))
            # A frame the full disk let in only in part counts whole among the waiting.
            assert stored <= status(data)["items_received"] <= stored + waiting
            assert waiting > 0 and "nothing is lost" in err
            os.unlink(filler)
            wait_for(lambda: status(data)["items_received"] == stored + waiting, 60, "the rings stored")
            complete_everything(tmp_path, data, stored + waiting)
        finally:
            pipeline("consumer", "stop", "--data-dir", data)
            pipeline("broker", "stop", "--data-dir", data)
        assert shm_objects_of(data) == []


def test_a_store_that_fills_its_disk_drains_it_as_consumers_complete(tmp_path):
    """No space comes back from outside: the broker's own completed segments must go. Open
    segments are sealed when the disk is full, so the completed ones are deleted; before,
    they stayed until their 300 s age limit and ingest stood still."""
    workload = write_workload(tmp_path / "jobs.jsonl", items=6000)
    with small_tmpfs(str(tmp_path / "mnt"), 6 << 20) as mount:
        data = os.path.join(mount, "data")
        assert pipeline("broker", "start", "--data-dir", data, "--detach").returncode == 0
        consumer = pipeline("consumer", "start", "--data-dir", data, "--name", "c0", "--detach")
        assert consumer.returncode == 0, consumer.stderr
        try:
            produce = pipeline("produce", workload, "--data-dir", data)  # about 10 MB through a 6 MiB disk
            assert produce.returncode == 0, produce.stderr
            wait_for(lambda: status(data)["items_completed"] == 6000, 120, "every item completed")
        finally:
            pipeline("consumer", "stop", "--data-dir", data)
            pipeline("broker", "stop", "--data-dir", data)
        assert summarize_results(os.path.join(data, "results")).items == 6000


@pytest.mark.campaign
@pytest.mark.slow
def test_the_demo_finishes_on_a_disk_smaller_than_its_results_and_store(tmp_path):
    """The default demo (20,000 items, hundreds of lanes) on an 8 MiB disk that also holds
    its results (about 5 MB): before, the first lanes' 64 KiB first allocations filled the
    disk, the frame they belonged to was held back whole, nothing was dispatched, and the
    run stood still forever at 0 routed."""
    with small_tmpfs(str(tmp_path / "mnt"), 8 << 20) as mount:
        data, report = os.path.join(mount, "data"), tmp_path / "report.json"
        done = pipeline("launch", "--items", "20000", "--data-dir", data, "--report", str(report))
        assert done.returncode == 0, done.stderr
        finished = json.loads(report.read_text())
        assert finished["lost"] == 0 and finished["items_with_results"] == 20000 and finished["accounting_ok"]
