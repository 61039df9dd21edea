"""The executor's node: started with the first job, started again when it stopped, and a
node that fails to start or stops soon after each start is tried again after a wait that
doubles, never in a loop; the node's results every job read are freed, at most every
RECLAIM_INTERVAL_S (simulated clock, a stand-in node: no process)."""

from __future__ import annotations

import json
import os

import pytest

from pipeline.batchjob.collect import COLLECTED_NAME
from pipeline.batchjob.manifest import JOB_DIR, MANIFEST_NAME
from pipeline.batchjob.reclaim import HOLE_ALIGN_BYTES
from pipeline.runtime.madefiles import RESULTS_DIR
from pipeline.service.limits import NODE_RETRY_FIRST_S, NODE_RETRY_MAX_S, NODE_STABLE_S, RECLAIM_INTERVAL_S
from pipeline.service.runner import DATA_NAME, BatchRun, RunBatchExecutor
from pipeline.wire.errors import NodeStartError


class StandInNode:
    """What the executor uses of a NodeHandle; `fail` starts raise, `up` says whether it serves."""

    def __init__(self) -> None:
        self.node_pid: int | None = None
        self.up = False
        self.fail = False
        self.starts = self.stops = 0
        self.info: dict = {}  # its ready line: the live results folder
        self.spec = type("Spec", (), {"settings": type("Settings", (), {"data_dir": "/unused/node"})()})()

    def alive(self) -> bool:
        return self.up

    def start(self) -> dict:
        self.starts += 1
        if self.fail:
            raise NodeStartError("the node's broker did not start")
        self.node_pid, self.up = 1000 + self.starts, True
        return {"node_pid": self.node_pid, "consumers": 2}

    def stop(self) -> None:
        self.stops += 1
        self.node_pid, self.up = None, False


@pytest.fixture
def executor():
    clock = [0.0]
    runner = RunBatchExecutor([])
    runner.node = StandInNode()
    runner.clock = lambda: clock[0]
    return runner, runner.node, clock


def test_the_node_starts_once_and_again_when_it_stopped(executor) -> None:
    runner, node, clock = executor
    assert runner._node_serves() and node.starts == 1
    assert runner._node_serves() and node.starts == 1  # it serves: nothing to do
    clock[0] += NODE_STABLE_S + 1
    node.up = False  # a process of it died, long after its start
    assert runner._node_serves() and (node.starts, node.stops) == (2, 1)


def test_a_node_that_cannot_start_is_tried_again_after_a_doubling_wait(executor) -> None:
    runner, node, clock = executor
    node.fail = True
    waits = []
    for _ in range(12):
        assert not runner._node_serves()
        started = node.starts
        while node.starts == started:  # the next try comes only once its wait passed
            assert not runner._node_serves()
            clock[0] += 0.5
        waits.append(runner._node_wait_s())
    assert waits[0] == 2 * NODE_RETRY_FIRST_S * 2 and waits[-1] == NODE_RETRY_MAX_S
    assert all(b >= a for a, b in zip(waits, waits[1:]))
    node.fail = False
    clock[0] += NODE_RETRY_MAX_S
    assert runner._node_serves()


def test_a_node_that_dies_soon_after_each_start_is_not_restarted_in_a_loop(executor) -> None:
    runner, node, clock = executor
    assert runner._node_serves()
    starts_at = []
    for _ in range(8):
        node.up = False  # it dies at once (an engine killed by the same request each time)
        while not runner._node_serves():
            clock[0] += 0.25
        starts_at.append(clock[0])
    gaps = [b - a for a, b in zip(starts_at, starts_at[1:])]
    assert all(b > a for a, b in zip(gaps, gaps[1:])), gaps  # each wait longer than the last
    clock[0] += NODE_STABLE_S + 1
    node.up = False  # this time it ran for a while: the wait starts over
    assert runner._node_serves()
    assert runner._node_failures == 0


def test_the_node_results_every_ran_job_read_are_freed_at_most_every_interval(executor, tmp_path) -> None:
    runner, node, clock = executor
    node.spec.settings.data_dir = str(tmp_path / "node")
    results = tmp_path / "node" / RESULTS_DIR / "run-1"
    results.mkdir(parents=True)
    (results / "c0.jsonl").write_bytes(b"x" * 1023 + b"\n" * (2 * HOLE_ALIGN_BYTES))
    relative = os.path.join(RESULTS_DIR, "run-1", "c0.jsonl")
    ran, new = (BatchRun(name, "/unused/in", str(tmp_path / name), 10) for name in ("ran", "new"))
    positions = tmp_path / "ran" / DATA_NAME / JOB_DIR / COLLECTED_NAME
    positions.parent.mkdir(parents=True)
    positions.write_text(json.dumps({relative: HOLE_ALIGN_BYTES}))
    (positions.parent / MANIFEST_NAME).write_text("{}")  # a job that was made (its content is not read)
    runner.tidy(lambda: [ran, new])  # `new` was never made (no data directory): it holds nothing
    assert _data_start(results / "c0.jsonl") == HOLE_ALIGN_BYTES
    positions.write_text(json.dumps({relative: 2 * HOLE_ALIGN_BYTES}))
    clock[0] += RECLAIM_INTERVAL_S - 0.5
    runner.tidy(lambda: [ran, new])
    assert _data_start(results / "c0.jsonl") == HOLE_ALIGN_BYTES  # not yet
    clock[0] += 0.5
    runner.tidy(lambda: [ran, new])
    assert _data_start(results / "c0.jsonl") == 2 * HOLE_ALIGN_BYTES
    # A node started again writes a folder of its own: the stopped one's file, read whole, goes;
    # while no node serves, which folder is live is not known, and none goes.
    size = os.path.getsize(results / "c0.jsonl")
    positions.write_text(json.dumps({relative: size}))
    os.utime(results / "c0.jsonl", (0, 0))
    node.info["results_dir"] = str(tmp_path / "node" / RESULTS_DIR / "run-2")
    clock[0] += RECLAIM_INTERVAL_S
    runner.tidy(lambda: [ran, new])
    assert results.exists()
    assert runner._node_serves()
    clock[0] += RECLAIM_INTERVAL_S
    runner.tidy(lambda: [ran, new])
    assert not results.exists()


def _data_start(path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_DATA)
    finally:
        os.close(fd)
