"""Stage processes started by `pipeline broker|consumer start` and stopped by `... stop`.

A stage process in the foreground writes a pid file in the run directory while it serves
(`run/broker.pid`, `run/consumer-NAME.pid`) and removes it when it stops, so `stop` finds
it whether or not it was detached. `--detach` runs the same command again in the background,
in its own session, with stdout and stderr appended to a log file beside the pid file.

Stopping is graceful first: SIGTERM (a consumer finishes its batch in hand and says goodbye,
so the batches it held go back to dispatch at once; a broker closes its files), then SIGKILL
after the timeout. A pid file whose process is gone, or is some other program that reused
the pid, is removed and reported, never signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

# How often a stop or a detached start checks on the process.
POLL_S = 0.05
# A detached stage must be serving within this (a broker's recovery of a large store is the
# slow case; it logs its progress to its log file).
DETACH_READY_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class StageFiles:
    """The pid and log files of one stage process in a run directory."""

    pid_path: str
    log_path: str

    @classmethod
    def of(cls, run_dir: str, stage: str) -> StageFiles:
        return cls(os.path.join(run_dir, f"{stage}.pid"), os.path.join(run_dir, f"{stage}.log"))


def write_pid_file(path: str) -> None:
    """This process's pid and start time (so a recycled pid is never taken for it)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(_owner_only(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as file:
        file.write(f"{os.getpid()} {psutil.Process().create_time()!r}\n")
    os.replace(temporary, path)


def _owner_only(path: str, flags: int) -> int:
    """Open `path` with mode 0600 whatever the umask (an existing file is made 0600 too)."""
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def remove_pid_file(path: str) -> None:
    """Remove `path` if it names this process (a newer stage may have replaced it)."""
    try:
        if read_pid(path) == os.getpid():
            os.unlink(path)
    except FileNotFoundError:
        pass


def read_pid(path: str) -> int | None:
    return _read(path)[0]


def _read(path: str) -> tuple[int | None, float | None]:
    """(pid, start time) from a pid file; (None, None) when it is missing or unreadable."""
    try:
        with open(path) as file:
            fields = file.read().split()
    except FileNotFoundError:
        return None, None
    try:
        return int(fields[0]), float(fields[1]) if len(fields) > 1 else None
    except (IndexError, ValueError):
        return None, None


def running_stage(path: str) -> psutil.Process | None:
    """The live stage process a pid file names, or None (the file is then removed): the pid
    must be alive and be a `pipeline` process, not another program that reused the pid."""
    process = stage_process(path)
    if process is not None or read_pid(path) is None:
        return process
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return None


def stage_process(path: str) -> psutil.Process | None:
    """The live `pipeline` process a pid file names (same pid and start time, not a zombie),
    or None; changes nothing (`pipeline tools cleanup` lists a stale pid file before it
    removes it)."""
    pid, started = _read(path)
    if pid is None:
        return None
    try:
        process = psutil.Process(pid)
        same = started is None or process.create_time() == started
        if same and process.status() != psutil.STATUS_ZOMBIE and _is_pipeline(process):
            return process
    except psutil.Error:
        pass
    return None


def _is_pipeline(process: psutil.Process) -> bool:
    command = " ".join(process.cmdline())
    return "pipeline" in command


def detach(argv: list[str], files: StageFiles, ready: Callable[[int], bool]) -> int:
    """Run `python -m pipeline argv...` in the background (new session, output to the log
    file) and wait until `ready(pid)`; returns its pid. RuntimeError if it exits first (the
    log file says why), TimeoutError if it is not ready in time (it is then killed)."""
    os.makedirs(os.path.dirname(files.log_path), mode=0o700, exist_ok=True)
    log = open(_owner_only(files.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab")
    try:
        child = subprocess.Popen([sys.executable, "-m", "pipeline", *argv], stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()
    deadline = time.monotonic() + DETACH_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"it exited with status {child.returncode}: {_last_line(files.log_path)} "
                               f"(log: {files.log_path})")
        if ready(child.pid):
            return child.pid
        time.sleep(POLL_S)
    child.kill()
    child.wait()
    raise TimeoutError(f"not ready after {DETACH_READY_TIMEOUT_S} s; see {files.log_path}")


# How much of a stage's log end is read to say why it exited: its last message is there.
LOG_TAIL_BYTES = 4096


def _last_line(log_path: str) -> str:
    """The last non-empty line of a log file (what a stage that exited said last)."""
    try:
        with open(log_path, "rb") as file:
            file.seek(max(0, os.fstat(file.fileno()).st_size - LOG_TAIL_BYTES))
            lines = [line for line in file.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError as exc:
        return f"(its log cannot be read: {exc.strerror})"
    return lines[-1].strip() if lines else "(its log is empty)"


def stop_stage(path: str, timeout_s: float) -> str:
    """Stop the stage a pid file names: SIGTERM, then SIGKILL after `timeout_s`. Returns
    what happened, in words, for the command's output."""
    process = running_stage(path)
    if process is None:
        return "not running"
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
        outcome = f"stopped (pid {process.pid})"
    except psutil.TimeoutExpired:
        process.kill()
        process.wait(timeout_s)
        outcome = f"killed after {timeout_s:g} s (pid {process.pid})"
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return outcome
