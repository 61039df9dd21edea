"""Graceful stop on SIGTERM / SIGINT for a process's main loop, and the launcher's count of them."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass


def stop_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Callable[[], bool]:
    """Install handlers that set a flag; return `stop()`, true once a signal came.

    A second signal while stopping falls through to the default action (a forceful stop),
    as users expect of a second Ctrl-C.
    """
    flag = threading.Event()

    def handle(signum, _frame) -> None:
        if flag.is_set():
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        flag.set()

    for signum in signals:
        signal.signal(signum, handle)
    return flag.is_set


@dataclass(slots=True)
class Interrupts:
    """How many stop signals (SIGINT, SIGTERM) the launcher got: one asks for an orderly
    stop, two for a forceful one. The handler only counts: the launcher's code checks, so a
    second Ctrl-C can never cut its stop, report or clean-up short.
    NOTE: not `stop_on_signals`, whose second signal ends the process at once, and not a
    KeyboardInterrupt raised by the handler: either would skip killing the children and
    removing what they leave. Owner: the launcher's main thread."""

    count: int = 0

    @classmethod
    def install(cls) -> Interrupts:
        interrupts = cls()

        def handle(_signum, _frame) -> None:
            interrupts.count += 1

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: a closed terminal
            signal.signal(signum, handle)
        return interrupts

    def stopping(self) -> bool:
        return self.count >= 1

    def forcing(self) -> bool:
        return self.count >= 2
