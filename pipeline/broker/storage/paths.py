"""Where the disk tier keeps its files: one documented directory layout.

    DATA_DIR/
      segments/                              live segments
        m{model:05d}/                        one directory per model
          s{signature:016x}/                 one per shape: shape purity is in the layout
            l{lane:04d}-{seq:010d}.seg       one file per (lane, segment sequence)
            l....-.........seg.creating      a segment being created (renamed to .seg once its
                                             header is written; recovery removes leftovers)
      quarantine/                            segments found corrupt by recovery, moved here
        m.../s.../l...-....seg               with the same relative path, never deleted by us

Every directory is created owner-only (0700). Names sort by model, shape, lane and sequence,
so a listing reads in dispatch order and tools need no index.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from pipeline.layouts import SEGMENTS_DIR, segment_relpath

QUARANTINE_DIR = "quarantine"
# A segment is created under its name plus this suffix and renamed once its header is
# written, so a crash mid-create never leaves a headerless file under a segment name.
CREATING_SUFFIX = ".creating"
# Owner-only directories: SPEC §7, every data directory is created owner-only.
DIRECTORY_MODE = 0o700

_NAME_RE = re.compile(r"^l(\d{4})-(\d{10})\.seg$")
_MODEL_RE = re.compile(r"^m(\d{5})$")
_SHAPE_RE = re.compile(r"^s([0-9a-f]{16})$")


@dataclass(frozen=True, slots=True)
class SegmentPath:
    """A segment file's path and the keys its name carries."""

    path: str
    model: int
    signature: int
    lane: int
    segment_seq: int


def segment_path(data_dir: str, model: int, signature: int, lane: int, segment_seq: int) -> str:
    return os.path.join(data_dir, SEGMENTS_DIR, segment_relpath(model, signature, lane, segment_seq))


def make_dirs(path: str) -> None:
    """Create `path` and its parents owner-only (an existing directory is left as it is)."""
    os.makedirs(path, mode=DIRECTORY_MODE, exist_ok=True)


def iter_segments(root: str) -> Iterator[SegmentPath]:
    """Every segment file under `root` (a data directory, or its segments/ directly), in
    name order. Files that do not follow the naming scheme are skipped: `verify` reports
    them through `stray_files`."""
    base = os.path.join(root, SEGMENTS_DIR) if os.path.isdir(os.path.join(root, SEGMENTS_DIR)) else root
    for model_name in sorted(os.listdir(base)):
        model_match = _MODEL_RE.match(model_name)
        model_dir = os.path.join(base, model_name)
        if not model_match or not os.path.isdir(model_dir):
            continue
        for shape_name in sorted(os.listdir(model_dir)):
            shape_match = _SHAPE_RE.match(shape_name)
            shape_dir = os.path.join(model_dir, shape_name)
            if not shape_match or not os.path.isdir(shape_dir):
                continue
            for file_name in sorted(os.listdir(shape_dir)):
                name_match = _NAME_RE.match(file_name)
                if name_match:
                    yield SegmentPath(
                        os.path.join(shape_dir, file_name), int(model_match.group(1)),
                        int(shape_match.group(1), 16), int(name_match.group(1)), int(name_match.group(2)),
                    )


def abandoned_creates(root: str) -> list[str]:
    """Segments whose creation a crash interrupted (CREATING_SUFFIX): they hold no entry."""
    base = os.path.join(root, SEGMENTS_DIR) if os.path.isdir(os.path.join(root, SEGMENTS_DIR)) else root
    found = []
    for dirpath, _dirnames, filenames in os.walk(base):
        found.extend(os.path.join(dirpath, name) for name in filenames if name.endswith(CREATING_SUFFIX))
    return sorted(found)


def stray_files(root: str) -> list[str]:
    """Files under the segments directory that are not named like segments."""
    base = os.path.join(root, SEGMENTS_DIR) if os.path.isdir(os.path.join(root, SEGMENTS_DIR)) else root
    known = {s.path for s in iter_segments(root)}
    strays = []
    for dirpath, _dirnames, filenames in os.walk(base):
        strays.extend(p for name in filenames if (p := os.path.join(dirpath, name)) not in known)
    return sorted(strays)
