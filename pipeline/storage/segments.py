"""The segment files of one data directory: which segment each lane appends to, a bounded
cache of open files, sealing by size and age, whole-file deletion, the store log, and
recovery.

Segments are keyed by (model, signature, lane) plus a sequence number (layout in
`pipeline.storage.paths`). Each lane appends to one open segment at a time; a segment
seals when it is full or old, and is deleted whole once sealed and fully tombstoned; a
damaged one is never deleted: it is moved to quarantine/ once everything it can still
deliver is done. Every create, seal, delete and quarantine is recorded in the store log
(`storelog.py`), in the order that makes a crash safe, so recovery can tell a segment that
was lost from one that was finished.

Open files are bounded (`open_files_max`): a segment's descriptor and mapping are opened on
demand and the least recently used are closed, so 100,000 lanes across shapes do not exhaust
descriptors (SPEC §5). Closing never loses anything: a closed file's counts and completion
bitmap stay in its SegmentState (`SegmentProgress`), and its records are in the store log
(`storelog.py`), one file for the whole store, which this class owns.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import pipeline.storage.crashpoints as crashpoints
from pipeline.broker.ids import LaneKey, SegmentId
from pipeline.storage.chains import read_lineage, recovered_chains
from pipeline.storage.diskio import NO_SPACE_ERRNOS, Durability, fsync_directory
from pipeline.storage.paths import (
    QUARANTINE_DIR,
    SEGMENTS_DIR,
    SegmentPath,
    make_dirs,
    quarantine_target,
    segment_path,
)
from pipeline.storage.recovery import (  # the reports re-exported: they lived here first
    MissingSegment,
    Quarantined,
    RecoveredSegment,
    RecoveryReport,
    count_files,
    first_damage,
    note_missing,
    read_store,
    refuse_other_layout,
)
from pipeline.storage.scan import census_segment
from pipeline.storage.segment import (
    DEFAULT_SEGMENT_MAX_BYTES,
    EncodedGroup,
    ScanReport,
    SegmentFile,
    SegmentKeys,
    SegmentProgress,
    scan_segment,
    unlink_segment,
)
from pipeline.storage.storelog import (
    LOG_COMPACT_GROWTH,
    LogReading,
    SegmentRecords,
    StoreLog,
    keep_as_evidence,
    log_path,
    read_store_log,
)
from pipeline.wire import fileops
from pipeline.wire.dirpin import DirPin
from pipeline.wire.errors import DiskFullError, SegmentFormatError, StoreReadError
from pipeline.wire.layouts.storelog import LOG_CREATED, LOG_DELETED, LOG_QUARANTINED

__all__ = ["MissingSegment", "Quarantined", "RecoveredSegment", "RecoveryReport", "SegmentState", "SegmentStore"]

# Open segment files kept at once. Each costs two descriptors (the segment and the dup its
# mapping keeps: pipeline/runtime/processes.py's FDS_PER_OPEN_SEGMENT) and a
# mapping; 384 (768 descriptors) covers the lanes a sticky shape drains at a time, and the
# broker sizes it down to what its descriptor limit leaves (processes.open_files_budget).
DEFAULT_OPEN_FILES_MAX = 384
# A segment seals at this age even if not full, so a slow lane's completed work is freed
# (a sealed, fully tombstoned segment is deleted) within minutes, not never.
DEFAULT_SEGMENT_MAX_AGE_S = 300.0


@dataclass(slots=True)
class SegmentState:
    """What the store knows of one segment, open or not. `damage`: why recovery found it
    damaged ("" if it is not): it is quarantined instead of deleted once done."""

    id: SegmentId
    path: str
    lane: LaneKey
    keys: SegmentKeys
    created_s: float
    entry_count: int = 0
    deleted_count: int = 0
    sealed: bool = False
    damage: str = ""
    held: str = ""  # done, but the disk refused its deletion or move: why (tried again at each sync)
    gone_at: int = -1  # `StoreLog.compactions` when its DELETED or QUARANTINED record was written
    # While its file is closed: what reopening it needs. NOTE: reading a closed segment's
    # completions back from the log at its reopen was rejected: with one log for the whole
    # store that is a read of every segment's records for one file.
    progress: SegmentProgress | None = None


class SegmentStore:
    """Every segment of a data directory and its store log.

    Owner: the disk tier, in the broker's single dispatch loop. Not thread-safe. `close()`
    closes every open file and the log; nothing needs unlinking (the files are
    the durable store).
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
        # Checked before a file is made, opened, moved or removed by path (`pipeline.wire.dirpin`).
        self._pin = DirPin.take(data_dir)
        self.segments: dict[SegmentId, SegmentState] = {}
        self._appending: dict[LaneKey, SegmentId] = {}  # each lane's open (unsealed) segment
        # The next segment's sequence, one for the whole store: a name is never reused and a
        # lane's segments sort in creation order. NOTE: a counter per lane was rejected: an
        # entry for every lane ever made outlived it, growing with a job's distinct shapes.
        self._next_seq = 0
        self._open: OrderedDict[SegmentId, SegmentFile] = OrderedDict()  # LRU, newest last
        self._unsynced: set[SegmentId] = set()
        self._log: StoreLog | None = None  # opened by recover() or the first record
        self._completions_held = 0  # completed entries of the live segments: the log's live set
        self._log_compact_floor = 0  # after a compaction that could not be made: not before this size
        self._undeleted: list[SegmentState] = []  # done, its deletion or move refused (`held`): retried at sync
        self._quarantined: list[Quarantined] = []  # moved while running, for the broker's log
        self._notes: list[str] = []  # what went wrong while running and cost nothing, for its log
        self._next_id = 0
        self.files_closed_by_cache = 0

    # ------------------------------------------------------------------ files

    def _file(self, segment: SegmentId) -> SegmentFile:
        """The segment's open file, opening it (and closing the least recently used) if needed."""
        file = self._open.get(segment)
        if file is not None:
            self._open.move_to_end(segment)
            return file
        state = self.segments[segment]
        assert state.progress is not None, state.path  # every segment was open once in this process
        self._pin.check()
        file = SegmentFile.open(state.path, self.durability, self._log_file(), state.progress,
                                self.segment_max_bytes, keys=state.keys)
        state.progress = None
        self._admit(segment, file)
        return file

    def _admit(self, segment: SegmentId, file: SegmentFile) -> None:
        while len(self._open) >= self.open_files_max:
            victim, old = self._open.popitem(last=False)
            if victim in self._unsynced:
                old.sync()
                self._unsynced.discard(victim)
            self.segments[victim].progress = old.progress()
            old.close()
            self.files_closed_by_cache += 1
        self._open[segment] = file

    def _new_segment(self, lane: LaneKey, now_s: float, need_bytes: int = 0) -> SegmentState:
        seq = self._next_seq
        path = segment_path(self.data_dir, lane.model, lane.signature, lane.lane, seq)  # SegmentNameError
        self._pin.check()
        try:
            make_dirs(os.path.dirname(path))
        except OSError as exc:
            if exc.errno in NO_SPACE_ERRNOS:  # no inode or directory block left: backpressure too
                raise DiskFullError(f"{os.path.dirname(path)}: disk full ({exc.strerror}) creating the shape's "
                                    f"directory; appends stop until space comes back, nothing accepted is lost") from exc
            raise
        keys = SegmentKeys(lane.model, lane.signature, lane.lane, seq)
        file = SegmentFile.create(path, keys, self.durability, self._log_file(), self.segment_max_bytes, need_bytes)
        if crashpoints.ARMED:
            crashpoints.hit("create.after_rename")
        try:
            self._log_file().lifecycle(LOG_CREATED, keys)  # after the rename: a crash between is adopted
        except DiskFullError:  # backpressure, as above: the empty file goes, and its number with it
            file.close()
            file.unlink()
            raise
        self._next_seq = seq + 1  # only once it exists: a create the disk refused takes no number
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

    # ----------------------------------------------------------------- log

    def _log_file(self) -> StoreLog:
        """The store log open for appending: a store used without recovery appends to what
        is there (or starts one)."""
        if self._log is None:
            self._log = StoreLog.open(self.data_dir, self._durable)
        return self._log

    @property
    def log(self) -> StoreLog:
        """The store log, for the other records of the store (the shapes' chains)."""
        return self._log_file()

    def _compact_log(self, lineage: np.ndarray | None = None, past_damage: bool = False) -> str:
        """Rewrite the store log as the live segments' records and the LINEAGE bodies
        `lineage` (None: all of them); "" or why not (no room for the new file, damage in
        the old: it stays in use, and is not tried again before it grew by
        LOG_COMPACT_GROWTH)."""
        self._pin.check()
        log = self._log_file()
        why = log.compact(self.data_dir, [s.keys for s in self.segments.values()], lineage, past_damage)
        self._log_compact_floor = log.end * LOG_COMPACT_GROWTH if why else 0
        return why

    @property
    def _durable(self) -> bool:
        return self.durability is Durability.POWER

    def _record_gone(self, kind: int, keys: SegmentKeys, state: SegmentState | None = None) -> None:
        """A DELETED or QUARANTINED record, made durable before the unlink or move it
        announces (so a segment the log names and the disk lacks was lost, never ours):
        once, for a `state` whose unlink or move is tried again, until a compaction
        rewrites it as live (a retry costs no record and no sync)."""
        log = self._log_file()
        if state is not None and state.gone_at == log.compactions:
            return
        log.lifecycle(kind, keys)
        log.sync()
        if state is not None:
            state.gone_at = log.compactions

    # ----------------------------------------------------------------- appends

    def append(self, lane: LaneKey, group: EncodedGroup, now_s: float) -> tuple[SegmentId, int]:
        """Write an encoded group to the lane's open segment (a new one when there is none or
        the group does not fit); return (segment id, byte offset of the group's first entry).
        OSError (ENOSPC among them) propagates with nothing recorded as stored; so does
        SegmentNameError for a lane whose keys do not fit a segment name."""
        segment = self._appending.get(lane)
        file = None if segment is None else self._file(segment)
        if file is None or not file.room_for(group.data.nbytes):
            if segment is not None:
                self.seal(segment)
                if crashpoints.ARMED:
                    crashpoints.hit("rotate.after_seal")
            state = self._new_segment(lane, now_s, group.data.nbytes)
            segment, file = state.id, self._open[state.id]
        offset = file.append(group)
        self.segments[segment].entry_count += group.count
        if file.needs_sync:
            self._unsynced.add(segment)
        return segment, offset

    def sync(self) -> None:
        """`power`: fdatasync every segment that took appends since the last call, then the
        store log (their boundaries, creations, and the completions since the last call: one
        fdatasync for all of them; group commit): before anything of them is acknowledged.
        An error is fatal to the caller: see DurabilityError. Then the deletes a full disk
        held back are tried again."""
        for segment in sorted(self._unsynced):
            self._file(segment).sync()
        self._unsynced.clear()
        if self._log is not None:
            self._log.sync()
            live_bytes = (self._completions_held // 8 + 4 * len(self.segments) + self._log.lineage_records) * 64
            if self._log.wants_compaction(live_bytes) and self._log.end >= self._log_compact_floor:
                why = self._compact_log()
                self._notes += [why] if why else []
        retry, self._undeleted = self._undeleted, []
        for state in retry:
            self._note_moved(self._delete_if_done(state))

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
        self._note_moved(self._delete_if_done(state))

    def seal_aged(self, now_s: float) -> list[SegmentId]:
        """Seal every open segment older than the age limit; return them."""
        aged = [s for s in self._appending.values()
                if now_s - self.segments[s].created_s >= self.segment_max_age_s]
        for segment in aged:
            self.seal(segment)
        return aged

    def tombstone_many(self, segment: SegmentId, offsets: Sequence[int] | np.ndarray) -> int:
        """Complete entries of one segment (log records, `SegmentFile.tombstone_many`);
        return how many were live. The segment is deleted whole (a damaged one: moved to
        quarantine/) when it is sealed and nothing in it is live any more."""
        state = self.segments[segment]
        fresh = self._file(segment).tombstone_many(offsets)
        if fresh:
            state.deleted_count += fresh
            self._completions_held += fresh
            self._note_moved(self._delete_if_done(state))
        return fresh

    def _delete_if_done(self, state: SegmentState, why_done: str = "everything it could deliver is done",
                        at: int = 0) -> Quarantined | None:
        """A sealed segment with nothing live left is deleted whole, a damaged one moved to
        quarantine/ (returned; `at`: its first damage), each once its record is in the log.
        What the disk refuses (no room for the record, a move that fails) leaves it on disk
        and registered, its records kept by every compaction, and is tried again at each
        sync, named once: a completion must not stop the broker."""
        if not (state.sealed and state.deleted_count == state.entry_count) or state.id not in self.segments:
            return None
        file = self._open.pop(state.id, None)
        if file is not None:
            state.progress = file.progress()
            file.close()
        try:
            moved = self._retire(state, why_done, at)
        except (OSError, DiskFullError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            if not state.held:
                undone = "moved to quarantine/" if state.damage else "deleted"
                self._notes.append(f"{state.path}: done, but not {undone} ({why}): it stays, tried again at each "
                                   f"group commit")
            state.held = why
            self._undeleted.append(state)
            return None
        self._completions_held -= state.deleted_count
        del self.segments[state.id]
        return moved

    def _retire(self, state: SegmentState, why_done: str, at: int) -> Quarantined | None:
        if state.damage:
            return self._quarantine(state.path, state.keys, at, f"damaged ({state.damage}); {why_done}", state=state)
        self._pin.check()
        self._record_gone(LOG_DELETED, state.keys, state)  # before the unlink: never a false MISSING
        if crashpoints.ARMED:
            crashpoints.hit("delete.before_unlink")
        try:
            unlink_segment(state.path, self.durability)
        except FileNotFoundError:
            pass  # gone already (someone else's hand): what the record says
        return None

    def _note_moved(self, moved: Quarantined | None) -> None:
        if moved is not None:
            self._quarantined.append(moved)

    def _quarantine(self, path: str, keys: SegmentKeys, offset: int, why: str, entries: int = 0,
                    item_ids: tuple[int, ...] = (), identity_refused: bool = False,
                    state: SegmentState | None = None) -> Quarantined:
        """Move a (closed) segment to quarantine/, the move recorded first; never deleted."""
        self._pin.check()
        self._record_gone(LOG_QUARANTINED, keys, state)
        target = quarantine_target(self.data_dir, path)
        make_dirs(os.path.dirname(target))
        fileops.rename(path, target)  # same file system: the data directory
        if self.durability is Durability.POWER:
            fsync_directory(os.path.dirname(path))
            fsync_directory(os.path.dirname(target))
        return Quarantined(path, offset, why, target, entries, item_ids, identity_refused)

    def keep_damaged(self, segment: SegmentId, why: str) -> None:
        """Damage found in a segment after recovery (a consumer's checks): kept, moved to
        quarantine/ once done, like one recovery found damaged."""
        state = self.segments.get(segment)
        if state is not None and not state.damage:
            state.damage = why
            self._pin.check()
            make_dirs(os.path.dirname(quarantine_target(self.data_dir, state.path)))

    def take_quarantined(self) -> tuple[list[Quarantined], list[str]]:
        """Segments moved to quarantine/ while running since the last call, and notes of what
        went wrong and cost nothing (a compaction of the store log not made): for the
        broker's log."""
        taken, notes, self._quarantined, self._notes = self._quarantined, self._notes, [], []
        return taken, notes

    def drop_lane(self, lane: LaneKey) -> None:
        """The lane's id was released: seal its open segment (a released id may come back as
        a new lane, which starts a new segment)."""
        segment = self._appending.get(lane)
        if segment is not None:
            self.seal(segment)

    def release_below(self, segment: SegmentId, offset: int) -> None:
        """Entries of `segment` below `offset` were dispatched: drop their pages from the
        mapping if the file is open (`SegmentFile.release_below`)."""
        file = self._open.get(segment)
        if file is not None:
            file.release_below(offset)

    def readable_end(self, segment: SegmentId) -> int:
        return self._file(segment).readable_end

    def entry_header_columns(self, segment: SegmentId, offsets: np.ndarray) -> np.ndarray:
        """The live entries at `offsets` of `segment`, as checked columns (see SegmentFile)."""
        return self._file(segment).entry_header_columns(offsets)

    def entry_offsets(self, segment: SegmentId, start: int, end: int, count: int) -> tuple[np.ndarray, int]:
        """The next `count` live entries of `segment` from byte `start` (see SegmentFile)."""
        return self._file(segment).entry_offsets(start, end, count)

    def state_at(self, segment: SegmentId, offset: int) -> int:
        return self._file(segment).state_at(offset)

    def flush_tombstones(self) -> None:
        """`power`: fdatasync the store log's completions since the last sync."""
        if self._log is not None:
            self._log.sync()

    def abandon(self) -> None:
        """Close every descriptor and mapping without syncing or writing anything: the state
        a kill -9 leaves (whatever reached the files stays, nothing in memory is written).
        For crash tests and fault campaigns that reopen the directory in the same process."""
        for file in self._open.values():
            file.close()
        self._open.clear()
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        self.sync()
        self.abandon()  # everything is synced: letting go is all that is left

    # ----------------------------------------------------------------- recovery

    def recover(self) -> RecoveryReport:
        """Scan every segment and salvage what it holds (scan.py); record the scan's boundary;
        delete finished segments and quarantine finished damaged ones; quarantine whole the
        segments whose identity cannot be established; name every stray, every missing
        segment (the log against the disk) and every damaged or lost entry; register the
        rest (in lane and sequence order) for the disk tier to rebuild its queues from; and
        rewrite the log as the live set. StoreReadError if a file cannot be read."""
        started = time.monotonic()
        report = RecoveryReport()
        listing = read_store(self.data_dir, report)
        log_reading = read_store_log(self.data_dir)
        lineage = read_lineage(log_reading)
        if log_reading.damaged or lineage.damaged:  # kept before anything replaces it
            kept = keep_as_evidence(log_path(self.data_dir), os.path.join(self.data_dir, QUARANTINE_DIR))
            report.catalog_notes.append(f"{log_reading.path}: damaged; kept as {kept}")
        report.catalog_found = log_reading.found
        live = log_reading.live()  # before anything this recovery records
        self._log = StoreLog.open(self.data_dir, self._durable, log_reading)
        self._next_seq = max(self._next_seq, log_reading.highest_seq + 1)  # never reuse a name the log holds
        for path in listing.creating + listing.orphan_journals:
            fileops.unlink(path)  # a crash interrupted its creation or deletion: no entry is in it
            report.abandoned_creates.append(path)
        report.strays = listing.strays
        for found in listing.segments:
            self._recover_segment(found, live if log_reading.found else None, log_reading, report)
        report.missing += note_missing(self.data_dir, self._durable, listing, live, bool(log_reading.damaged))
        if not log_reading.found and listing.segments:
            report.catalog_problems.append(
                f"{log_reading.path}: no store log although {len(listing.segments)} segments exist: rebuilt from "
                f"the disk; a segment lost before this start cannot be detected")
        report.catalog_problems += lineage.damaged
        report.chains, kept = recovered_chains(lineage, report.live_shapes())
        self._settle_log(log_reading, report, kept)
        report.quarantine_files = count_files(os.path.join(self.data_dir, QUARANTINE_DIR))
        report.seconds = time.monotonic() - started
        return report

    def _recover_segment(self, found: SegmentPath, live: dict[SegmentKeys, SegmentRecords] | None,
                         log_reading: LogReading, report: RecoveryReport) -> None:
        """`live`: the segments the log says exist (None: there was no log)."""
        report.segments_scanned += 1
        self._next_seq = max(self._next_seq, found.segment_seq + 1)  # whatever becomes of it: on disk
        try:
            scan = scan_segment(found.path, found.keys, name_confirmed=live is not None and found.keys in live,
                                skip_done=True, records=log_reading.of(found.keys))
        except SegmentFormatError as exc:
            refuse_other_layout(found.path)
            self._quarantine_unidentified(found, str(exc), log_reading.of(found.keys), report)
            return
        except OSError as exc:
            raise StoreReadError(f"{found.path}: cannot read the segment ({exc.strerror}, errno {exc.errno})") from exc
        report.bytes_scanned += scan.data_end - scan.walk_start
        report.entries_unread += int(scan.done_offsets.size)
        if live is not None and found.keys not in live:
            report.adopted.append(found.path)
        self._adopt(found, scan, report, log_reading.of(found.keys).gone == LOG_QUARANTINED)

    def _adopt(self, found: SegmentPath, scan: ScanReport, report: RecoveryReport, quarantined: bool) -> None:
        """`quarantined`: the log says it was quarantined (its move was not made): kept as damaged."""
        lane = LaneKey(found.model, found.signature, found.lane)
        report.damaged += scan.damaged
        report.lost += [] if scan.lost is None else [scan.lost]
        report.torn_tails += scan.torn
        report.repaired_states += scan.repaired_states
        if scan.identity_damage:
            report.damaged_identities.append(f"{found.path}: {scan.identity_damage}")
        if not scan.counts_agree:
            report.repaired_counts.append(found.path)
        file = SegmentFile.reopen(scan, self.durability, self._log_file(), self.segment_max_bytes)  # repairs
        # NOTE: recovered segments are sealed rather than appended to: a new run starts new
        # segments, and an old one is deleted as soon as its entries are done.
        if not file.sealed:
            file.seal()
        state = self._register(found.path, lane, scan.keys, 0.0)
        state.entry_count, state.deleted_count, state.sealed = scan.entry_count, scan.tombstone_count, True
        state.damage = (scan.problems()[0] if scan.is_damaged
                        else "recorded as quarantined, its move not made" if quarantined else "")
        if state.damage:
            report.damaged_segments.append(found.path)
            # Its quarantine directory now, while recovery may still fail the start: moving it
            # there once its good entries are done is then a rename, which needs no space.
            make_dirs(os.path.dirname(quarantine_target(self.data_dir, found.path)))
        self._admit(state.id, file)
        self._completions_held += state.deleted_count
        if state.deleted_count == state.entry_count:  # nothing left to deliver
            moved = self._delete_if_done(state, "nothing in it is deliverable", first_damage(scan))
            report.quarantined += [moved] if moved is not None else []
            report.deleted += [found.path] if state.id not in self.segments and not state.damage else []
            report.catalog_notes += [f"{found.path}: done, but kept ({state.held})"] if state.held else []
            return
        report.segments.append(RecoveredSegment(state, scan))
        report.live_entries += scan.live_count

    def _quarantine_unidentified(self, found: SegmentPath, why: str, records: SegmentRecords,
                                 report: RecoveryReport) -> None:
        """Its identity cannot be established: never delivered. Its entries are walked and
        counted (at least what its seal record says) and the file moved to quarantine/."""
        try:
            census = census_segment(found.path)
        except OSError as exc:
            raise StoreReadError(f"{found.path}: cannot read the segment ({exc.strerror}, errno {exc.errno})") from exc
        entries = max(census.entries, records.sealed_count or 0)
        try:
            report.quarantined.append(self._quarantine(found.path, found.keys, 0, why, entries, census.item_ids, True))
        except DiskFullError as exc:  # counted and named all the same; moved at a later start
            report.quarantined.append(Quarantined(found.path, 0, f"{why}; not moved to quarantine/ ({exc}): it "
                                                  f"stays where it is", found.path, entries, census.item_ids, True))

    def _settle_log(self, log_reading: LogReading, report: RecoveryReport, lineage: np.ndarray) -> None:
        """The log's damage reported, and the log rewritten as the live segments' records and
        the `lineage` bodies (a torn tail, damage kept in quarantine/ by `recover`, and the
        records of segments gone with them)."""
        report.catalog_problems += log_reading.damaged
        report.catalog_notes += [log_reading.torn] if log_reading.torn else []
        why = self._compact_log(lineage, past_damage=True)
        if why:
            report.catalog_notes.append(why)


