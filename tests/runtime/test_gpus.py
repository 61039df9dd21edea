"""GPU detection: CUDA_VISIBLE_DEVICES first, then nvidia-smi (a real script on PATH here)."""

from __future__ import annotations

import os
import stat

import pytest

from pipeline.runtime.gpus import consumer_placements, detect_gpus, engine_groups, gpus_per_engine
from pipeline.wire.errors import SettingsError


@pytest.mark.parametrize("visible, expected", [
    ("0", ["0"]), ("2,3", ["2", "3"]), ("", []), ("-1", []), (" 1 , 0 ", ["1", "0"]),
    ("0,-1,2", ["0"]),  # CUDA stops at the first invalid entry
    ("GPU-8f2a,MIG-1c3d/1/0", ["GPU-8f2a", "MIG-1c3d/1/0"]),
])
def test_cuda_visible_devices_decides(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert detect_gpus() == expected


def fake_smi(tmp_path, monkeypatch, body: str) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.integration
def test_nvidia_smi_lists_the_gpus(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, 'echo "GPU 0: NVIDIA H200 (UUID: GPU-a)"; echo "GPU 1: NVIDIA H200 (UUID: GPU-b)"')
    assert detect_gpus() == ["0", "1"]


@pytest.mark.integration
def test_a_failing_nvidia_smi_means_no_gpu(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, 'echo "NVIDIA-SMI has failed" >&2; exit 9')
    assert detect_gpus() == []


def test_no_nvidia_smi_means_no_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_gpus() == []


@pytest.mark.parametrize("visible, consumers, expected", [
    ("0,1", None, [("gpu0", "0"), ("gpu1", "1")]),
    ("MIG-a/1/0,MIG-b/2/0", None, [("gpu-0", "MIG-a/1/0"), ("gpu-1", "MIG-b/2/0")]),
    ("0,1", 3, [("consumer0", "0"), ("consumer1", "1"), ("consumer2", "0")]),  # spread over the GPUs
    ("", None, [("consumer0", None), ("consumer1", None)]),  # no GPU: two CPU consumers
])
def test_the_launcher_starts_one_consumer_per_gpu_pinned_to_it(tmp_path, monkeypatch, visible, consumers, expected):
    from pipeline.producer.demos import demo_workload
    from pipeline.runtime.launcher import Launcher
    from pipeline.runtime.settings import LaunchSettings

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    settings = LaunchSettings(data_dir=str(tmp_path), consumers=consumers)
    configs = Launcher(settings, demo_workload(10)).consumer_configs()
    assert [(c.name, c.gpu) for c in configs] == expected


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("tensor_parallel", [1, 2, 4])
def test_gpus_cut_into_whole_engines_of_tensor_parallel_size(gpus, tensor_parallel):
    ids = [str(k) for k in range(gpus)]
    if tensor_parallel > gpus:
        with pytest.raises(SettingsError, match=f"an engine of {tensor_parallel} GPUs .* needs {tensor_parallel}"):
            engine_groups(ids, tensor_parallel)
        return
    groups = engine_groups(ids, tensor_parallel)
    assert len(groups) == gpus // tensor_parallel
    assert all(len(group) == tensor_parallel for group in groups)
    assert [gpu for group in groups for gpu in group] == ids  # each GPU in one engine, in order


@pytest.mark.parametrize("gpus, per_engine", [(3, 2), (6, 4), (8, 3), (5, 4)])
def test_a_gpu_count_that_does_not_divide_is_refused(gpus, per_engine):
    with pytest.raises(SettingsError, match=f"{gpus} GPUs .* do not divide into engines of {per_engine}"):
        engine_groups([str(k) for k in range(gpus)], per_engine)


def test_an_engine_takes_tensor_times_pipeline_parallel_gpus():
    assert gpus_per_engine({}) == 1
    assert gpus_per_engine({"tensor_parallel_size": 4}) == 4
    assert gpus_per_engine({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}) == 4


@pytest.mark.parametrize("gpus, per_engine, consumers, expected", [
    (["0", "1", "2", "3"], 2, None, [("gpu0_1", "0,1"), ("gpu2_3", "2,3")]),
    (["0", "1", "2", "3", "4", "5", "6", "7"], 4, None, [("gpu0_1_2_3", "0,1,2,3"), ("gpu4_5_6_7", "4,5,6,7")]),
    (["0", "1", "2", "3"], 2, 3, [("consumer0", "0,1"), ("consumer1", "2,3"), ("consumer2", "0,1")]),  # spread
    (["0", "1", "2", "3"], 4, 1, [("gpu0_1_2_3", "0,1,2,3")]),
    (["GPU-a", "GPU-b"], 2, None, [("gpu-0", "GPU-a,GPU-b")]),
    ([], 4, None, [("consumer0", None), ("consumer1", None)]),  # no GPU: CPU consumers, vLLM's CPU workers
])
def test_each_consumer_is_one_engine_over_its_group(gpus, per_engine, consumers, expected):
    placements = consumer_placements(gpus, per_engine, consumers, 2)
    assert [(p.name, p.gpu) for p in placements] == expected


@pytest.mark.parametrize("visible, tensor_parallel, expected", [
    ("0,1,2,3", 2, [("gpu0_1", "0,1"), ("gpu2_3", "2,3")]),
    ("0,1,2,3,4,5,6,7", 8, [("gpu0_1_2_3_4_5_6_7", "0,1,2,3,4,5,6,7")]),
])
def test_the_launcher_gives_each_consumer_an_engines_gpus(tmp_path, monkeypatch, visible, tensor_parallel, expected):
    from pipeline.producer.demos import demo_workload
    from pipeline.runtime.launcher import Launcher
    from pipeline.runtime.settings import LaunchSettings

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    settings = LaunchSettings(data_dir=str(tmp_path), engine_options={"tensor_parallel_size": tensor_parallel})
    configs = Launcher(settings, demo_workload(10)).consumer_configs()
    assert [(c.name, c.gpu) for c in configs] == expected


@pytest.mark.integration
def test_nvidia_smi_gpus_are_grouped_too(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, "for k in 0 1 2 3; do echo \"GPU $k: NVIDIA H100 (UUID: GPU-$k)\"; done")
    placements = consumer_placements(detect_gpus(), gpus_per_engine({"tensor_parallel_size": 4}), None, 2)
    assert [(p.name, p.gpu) for p in placements] == [("gpu0_1_2_3", "0,1,2,3")]
