"""Which GPUs this machine has, and which of them each consumer's engine takes (SPEC §6:
one consumer per engine, an engine being one GPU, or several for tensor or pipeline
parallel).

    placements = consumer_placements(detect_gpus(), gpus_per_engine(options), None, 2)
    [(p.name, p.gpu) for p in placements]   # [("gpu0_1", "0,1"), ("gpu2_3", "2,3")] at TP 2
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.wire.errors import SettingsError

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


# The engine options (vLLM's names) that make one engine span several GPUs: it takes their
# product, tensor parallel within a stage times pipeline stages.
PARALLEL_OPTIONS = ("tensor_parallel_size", "pipeline_parallel_size")


def gpus_per_engine(engine_options: Mapping[str, object]) -> int:
    """How many GPUs one engine takes: tensor_parallel_size x pipeline_parallel_size (1 each
    when not given; the engine's own option check refuses values that are not positive)."""
    count = 1
    for key in PARALLEL_OPTIONS:
        value = engine_options.get(key, 1)
        count *= value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1
    return count


def engine_groups(gpus: Sequence[str], per_engine: int) -> list[tuple[str, ...]]:
    """The GPUs cut into engines of `per_engine` each, in their order (8 GPUs at 4: 0-3 and
    4-7; a group's GPUs are one engine's CUDA_VISIBLE_DEVICES); none without GPUs. A count
    that does not divide is a SettingsError: a GPU left out of every engine would idle all
    run, and the user meant some other split.

    Example: ["0", "1", "2", "3"] at 2 -> [("0", "1"), ("2", "3")]; ["0", "1", "2"] at 2 ->
    SettingsError."""
    if not gpus:
        return []
    assert per_engine >= 1, per_engine
    options = " x ".join(PARALLEL_OPTIONS)
    if len(gpus) < per_engine:
        raise SettingsError(f"an engine of {per_engine} GPUs ({options}) needs {per_engine}, and only "
                            f"{len(gpus)} are visible here ({','.join(gpus)})")
    if len(gpus) % per_engine:
        raise SettingsError(f"{len(gpus)} GPUs ({','.join(gpus)}) do not divide into engines of {per_engine} "
                            f"({options}): give sizes whose product divides {len(gpus)}, or set "
                            f"CUDA_VISIBLE_DEVICES to a multiple of {per_engine} GPUs")
    return [tuple(gpus[k:k + per_engine]) for k in range(0, len(gpus), per_engine)]


@dataclass(slots=True, frozen=True)
class Placement:
    """One consumer's name and its engine's GPUs (a CUDA_VISIBLE_DEVICES value; None on the CPU)."""

    name: str
    gpu: str | None


def consumer_placements(gpus: Sequence[str], per_engine: int, consumers: int | None,
                        cpu_consumers: int) -> list[Placement]:
    """Each consumer's name and GPUs: one consumer per engine group (`engine_groups`), or
    `consumers` of them spread over the groups in turn (several engines to a group, as
    several to a GPU); without GPUs, `consumers` (else `cpu_consumers`) CPU ones. A consumer
    per group is named after its GPUs (gpu0; gpu0_1 for an engine over GPUs 0 and 1), or
    gpu-K where a GPU is named by UUID; otherwise consumerK."""
    groups = engine_groups(gpus, per_engine)
    count = consumers or len(groups) or cpu_consumers
    if not groups:
        return [Placement(f"consumer{k}", None) for k in range(count)]
    placements = []
    for k in range(count):
        group = groups[k % len(groups)]
        if count != len(groups):
            name = f"consumer{k}"
        elif all(gpu.isdigit() for gpu in group):
            name = "gpu" + "_".join(group)
        else:
            name = f"gpu-{k}"
        placements.append(Placement(name, ",".join(group)))
    return placements
