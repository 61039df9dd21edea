"""GPU detection: CUDA_VISIBLE_DEVICES first, then nvidia-smi (a real script on PATH here)."""

from __future__ import annotations

import os
import stat

import pytest

from pipeline.runtime.gpus import detect_gpus


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


def test_nvidia_smi_lists_the_gpus(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, 'echo "GPU 0: NVIDIA H200 (UUID: GPU-a)"; echo "GPU 1: NVIDIA H200 (UUID: GPU-b)"')
    assert detect_gpus() == ["0", "1"]


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
    from pipeline.producer.workload import demo_workload
    from pipeline.runtime.launcher import Launcher
    from pipeline.runtime.settings import LaunchSettings

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    settings = LaunchSettings(data_dir=str(tmp_path), consumers=consumers)
    configs = Launcher(settings, demo_workload(10)).consumer_configs()
    assert [(c.name, c.gpu) for c in configs] == expected
