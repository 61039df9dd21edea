"""The store log (DATA_DIR/store.log): the one append-only record of what the store holds and
of what changes about its segments once their entries are written (layout STORE_LOG_DTYPE in
`pipeline.wire.layouts`).

Segments are written once: a completion is a COMPLETED record here (up to eight entries of a
segment each), the commit boundary (entry_count, data_end) a BOUNDARY record after each
group commit, and the seal a SEALED record. Why: under power loss a sector being written may
read back as garbage, so nothing acknowledged is ever rewritten in place.

The log is also the store's catalog, so that a segment file that disappears is noticed (a
MISSING segment), never silently forgotten: each segment's life is a record naming its keys
whole, in the order that leaves every crash no more than one step behind in the safe
direction. CREATED after the rename into place (a segment on disk the log does not name is
adopted by recovery, logged, not an error); DELETED before the unlink and QUARANTINED before
the move, each synced first in `power` (so a segment the log names and the disk lacks was
lost, not deleted by us). Their space: the disk's reserve kept free for results
(`segment.py`), as for every completion.
NOTE: a catalog file beside the log, with a mirror against torn sectors, was rejected: a
second torn-write rule, a second recovery path and two more fdatasyncs per delete.
NOTE: in-place writes (a tombstone in the entry's state word, boundary words in the header)
were rejected: they share a sector with acknowledged bytes, and 492 of 1,083 simulated power
cuts with garbled 512-byte sectors lost acknowledged items (docs/history/RELIABILITY-history.md).
NOTE: a journal file per segment was rejected: a group commit in `power` then fdatasynced
every segment's journal that took completions, where one log takes one fdatasync.

The torn-write rule. Appends never rewrite a sector holding synced records: in `power`, the
first write after a sync starts at the next SYNC_ALIGN_BYTES boundary (the zeros before it
are padding, which the reader skips). Every record carries its sync group's epoch, so a
reader knows which records were synced: those of an epoch before the newest, and those of
epoch 0, which only a compaction writes (the file made durable whole before its rename). A
record that fails its checks among them is damage, named by path and byte offset; one after
the last of them was written since the last sync, where a power cut may leave any sector
garbled, kept or unwritten, each on its own: a torn write, ignored (what it held was never
synced, so at worst a completion is delivered again). Damage cannot be pinned on a segment (its own words
are what failed), so a reading with damage makes every segment's boundary untrusted: their
scans judge every bad byte acknowledged (`scan.py`). A record of another version of the
layout is refused (SegmentFormatError), never taken for garbage.

The one recovery path: `read_store_log` replays the file into what it says of each segment
(`SegmentRecords`, keyed by sequence and keys tag); recovery hands each segment's records to
its scan, and then writes the log afresh holding only the live segments' records (temp
file, fsync, rename, directory fsync), a damaged log first kept in quarantine/ as evidence.
While the broker runs, the log is compacted the same way (read back, replayed, the live set
written) when it holds more than LOG_COMPACT_GROWTH times the live set, so its size follows
the live segments, not the job; never past damage (recovery names and keeps it).

Durability: COMPLETED and SEALED records reach the disk at `sync()` (the group-commit points):
a completion lost to a power cut means a redelivery, which at-least-once allows. A BOUNDARY
record is written after the fdatasync that made its entries durable and becomes durable with
the same group commit's sync of the log.

Owner: the segment store (`segments.py`) of the broker's disk tier, the only writer; its
segment files append records through it. Readers (`read_store_log`) are recovery and the
tools. Not thread-safe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from pipeline.storage.diskio import NO_SPACE_ERRNOS, fdatasync, fsync_directory
from pipeline.storage.identity import SegmentKeys
from pipeline.storage.replace import write_replacement
from pipeline.wire import fileops
from pipeline.wire.errors import DiskFullError, SegmentFormatError, SegmentNameError, StoreReadError
from pipeline.wire.layouts.names import SEGMENT_SEQ_LIMIT, check_segment_keys
from pipeline.wire.layouts.segments import ENTRY_ALIGN_BYTES, SYNC_ALIGN_BYTES
from pipeline.wire.layouts.storelog import (
    COMPLETED_PER_RECORD,
    LOG_BOUNDARY,
    LOG_COMPLETED,
    LOG_CREATED,
    LOG_DELETED,
    LOG_EPOCH_LIMIT,
    LOG_HEAD_WORD_BASE,
    LOG_KIND_NAMES,
    LOG_LINEAGE,
    LOG_QUARANTINED,
    LOG_RECORD_SIZE_BYTES,
    LOG_SEALED,
    LOG_SEGMENT_BYTES_LIMIT,
    LOG_SEQUENCE,
    STORE_LOG_FILE,
    STORE_LOG_VERSION,
    keys_tag,
    log_checksums,
    other_versions,
    record_words,
    valid_rows,
)

__all__ = ["LogKey", "LogReading", "SegmentRecords", "StoreLog", "encode_lifecycle", "keep_as_evidence",
           "lifecycle_keys", "log_key", "log_path", "read_store_log"]

# Damaged records named one by one in a reading (the count is always whole): a log line,
# not a dump.
DAMAGE_NAMED_MAX = 20
# Below this size the log is never compacted while the broker runs (1 MiB: 16,384 records).
LOG_COMPACT_MIN_BYTES = 1 << 20
# Compact when the file holds this many times the live set's bytes: each compaction rewrites
# the live set once, so its cost per record appended stays O(1).
LOG_COMPACT_GROWTH = 4
# Suffix of the compaction's temp file beside the log (a leftover is an interrupted one).
LOG_TMP_SUFFIX = ".tmp"
_SLOT_SHIFT = ENTRY_ALIGN_BYTES.bit_length() - 1
assert 1 << _SLOT_SHIFT == ENTRY_ALIGN_BYTES


def log_path(data_dir: str) -> str:
    return os.path.join(data_dir, STORE_LOG_FILE)


# A segment as the log names it: (segment sequence, keys tag).
LogKey = tuple[int, int]


def log_key(keys: SegmentKeys) -> LogKey:
    return keys.segment_seq, keys_tag(keys.model, keys.signature, keys.lane)


@dataclass(slots=True)
class SegmentRecords:
    """What the log says of one segment. `completed`: the offsets completed (sorted, unique).
    `boundaries`: every boundary record's (entry_count, data_end), in file order;
    `entry_count` and `data_end`: the last one's (None if none); `sealed_count`: the seal's
    entry count (None if not sealed). `keys`: the segment's keys whole, from its life's records
    (None: none of them is in the log). `gone`: LOG_DELETED or LOG_QUARANTINED once either is
    recorded (for good: a name is never reused while a record of it exists), else 0.
    `untrusted`: the log holds damage, which may have been this segment's records (its
    boundary is then not to be relied on)."""

    completed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    boundaries: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    entry_count: int | None = None
    data_end: int | None = None
    sealed_count: int | None = None
    keys: SegmentKeys | None = None
    gone: int = 0
    untrusted: str = ""

    @property
    def sealed(self) -> bool:
        return self.sealed_count is not None


@dataclass(slots=True)
class LogReading:
    """The store log read back: each segment's records by (sequence, keys tag); `end`: one
    past the last valid record (where a writer goes on); `damaged` names bad records before
    the last valid one synced; `torn` the bad bytes after it (a torn write)."""

    path: str
    segments: dict[tuple[int, int], SegmentRecords] = field(default_factory=dict)
    records: int = 0
    end: int = 0
    damaged: list[str] = field(default_factory=list)
    damaged_records: int = 0
    torn: str = ""
    highest_seq: int = -1  # the highest segment sequence a valid record names (-1: none)
    newest_epoch: int = -1  # the highest epoch a valid record carries (-1: none)
    found: bool = False  # the file exists
    # The LINEAGE records' bodies, (n, 4) uint64 in file order: `chains.py` reads them.
    lineage: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), dtype=np.uint64))

    def live(self) -> dict[SegmentKeys, SegmentRecords]:
        """The segments the log says exist: created, and neither deleted nor quarantined."""
        return {r.keys: r for r in self.segments.values() if r.keys is not None and not r.gone}

    def of(self, keys: SegmentKeys) -> SegmentRecords:
        """The segment's records (none known: an empty, trusted reading unless the log is damaged)."""
        found = self.segments.get(log_key(keys))
        if found is None:
            found = SegmentRecords()
        if self.damaged and not found.untrusted:
            found.untrusted = (f"{self.damaged_records} store log records damaged (first: {self.damaged[0]}): "
                               f"every bad byte is judged acknowledged")
        return found


def decode_log(data: bytes | memoryview, path: str) -> LogReading:
    """Replay the log's bytes (module docstring): one numpy pass over its records.
    SegmentFormatError for a record of another version of the layout."""
    words = record_words(data)
    reading = LogReading(path)
    whole_bytes = words.shape[0] * LOG_RECORD_SIZE_BYTES
    nonzero = np.flatnonzero(words.any(axis=1))
    rows = words[nonzero]
    foreign = np.flatnonzero(other_versions(rows))
    if foreign.size:
        at, version = int(nonzero[foreign[0]]) * LOG_RECORD_SIZE_BYTES, int(rows[foreign[0], 0] >> 32) & 0xFFFF
        raise SegmentFormatError(f"{path}: offset {at}: a store log record of version {version}; this broker reads "
                                 f"version {STORE_LOG_VERSION} only: finish this data directory with the release that "
                                 f"wrote it, or move it away")
    good = valid_rows(rows)
    valid = np.flatnonzero(good)
    epochs = (rows[:, 2] >> np.uint64(32)).astype(np.int64)
    reading.newest_epoch = int(epochs[valid].max()) if valid.size else -1
    synced = np.flatnonzero(good & ((epochs < reading.newest_epoch) | (epochs == 0)))
    synced_end = int(synced[-1]) + 1 if synced.size else 0  # rows before it were synced
    bad = np.flatnonzero(~good)
    damaged, torn = bad[bad < synced_end], bad[bad >= synced_end]
    for index in damaged[:DAMAGE_NAMED_MAX].tolist():
        reading.damaged.append(f"{path}: offset {int(nonzero[index]) * LOG_RECORD_SIZE_BYTES}: store log record "
                               f"fails its checks (magic, version, kind or checksum)")
    reading.damaged_records = int(damaged.shape[0])
    partial = len(data) > whole_bytes and any(bytes(data[whole_bytes:]))
    if torn.size or partial:
        first = int(nonzero[torn[0]]) * LOG_RECORD_SIZE_BYTES if torn.size else whole_bytes
        what = [f"{int(torn.shape[0])} records written since the last sync fail their checks"] if torn.size else []
        what += ["a partial record ends the file"] if partial else []
        reading.torn = f"{path}: offset {first}: {' and '.join(what)} (a torn write, ignored)"
    reading.records = int(valid.shape[0])
    reading.end = (int(nonzero[valid[-1]]) + 1) * LOG_RECORD_SIZE_BYTES if valid.size else 0
    _replay(reading, rows[valid])
    return reading


def _segment_runs(seqs: np.ndarray, tags: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, list]:
    """The rows sorted by segment, then by `order` (a stable sort of everything), and each
    segment's run in it as (key, start, end): no Python step per row, none per segment but
    the run's tuple."""
    ranked = np.lexsort((order, tags, seqs))
    if not ranked.size:
        return ranked, []
    s, t = seqs[ranked], tags[ranked]
    starts = np.flatnonzero(np.r_[True, (s[1:] != s[:-1]) | (t[1:] != t[:-1])])
    ends = np.r_[starts[1:], ranked.size]
    return ranked, list(zip(zip(s[starts].tolist(), t[starts].tolist()), starts.tolist(), ends.tolist()))


def _records(segments: dict[LogKey, SegmentRecords], key: LogKey) -> SegmentRecords:
    found = segments.get(key)
    if found is None:
        found = segments[key] = SegmentRecords()
    return found


def _replay(reading: LogReading, rows: np.ndarray) -> None:
    """Each segment's records from the valid rows (file order). A record whose checksum
    holds but whose sequence no segment name can carry is named as damage, and left out."""
    beyond = rows[:, 1] >= np.uint64(SEGMENT_SEQ_LIMIT)
    if beyond.any():
        reading.damaged.append(f"{reading.path}: {int(beyond.sum())} store log records name a segment sequence "
                               f"no segment name can carry (first: {int(rows[beyond][0, 1])})")
        reading.damaged_records += int(beyond.sum())
        rows = rows[~beyond]
    kinds = rows[:, 0] >> np.uint64(48)
    seqs, tags = rows[:, 1].astype(np.int64), (rows[:, 2] & np.uint64(0xFFFFFFFF)).astype(np.int64)
    if rows.shape[0]:
        reading.highest_seq = int(seqs.max())
    segments = reading.segments
    done = np.flatnonzero(kinds == np.uint64(LOG_COMPLETED))
    if done.size:
        slots = np.ascontiguousarray(rows[done, 3:7]).view("<u4").reshape(-1, COMPLETED_PER_RECORD)
        used = slots != 0  # no entry starts at 0
        offsets = slots[used].astype(np.int64) << _SLOT_SHIFT
        counts = used.sum(axis=1)
        owner_seq, owner_tag = np.repeat(seqs[done], counts), np.repeat(tags[done], counts)
        ranked, runs = _segment_runs(owner_seq, owner_tag, offsets)
        ordered = offsets[ranked]  # by segment, then offset
        for key, start, end in runs:
            mine = ordered[start:end]
            keep = np.ones(mine.shape[0], dtype=bool)
            keep[1:] = mine[1:] != mine[:-1]  # a completion recorded twice counts once
            _records(segments, key).completed = mine[keep]
    for kind in (LOG_BOUNDARY, LOG_SEALED):
        picked = np.flatnonzero(kinds == np.uint64(kind))
        ranked, runs = _segment_runs(seqs[picked], tags[picked], picked)
        values = rows[picked[ranked], 3:5].astype(np.int64)  # by segment, then file order
        for key, start, end in runs:
            records = _records(segments, key)
            if kind == LOG_BOUNDARY:
                records.boundaries = values[start:end]
                records.entry_count, records.data_end = int(values[end - 1, 0]), int(values[end - 1, 1])
            else:
                records.sealed_count = int(values[end - 1, 0])
    _replay_lives(reading, rows, kinds)
    reading.lineage = np.ascontiguousarray(rows[kinds == np.uint64(LOG_LINEAGE), 3:7])


def _replay_lives(reading: LogReading, rows: np.ndarray, kinds: np.ndarray) -> None:
    """The life records: each segment's keys, and whether it is gone (a deleted or
    quarantined segment stays gone whatever else the log says of it). A record whose
    checksum holds but whose keys no segment name can carry, or that its tag does not match,
    is named as damage."""
    lives = np.isin(kinds, np.array([LOG_CREATED, LOG_DELETED, LOG_QUARANTINED], dtype=np.uint64))
    for index in np.flatnonzero(lives).tolist():
        keys, kind = lifecycle_keys(rows[index]), int(kinds[index])
        why = "" if log_key(keys)[1] == int(rows[index, 2]) & 0xFFFFFFFF else "its keys do not match its tag"
        try:
            check_segment_keys(keys.model, keys.signature, keys.lane, keys.segment_seq)
        except SegmentNameError as exc:
            why = str(exc)
        if why:
            reading.damaged.append(f"{reading.path}: a {LOG_KIND_NAMES[kind]} record for {keys}: {why}")
            reading.damaged_records += 1
            continue
        records = _records(reading.segments, log_key(keys))
        records.keys = keys
        records.gone = kind if kind != LOG_CREATED else records.gone


def lifecycle_keys(row: np.ndarray) -> SegmentKeys:
    """The keys a life record (CREATED, DELETED, QUARANTINED, MISSING) names whole."""
    word = int(row[3])
    return SegmentKeys(word & 0xFFFFFFFF, int(row[4]), word >> 32, int(row[1]))


def read_store_log(data_dir: str) -> LogReading:
    """The data directory's store log (an empty reading if it has none yet); StoreReadError
    if it cannot be read."""
    path = log_path(data_dir)
    try:
        with open(path, "rb") as file:
            data = file.read()
    except FileNotFoundError:
        return LogReading(path)
    except OSError as exc:
        raise StoreReadError(f"{path}: cannot read the store log ({exc.strerror}, errno {exc.errno})") from exc
    reading = decode_log(data, path)
    reading.found = True
    return reading


def encode_records(kind: int, key: LogKey, bodies: np.ndarray, epoch: int = 0) -> np.ndarray:
    """Records of one kind and segment, checksummed, as an (n, 8) uint64 array: `bodies` an
    (n, 4) uint64 array of their body words."""
    assert 0 <= epoch < LOG_EPOCH_LIMIT, epoch
    count = int(bodies.shape[0])
    words = np.zeros((count, 8), dtype=np.uint64)
    seq, tag = key
    words[:, 0] = LOG_HEAD_WORD_BASE | kind << 48
    words[:, 1] = seq
    words[:, 2] = epoch << 32 | tag
    words[:, 3:7] = bodies
    words[:, 7] = log_checksums(words[:, :7])
    return words


def encode_completed(key: LogKey, offsets: np.ndarray, epoch: int = 0) -> np.ndarray:
    """COMPLETED records naming `offsets` (entry offsets, ENTRY_ALIGN_BYTES-aligned), eight a
    record."""
    offsets = np.asarray(offsets, dtype=np.int64)
    # A segment this large is never made (segments seal at DEFAULT_SEGMENT_MAX_BYTES; one
    # group past it gets a segment of its own, bounded by a ring record): our bug.
    assert not (offsets & (ENTRY_ALIGN_BYTES - 1)).any() and (offsets > 0).all(), offsets
    assert (offsets < LOG_SEGMENT_BYTES_LIMIT).all(), offsets
    full = -(-offsets.shape[0] // COMPLETED_PER_RECORD)
    slots = np.zeros(full * COMPLETED_PER_RECORD, dtype="<u4")
    slots[:offsets.shape[0]] = offsets >> _SLOT_SHIFT
    return encode_records(LOG_COMPLETED, key, slots.view("<u8").reshape(full, 4), epoch)


def encode_lifecycle(kind: int, keys: SegmentKeys, entry_count: int = 0, time_ns: int = 0,
                     epoch: int = 0) -> np.ndarray:
    """One life record (CREATED, DELETED, QUARANTINED, MISSING) naming the segment's keys."""
    body = np.array([[keys.model | keys.lane << 32, keys.signature & 0xFFFFFFFFFFFFFFFF, entry_count, time_ns]],
                    dtype=np.uint64)
    return encode_records(kind, log_key(keys), body, epoch)


def encode_segment(key: LogKey, records: SegmentRecords, keys: SegmentKeys | None, gone: bool) -> np.ndarray:
    """A segment's records written afresh (a compaction): its creation (when its keys are
    known), completions, last boundary, seal, and (`gone`) its deletion or quarantine if
    recorded: never for a segment the store holds live again (a move that failed)."""
    parts = [encode_lifecycle(LOG_CREATED, keys)] if keys is not None else []
    parts.append(encode_completed(key, records.completed))
    if records.data_end is not None:
        # int64 as read back (a forged record may hold any bits): rewritten bit for bit
        words = np.array([[records.entry_count, records.data_end, 0, 0]], dtype=np.int64).view(np.uint64)
        parts.append(encode_records(LOG_BOUNDARY, key, words))
    if records.sealed_count is not None:
        words = np.array([[records.sealed_count, 0, 0, 0]], dtype=np.int64).view(np.uint64)
        parts.append(encode_records(LOG_SEALED, key, words))
    if gone and records.gone and keys is not None:
        parts.append(encode_lifecycle(records.gone, keys))
    return np.concatenate(parts)


class StoreLog:
    """The store log open for appending (module docstring). `durable`: `power`, where each
    write after a sync starts on a SYNC_ALIGN_BYTES boundary and `sync()` fdatasyncs."""

    def __init__(self, path: str, fd: int, durable: bool, end: int, epoch: int, lineage_records: int) -> None:
        self.path = path
        self.durable = durable
        self._fd = fd
        self.end = end  # one past the last record written
        self.epoch = epoch  # the epoch of what is written until the next sync
        self._dirty = False
        self._tail_synced = bool(end % SYNC_ALIGN_BYTES)  # the sector at `end` holds synced records
        self.lineage_records = lineage_records  # LINEAGE records the file holds: a compaction keeps them
        self.compactions = 0  # made by this object: a record written before one may not be in the file

    @classmethod
    def open(cls, data_dir: str, durable: bool, reading: LogReading | None = None) -> StoreLog:
        """The log as it is on disk, for appending after its last valid record (a new one if
        there is none, its name made durable at once in `power`). Torn records are first
        cut away by writing every segment's records into a fresh file: appending after
        garbage would make it damage in the middle, and writing over it could tear the
        sector of synced records."""
        reading = reading if reading is not None else read_store_log(data_dir)
        path = log_path(data_dir)
        existed = os.path.exists(path)
        if reading.torn and existed:
            return cls.write_fresh(data_dir, reading, None, durable)
        fd = cls._open(path, os.O_RDWR | os.O_CREAT)
        if durable and not existed:
            fsync_directory(data_dir)
        return cls(path, fd, durable, reading.end, max(reading.newest_epoch + 1, 1), int(reading.lineage.shape[0]))

    @classmethod
    def write_fresh(cls, data_dir: str, reading: LogReading, live: list[SegmentKeys] | None,
                    durable: bool, lineage: np.ndarray | None = None) -> StoreLog:
        """Replace the log whole with the records `reading` holds of the `live` segments (all
        of them: None) and the LINEAGE bodies `lineage` (all of the reading's: None), as
        epoch 0: temp file, fsync, rename, directory fsync. DiskFullError leaves the old log
        as it was."""
        path = log_path(data_dir)
        named = ([(key, r.keys) for key, r in reading.segments.items()] if live is None
                 else [(log_key(k), k) for k in live])
        empty = SegmentRecords()
        parts = [np.zeros((0, 8), dtype=np.uint64)]
        parts += [encode_segment(key, reading.segments.get(key, empty), keys, live is None) for key, keys in named]
        lineage = reading.lineage if lineage is None else lineage
        parts.append(encode_records(LOG_LINEAGE, (0, 0), lineage))
        if reading.highest_seq >= 0:
            parts.append(encode_records(LOG_SEQUENCE, (reading.highest_seq, 0), np.zeros((1, 4), dtype=np.uint64)))
        data = np.concatenate(parts).tobytes()
        fd = write_replacement(path, path + LOG_TMP_SUFFIX, data, max(len(data), LOG_RECORD_SIZE_BYTES), "store log")
        return cls(path, fd, durable, len(data), 1, int(lineage.shape[0]))

    @staticmethod
    def _open(path: str, flags: int) -> int:
        try:
            return fileops.open_fd(path, flags, 0o600)
        except OSError as exc:
            if exc.errno in NO_SPACE_ERRNOS:
                raise DiskFullError(f"{path}: disk full ({exc.strerror}) creating the store log; appends stop "
                                    f"until space comes back, nothing accepted is lost") from exc
            raise

    def completed(self, key: LogKey, offsets: np.ndarray) -> None:
        self._append(encode_completed(key, offsets, self.epoch))

    def boundary(self, key: LogKey, entry_count: int, data_end: int) -> None:
        self._append(encode_records(LOG_BOUNDARY, key, np.array([[entry_count, data_end, 0, 0]], dtype=np.uint64),
                                    self.epoch))

    def sealed(self, key: LogKey, entry_count: int) -> None:
        self._append(encode_records(LOG_SEALED, key, np.array([[entry_count, 0, 0, 0]], dtype=np.uint64), self.epoch))

    def lineage(self, bodies: np.ndarray) -> None:
        """LINEAGE records of the given (n, 4) uint64 bodies (`chains.py` makes them)."""
        self._append(encode_records(LOG_LINEAGE, (0, 0), bodies, self.epoch))
        self.lineage_records += int(bodies.shape[0])

    def lifecycle(self, kind: int, keys: SegmentKeys) -> None:
        """A segment created, deleted or quarantined; the caller syncs before the unlink or
        move a DELETED or QUARANTINED record announces (module docstring)."""
        assert kind in (LOG_CREATED, LOG_DELETED, LOG_QUARANTINED), kind
        self._append(encode_lifecycle(kind, keys, epoch=self.epoch))

    def _append(self, records: np.ndarray) -> None:
        """One pwrite of the records (the whole of it or an OSError: a short write left
        unnoticed would tear a record in the middle once the next is written after it)."""
        at = self.end
        if self.durable and self._tail_synced:
            at = -(-at // SYNC_ALIGN_BYTES) * SYNC_ALIGN_BYTES
        try:
            fileops.pwrite_all(self._fd, records.tobytes(), at)
        except OSError as exc:
            if exc.errno in NO_SPACE_ERRNOS:
                raise DiskFullError(f"{self.path}: disk full ({exc.strerror}) writing {records.nbytes} bytes of the "
                                    f"store log at offset {at}") from exc
            raise
        self.end = at + records.nbytes
        self._tail_synced = False
        self._dirty = True

    def sync(self) -> None:
        """Close the epoch of what was written since the last call: in `power`, fdatasync it
        first (DurabilityError: fatal)."""
        if not self._dirty:
            return
        if self.durable:
            fdatasync(self._fd, self.path)  # DurabilityError: fatal
            self._tail_synced = bool(self.end % SYNC_ALIGN_BYTES)
        self.epoch += 1
        self._dirty = False

    def wants_compaction(self, live_bytes: int) -> bool:
        return self.end > max(LOG_COMPACT_MIN_BYTES, LOG_COMPACT_GROWTH * live_bytes)

    def compact(self, data_dir: str, live: list[SegmentKeys], lineage: np.ndarray | None = None,
                past_damage: bool = False) -> str:
        """Rewrite the log holding only the `live` segments' records and the LINEAGE bodies
        `lineage` (None: every one the file holds), read back from this file (the one
        recovery path), and go on appending to the new file: the same object, as every
        open segment file appends through it. "" or why not: DiskFullError, or damage in
        the file (left for recovery to name and keep; `past_damage`: recovery, which kept
        it in quarantine/ first), leaves the old file in use."""
        self.sync()
        reading = read_store_log(data_dir)
        if reading.damaged and not past_damage:
            return f"store log not compacted: {reading.damaged_records} records damaged (first: {reading.damaged[0]})"
        try:
            fresh = StoreLog.write_fresh(data_dir, reading, live, self.durable, lineage)
        except DiskFullError as exc:
            return f"store log not compacted: {exc}"
        self.close()
        self.path, self._fd, self.end, self.epoch = fresh.path, fresh._fd, fresh.end, fresh.epoch
        self.lineage_records = fresh.lineage_records
        self.compactions += 1
        self._tail_synced, self._dirty = fresh._tail_synced, False
        fresh._fd = -1
        return ""

    def close(self) -> None:
        if self._fd >= 0:
            fileops.close_fd(self._fd)
            self._fd = -1


def keep_as_evidence(path: str, quarantine_dir: str) -> str:
    """A copy of the log at `path` in `quarantine_dir` (as store.log, or store.log.N beside
    earlier ones), made durable before a compaction replaces it: damage is kept, never
    deleted. The path of the copy.
    NOTE: a hard link was rejected: recovery appends to the log before it compacts it, and
    with no room to compact, the whole broker life would go on into the evidence."""
    os.makedirs(quarantine_dir, mode=0o700, exist_ok=True)
    target, copies = os.path.join(quarantine_dir, STORE_LOG_FILE), 0
    while os.path.lexists(target if not copies else f"{target}.{copies}"):
        copies += 1
    target = target if not copies else f"{target}.{copies}"
    with open(path, "rb") as file:
        data = file.read()
    fd = fileops.open_fd(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fileops.pwrite_all(fd, data, 0)
        fileops.fsync(fd)
    finally:
        fileops.close_fd(fd)
    fsync_directory(quarantine_dir)
    return target
