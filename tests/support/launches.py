"""A small demo launch on real processes, for the tests of the launcher's start."""

from __future__ import annotations

from pipeline.producer.demos import named_workload
from pipeline.runtime.launcher import Launcher
from pipeline.runtime.settings import LaunchSettings


def demo_launcher(tmp_path, items: int = 200) -> Launcher:
    """A launcher of `items` demo items: one producer, one sim consumer, its data directory
    under `tmp_path`."""
    settings = LaunchSettings.resolve(None, {"items": items, "producers": 1, "consumers": 1,
                                             "data_dir": str(tmp_path / "data")})
    return Launcher(settings, named_workload("demo", items))
