"""A simulated clock for driving a process loop in the test's own process: the modules given
see a `time` whose monotonic clock moves only when the test says, and whose sleep advances
it instead of waiting. Everything else of `time` is the real module."""

from __future__ import annotations

import time
from types import ModuleType

import pytest


class SimulatedTime:
    """Stands in for the `time` module: monotonic(), monotonic_ns() and sleep() on a clock
    the test moves (advance); any other name is the real module's."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_ns = int(start_s * 1e9)

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock never goes back"
        self.now_ns += int(seconds * 1e9)

    def monotonic(self) -> float:
        return self.now_ns / 1e9

    def monotonic_ns(self) -> int:
        return self.now_ns

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def __getattr__(self, name: str):
        return getattr(time, name)


def simulate_time(monkeypatch: pytest.MonkeyPatch, *modules: ModuleType, start_s: float = 1000.0) -> SimulatedTime:
    """One SimulatedTime as the `time` of every module in `modules` for the test's length."""
    clock = SimulatedTime(start_s)
    for module in modules:
        assert getattr(module, "time", None) is time, f"{module.__name__} does not use `import time`"
        monkeypatch.setattr(module, "time", clock)
    return clock
