"""A consumer's results are as durable as its broker's store: at `power` the broker
fdatasyncs each completion record, so a result still in the page cache would be lost by a
power cut with its item marked done (found by tools/power_cuts.py on a real kernel: 228 of
2,000 acknowledged items lost at `power` before this). A real broker process at each
durability level, an in-process consumer with a file layer that records every fsync."""

from __future__ import annotations

import os

import pytest

from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.process import Consumer
from pipeline.consumer.results import ResultsFile
from lab.reliability.procs import Stages, pipeline, write_workload
from pipeline.wire import fileops
from pipeline.wire.protocol import DURABILITY_LEVELS
from tests.support.recording_io import Recording

pytestmark = pytest.mark.integration

ITEMS = 60


def _consume(tmp_path, durability: str) -> tuple[list[str], str]:
    stages = Stages(str(tmp_path / "data"), consumers=(), durability=durability)
    stages.start()
    try:
        workload = write_workload(str(tmp_path / "w.jsonl"), ITEMS, seed=3, key="d")
        pipeline("produce", workload, "--data-dir", stages.data_dir)
        config = ConsumerConfig(stages.socket_path, str(tmp_path / "results"), "c0", max_batch_items=16,
                                engine_options={"cost_s_per_batch": 0.0})
        consumer = Consumer(config)
        layer = Recording()
        previous = fileops.install(layer)
        try:
            consumer.run(lambda: consumer.counters.items >= ITEMS)
        finally:
            fileops.install(previous)
    finally:
        stages.close()
    return layer.fsynced, consumer.results_path


@pytest.mark.parametrize("durability", ["power", "process"])
def test_results_are_fsynced_before_completion_exactly_when_the_broker_is_at_power(tmp_path, durability):
    fsynced, results = _consume(tmp_path, durability)
    writes = fsynced.count(os.path.realpath(results))
    if durability == "power":
        assert writes >= ITEMS // 16  # every batch's lines (60 items in batches of at most 16)
    else:
        assert writes == 0


def test_turning_fsync_on_syncs_what_the_file_already_holds_and_every_write_after(tmp_path):
    path = str(tmp_path / "r" / "c0.jsonl")
    results = ResultsFile(path)
    layer = Recording()
    previous = fileops.install(layer)
    try:
        results.write(b"1\n")
        assert layer.fsynced == []
        results.sync_writes(True)
        assert layer.fsynced == [path]  # what a broker at `process` had counted on
        results.write(b"2\n")
        assert layer.fsynced == [path, path]
        results.sync_writes(False)
        results.write(b"3\n")
        assert layer.fsynced == [path, path]
    finally:
        fileops.install(previous)
        results.close()


def test_the_wire_names_the_durability_levels_the_store_has():
    from pipeline.storage import Durability

    assert DURABILITY_LEVELS == tuple(level.value for level in Durability)
