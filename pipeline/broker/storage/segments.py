"""The segment files of one data directory: which segment each lane appends to, a bounded
cache of open files, sealing by size and age, whole-file deletion, and recovery.

Segments are keyed by (model, signature, lane) plus a sequence number (layout in
`pipeline.broker.storage.paths`). Each lane appends to one open segment at a time; a segment
seals when it is full or old, and is deleted whole once sealed and fully tombstoned.

Open files are bounded (`open_files_max`): a segment's descriptor and mapping are opened on
demand and the least recently used are closed, so 100,000 lanes across shapes do not exhaust
descriptors (SPEC §5). Closing never loses anything: counts live in this process's state and
in the segment header, which is written through the mapping before it is closed.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pipeline.broker.ids import LaneKey, SegmentId
from pipeline.broker.storage import crashpoints
from pipeline.broker.storage.paths import (
    QUARANTINE_DIR,
    SEGMENTS_DIR,
    abandoned_creates,
    iter_segments,
    make_dirs,
    segment_path,
)
from pipeline.broker.storage.segment import (
    DEFAULT_SEGMENT_MAX_BYTES,
    Durability,
    EncodedGroup,
    ScanReport,
    SegmentFile,
    SegmentKeys,
    fsync_directory,
    scan_segment,
)
from pipeline.errors import SegmentFormatError

# Open segment files kept at once. Each costs a descriptor and a mapping; 512 stays far
# below the usual 1,024-descriptor soft limit with room for sockets and rings, and covers
# the lanes a sticky shape drains at a time.
DEFAULT_OPEN_FILES_MAX = 512
# A segment seals at this age even if not full, so a slow lane's completed work is freed
# (a sealed, fully tombstoned segment is deleted) within minutes, not never.
DEFAULT_SEGMENT_MAX_AGE_S = 300.0


@dataclass(slots=True)
class SegmentState:
    """What the store knows of one segment, open or not."""

    id: SegmentId
    path: str
    lane: LaneKey
    keys: SegmentKeys
    created_s: float
    entry_count: int = 0
    deleted_count: int = 0
    sealed: bool = False


@dataclass(slots=True)
class RecoveredSegment:
    """One segment as recovery found it: its state and its scan."""

    state: SegmentState
    report: ScanReport


class TornTail(NamedTuple):
    """A crash cut the last write of a segment short: the bytes from `offset` on were
    dropped (zeroed); every whole entry before them was kept."""

    path: str
    offset: int
    bytes_dropped: int


class Quarantined(NamedTuple):
    """A segment recovery refused: damage at `offset` (0: the header) for `reason`; moved
    to `moved_to`, never truncated or deleted by us."""

    path: str
    offset: int
    reason: str
    moved_to: str


@dataclass(slots=True)
class RecoveryReport:
    """What recovery did, for logs and the run report. `segments` are the segments kept
    (with live entries), `deleted` sealed segments found with nothing live, `repaired_counts`
    the segments whose header counts disagreed with their entries (now rewritten)."""

    segments: list[RecoveredSegment] = field(default_factory=list)
    quarantined: list[Quarantined] = field(default_factory=list)
    torn_tails: list[TornTail] = field(default_factory=list)
    repaired_counts: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    abandoned_creates: list[str] = field(default_factory=list)
    segments_scanned: int = 0
    live_entries: int = 0
    bytes_scanned: int = 0
    seconds: float = 0.0

    @property
    def scan_bytes_per_s(self) -> float:
        return self.bytes_scanned / self.seconds if self.seconds > 0 else 0.0

    def release_scans(self) -> None:
        """Drop the kept segments' per-entry arrays (64 bytes per entry) once the disk tier
        has rebuilt its queues from them; the counts above stay."""
        for kept in self.segments:
            kept.report.offsets = kept.report.offsets[:0]
            kept.report.headers = kept.report.headers[:0]

    def summary(self) -> str:
        """One line for the log; problems follow on their own lines."""
        lines = [
            f"recovery: {self.segments_scanned} segments, {self.bytes_scanned:,} bytes scanned in "
            f"{self.seconds:.3f} s ({self.scan_bytes_per_s / 1e6:,.0f} MB/s); {self.live_entries:,} "
            f"live entries in {len(self.segments)} segments; {len(self.deleted)} finished segments "
            f"deleted; {len(self.repaired_counts)} header counts repaired; "
            f"{len(self.abandoned_creates)} interrupted creates removed"
        ]
        lines += [f"torn tail: {t.path}: {t.bytes_dropped} bytes dropped at offset {t.offset}" for t in self.torn_tails]
        lines += [f"QUARANTINED: {q.path}: offset {q.offset}: {q.reason} (moved to {q.moved_to})" for q in self.quarantined]
        return "\n".join(lines)


class SegmentStore:
    """Every segment of a data directory.

    Owner: the disk tier, in the broker's single dispatch loop. Not thread-safe. `close()`
    closes every open file; nothing needs unlinking (the files are the durable store).
    """

    def __init__(
        self,
        data_dir: str,
        durability: Durability = Durability.PROCESS,
        *,
        segment_max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES,
        segment_max_age_s: float = DEFAULT_SEGMENT_MAX_AGE_S,
        open_files_max: int = DEFAULT_OPEN_FILES_MAX,
    ) -> None:
        assert open_files_max >= 1
        self.data_dir = data_dir
        self.durability = durability
        self.segment_max_bytes = segment_max_bytes
        self.segment_max_age_s = segment_max_age_s
        self.open_files_max = open_files_max
        make_dirs(os.path.join(data_dir, SEGMENTS_DIR))
        self.segments: dict[SegmentId, SegmentState] = {}
        self._appending: dict[LaneKey, SegmentId] = {}  # each lane's open (unsealed) segment
        self._next_seq: dict[LaneKey, int] = {}
        self._open: OrderedDict[SegmentId, SegmentFile] = OrderedDict()  # LRU, newest last
        self._unsynced: set[SegmentId] = set()
        self._tombstoned: set[SegmentId] = set()  # `power`: tombstones not yet msync'ed
        self._next_id = 0
        self.files_opened = 0
        self.files_closed_by_cache = 0

    # ------------------------------------------------------------------ files

    def _file(self, segment: SegmentId) -> SegmentFile:
        """The segment's open file, opening it (and closing the least recently used) if needed."""
        file = self._open.get(segment)
        if file is not None:
            self._open.move_to_end(segment)
            return file
        file = SegmentFile.open(self.segments[segment].path, self.durability, self.segment_max_bytes)
        self._admit(segment, file)
        return file

    def _admit(self, segment: SegmentId, file: SegmentFile) -> None:
        while len(self._open) >= self.open_files_max:
            victim, old = self._open.popitem(last=False)
            if victim in self._unsynced:
                old.sync()
                self._unsynced.discard(victim)
            if victim in self._tombstoned:
                old.flush_tombstones()
                self._tombstoned.discard(victim)
            old.close()
            self.files_closed_by_cache += 1
        self._open[segment] = file
        self.files_opened += 1

    def _new_segment(self, lane: LaneKey, now_s: float) -> SegmentState:
        seq = self._next_seq.get(lane, 0)
        self._next_seq[lane] = seq + 1
        path = segment_path(self.data_dir, lane.model, lane.signature, lane.lane, seq)
        make_dirs(os.path.dirname(path))
        keys = SegmentKeys(lane.model, lane.signature, lane.lane, seq)
        file = SegmentFile.create(path, keys, self.durability, self.segment_max_bytes)
        state = self._register(path, lane, keys, now_s)
        self._admit(state.id, file)
        self._appending[lane] = state.id
        return state

    def _register(self, path: str, lane: LaneKey, keys: SegmentKeys, created_s: float) -> SegmentState:
        segment = SegmentId(self._next_id)
        self._next_id += 1
        state = SegmentState(segment, path, lane, keys, created_s)
        self.segments[segment] = state
        return state

    # ----------------------------------------------------------------- appends

    def append(self, lane: LaneKey, group: EncodedGroup, now_s: float) -> tuple[SegmentId, int]:
        """Write an encoded group to the lane's open segment (a new one when there is none or
        the group does not fit); return (segment id, byte offset of the group's first entry).
        OSError (ENOSPC among them) propagates with nothing recorded as stored."""
        segment = self._appending.get(lane)
        file = None if segment is None else self._file(segment)
        if file is None or not file.room_for(group.data.nbytes):
            if segment is not None:
                self.seal(segment)
                if crashpoints.ARMED:
                    crashpoints.hit("rotate.after_seal")
            state = self._new_segment(lane, now_s)
            segment, file = state.id, self._open[state.id]
        offset = file.append(group)
        self.segments[segment].entry_count += group.count
        if file.needs_sync:
            self._unsynced.add(segment)
        return segment, offset

    def sync(self) -> None:
        """`power`: fdatasync every segment that took appends since the last call (group
        commit). An error is fatal to the caller: see DurabilityError."""
        for segment in sorted(self._unsynced):
            self._file(segment).sync()
        self._unsynced.clear()

    @property
    def needs_sync(self) -> bool:
        return bool(self._unsynced)

    # ---------------------------------------------------------------- lifecycle

    def seal(self, segment: SegmentId) -> None:
        state = self.segments[segment]
        if state.sealed:
            return
        if segment in self._unsynced:
            self._file(segment).sync()
            self._unsynced.discard(segment)
        self._file(segment).seal()
        state.sealed = True
        if self._appending.get(state.lane) == segment:
            del self._appending[state.lane]
        self._delete_if_done(state)

    def seal_aged(self, now_s: float) -> list[SegmentId]:
        """Seal every open segment older than the age limit; return them."""
        aged = [s for s in self._appending.values()
                if now_s - self.segments[s].created_s >= self.segment_max_age_s]
        for segment in aged:
            self.seal(segment)
        return aged

    def tombstone(self, segment: SegmentId, offset: int) -> bool:
        """Tombstone one entry (False if it already was); see `tombstone_many`."""
        return self.tombstone_many(segment, (offset,)) == 1

    def tombstone_many(self, segment: SegmentId, offsets) -> int:
        """Tombstone entries of one segment (state words, then its deleted count once);
        return how many were live. The segment is deleted whole when it is sealed and
        nothing in it is live any more."""
        state = self.segments[segment]
        fresh = self._file(segment).tombstone_many(offsets)
        if fresh:
            state.deleted_count += fresh
            if self.durability is Durability.POWER:
                self._tombstoned.add(segment)
            self._delete_if_done(state)
        return fresh

    def _delete_if_done(self, state: SegmentState) -> None:
        if not (state.sealed and state.deleted_count == state.entry_count):
            return
        if crashpoints.ARMED:
            crashpoints.hit("delete.before_unlink")
        file = self._open.pop(state.id, None)
        if file is not None:
            file.close()
        self._tombstoned.discard(state.id)
        os.unlink(state.path)
        if self.durability is Durability.POWER:
            fsync_directory(os.path.dirname(state.path))
        del self.segments[state.id]

    def drop_lane(self, lane: LaneKey) -> None:
        """The lane's id was released: seal its open segment (a released id may come back as
        a new lane, which starts a new segment)."""
        segment = self._appending.get(lane)
        if segment is not None:
            self.seal(segment)

    def readable_end(self, segment: SegmentId) -> int:
        return self._file(segment).readable_end

    def entry_headers(self, segment: SegmentId, offsets: list[int]) -> list[tuple]:
        """The live entries at `offsets` of `segment` (see SegmentFile.entry_headers)."""
        return self._file(segment).entry_headers(offsets)

    def entry_header_columns(self, segment: SegmentId, offsets: np.ndarray) -> np.ndarray:
        """The live entries at `offsets` of `segment`, as columns (see SegmentFile)."""
        return self._file(segment).entry_header_columns(offsets)

    def state_at(self, segment: SegmentId, offset: int) -> int:
        return self._file(segment).state_at(offset)

    def flush_tombstones(self) -> None:
        """`power`: msync the segments that took tombstones since the last call."""
        for segment in sorted(self._tombstoned):
            self._file(segment).flush_tombstones()
        self._tombstoned.clear()

    def close(self) -> None:
        self.sync()
        for file in self._open.values():
            file.close()
        self._open.clear()

    # ----------------------------------------------------------------- recovery

    def recover(self) -> RecoveryReport:
        """Scan every segment: quarantine the corrupt ones, drop torn tails, repair counts,
        delete sealed segments with nothing live, and register the rest (in lane and
        sequence order) for the disk tier to rebuild its queues from."""
        started = time.monotonic()
        report = RecoveryReport()
        for path in abandoned_creates(self.data_dir):
            os.unlink(path)  # a crash interrupted its creation: it holds no entry
            report.abandoned_creates.append(path)
        for found in iter_segments(self.data_dir):
            report.segments_scanned += 1
            try:
                scan = scan_segment(found.path)
            except SegmentFormatError as exc:
                self._quarantine(found.path, report, 0, str(exc))
                continue
            report.bytes_scanned += scan.data_end
            if scan.corrupt_at is not None:
                self._quarantine(found.path, report, scan.corrupt_at, scan.corrupt_reason)
                continue
            self._adopt(found, scan, report)
        report.seconds = time.monotonic() - started
        return report

    def _adopt(self, found, scan: ScanReport, report: RecoveryReport) -> None:
        lane = LaneKey(found.model, found.signature, found.lane)
        if scan.torn_at is not None:
            report.torn_tails.append(TornTail(found.path, scan.torn_at, scan.torn_bytes))
        if not scan.counts_agree:
            report.repaired_counts.append(found.path)
        self._next_seq[lane] = max(self._next_seq.get(lane, 0), found.segment_seq + 1)
        file = SegmentFile.reopen(scan, self.durability, self.segment_max_bytes)  # repairs
        # NOTE: recovered segments are sealed rather than appended to: a new run starts new
        # segments, and an old one is deleted as soon as its entries are done.
        if not file.sealed:
            file.seal()
        state = self._register(found.path, lane, scan.keys, 0.0)
        state.entry_count, state.deleted_count, state.sealed = scan.entry_count, scan.tombstone_count, True
        if state.deleted_count == state.entry_count:
            file.close()
            file.unlink()
            del self.segments[state.id]
            report.deleted.append(found.path)
            return
        self._admit(state.id, file)
        report.segments.append(RecoveredSegment(state, scan))
        report.live_entries += scan.live_count

    def _quarantine(self, path: str, report: RecoveryReport, offset: int, why: str) -> None:
        relative = os.path.relpath(path, os.path.join(self.data_dir, SEGMENTS_DIR))
        target = os.path.join(self.data_dir, QUARANTINE_DIR, relative)
        copies = 0
        while os.path.exists(target if not copies else f"{target}.{copies}"):
            copies += 1  # an earlier run quarantined a file of the same name: keep both
        target = target if not copies else f"{target}.{copies}"
        make_dirs(os.path.dirname(target))
        shutil.move(path, target)
        if self.durability is Durability.POWER:
            fsync_directory(os.path.dirname(path))
            fsync_directory(os.path.dirname(target))
        report.quarantined.append(Quarantined(path, offset, why, target))
