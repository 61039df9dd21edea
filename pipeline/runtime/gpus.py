"""Which GPUs this machine has, for one consumer per GPU (SPEC §6)."""

from __future__ import annotations

import os
import shutil
import subprocess

# nvidia-smi answers in well under a second; a wedged driver must not hang the launcher.
NVIDIA_SMI_TIMEOUT_S = 10.0


def detect_gpus() -> list[int]:
    """GPU indices: CUDA_VISIBLE_DEVICES when it is set (an empty value or -1 means none, as
    CUDA reads it), else the GPUs `nvidia-smi -L` lists, else none.

    Example: CUDA_VISIBLE_DEVICES="2,3" -> [2, 3]; unset on a machine without nvidia-smi -> [].
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        if not ids or ids[0] == "-1":
            return []
        return [int(part) for part in ids if part.isdigit()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S,
                                 check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [k for k, line in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]
