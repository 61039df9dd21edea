"""Which GPUs this machine has, for one consumer per GPU (SPEC §6)."""

from __future__ import annotations

import os
import shutil
import subprocess

# How CUDA_VISIBLE_DEVICES names a device other than by index.
_UUID_PREFIXES = ("GPU-", "MIG-")
# nvidia-smi answers in well under a second; a wedged driver must not hang the launcher.
NVIDIA_SMI_TIMEOUT_S = 10.0


def detect_gpus() -> list[str]:
    """The GPUs a consumer can be pinned to, each as a CUDA_VISIBLE_DEVICES value: the
    entries of CUDA_VISIBLE_DEVICES when it is set (indices, GPU-... or MIG-... UUIDs; an
    empty value or -1 means none, and CUDA ignores everything from an invalid entry on, so
    this does too), else the indices `nvidia-smi -L` lists, else none.

    Example: CUDA_VISIBLE_DEVICES="2,3" -> ["2", "3"]; "MIG-4f1e...,MIG-9a0c..." -> both
    UUIDs; unset on a machine without nvidia-smi -> [].
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = []
        for part in (p.strip() for p in visible.split(",")):
            if not (part.isdigit() or part.startswith(_UUID_PREFIXES)):
                break  # "-1", "", or anything CUDA would not read: no device from here on
            ids.append(part)
        return ids
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S,
                                 check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(k) for k, _ in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]
