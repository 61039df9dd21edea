"""The time a producer has spent on one request of a workload that runs foreign code (a batch
job's chat template and tokenizer), as its supervisor (the launcher) charges it against the
per-request time limit (`busy_limit_s`, --prompt-time-limit-s).

    timer = PromptTimer(limit_s=60.0)
    timer.observe(episode, cpu_at_start_ns, wall_ns, cpu_ns, state)   # every supervision pass
    timer.ran_past()

Charged: the CPU time the producer's process used since it started the request (all its
threads: a tokenizer may hand a long input to a pool of its own; the producer's other
threads sleep meanwhile; from a stamp up to `inventory.CPU_CLOCK_READ_INTERVAL_NS` old), plus the time it was seen blocked in it (sleeping without using
CPU: a deadlock, a wait that never ends), counted only between two passes that both saw it
asleep and at most MAX_PASS_GAP_S a pass.
Not charged: time it was paused from outside (SIGSTOP: state T), time it waited for a core
other work held (runnable: state R, no CPU used), and time the supervisor itself did not run
(a paused VM, a stopped launcher: a pass gap past MAX_PASS_GAP_S).
NOTE: wall time since the request started was rejected: a producer stopped for 6 s under a
3-second limit, or a VM paused for a minute under the default, had a healthy request
answered 400 for good.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# The longest gap between two supervision passes that is counted as a blocked producer's
# time: the launcher passes every watch_interval_s (at most 0.5 s) plus a broker status call; a
# longer gap means the supervisor did not run (a paused VM, SIGSTOP), which says nothing of
# the producer.
MAX_PASS_GAP_S = 2.0
# Process states (/proc/PID/stat) of a process blocked in the kernel: sleeping, or waiting
# on I/O.
BLOCKED_STATES = frozenset("SD")
# CPUCLOCK_SCHED: the clock id kind of a process's CPU clock, as glibc's clock_getcpuclockid
# builds it (the clock `time.process_time_ns` reads in that process).
_CPUCLOCK_SCHED = 2


@dataclass(slots=True)
class PromptTimer:
    """One producer's charged time on its current request (the module's doc). Pure: the
    caller observes the process. Owner: the launcher's main thread."""

    limit_s: float
    episode: int = 0  # which request in hand: the ledger's busy-since stamp (0: none yet)
    cpu_at_start_ns: int = 0
    cpu_ns: int = 0
    wall_ns: int = 0
    blocked: bool = False
    blocked_ns: int = 0

    def observe(self, episode: int, cpu_at_start_ns: int, wall_ns: int, cpu_ns: int, state: str) -> None:
        """One supervision pass: the producer is on request `episode` (started when its CPU
        clock read `cpu_at_start_ns`); now `wall_ns` (monotonic), its CPU clock `cpu_ns`, its
        process state `state` (one letter, as /proc says)."""
        blocked = state in BLOCKED_STATES
        if episode != self.episode:
            self.episode, self.cpu_at_start_ns, self.blocked_ns = episode, cpu_at_start_ns, 0
        else:
            gap_ns = wall_ns - self.wall_ns
            if self.blocked and blocked and 0 < gap_ns <= MAX_PASS_GAP_S * 1e9:
                self.blocked_ns += max(0, gap_ns - (cpu_ns - self.cpu_ns))
        self.cpu_ns, self.wall_ns, self.blocked = max(cpu_ns, cpu_at_start_ns), wall_ns, blocked

    def charged_ns(self) -> int:
        return self.cpu_ns - self.cpu_at_start_ns + self.blocked_ns

    def ran_past(self) -> bool:
        return self.episode != 0 and self.charged_ns() >= self.limit_s * 1e9

    def check_invariants(self) -> None:
        assert self.limit_s > 0, self.limit_s
        assert self.blocked_ns >= 0 and self.cpu_ns >= self.cpu_at_start_ns, (self.blocked_ns, self.cpu_ns)


def process_cpu_ns(pid: int) -> int | None:
    """The CPU time process `pid` has used, all its threads together (its clock
    `time.process_time_ns` reads), or None once it is gone."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | _CPUCLOCK_SCHED)
    except OSError:
        return None


def process_state(pid: int) -> str:
    """Process `pid`'s state letter (R running, S sleeping, D in I/O, T stopped, ...), or ""
    once it is gone. NOTE: /proc, not psutil: one read, no objects, on every pass."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return ""
    end = raw.rfind(b")")  # the command name may hold spaces and parentheses
    return raw[end + 2:end + 3].decode() if end >= 0 else ""
