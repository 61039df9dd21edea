"""The run-batch executor's children: a run that ends wakes the scheduler at once (`on_end`,
from a thread waiting on the child's pidfd) and its next poll says how it ended. The
children here are short Python processes standing in for `pipeline run-batch`."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipeline.service.runner import ANSWERED_ALL, CHECKING, ENDED, FAILED, BatchRun, RunBatchExecutor, _wait_then


def _pidfd_works() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not _pidfd_works(), reason="no pidfd here: the scheduler's tick finds a run's end")]
# A descriptor number select.select refuses (FD_SETSIZE is 1024).
HIGH_FD = 1500

# A child of these ends within a second; a loaded machine may take far longer to start one.
END_WAIT_S = 60.0


class Standing(RunBatchExecutor):
    """Runs `code` (Python) instead of run-batch."""

    def __init__(self, code: str) -> None:
        super().__init__([])
        self.code = code

    def command(self, run: BatchRun) -> list[str]:
        return [sys.executable, "-c", self.code]


def a_run(tmp_path: Path, name: str = "batch_1") -> BatchRun:
    return BatchRun(name, str(tmp_path / "input.jsonl"), str(tmp_path / name), 4)


@pytest.mark.parametrize(("code", "outcome"), [("pass", ANSWERED_ALL), ("raise SystemExit(3)", FAILED)])
def test_a_run_that_ends_wakes_the_scheduler_and_its_poll_says_how(tmp_path, code, outcome):
    executor = Standing(code)
    ended = threading.Event()
    executor.on_end = ended.set
    run = a_run(tmp_path)
    assert executor.start(run)
    assert ended.wait(END_WAIT_S), "on_end was not called"
    progress = executor.poll(run)
    assert (progress.state, progress.outcome) == (ENDED, outcome)
    assert executor.running() == 0


def test_no_wake_while_the_run_goes_on(tmp_path):
    release = tmp_path / "release"
    executor = Standing(f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.01)")
    ended = threading.Event()
    executor.on_end = ended.set
    run = a_run(tmp_path)
    assert executor.start(run)
    try:
        assert not ended.wait(0.3)
        assert executor.poll(run).state == CHECKING  # running; no job status files yet
    finally:
        release.write_text("")
    assert ended.wait(END_WAIT_S), "on_end was not called"
    assert executor.poll(run).state == ENDED


def test_the_wait_takes_a_descriptor_past_what_select_takes():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= HIGH_FD:
        pytest.skip(f"descriptors limited to {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HIGH_FD + 1), hard))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        pidfd = os.pidfd_open(child.pid)
        os.dup2(pidfd, HIGH_FD)
        os.close(pidfd)
        ended = threading.Event()
        _wait_then(HIGH_FD, ended.set)
        assert ended.is_set()
        with pytest.raises(OSError):
            os.fstat(HIGH_FD)  # closed by the wait
    finally:
        child.wait()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
