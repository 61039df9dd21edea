"""A job stopped by a signal at any moment: the same command goes on at once (nothing a
killed run left holds the job), a producer paused from outside is not charged for the pause,
and a stop while a new job checks its input leaves nothing that refuses the next run. Real
processes and signals, the sim engine."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from pipeline.runtime.prompttime import process_cpu_ns, process_state
from tools.tiny_llama import CHAT_TEMPLATE
from tests.support.jobs import (
    ROOT,
    SLOW_CONFIG,
    answered_lines,
    build_model,
    chat,
    command,
    copy_model,
    rows_by_id,
    run_batch,
    start_batch,
    wait_until,
    write_requests,
)

pytestmark = pytest.mark.integration

REQUESTS = 300
PRODUCER_RING = re.compile(r"/dev/shm/sbrk-[0-9a-f]+-p\d+")
CONSUMER_RING = re.compile(r"/dev/shm/sbrk-[0-9a-f]+-g\d+-c\d+")
# Requests in an input whose check takes seconds (about 40 MB), so a signal lands in it.
SCAN_REQUESTS = 300_000
# How long a rerun right after a kill -9 may take to finish a small job: the orphans of the
# killed run once held it for FIRST_REGISTRATION_TIMEOUT_S (120 s).
RERUN_LIMIT_S = 90.0
# A template that spins on every request (about 40 ms of CPU), so that a producer is making
# a prompt most of the time.
SPINS = "{% set ns = namespace(n=0) %}{% for i in range(10000) %}{% set ns.n = ns.n + i %}{% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def job_args(tmp_path: Path, model: str, count: int = REQUESTS, *more: str) -> list[str]:
    config = tmp_path / "slow.toml"
    config.write_text(SLOW_CONFIG)
    source = write_requests(tmp_path / "in.jsonl", [chat(f"r{k}", f"question {k}") for k in range(count)])
    return ["-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--data-dir", str(tmp_path / "data"),
            "--config", str(config), "--model", model, *more]


def producers_of(pid: int) -> list[int]:
    """The producer processes of run-batch `pid`: its children that map one producer ring."""
    found = []
    for child in psutil.Process(pid).children():
        try:
            maps = Path(f"/proc/{child.pid}/maps").read_text()
        except OSError:
            continue
        if PRODUCER_RING.search(maps) and not CONSUMER_RING.search(maps):
            found.append(child.pid)
    return found


@pytest.mark.parametrize("moment", ["producers register", "mid-run"])
def test_a_rerun_right_after_kill_9_finishes_the_job_at_once(tmp_path, model_dir, moment):
    args = job_args(tmp_path, model_dir)
    data = tmp_path / "data"
    job = start_batch(*args)
    try:
        if moment == "producers register":
            wait_until(lambda: (data / "run" / "broker.sock").exists() or job.poll() is not None, "the broker")
        else:
            wait_until(lambda: answered_lines(data) > 0 or job.poll() is not None, "the first answers")
        assert job.poll() is None, job.stderr.read()
        os.kill(job.pid, signal.SIGKILL)
    finally:
        job.wait()
    started_s = time.monotonic()
    done = run_batch(*args, timeout_s=RERUN_LIMIT_S)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started_s < RERUN_LIMIT_S
    rows = rows_by_id(tmp_path / "out.jsonl")
    assert set(rows) == {f"r{k}" for k in range(REQUESTS)}
    assert all(row["response"]["status_code"] == 200 for row in rows.values())
    job.stderr.close()


@pytest.mark.campaign
def test_a_producer_paused_past_the_time_limit_is_not_charged_for_the_pause(tmp_path, model_dir):
    model = copy_model(model_dir, tmp_path / "spins" / "tiny-llama")
    (model / "chat_template.jinja").write_text(SPINS + CHAT_TEMPLATE)
    args = job_args(tmp_path, str(model), 400, "--producers", "1", "--prompt-time-limit-s", "1")
    job = start_batch(*args)
    try:
        wait_until(lambda: producers_of(job.pid) or job.poll() is not None, "the producer")
        producer = producers_of(job.pid)[0]
        for _ in range(3):  # paused 2.5 s at a time, each time most likely on a request
            os.kill(producer, signal.SIGSTOP)
            wait_until(lambda: process_state(producer) in ("T", ""), "the pause")
            time.sleep(2.5)
            os.kill(producer, signal.SIGCONT)
            time.sleep(0.3)
        assert process_cpu_ns(producer) is not None, "the producer was stopped: the pauses were charged"
        _out, err = job.communicate(timeout=180)
    finally:
        job.kill()
        job.wait()
    assert job.returncode == 0, err
    rows = rows_by_id(tmp_path / "out.jsonl")
    assert len(rows) == 400
    refused = {k: r["response"]["body"] for k, r in rows.items() if r["response"]["status_code"] != 200}
    assert not refused, refused
    assert "time limit" not in err
    assert process_cpu_ns(producer) is None and process_state(producer) == ""  # gone reads as gone


def big_input(path: Path) -> Path:
    line = json.dumps(chat("ID", "hi", max_tokens=1))
    with open(path, "w") as f:
        for k in range(SCAN_REQUESTS):
            f.write(line.replace("ID", f"s{k}") + "\n")
    return path


@pytest.fixture(scope="module")
def scan_input(tmp_path_factory) -> Path:
    return big_input(tmp_path_factory.mktemp("scan") / "big.jsonl")


def made(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_ctime_ns


def start_scan(tmp_path: Path, model_dir: str, source: Path) -> subprocess.Popen:
    """run-batch on `source`, once its check of the input has started (its scan directory
    made anew, under its lock)."""
    scan, lock = tmp_path / "data" / "job" / "scan", tmp_path / "data" / "job" / "lock"
    before = made(scan)
    job = subprocess.Popen(command("-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--data-dir",
                                   str(tmp_path / "data"), "--model", model_dir),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    wait_until(lambda: (made(scan) not in (None, before) and lock.read_text().strip() == str(job.pid))
               or job.poll() is not None, "the scan")
    assert job.poll() is None, job.stderr.read()
    return job


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_while_a_new_job_checks_its_input_leaves_nothing(tmp_path, model_dir, scan_input, signum):
    job = start_scan(tmp_path, model_dir, scan_input)
    job.send_signal(signum)
    _out, err = job.communicate(timeout=60)
    assert job.returncode == 128 + signum, err
    assert err.strip().splitlines()[-1].endswith("while checking the input; nothing was kept"), err
    assert "Aborted" not in err and "Traceback" not in err
    assert not (tmp_path / "data").exists()


def test_a_new_job_killed_while_it_checks_its_input_is_taken_over_by_the_same_command(tmp_path, model_dir,
                                                                                       scan_input):
    job = start_scan(tmp_path, model_dir, scan_input)
    job.kill()
    job.communicate()
    assert (tmp_path / "data" / "job" / "lock").exists()  # what the killed check left
    again = start_scan(tmp_path, model_dir, scan_input)  # not refused: checking again
    again.send_signal(signal.SIGTERM)
    _out, err = again.communicate(timeout=60)
    assert again.returncode == 128 + signal.SIGTERM, err
    assert "a stopped check of an input left" in err and "nothing was kept" in err
    assert not (tmp_path / "data").exists()
