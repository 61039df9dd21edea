"""GPU detection: CUDA_VISIBLE_DEVICES first, then nvidia-smi (a real script on PATH here)."""

from __future__ import annotations

import os
import stat

import pytest

from pipeline.runtime.gpus import detect_gpus


@pytest.mark.parametrize("visible, expected", [("0", [0]), ("2,3", [2, 3]), ("", []), ("-1", []), (" 1 , 0 ", [1, 0])])
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
    assert detect_gpus() == [0, 1]


def test_a_failing_nvidia_smi_means_no_gpu(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, 'echo "NVIDIA-SMI has failed" >&2; exit 9')
    assert detect_gpus() == []


def test_no_nvidia_smi_means_no_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_gpus() == []
