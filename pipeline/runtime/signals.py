"""Graceful stop on SIGTERM / SIGINT for a process's main loop."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable


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
