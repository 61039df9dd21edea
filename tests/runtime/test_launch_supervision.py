"""The launcher's supervision of producers that run foreign code (a batch job's chat template
and tokenizer): a producer that runs past the time limit on one request, or crashes on one,
is stopped, that request is handed to the workload (`on_stuck`), and a producer starts again
after what was published; one killed from outside is only started again. Real processes: a
broker, sim consumers, and producers forked with a workload of this module."""

from __future__ import annotations

import faulthandler
import glob
import json
import os
import signal
import time

import numpy as np
import pytest

from pipeline.producer.workload import WorkItem, Workload
from pipeline.runtime.launcher import Launcher
from pipeline.runtime.settings import LaunchSettings

pytestmark = pytest.mark.integration

ITEMS = 600
HANG_AT = 137
CRASH_AT = 411
KILLED_AT = 250


class Troubled(Workload):
    """Items 0..ITEMS-1 in two contiguous shares; item HANG_AT hangs its producer, CRASH_AT
    aborts it (SIGABRT), KILLED_AT has it killed by SIGKILL once (a kill from outside)."""

    item_stock = False
    busy_limit_s = 1.0

    def __init__(self, marker: str) -> None:
        super().__init__("troubled", ITEMS, self._build, total_tokens=0, models=(0,))
        self.skip: set[int] = set()
        self.stuck: list[tuple[int, str]] = []  # in the launcher's process
        self.marker = marker  # a file: KILLED_AT's producer was killed once already

    @staticmethod
    def _build(k: int) -> WorkItem:
        return WorkItem(model=0, components=[np.arange(8, dtype=np.int32)], suffix=np.full(4 + k % 9, k, np.int32),
                        payload=b"%d" % k, timestamp_ms=None, line=0)

    def produce(self, submit, index, count, watch, stop, start_at=None) -> None:
        first, end = index * ITEMS // count, (index + 1) * ITEMS // count
        first = max(first, start_at or 0)

        def items():
            for k in range(first, end):
                if k in self.skip or stop():
                    continue
                watch.busy(k)
                if k == HANG_AT:
                    time.sleep(3600)
                if k == CRASH_AT:
                    faulthandler.disable()  # pytest's would print this process's stack
                    os.abort()
                if k == KILLED_AT and not os.path.exists(self.marker):
                    open(self.marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                watch.idle()
                yield self._build(k)

        def on_submitted(_count: int) -> None:
            pass

        submit(items(), on_submitted)

    def on_stuck(self, position: int, why: str) -> None:
        self.stuck.append((position, why))
        self.skip.add(position)


def test_a_stuck_or_crashed_producer_is_replaced_and_only_its_request_is_lost(tmp_path):
    workload = Troubled(str(tmp_path / "killed-once"))
    settings = LaunchSettings(data_dir=str(tmp_path / "data"), producers=2, consumers=2)
    launcher = Launcher(settings, workload)
    try:
        outcome = launcher.run()
    finally:
        launcher.cleanup()
    assert outcome.why == "completed", outcome.why
    stuck = dict(workload.stuck)
    assert set(stuck) == {HANG_AT, CRASH_AT}, workload.stuck
    assert "time limit" in stuck[HANG_AT] and "SIGABRT" in stuck[CRASH_AT]
    rows = [json.loads(line) for path in glob.glob(str(tmp_path / "data" / "results" / "*" / "*.jsonl"))
            for line in open(path)]
    answered = {int(__import__("base64").b64decode(row["payload"])) for row in rows}
    assert answered == set(range(ITEMS)) - {HANG_AT, CRASH_AT}
    assert launcher.restarts == 3  # the hang, the crash, the kill from outside
