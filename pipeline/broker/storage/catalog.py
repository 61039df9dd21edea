"""The segment catalog (DATA_DIR/segments.catalog): the broker's record of what it stored, so
that a segment file that disappears is noticed (a MISSING segment), never silently forgotten.

One record (CATALOG_RECORD_DTYPE in `pipeline.wire.layouts`) per segment lifecycle event, never
per item: created, sealed (with its entry count), deleted, quarantined. Order against the
files, so that every crash leaves the catalog no more than one step behind in the safe
direction:

    create      recorded after the rename into place: a segment on disk that the catalog
                lacks is adopted by recovery (logged), not an error
    seal        recorded before the header's sealed flag (a crash between: sealed anyway)
    delete      recorded before the unlink; quarantine before the move: so a segment the
                catalog holds and the disk lacks was lost, not deleted by us

`power` durability fdatasyncs the catalog before anything that depends on it is
acknowledged: a delete or quarantine record before the unlink or move, creates and seals at
the group commit (`sync`), which comes before any item of the new segment is acknowledged.

Records are written with pwrite into preallocated space (zeros past the last record, like a
segment), so a record write never needs space of its own: `reserve` grows the file ahead, at
segment creation (where DiskFullError is backpressure, as for the segment itself), by enough
for every seal and delete still to come. A torn last record (a crash mid-write) is ignored;
a damaged record before the last is reported. The file is rewritten whole, holding only the
live set (`compact`: temp file, fsync, rename, directory fsync) at recovery and when it
holds more than CATALOG_COMPACT_GROWTH times the live set's records.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import xxhash

from pipeline.broker.storage.replace import preallocate, write_replacement
from pipeline.broker.storage.scan import SegmentKeys
from pipeline.wire import fileops
from pipeline.wire.errors import DurabilityError, SegmentNameError, StoreReadError
from pipeline.wire.layouts import (
    CATALOG_CHECKSUM_FROM,
    CATALOG_COUNT_UNKNOWN,
    CATALOG_CREATED,
    CATALOG_DELETED,
    CATALOG_KIND_NAMES,
    CATALOG_MAGIC,
    CATALOG_MISSING,
    CATALOG_QUARANTINED,
    CATALOG_RECORD_DTYPE,
    CATALOG_RECORD_SIZE_BYTES,
    CATALOG_RECORD_STRUCT,
    CATALOG_SEALED,
    CATALOG_VERSION,
    check_segment_keys,
)

# Preallocation step of the catalog file: 1,024 records (64 KiB), a few hundred segments'
# lifecycles, so growing it is a per-hundreds-of-segments cost.
CATALOG_CHUNK_RECORDS = 1024
# Below this many records (1 MiB) the catalog is never compacted while the broker runs.
CATALOG_COMPACT_MIN_RECORDS = 16_384
# Compact when the file holds this many times the records of the live set: each compaction
# rewrites the live set once, so its cost per lifecycle event stays O(1).
CATALOG_COMPACT_GROWTH = 4
# Suffix of the compaction's temp file beside the catalog.
CATALOG_TMP_SUFFIX = ".tmp"


@dataclass(slots=True)
class CatalogEntry:
    """A segment the catalog says exists: `entry_count` from its seal record, None while
    it was still open."""

    keys: SegmentKeys
    entry_count: int | None = None


@dataclass(slots=True)
class CatalogReading:
    """A catalog file read back: the live set, and what was wrong with the file."""

    path: str
    live: dict[SegmentKeys, CatalogEntry] = field(default_factory=dict)
    records: int = 0
    damaged: list[str] = field(default_factory=list)  # records before the last that fail checks
    torn_last: str = ""  # the last record failed its checks: a torn append, ignored
    highest_seq: dict[tuple[int, int, int], int] = field(default_factory=dict)  # per (model, signature, lane)


def encode_record(kind: int, keys: SegmentKeys, entry_count: int = 0, time_ns: int | None = None) -> bytes:
    """One catalog record, checksummed."""
    body = CATALOG_RECORD_STRUCT.pack(
        CATALOG_MAGIC, CATALOG_VERSION, kind, keys.model, keys.lane, keys.signature, keys.segment_seq,
        entry_count, time.time_ns() if time_ns is None else time_ns, 0,
    )
    checksum = xxhash.xxh3_64_intdigest(body[:CATALOG_CHECKSUM_FROM])
    return body[:CATALOG_CHECKSUM_FROM] + checksum.to_bytes(8, "little")


def decode_records(data: bytes, path: str) -> tuple[np.ndarray, list[str], str]:
    """The valid records of a catalog's bytes (CATALOG_RECORD_DTYPE, in file order), the
    damaged ones before the last non-zero record (named by offset), and the last one if it
    is torn. Zero records past the last non-zero one are preallocated space."""
    whole = len(data) // CATALOG_RECORD_SIZE_BYTES
    raw = np.frombuffer(data, dtype=np.uint8, count=whole * CATALOG_RECORD_SIZE_BYTES).reshape(whole, CATALOG_RECORD_SIZE_BYTES)
    nonzero = np.flatnonzero(raw.any(axis=1))
    partial = len(data) % CATALOG_RECORD_SIZE_BYTES and any(data[whole * CATALOG_RECORD_SIZE_BYTES:])
    last = int(nonzero[-1]) if nonzero.size else -1
    records = raw.view(CATALOG_RECORD_DTYPE).reshape(-1)
    good, damaged, torn = [], [], ""
    for index in range(last + 1):
        why = _record_problem(records[index], raw[index])
        if not why:
            good.append(index)
        elif index == last and not partial:
            torn = f"{path}: offset {index * CATALOG_RECORD_SIZE_BYTES}: last record {why} (a torn append, ignored)"
        else:
            damaged.append(f"{path}: offset {index * CATALOG_RECORD_SIZE_BYTES}: catalog record {why}")
    if partial:
        torn = f"{path}: offset {whole * CATALOG_RECORD_SIZE_BYTES}: a partial last record (a torn append, ignored)"
    return records[good], damaged, torn


def _record_problem(record: np.void, raw: np.ndarray) -> str:
    if not raw.any():
        return "is zero"
    if xxhash.xxh3_64_intdigest(raw[:CATALOG_CHECKSUM_FROM].tobytes()) != int(record["checksum"]):
        return "fails its checksum"
    if record["magic"] != CATALOG_MAGIC or record["version"] != CATALOG_VERSION:
        return f"has magic {bytes(record['magic'])!r}, version {int(record['version'])}"
    if int(record["kind"]) not in CATALOG_KIND_NAMES:
        return f"has unknown kind {int(record['kind'])}"
    return ""


def record_keys(record: np.void) -> SegmentKeys:
    return SegmentKeys(int(record["model"]), int(record["signature"]), int(record["lane"]), int(record["segment_seq"]))


def _read_bytes(path: str, what: str) -> bytes | None:
    """The file's bytes, None if it does not exist; StoreReadError if it cannot be read."""
    try:
        with open(path, "rb") as file:
            return file.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreReadError(f"{path}: cannot read the {what} ({exc.strerror}, errno {exc.errno})") from exc


def read_catalog(path: str) -> CatalogReading | None:
    """Replay a catalog file (None if there is none): which segments it says exist."""
    data = _read_bytes(path, "segment catalog")
    if data is None:
        return None
    records, damaged, torn = decode_records(data, path)
    reading = CatalogReading(path, records=int(records.shape[0]), damaged=damaged, torn_last=torn)
    for record in records:
        keys, kind = record_keys(record), int(record["kind"])
        try:  # a record whose checksum holds but that no segment file name can carry: named, not kept
            check_segment_keys(keys.model, keys.signature, keys.lane, keys.segment_seq)
        except SegmentNameError as exc:
            reading.damaged.append(f"{path}: a {CATALOG_KIND_NAMES[kind]} record for {keys}: {exc}")
            continue
        lane = (keys.model, keys.signature, keys.lane)
        reading.highest_seq[lane] = max(reading.highest_seq.get(lane, -1), keys.segment_seq)
        if kind == CATALOG_CREATED:
            reading.live.setdefault(keys, CatalogEntry(keys))
        elif kind == CATALOG_SEALED:
            reading.live[keys] = CatalogEntry(keys, int(record["entry_count"]))
        elif kind in (CATALOG_DELETED, CATALOG_QUARANTINED):
            reading.live.pop(keys, None)
        else:  # a MISSING record belongs in a note file, never in the catalog
            reading.damaged.append(f"{path}: a {CATALOG_KIND_NAMES[kind]} record for {keys} in the catalog")
    return reading


@dataclass(frozen=True, slots=True)
class MissingNote:
    """A note in quarantine/ that recovery found a segment missing (`write_missing_note`)."""

    path: str
    keys: SegmentKeys
    entry_count: int | None  # None: unknown, it was still open
    time_ns: int


def write_missing_note(path: str, keys: SegmentKeys, entry_count: int | None, durable: bool) -> None:
    """The evidence of a missing segment, kept until an operator removes it: one MISSING
    record (the catalog's layout) in its own file."""
    count = CATALOG_COUNT_UNKNOWN if entry_count is None else entry_count
    fd = fileops.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        fileops.pwrite_all(fd, encode_record(CATALOG_MISSING, keys, count), 0)
        if durable:
            fileops.fsync(fd)
    finally:
        fileops.close_fd(fd)


def read_missing_note(path: str) -> MissingNote | str:
    """The note, or why it is not one."""
    data = _read_bytes(path, "missing-segment note") or b""
    records, damaged, torn = decode_records(data, path)
    if records.shape[0] != 1 or int(records[0]["kind"]) != CATALOG_MISSING:
        return f"{path}: not a missing-segment note ({'; '.join(damaged) or torn or 'no record'})"
    count = int(records[0]["entry_count"])
    return MissingNote(path, record_keys(records[0]), None if count == CATALOG_COUNT_UNKNOWN else count,
                       int(records[0]["time_ns"]))


class SegmentCatalog:
    """The catalog file open for writing (see the module docstring).

    Owner: the SegmentStore, in the broker's single dispatch loop; the only writer. Not
    thread-safe. `close()` releases the descriptor; the file is the durable record and stays.
    """

    def __init__(self, path: str, fd: int, durable: bool, used: int) -> None:
        self.path = path
        self.durable = durable  # `power`: fdatasync before dependents are acknowledged
        self._fd = fd
        self.used = used  # records in the file (the next one goes at this slot)
        self.allocated = os.fstat(fd).st_size // CATALOG_RECORD_SIZE_BYTES
        self._dirty = False

    @classmethod
    def open_existing(cls, path: str, durable: bool) -> SegmentCatalog:
        """Append to the catalog as it is (a store used without recovery). The next record
        goes after the last valid one: over a torn last record, which would otherwise read
        as damage in the middle of the file."""
        data = _read_bytes(path, "segment catalog") or b""
        whole = len(data) // CATALOG_RECORD_SIZE_BYTES
        raw = np.frombuffer(data, dtype=np.uint8, count=whole * CATALOG_RECORD_SIZE_BYTES).reshape(whole, CATALOG_RECORD_SIZE_BYTES)
        nonzero = np.flatnonzero(raw.any(axis=1))
        used = int(nonzero[-1]) + 1 if nonzero.size else 0
        if used and _record_problem(raw[used - 1].view(CATALOG_RECORD_DTYPE)[0], raw[used - 1]):
            used -= 1
        fd = fileops.open_fd(path, os.O_RDWR | os.O_CREAT, 0o600)
        if len(data) % CATALOG_RECORD_SIZE_BYTES:  # a partial last record: cut it, it was torn
            fileops.ftruncate(fd, whole * CATALOG_RECORD_SIZE_BYTES)
        return cls(path, fd, durable, used)

    @classmethod
    def write_fresh(cls, path: str, live: list[CatalogEntry], durable: bool, reserve: int) -> SegmentCatalog:
        """Compaction: a new catalog holding `live` (a created and, if sealed, a sealed
        record each) with room for `reserve` more records, made durable and renamed over
        the old one (temp file, fsync, rename, directory fsync). DiskFullError if there is
        no space for it: the old catalog is then untouched and still valid."""
        data = bytearray()
        for entry in sorted(live, key=lambda e: (e.keys.model, e.keys.signature, e.keys.lane, e.keys.segment_seq)):
            data += encode_record(CATALOG_CREATED, entry.keys)
            if entry.entry_count is not None:
                data += encode_record(CATALOG_SEALED, entry.keys, entry.entry_count)
        used = len(data) // CATALOG_RECORD_SIZE_BYTES
        chunks = -(-(used + reserve) // CATALOG_CHUNK_RECORDS)
        fd = write_replacement(path, path + CATALOG_TMP_SUFFIX, bytes(data),
                               chunks * CATALOG_CHUNK_RECORDS * CATALOG_RECORD_SIZE_BYTES, "segment catalog")
        return cls(path, fd, durable, used)

    def reserve(self, free: int) -> None:
        """Make room for `free` more records now (DiskFullError if the disk has none), so
        that the records still to come (seals, deletes) never need space."""
        if self.used + free > self.allocated:
            _allocate(self._fd, self.path, self.used + free)
            self.allocated = os.fstat(self._fd).st_size // CATALOG_RECORD_SIZE_BYTES

    def record(self, kind: int, keys: SegmentKeys, entry_count: int = 0) -> None:
        """Write one record. Deletes and quarantines are made durable at once in `power`
        (before the unlink or move they announce); creates and seals at `sync()`."""
        if self.used >= self.allocated:
            self.reserve(CATALOG_CHUNK_RECORDS)
        # NOTE: the whole record or an OSError: a short write left unnoticed here would leave a
        # torn record in the middle of the catalog once the next one is written after it.
        fileops.pwrite_all(self._fd, encode_record(kind, keys, entry_count), self.used * CATALOG_RECORD_SIZE_BYTES)
        self.used += 1
        self._dirty = self.durable
        if self.durable and kind in (CATALOG_DELETED, CATALOG_QUARANTINED):
            self.sync()

    def sync(self) -> None:
        """`power`: fdatasync what was recorded since the last call (DurabilityError: fatal)."""
        if self._dirty:
            try:
                fileops.fdatasync(self._fd)
            except OSError as exc:
                raise DurabilityError(f"{self.path}: fdatasync failed ({exc.strerror}, errno {exc.errno}): "
                                      f"the kernel may have dropped the dirty pages, so the broker must stop") from exc
            self._dirty = False

    def wants_compaction(self, live_records: int) -> bool:
        return self.used > max(CATALOG_COMPACT_MIN_RECORDS, CATALOG_COMPACT_GROWTH * live_records)

    def close(self) -> None:
        if self._fd >= 0:
            fileops.close_fd(self._fd)
            self._fd = -1


def _allocate(fd: int, path: str, records: int) -> None:
    """Preallocate the file to hold `records` (rounded up to a chunk)."""
    chunks = -(-records // CATALOG_CHUNK_RECORDS)
    preallocate(fd, path, chunks * CATALOG_CHUNK_RECORDS * CATALOG_RECORD_SIZE_BYTES, "segment catalog")
