"""Where the disk tier keeps its files: one documented directory layout.

    DATA_DIR/
      store.log                              what the store holds (each segment's creation,
                                             seal, deletion or quarantine) and its completions
                                             and commit boundaries (storelog.py); compacted
      store.log.tmp                          through this name (a leftover is an interrupted
                                             compaction)
      segments/                              live segments
        m{model:05d}/                        one directory per model
          s{signature:016x}/                 one per shape: shape purity is in the layout
            l{lane:04d}-{seq:010d}.seg       one file per (lane, segment sequence)
            l....-.........seg.creating      a segment being created (renamed to .seg once its
                                             header is written; recovery removes leftovers)
            l....-.........seg.journal       a segment journal of an earlier release (completions
                                             now go to store.log): recovery refuses a store
                                             holding one beside its segment, and removes one
                                             left without it
      quarantine/                            evidence, never deleted by us (an operator clears it)
        m.../s.../l...-....seg[.N]           a segment moved out of segments/ with the same
                                             relative path: its identity could not be
                                             established, or it was damaged and everything it
                                             could still deliver is done
        m.../s.../l...-....seg.missing       a note (one store log record): recovery found
                                             the segment gone although the store log held it

Every directory is created owner-only (0700). Names sort by model, shape, lane and sequence,
so a listing reads in dispatch order. The name format and its parser are defined once, in
`pipeline.wire.layouts`; anything under segments/ that does not parse is a stray, reported and
counted by recovery and `verify`, never skipped without a word.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pipeline.storage.scan import SegmentKeys
from pipeline.wire.layouts.names import (
    LANE_ID_LIMIT,
    MODEL_ID_LIMIT,
    SEGMENT_JOURNAL_SUFFIX,
    SEGMENTS_DIR,
    parse_model_dir,
    parse_segment_file,
    parse_shape_dir,
    segment_relpath,
)

QUARANTINE_DIR = "quarantine"
# A segment is created under its name plus this suffix and renamed once its header is
# written, so a crash mid-create never leaves a headerless file under a segment name.
CREATING_SUFFIX = ".creating"
# A note in quarantine/ for a segment recovery found missing (one store log record).
MISSING_SUFFIX = ".missing"
# Owner-only directories: SPEC §7, every data directory is created owner-only.
DIRECTORY_MODE = 0o700


@dataclass(frozen=True, slots=True)
class SegmentPath:
    """A segment file's path and the keys its name carries."""

    path: str
    model: int
    signature: int
    lane: int
    segment_seq: int

    @property
    def keys(self) -> SegmentKeys:
        return SegmentKeys(self.model, self.signature, self.lane, self.segment_seq)


@dataclass(frozen=True, slots=True)
class Stray:
    """Something under segments/ that is not named like the layout above: never read, moved
    or deleted, but reported (its entries, if it holds any, are not delivered)."""

    path: str
    reason: str

    def describe(self) -> str:
        return f"{self.path}: stray: {self.reason}"


@dataclass(slots=True)
class StoreListing:
    """One walk of segments/: segments in name order, interrupted creates, segment journals of
    an earlier release (those whose segment is there, and those left without it), strays."""

    segments: list[SegmentPath] = field(default_factory=list)
    creating: list[str] = field(default_factory=list)
    orphan_journals: list[str] = field(default_factory=list)
    old_journals: list[str] = field(default_factory=list)
    strays: list[Stray] = field(default_factory=list)


def segment_path(data_dir: str, model: int, signature: int, lane: int, segment_seq: int) -> str:
    """SegmentNameError for a key past its limit (`pipeline.wire.layouts.segment_relpath`)."""
    return os.path.join(data_dir, SEGMENTS_DIR, segment_relpath(model, signature, lane, segment_seq))


def make_dirs(path: str) -> None:
    """Create `path` and its parents owner-only (an existing directory is left as it is)."""
    os.makedirs(path, mode=DIRECTORY_MODE, exist_ok=True)


def store_dirs(root: str) -> tuple[str, str]:
    """(data directory, its segments directory) for a data directory or its segments/."""
    if os.path.isdir(os.path.join(root, SEGMENTS_DIR)) or os.path.basename(os.path.normpath(root)) != SEGMENTS_DIR:
        return root, os.path.join(root, SEGMENTS_DIR)
    return os.path.dirname(os.path.normpath(root)), root


def quarantine_target(data_dir: str, path: str, suffix: str = "") -> str:
    """Where a segment (or its note) goes in quarantine/: the same relative path, with `.N`
    appended when an earlier file of that name is there (both are kept)."""
    relative = os.path.relpath(path, os.path.join(data_dir, SEGMENTS_DIR)) + suffix
    target = os.path.join(data_dir, QUARANTINE_DIR, relative)
    copies = 0
    while os.path.lexists(target if not copies else f"{target}.{copies}"):
        copies += 1
    return target if not copies else f"{target}.{copies}"


def list_store(root: str) -> StoreListing:
    """Walk segments/ once (OSError if a directory of it cannot be read; none at all is an
    empty store). Symbolic links are strays: the store never follows one."""
    _data_dir, base = store_dirs(root)
    listing = StoreListing()
    if not os.path.lexists(base):
        return listing
    for model_entry in _entries(base):
        model = parse_model_dir(model_entry.name)
        if model is None or not _is_dir(model_entry):
            listing.strays.append(_stray(model_entry, f"not a model directory (m00000 .. m{MODEL_ID_LIMIT - 1})"))
            continue
        for shape_entry in _entries(model_entry.path):
            signature = parse_shape_dir(shape_entry.name)
            if signature is None or not _is_dir(shape_entry):
                listing.strays.append(_stray(shape_entry, "not a shape directory (s + 16 hex digits)"))
                continue
            entries = _entries(shape_entry.path)
            names = {entry.name for entry in entries}
            for entry in entries:
                _classify_file(entry, model, signature, listing, names)
    return listing


def _classify_file(entry: os.DirEntry, model: int, signature: int, listing: StoreListing, names: set[str]) -> None:
    name = entry.name
    if name.endswith(SEGMENT_JOURNAL_SUFFIX) and entry.is_file(follow_symlinks=False) and parse_segment_file(
            name[: -len(SEGMENT_JOURNAL_SUFFIX)]) is not None:
        kept = name[: -len(SEGMENT_JOURNAL_SUFFIX)] in names
        (listing.old_journals if kept else listing.orphan_journals).append(entry.path)
        return
    creating = name.endswith(CREATING_SUFFIX)
    parsed = parse_segment_file(name[: -len(CREATING_SUFFIX)] if creating else name)
    if parsed is None or not entry.is_file(follow_symlinks=False):
        listing.strays.append(_stray(entry, f"not a segment file (l0000 .. l{LANE_ID_LIMIT - 1}-{{seq:010d}}.seg)"))
    elif creating:
        listing.creating.append(entry.path)
    else:
        listing.segments.append(SegmentPath(entry.path, model, signature, *parsed))


def _entries(directory: str) -> list[os.DirEntry]:
    with os.scandir(directory) as found:
        return sorted(found, key=lambda entry: entry.name)


def _is_dir(entry: os.DirEntry) -> bool:
    return entry.is_dir(follow_symlinks=False)


def _stray(entry: os.DirEntry, expected: str) -> Stray:
    if entry.is_symlink():
        return Stray(entry.path, f"a symbolic link ({expected})")
    if entry.is_dir(follow_symlinks=False):
        files = sum(len(names) for _root, _dirs, names in os.walk(entry.path))
        return Stray(entry.path, f"a directory holding {files} files, {expected}")
    return Stray(entry.path, f"a file, {expected}")


def iter_segments(root: str) -> list[SegmentPath]:
    """Every segment file under `root` (a data directory, or its segments/ directly), in
    name order. What does not follow the naming scheme is in `list_store(root).strays`."""
    return list_store(root).segments

