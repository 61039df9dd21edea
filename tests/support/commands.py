"""The `pipeline` command as a user runs it, in a subprocess: `launch` and the other
commands, a one-line error checked, a running launch watched and stopped with Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from tests.runtime.runs import wait_for
from tests.support.repo import ROOT

# Generous: a run here takes seconds; this only keeps a hung run from hanging the suite.
RUN_TIMEOUT_S = 240


def launch(*args: str, timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "launch", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)


def pipeline(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=cwd)


def one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


def while_running(launcher: subprocess.Popen, predicate, what: str):
    """Wait for `predicate()` while the launch runs; fail at once, with its output, if the
    launch ends first (rather than timing out on something that can no longer happen)."""
    def check():
        if launcher.poll() is not None:
            out, err = launcher.communicate()
            raise AssertionError(f"the launch ended ({launcher.returncode}) before {what}:\n{out}\n{err}")
        return predicate()

    return wait_for(check, 60, what)


def interrupt(launcher: subprocess.Popen, children: list, signals: int) -> str:
    """Send `signals` SIGINTs (a Ctrl-C each) to a running launch; check it exits 130 and
    leaves no child running; its stdout. A launch that failed before is killed, and fails."""
    try:
        for _ in range(signals if launcher.poll() is None else 0):
            launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, err
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert alive == []
    return out
