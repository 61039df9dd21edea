"""A producer's request stamps (`LedgerSlot.busy`): the CPU clock read at most once per
CPU_CLOCK_READ_INTERVAL_NS, its stamp never after the request's start and behind it by at
most what the process used in that interval. Pure: simulated clocks, a plain list as the
ledger's shared words."""

from __future__ import annotations

import random

from pipeline.runtime.inventory import CPU_CLOCK_READ_INTERVAL_NS, ProducerLedger

MS = 1_000_000  # ns in a millisecond


class Clocks:
    """A process's monotonic and CPU clocks, moved by the test; counts CPU clock reads."""

    def __init__(self) -> None:
        self.wall_ns, self.cpu_ns, self.cpu_reads = 5_000 * MS, 70 * MS, 0

    def monotonic(self) -> int:
        return self.wall_ns

    def cpu(self) -> int:
        self.cpu_reads += 1
        return self.cpu_ns

    def run(self, wall_ns: int, threads: int) -> None:
        """`wall_ns` pass with `threads` threads on a core each (0: blocked)."""
        self.wall_ns += wall_ns
        self.cpu_ns += wall_ns * threads


def ledger_of(producers: int) -> ProducerLedger:
    ledger = ProducerLedger([0] * (ProducerLedger._WORDS * producers + 1))
    for index in range(producers):
        ledger.reset(index)
    return ledger


def test_each_stamp_is_at_most_the_cpu_at_the_start_and_reads_are_rare():
    rng = random.Random(33)
    clocks, ledger = Clocks(), ledger_of(2)
    slot = ledger.slot(1)
    slot.monotonic_ns, slot.cpu_clock_ns = clocks.monotonic, clocks.cpu
    last_read_ns, requests = None, 20_000
    for position in range(requests):
        clocks.run(rng.choice((0, 50_000, 150_000, 3 * MS, 40 * MS)), rng.choice((0, 1, 1, 1, 4)))
        reads = clocks.cpu_reads
        slot.busy(position)
        since_ns, made = ledger.busy_with(1)
        stamp_ns = ledger.busy_cpu_from(1)
        assert (since_ns, made) == (clocks.wall_ns, position)
        assert stamp_ns <= clocks.cpu_ns  # never charged less than the request took
        if clocks.cpu_reads > reads:
            assert stamp_ns == clocks.cpu_ns
            assert last_read_ns is None or clocks.wall_ns - last_read_ns >= CPU_CLOCK_READ_INTERVAL_NS
            last_read_ns = clocks.wall_ns
        else:  # the stamp is the last read's, within the interval of wall time
            assert clocks.wall_ns - last_read_ns < CPU_CLOCK_READ_INTERVAL_NS
        slot.idle()
        assert ledger.busy_with(1) is None and ledger.busy_with(0) is None
    assert clocks.cpu_reads < requests // 3


def test_a_read_at_the_interval_and_none_just_before_it():
    clocks, ledger = Clocks(), ledger_of(1)
    slot = ledger.slot(0)
    slot.monotonic_ns, slot.cpu_clock_ns = clocks.monotonic, clocks.cpu
    slot.busy(0)
    assert clocks.cpu_reads == 1  # the first request always reads
    clocks.run(CPU_CLOCK_READ_INTERVAL_NS - 1, 1)
    slot.busy(1)
    assert clocks.cpu_reads == 1 and ledger.busy_cpu_from(0) == clocks.cpu_ns - (CPU_CLOCK_READ_INTERVAL_NS - 1)
    clocks.run(1, 1)
    slot.busy(2)
    assert clocks.cpu_reads == 2 and ledger.busy_cpu_from(0) == clocks.cpu_ns
