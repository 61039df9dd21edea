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

`power` durability fdatasyncs the catalog (and its mirror) before anything that depends on it is
acknowledged: a delete or quarantine record before the unlink or move, creates and seals at
the group commit (`sync`), which comes before any item of the new segment is acknowledged.

Records are written with pwrite into preallocated space (zeros past the last record, like a
segment), so a record write never needs space of its own: `reserve` grows the file ahead, at
segment creation (where DiskFullError is backpressure, as for the segment itself), by enough
for every seal and delete still to come. A torn last record (a crash mid-write) is ignored;
a damaged record before the last is reported. The file is rewritten whole, holding only the
live set (`compact`: temp file, fsync, rename, directory fsync) at recovery and when it
holds more than CATALOG_COMPACT_GROWTH times the live set's records.

Torn sectors. A sector being written when the power goes may read back as garbage, and a
catalog record shares its sector with the synced records before it. So the catalog has a
mirror (segments.catalog.mirror, CATALOG_MIRROR_FILE): the same records at the same
offsets. In `power`, `sync()` fdatasyncs the catalog, then writes the records since the
last sync into the mirror and fdatasyncs it; records go into the catalog only while the
mirror is synced. At every moment one file is whole and holds every record ever synced,
so a power cut costs no synced record: a reading is the union of both files' valid
records, and a bad record is damage only where neither file holds it whole. A pair that
is not whole and identical is rewritten (compacted) when it is opened, before anything is
appended beside the damage. A compaction writes and fsyncs both new files before renaming
either; a crash between the renames leaves two whole files whose union is the live set.
In `process` each record goes into both files at once, with no sync, as before.

NOTE: a mirror, not padding each sync to a fresh 4 KiB sector as the store log does: a catalog
sync is one record or a few (a delete is synced alone), so padding would take a 4 KiB
block per sync and `reserve` a block per record still to come (64 times the reserve: about 800
MB for 100,000 open lanes instead of 12.8); the mirror costs a second fdatasync per
catalog sync (a few per segment's lifetime, none per item) and twice the catalog's space.
No format change: the records and the catalog's layout are those of before, so a data
directory with no mirror opens, and gets one at that open.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import xxhash

from pipeline.broker.storage.replace import preallocate, write_replacements
from pipeline.broker.storage.scan import SegmentKeys
from pipeline.wire import fileops
from pipeline.wire.errors import DiskFullError, DurabilityError, SegmentNameError, StoreReadError
from pipeline.wire.layouts.catalog import (
    CATALOG_CHECKSUM_FROM,
    CATALOG_COUNT_UNKNOWN,
    CATALOG_CREATED,
    CATALOG_DELETED,
    CATALOG_KIND_NAMES,
    CATALOG_MAGIC,
    CATALOG_MIRROR_FILE,
    CATALOG_MISSING,
    CATALOG_QUARANTINED,
    CATALOG_RECORD_DTYPE,
    CATALOG_RECORD_SIZE_BYTES,
    CATALOG_RECORD_STRUCT,
    CATALOG_SEALED,
    CATALOG_VERSION,
)
from pipeline.wire.layouts.names import check_segment_keys

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
    notes: list[str] = field(default_factory=list)  # damage the mirror healed (torn writes)
    highest_seq: int = -1  # the highest segment sequence any record names (-1: none)


def encode_record(kind: int, keys: SegmentKeys, entry_count: int = 0, time_ns: int | None = None) -> bytes:
    """One catalog record, checksummed."""
    body = CATALOG_RECORD_STRUCT.pack(
        CATALOG_MAGIC, CATALOG_VERSION, kind, keys.model, keys.lane, keys.signature, keys.segment_seq,
        entry_count, time.time_ns() if time_ns is None else time_ns, 0,
    )
    checksum = xxhash.xxh3_64_intdigest(body[:CATALOG_CHECKSUM_FROM])
    return body[:CATALOG_CHECKSUM_FROM] + checksum.to_bytes(8, "little")


@dataclass(slots=True)
class _FileSlots:
    """One catalog file decoded slot by slot: its valid records (CATALOG_RECORD_DTYPE, in
    file order) and their slots, the bad slots before the last non-zero one (slot, why),
    the torn tail after the last valid record, and its slots up to the last non-zero one
    (how many records an append goes after)."""

    records: np.ndarray
    valid_slots: np.ndarray
    damaged: list[tuple[int, str]]
    torn: str
    raw: np.ndarray


def _decode_slots(data: bytes, path: str) -> _FileSlots:
    whole = len(data) // CATALOG_RECORD_SIZE_BYTES
    raw = np.frombuffer(data, dtype=np.uint8, count=whole * CATALOG_RECORD_SIZE_BYTES).reshape(whole, CATALOG_RECORD_SIZE_BYTES)
    nonzero = np.flatnonzero(raw.any(axis=1))
    partial = bool(len(data) % CATALOG_RECORD_SIZE_BYTES and any(data[whole * CATALOG_RECORD_SIZE_BYTES:]))
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
            damaged.append((index, f"{path}: offset {index * CATALOG_RECORD_SIZE_BYTES}: catalog record {why}"))
    if partial:
        torn = f"{path}: offset {whole * CATALOG_RECORD_SIZE_BYTES}: a partial last record (a torn append, ignored)"
    slots = np.array(good, dtype=np.int64)
    return _FileSlots(records[slots], slots, damaged, torn, raw[:last + 1])


def decode_records(data: bytes, path: str) -> tuple[np.ndarray, list[str], str]:
    """The valid records of a catalog's bytes (CATALOG_RECORD_DTYPE, in file order), the
    damaged ones before the last non-zero record (named by offset), and the last one if it
    is torn. Zero records past the last non-zero one are preallocated space."""
    slots = _decode_slots(data, path)
    return slots.records, [why for _slot, why in slots.damaged], slots.torn


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


def mirror_path(path: str) -> str:
    """The catalog's mirror beside it (CATALOG_MIRROR_FILE)."""
    return os.path.join(os.path.dirname(path), CATALOG_MIRROR_FILE)


def read_catalog(path: str) -> CatalogReading | None:
    """Replay a catalog and its mirror (None if neither exists): which segments they say
    exist. The records are the union of both files' valid ones; damage is a problem only
    where no file holds the record whole (module docstring)."""
    files = [(where, _read_bytes(where, "segment catalog")) for where in (path, mirror_path(path))]
    decoded = [(where, _decode_slots(data, where)) for where, data in files if data is not None]
    if not decoded:
        return None
    reading = CatalogReading(path)
    reading.damaged, reading.notes = _judge_damage(decoded)
    if len(decoded) == 1:
        lacking = [where for where, data in files if data is None][0]
        reading.notes.append(f"{lacking}: missing; {decoded[0][0]} read alone (the pair is rewritten)")
    reading.torn_last = "; ".join(slots.torn for _where, slots in decoded if slots.torn)
    gone: set[SegmentKeys] = set()
    seen: set[bytes] = set()
    for _where, slots in decoded:
        for record in slots.records:
            if (body := record.tobytes()) not in seen:
                seen.add(body)
                _replay(reading, record, gone, path)
    reading.records = len(seen)
    return reading


def _judge_damage(decoded: list[tuple[str, _FileSlots]]) -> tuple[list[str], list[str]]:
    """(problems, notes). Alone, a file's bad records before its last valid one are problems.
    With its mirror: when either file is whole, it holds every record ever synced (only one
    file is written at a time, the other already synced), so the other's bad records were
    torn writes, healed: notes. Otherwise a bad slot is a problem unless the other file
    holds a valid record at that slot (both write each record at the same offset)."""
    if len(decoded) == 1:
        return [why for _slot, why in decoded[0][1].damaged], []
    (path_a, a), (path_b, b) = decoded
    whole_a, whole_b = not (a.damaged or a.torn), not (b.damaged or b.torn)
    if whole_a or whole_b:
        notes = [f"{where}: {len(s.damaged)} damaged records, every one that was synced held whole by {other} "
                 f"(torn writes, healed: the pair is rewritten)"
                 for where, s, other in ((path_a, a, path_b), (path_b, b, path_a)) if s.damaged]
        return [], notes
    valid_a, valid_b = set(a.valid_slots.tolist()), set(b.valid_slots.tolist())
    bad_a = {slot for slot, _why in a.damaged}
    problems = [why for slot, why in a.damaged if slot not in valid_b]
    problems += [why for slot, why in b.damaged if slot not in valid_a and slot not in bad_a]
    return problems, []


def _replay(reading: CatalogReading, record: np.void, gone: set[SegmentKeys], path: str) -> None:
    """One record into the reading. A deleted or quarantined segment stays gone whatever
    else a file says of it (names are never reused while a record of them exists)."""
    keys, kind = record_keys(record), int(record["kind"])
    try:  # a record whose checksum holds but that no segment file name can carry: named, not kept
        check_segment_keys(keys.model, keys.signature, keys.lane, keys.segment_seq)
    except SegmentNameError as exc:
        reading.damaged.append(f"{path}: a {CATALOG_KIND_NAMES[kind]} record for {keys}: {exc}")
        return
    reading.highest_seq = max(reading.highest_seq, keys.segment_seq)
    if kind in (CATALOG_DELETED, CATALOG_QUARANTINED):
        gone.add(keys)
        reading.live.pop(keys, None)
    elif keys in gone:
        return
    elif kind == CATALOG_CREATED:
        reading.live.setdefault(keys, CatalogEntry(keys))
    elif kind == CATALOG_SEALED:
        reading.live[keys] = CatalogEntry(keys, int(record["entry_count"]))
    else:  # a MISSING record belongs in a note file, never in the catalog
        reading.damaged.append(f"{path}: a {CATALOG_KIND_NAMES[kind]} record for {keys} in the catalog")


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
    """The catalog and its mirror open for writing (see the module docstring).

    Owner: the SegmentStore, in the broker's single dispatch loop; the only writer. Not
    thread-safe. `close()` releases the descriptors; the files are the durable record and stay.
    """

    def __init__(self, path: str, fds: tuple[int, int], durable: bool, used: int, note: str = "") -> None:
        self.path = path
        self.mirror = mirror_path(path)
        self.durable = durable  # `power`: fdatasync before dependents are acknowledged
        self._fd, self._mirror_fd = fds
        self.used = used  # records in each file (the next one goes at this slot)
        self.allocated = min(os.fstat(fd).st_size for fd in fds) // CATALOG_RECORD_SIZE_BYTES
        self._dirty = False
        self._unmirrored = bytearray()  # `power`: records in the catalog, not yet in the mirror
        self._unmirrored_slot = used
        self.opened_note = note  # why the pair was not rewritten at open, for the recovery report

    @classmethod
    def open_existing(cls, path: str, durable: bool) -> SegmentCatalog:
        """Append to the pair as it is (a store used without recovery, and recovery until its
        compaction) when both files are whole and hold the same records; else first rewrite
        both as the live set that their records say (a torn write healed before anything is
        written after it: appending beside a damaged record would let the next torn write
        take the only whole copy). With no room for that, append after the last non-zero
        record of either (named in `opened_note`)."""
        data = [_read_bytes(where, "segment catalog") for where in (path, mirror_path(path))]
        if data[0] is not None and data[1] is not None and data[0].rstrip(b"\0") == data[1].rstrip(b"\0"):
            slots = _decode_slots(data[0], path)
            if not (slots.damaged or slots.torn):
                return cls(path, cls._open_pair(path), durable, int(slots.raw.shape[0]))
        reading = read_catalog(path)
        live = list(reading.live.values()) if reading is not None else []
        try:
            return cls.write_fresh(path, live, durable, CATALOG_CHUNK_RECORDS)
        except DiskFullError as exc:
            used = max(((len(d.rstrip(b"\0")) + CATALOG_RECORD_SIZE_BYTES - 1) // CATALOG_RECORD_SIZE_BYTES
                        for d in data if d is not None), default=0)
            return cls(path, cls._open_pair(path), durable, used, f"not rewritten at open: {exc}")

    @staticmethod
    def _open_pair(path: str) -> tuple[int, int]:
        fd = fileops.open_fd(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            return fd, fileops.open_fd(mirror_path(path), os.O_RDWR | os.O_CREAT, 0o600)
        except BaseException:
            fileops.close_fd(fd)
            raise

    @classmethod
    def write_fresh(cls, path: str, live: list[CatalogEntry], durable: bool, reserve: int) -> SegmentCatalog:
        """Compaction: a new catalog and mirror holding `live` (a created and, if sealed, a
        sealed record each) with room for `reserve` more records, both written and made
        durable before either is renamed over the old pair (then one directory fsync).
        DiskFullError if there is no space for them: the old pair is then untouched and
        still valid. A crash between the renames leaves a new file beside an old one: both
        whole, and their union says what either says."""
        data = bytearray()
        for entry in sorted(live, key=lambda e: (e.keys.model, e.keys.signature, e.keys.lane, e.keys.segment_seq)):
            data += encode_record(CATALOG_CREATED, entry.keys)
            if entry.entry_count is not None:
                data += encode_record(CATALOG_SEALED, entry.keys, entry.entry_count)
        used = len(data) // CATALOG_RECORD_SIZE_BYTES
        chunks = -(-(used + reserve) // CATALOG_CHUNK_RECORDS)
        fds = write_replacements([(path, path + CATALOG_TMP_SUFFIX), (mirror_path(path), mirror_path(path) + CATALOG_TMP_SUFFIX)],
                                 bytes(data), chunks * CATALOG_CHUNK_RECORDS * CATALOG_RECORD_SIZE_BYTES, "segment catalog")
        return cls(path, (fds[0], fds[1]), durable, used)

    def reserve(self, free: int) -> None:
        """Make room for `free` more records now in both files (DiskFullError if the disk has
        none), so that the records still to come (seals, deletes) never need space."""
        if self.used + free > self.allocated:
            for fd, where in ((self._fd, self.path), (self._mirror_fd, self.mirror)):
                _allocate(fd, where, self.used + free)
            self.allocated = min(os.fstat(fd).st_size for fd in (self._fd, self._mirror_fd)) // CATALOG_RECORD_SIZE_BYTES

    def record(self, kind: int, keys: SegmentKeys, entry_count: int = 0) -> None:
        """Write one record into the catalog; in `process` into the mirror too at once, in
        `power` into the mirror at `sync()`, after the catalog's fdatasync. Deletes and
        quarantines are made durable at once in `power` (before the unlink or move they
        announce); creates and seals at `sync()`."""
        if self.used >= self.allocated:
            self.reserve(CATALOG_CHUNK_RECORDS)
        # NOTE: the whole record or an OSError: a short write left unnoticed here would leave a
        # torn record in the middle of the catalog once the next one is written after it.
        body, at = encode_record(kind, keys, entry_count), self.used * CATALOG_RECORD_SIZE_BYTES
        fileops.pwrite_all(self._fd, body, at)
        if self.durable:
            if not self._unmirrored:
                self._unmirrored_slot = self.used
            self._unmirrored += body
        else:
            fileops.pwrite_all(self._mirror_fd, body, at)
        self.used += 1
        self._dirty = self.durable
        if self.durable and kind in (CATALOG_DELETED, CATALOG_QUARANTINED):
            self.sync()

    def sync(self) -> None:
        """`power`: fdatasync the catalog, then write the same records into the mirror and
        fdatasync it (DurabilityError: fatal). Never both files unsynced at once."""
        if self._dirty:
            self._fdatasync(self._fd, self.path)
            fileops.pwrite_all(self._mirror_fd, bytes(self._unmirrored), self._unmirrored_slot * CATALOG_RECORD_SIZE_BYTES)
            self._fdatasync(self._mirror_fd, self.mirror)
            self._unmirrored.clear()
            self._dirty = False

    @staticmethod
    def _fdatasync(fd: int, path: str) -> None:
        try:
            fileops.fdatasync(fd)
        except OSError as exc:
            raise DurabilityError(f"{path}: fdatasync failed ({exc.strerror}, errno {exc.errno}): "
                                  f"the kernel may have dropped the dirty pages, so the broker must stop") from exc

    def wants_compaction(self, live_records: int) -> bool:
        return self.used > max(CATALOG_COMPACT_MIN_RECORDS, CATALOG_COMPACT_GROWTH * live_records)

    def close(self) -> None:
        for fd in (self._fd, self._mirror_fd):
            if fd >= 0:
                fileops.close_fd(fd)
        self._fd = self._mirror_fd = -1


def _allocate(fd: int, path: str, records: int) -> None:
    """Preallocate the file to hold `records` (rounded up to a chunk)."""
    chunks = -(-records // CATALOG_CHUNK_RECORDS)
    preallocate(fd, path, chunks * CATALOG_CHUNK_RECORDS * CATALOG_RECORD_SIZE_BYTES, "segment catalog")
