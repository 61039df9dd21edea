"""A segment's journal: the append-only record of what changes about a segment once its
entries are written (layout SEGMENT_JOURNAL_DTYPE in `pipeline.wire.layouts`).

Segments are written once: a completion is a COMPLETED record here, the commit boundary
(entry_count, data_end) a BOUNDARY record after each group commit, and the seal a SEALED
record. Why: under power loss a sector being written may read back as garbage.
NOTE: in-place writes (a tombstone in the entry's state word, boundary words in the header)
were rejected: they share a sector with acknowledged bytes, and 492 of 1,083 simulated power
cuts with garbled 512-byte sectors lost acknowledged items (docs/history/RELIABILITY-history.md).

Appends never rewrite a sector holding synced records either: in `power`, the first write
after a sync starts at the next SYNC_ALIGN_BYTES boundary (the zeros before it are padding,
which the reader skips). A record that fails its checks is damage when a valid one follows
it, named by path and byte offset; after the last valid one it is a torn append, ignored.

Durability: COMPLETED and SEALED records reach the disk at `sync()` (the group-commit
points): a completion lost to a power cut means a
redelivery, which at-least-once allows. A BOUNDARY record is written after the fdatasync
that made its entries durable and becomes durable with the journal's next sync (see
`pipeline.broker.storage.segment`).

Owner: the SegmentFile of its segment (the broker's disk tier), the only writer; readers
(`read_journal`) are recovery, the tools and consumers. Not thread-safe.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field

import numpy as np

from pipeline.broker.storage.identity import SegmentKeys
from pipeline.broker.storage.replace import write_replacement
from pipeline.wire import fileops
from pipeline.wire.errors import DiskFullError, DurabilityError, StoreReadError
from pipeline.wire.layouts import journal as journal_layout
from pipeline.wire.layouts.journal import (
    JOURNAL_BOUNDARY,
    JOURNAL_COMPLETED,
    JOURNAL_HEAD_WORD_BASE,
    JOURNAL_KIND_NAMES,
    JOURNAL_RECORD_SIZE_BYTES,
    JOURNAL_SEALED,
    SEGMENT_JOURNAL_DTYPE,
    journal_checksums,
)
from pipeline.wire.layouts.names import SEGMENT_JOURNAL_SUFFIX
from pipeline.wire.layouts.segments import SYNC_ALIGN_BYTES

__all__ = ["JournalReading", "SegmentJournal", "journal_path", "journal_seed", "read_journal"]

# Damaged records named one by one in a reading (the count is always whole): a log line,
# not a dump.
DAMAGE_NAMED_MAX = 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# Whether a record's kind (its head word's top 16 bits) is one we write: a table, not np.isin.
_KNOWN_KIND = np.zeros(1 << 16, dtype=bool)
_KNOWN_KIND[list(JOURNAL_KIND_NAMES)] = True


def journal_path(segment_path: str) -> str:
    return segment_path + SEGMENT_JOURNAL_SUFFIX


def journal_seed(keys: SegmentKeys) -> int:
    """The checksum seed of a segment's journal (`pipeline.wire.layouts.journal.journal_seed`)."""
    return journal_layout.journal_seed(keys.model, keys.lane, keys.segment_seq)


def encode_records(kind: int, values: np.ndarray, values2: np.ndarray | int, seed: int) -> np.ndarray:
    """Records of one kind, checksummed, as a SEGMENT_JOURNAL_DTYPE array."""
    count = int(values.shape[0])
    words = np.empty((count, 4), dtype=np.uint64)
    words[:, 0] = JOURNAL_HEAD_WORD_BASE | kind << 48
    words[:, 1] = values
    words[:, 2] = values2
    words[:, 3] = journal_checksums(words, seed)
    return words.view(SEGMENT_JOURNAL_DTYPE).reshape(count)


@dataclass(slots=True)
class JournalReading:
    """A journal read back. `completed`: the offsets completed (sorted, unique). `boundaries`:
    every boundary record's (entry_count, data_end), in file order; `entry_count` and
    `data_end`: the last one's (None if none); `sealed_count`: the seal's
    entry count (None if not sealed). `end`: one past the last valid record (where a writer
    goes on); `damaged` names bad records before the last valid one; `torn` the bad bytes
    after it (a torn append)."""

    path: str
    completed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    boundaries: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    entry_count: int | None = None
    data_end: int | None = None
    sealed_count: int | None = None
    records: int = 0
    end: int = 0
    damaged: list[str] = field(default_factory=list)
    damaged_records: int = 0
    torn: str = ""

    @property
    def sealed(self) -> bool:
        return self.sealed_count is not None


def decode_journal(data: bytes | memoryview, path: str, seed: int) -> JournalReading:
    """Replay a journal's bytes (module docstring): one numpy pass over its records."""
    whole = len(data) // JOURNAL_RECORD_SIZE_BYTES
    words = np.frombuffer(data, dtype="<u8", count=whole * 4).reshape(whole, 4)
    reading = JournalReading(path)
    nonzero = np.flatnonzero(words.any(axis=1))
    if not nonzero.size:
        if len(data) > whole * JOURNAL_RECORD_SIZE_BYTES and any(bytes(data[whole * JOURNAL_RECORD_SIZE_BYTES:])):
            reading.torn = f"{path}: offset {whole * JOURNAL_RECORD_SIZE_BYTES}: a partial record (a torn append, ignored)"
        return reading
    rows = words[nonzero]
    kinds = (rows[:, 0] >> np.uint64(48)).astype(np.int64)
    good = ((rows[:, 0] & np.uint64(0xFFFFFFFFFFFF)) == np.uint64(JOURNAL_HEAD_WORD_BASE)) & _KNOWN_KIND[kinds] \
        & (journal_checksums(rows[:, :3], seed) == rows[:, 3])
    valid = np.flatnonzero(good)
    last = int(valid[-1]) if valid.size else -1
    bad_before = np.flatnonzero(~good[:last + 1]) if last >= 0 else np.zeros(0, dtype=np.int64)
    for index in bad_before[:DAMAGE_NAMED_MAX].tolist():
        reading.damaged.append(f"{path}: offset {int(nonzero[index]) * JOURNAL_RECORD_SIZE_BYTES}: journal record "
                               f"fails its checks (magic, version, kind or checksum)")
    reading.damaged_records = int(bad_before.shape[0])
    if last + 1 < rows.shape[0] or len(data) % JOURNAL_RECORD_SIZE_BYTES:
        first_torn = int(nonzero[last + 1]) * JOURNAL_RECORD_SIZE_BYTES if last + 1 < rows.shape[0] else (
            whole * JOURNAL_RECORD_SIZE_BYTES)
        reading.torn = f"{path}: offset {first_torn}: {len(data) - first_torn} bytes of a torn append, ignored"
    chosen, chosen_kinds = rows[valid], kinds[valid]
    reading.records = int(valid.shape[0])
    reading.end = (int(nonzero[last]) + 1) * JOURNAL_RECORD_SIZE_BYTES if last >= 0 else 0
    # NOTE: a sort and a mask, not np.unique: its hash path took 3.3 ms per 20,000 offsets
    # against 0.13 ms, a quarter of a restart's reading of the store.
    done = np.sort(chosen[chosen_kinds == JOURNAL_COMPLETED, 1].astype(np.int64))
    reading.completed = done[np.concatenate(([True], done[1:] != done[:-1]))] if done.size else done
    boundaries = chosen[chosen_kinds == JOURNAL_BOUNDARY]
    reading.boundaries = boundaries[:, 1:3].astype(np.int64)
    if boundaries.shape[0]:
        reading.entry_count, reading.data_end = int(boundaries[-1, 1]), int(boundaries[-1, 2])
    seals = chosen[chosen_kinds == JOURNAL_SEALED]
    if seals.shape[0]:
        reading.sealed_count = int(seals[-1, 1])
    return reading


def read_journal(segment_path: str, keys: SegmentKeys) -> JournalReading:
    """The journal of the segment at `segment_path` (an empty reading if it has none yet);
    StoreReadError if it cannot be read."""
    path = journal_path(segment_path)
    try:
        with open(path, "rb") as file:
            data = file.read()
    except FileNotFoundError:
        return JournalReading(path)
    except OSError as exc:
        raise StoreReadError(f"{path}: cannot read the segment journal ({exc.strerror}, errno {exc.errno})") from exc
    return decode_journal(data, path, journal_seed(keys))


class SegmentJournal:
    """A segment's journal open for appending (module docstring). `durable`: `power`, where
    each write after a sync starts on a SYNC_ALIGN_BYTES boundary and `sync()` fdatasyncs."""

    def __init__(self, path: str, fd: int, seed: int, durable: bool, end: int) -> None:
        self.path = path
        self.durable = durable
        self._fd = fd
        self._seed = seed
        self.end = end  # one past the last record written
        self._dirty = False
        self._tail_synced = bool(end % SYNC_ALIGN_BYTES)  # the sector at `end` holds synced records

    @classmethod
    def create(cls, segment_path: str, keys: SegmentKeys, durable: bool) -> SegmentJournal:
        """An empty journal (its creation made durable by the segment's directory fsync)."""
        path = journal_path(segment_path)
        fd = cls._open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        return cls(path, fd, journal_seed(keys), durable, 0)

    @classmethod
    def reopen(cls, segment_path: str, keys: SegmentKeys, durable: bool,
               reading: JournalReading | None = None) -> tuple[SegmentJournal, JournalReading]:
        """The journal as it is on disk, for appending after its last valid record. A torn
        append after it is first cut away by writing the valid records into a fresh file
        (temp, fsync, rename, directory fsync): appending after the garbage would make it
        damage in the middle, and writing over it could tear the sector of synced records."""
        reading = reading if reading is not None else read_journal(segment_path, keys)
        path = journal_path(segment_path)
        if reading.torn and os.path.exists(path):
            cls._rewrite(path, reading, journal_seed(keys))
            reading = read_journal(segment_path, keys)
        fd = cls._open(path, os.O_RDWR | os.O_CREAT)
        return cls(path, fd, journal_seed(keys), durable, reading.end), reading

    @staticmethod
    def _open(path: str, flags: int) -> int:
        try:
            return fileops.open_fd(path, flags, 0o600)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise DiskFullError(f"{path}: disk full ({exc.strerror}) creating the segment journal; appends stop "
                                    f"until space comes back, nothing accepted is lost") from exc
            raise

    @staticmethod
    def _rewrite(path: str, reading: JournalReading, seed: int) -> None:
        parts = [encode_records(JOURNAL_COMPLETED, reading.completed.astype(np.uint64), 0, seed)]
        if reading.data_end is not None:
            parts.append(encode_records(JOURNAL_BOUNDARY, np.array([reading.entry_count], dtype=np.uint64),
                                        reading.data_end, seed))
        if reading.sealed_count is not None:
            parts.append(encode_records(JOURNAL_SEALED, np.array([reading.sealed_count], dtype=np.uint64), 0, seed))
        data = np.concatenate(parts).tobytes()
        fd = write_replacement(path, path + ".tmp", data, max(len(data), JOURNAL_RECORD_SIZE_BYTES), "segment journal")
        fileops.close_fd(fd)

    def completed(self, offsets: np.ndarray) -> None:
        self._append(encode_records(JOURNAL_COMPLETED, offsets.astype(np.uint64), 0, self._seed))

    def boundary(self, entry_count: int, data_end: int) -> None:
        self._append(encode_records(JOURNAL_BOUNDARY, np.array([entry_count], dtype=np.uint64), data_end, self._seed))

    def sealed(self, entry_count: int) -> None:
        self._append(encode_records(JOURNAL_SEALED, np.array([entry_count], dtype=np.uint64), 0, self._seed))

    def _append(self, records: np.ndarray) -> None:
        """One pwrite of the records (the whole of it or an OSError: a short write left
        unnoticed would tear a record in the middle once the next is written after it)."""
        at = self.end
        if self.durable and self._tail_synced:
            at = -(-at // SYNC_ALIGN_BYTES) * SYNC_ALIGN_BYTES
        try:
            fileops.pwrite_all(self._fd, records.tobytes(), at)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise DiskFullError(f"{self.path}: disk full ({exc.strerror}) writing {records.nbytes} bytes of the "
                                    f"segment journal at offset {at}") from exc
            raise
        self.end = at + records.nbytes
        self._tail_synced = False
        self._dirty = True

    def sync(self) -> None:
        """`power`: fdatasync what was written since the last call (DurabilityError: fatal)."""
        if self._dirty and self.durable:
            try:
                fileops.fdatasync(self._fd)
            except OSError as exc:
                raise DurabilityError(f"{self.path}: fdatasync failed ({exc.strerror}, errno {exc.errno}): the "
                                      f"kernel may have dropped the dirty pages, so the broker must stop") from exc
            self._tail_synced = bool(self.end % SYNC_ALIGN_BYTES)
        self._dirty = False

    def close(self) -> None:
        if self._fd >= 0:
            fileops.close_fd(self._fd)
            self._fd = -1
