"""The per-request time limit's charge (`PromptTimer`): CPU time, and time seen blocked,
never time paused from outside, waiting for a core, or unseen. Pure: a simulated clock."""

from __future__ import annotations

import os

from pipeline.runtime.prompttime import MAX_PASS_GAP_S, PromptTimer, process_cpu_ns, process_state

S = 1_000_000_000  # ns in a second
EPISODE = 7_000 * S  # the ledger's busy-since stamp of the request in hand
CPU0 = 40 * S  # the producer's CPU clock when it started the request


def passes(timer: PromptTimer, states: str, cpu_per_pass_s: float, gap_s: float = 0.5) -> None:
    """One supervision pass per letter of `states`, `gap_s` apart, the producer using
    `cpu_per_pass_s` of CPU between passes."""
    wall, cpu = timer.wall_ns or 1_000 * S, timer.cpu_ns or CPU0
    for state in states:
        wall += int(gap_s * S)
        cpu += int(cpu_per_pass_s * S)
        timer.observe(EPISODE, CPU0, wall, cpu, state)
        timer.check_invariants()


def test_cpu_time_reaches_the_limit_exactly_at_it():
    timer = PromptTimer(limit_s=3.0)
    passes(timer, "R" * 5, cpu_per_pass_s=0.5)  # 2.5 s of CPU
    assert not timer.ran_past()
    passes(timer, "R", cpu_per_pass_s=0.5)  # 3.0 s: at the limit
    assert timer.ran_past() and timer.charged_ns() == 3 * S


def test_a_producer_stopped_from_outside_is_not_charged_however_long():
    timer = PromptTimer(limit_s=3.0)
    passes(timer, "R", cpu_per_pass_s=0.1)
    passes(timer, "T" * 1000, cpu_per_pass_s=0.0)  # SIGSTOP for 500 s
    passes(timer, "R", cpu_per_pass_s=0.1)  # SIGCONT: it goes on
    assert not timer.ran_past() and timer.charged_ns() == int(0.2 * S)


def test_waiting_for_a_core_is_not_charged():
    timer = PromptTimer(limit_s=3.0)
    passes(timer, "R" * 100, cpu_per_pass_s=0.01)  # runnable for 50 s, 1 s of CPU
    assert not timer.ran_past() and timer.charged_ns() == 1 * S


def test_a_pause_of_the_supervisor_or_the_machine_is_not_charged():
    timer = PromptTimer(limit_s=3.0)
    passes(timer, "S", cpu_per_pass_s=0.0)
    passes(timer, "S", cpu_per_pass_s=0.0, gap_s=90.0)  # a VM paused for 90 s: nobody ran
    assert timer.charged_ns() == 0
    passes(timer, "S", cpu_per_pass_s=0.0, gap_s=MAX_PASS_GAP_S)  # a gap at the bound counts
    assert timer.charged_ns() == int(MAX_PASS_GAP_S * S)


def test_blocked_without_cpu_is_charged_so_a_deadlock_still_meets_the_limit():
    timer = PromptTimer(limit_s=3.0)
    passes(timer, "S" * 6, cpu_per_pass_s=0.0)  # 5 gaps of 0.5 s between 6 passes
    assert timer.charged_ns() == int(2.5 * S) and not timer.ran_past()
    passes(timer, "D", cpu_per_pass_s=0.0)
    assert timer.ran_past()


def test_a_sleeping_thread_beside_busy_ones_is_charged_their_cpu_not_twice():
    timer = PromptTimer(limit_s=3.0)
    passes(timer, "SS", cpu_per_pass_s=1.0)  # its tokenizer's pool at 2 cores while it waits
    assert timer.charged_ns() == 2 * S


def test_a_new_request_starts_from_nothing():
    timer = PromptTimer(limit_s=3.0)
    passes(timer, "SSSS", cpu_per_pass_s=0.5)
    timer.observe(EPISODE + S, CPU0 + 10 * S, timer.wall_ns + S // 2, CPU0 + 10 * S, "R")
    timer.check_invariants()
    assert timer.charged_ns() == 0 and not timer.ran_past()



def test_a_process_that_is_gone_reads_as_gone():
    """What the supervisor reads of a producer that has ended: no CPU clock, no state
    (a pid past the kernel's largest is never a process)."""
    with open("/proc/sys/kernel/pid_max") as f:
        gone = int(f.read()) + 1
    assert process_cpu_ns(gone) is None and process_state(gone) == ""
    assert process_cpu_ns(os.getpid()) > 0 and process_state(os.getpid()) == "R"
