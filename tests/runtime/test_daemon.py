"""Pid files of stage processes: found, stopped gracefully, killed after the timeout, and
never used to signal a process that is not a pipeline stage."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from pipeline.runtime import daemon

# A stand-in stage: a python process whose command line names the pipeline, that exits on
# SIGTERM (graceful) or ignores it (to be killed).
GRACEFUL = ("import pathlib, signal, sys, time\n"
            "def done(*_):\n    pathlib.Path(sys.argv[1]).write_text('graceful'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, done); print('ready', flush=True); time.sleep(60)  # pipeline")
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)  # pipeline"


def start(code: str, pid_path: str, *args: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    with open(pid_path, "w") as file:
        file.write(f"{process.pid} {psutil.Process(process.pid).create_time()!r}\n")
    assert process.stdout.readline().strip() == "ready"  # its SIGTERM handler is in place
    return process


@pytest.mark.integration
def test_stop_is_graceful_then_the_pid_file_goes(tmp_path):
    pid_path, marker = str(tmp_path / "broker.pid"), tmp_path / "exited"
    process = start(GRACEFUL, pid_path, str(marker))
    assert daemon.running_stage(pid_path).pid == process.pid
    assert daemon.stop_stage(pid_path, timeout_s=10).startswith("stopped")
    assert marker.read_text() == "graceful" and not os.path.exists(pid_path)
    assert daemon.stop_stage(pid_path, timeout_s=1) == "not running"


@pytest.mark.integration
def test_a_stage_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path):
    pid_path = str(tmp_path / "consumer-c0.pid")
    process = start(STUBBORN, pid_path)
    assert daemon.stop_stage(pid_path, timeout_s=0.5).startswith("killed after 0.5 s")
    process.wait(5)  # stop_stage reaped it already (it is this test's child)
    assert not psutil.pid_exists(process.pid)


@pytest.mark.integration
def test_a_pid_reused_by_another_program_is_never_signalled(tmp_path):
    pid_path = str(tmp_path / "broker.pid")
    other = subprocess.Popen(["sleep", "30"])
    try:
        with open(pid_path, "w") as file:
            file.write(f"{other.pid}\n")
        assert daemon.stop_stage(pid_path, timeout_s=1) == "not running"
        assert other.poll() is None and not os.path.exists(pid_path)  # untouched; stale file removed
    finally:
        other.kill()
        other.wait()


@pytest.mark.integration
def test_a_recycled_pid_with_another_start_time_is_not_the_stage(tmp_path):
    pid_path = str(tmp_path / "broker.pid")
    process = start(GRACEFUL, pid_path, str(tmp_path / "exited"))
    try:
        with open(pid_path, "w") as file:  # same pid, but the stage recorded started earlier
            file.write(f"{process.pid} {psutil.Process(process.pid).create_time() - 100!r}\n")
        assert daemon.stop_stage(pid_path, timeout_s=1) == "not running"
        assert process.poll() is None  # untouched
    finally:
        process.kill()
        process.wait()


def test_pid_file_of_this_process_is_written_and_removed(tmp_path):
    pid_path = str(tmp_path / "run" / "broker.pid")
    daemon.write_pid_file(pid_path)
    assert daemon.read_pid(pid_path) == os.getpid()
    daemon.remove_pid_file(pid_path)
    assert not os.path.exists(pid_path)
