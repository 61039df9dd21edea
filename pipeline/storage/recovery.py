"""What a disk-tier recovery found and did: the one report the broker's log, status and run
report read (`DiskTier.recovery`, kept after the scans' per-entry arrays are released).

    report = tier.recovery
    for line in report.summary().splitlines(): log(line)   # every problem on its own line,
                                                            # path, offset and item id named
    report.damage_counts()   # {"entries_damaged": 1, "entries_missing": 0, ...}: stable keys
    report.ok                # nothing damaged, lost, missing, quarantined, stray; store log sound

Named lists, one record per thing found (each with `describe()`, the line the summary logs):

    damaged          DamagedRange: acknowledged entries damaged in a live segment (path,
                     offset, end, item ids read from unverified headers); the segment's
                     good entries are still delivered
    lost             LostEntries: entries lost to truncation (path, missing byte range)
    missing          MissingSegment: the store log holds it, the disk does not
    quarantined      Quarantined: moved to quarantine/ (identity not established: its
                     entries are undeliverable; or damaged and done)
    strays           paths.Stray: under segments/ and not named like a segment
    torn_tails       TornRange: an unacknowledged write's leftovers (not a loss)
    repaired_states  RepairedState: a state word rewritten live (delivered again)
    damaged_identities  segments salvaged under their file name's keys
    catalog_problems / catalog_notes   the store log's damage / benign findings (the log is
                     the store's catalog: what it holds; a damaged LINEAGE record loses a
                     chain level, its shapes' order after the restart, no item)
    chains           the live shapes' chains the store log gave back (`chains.py`)

Owner: whoever holds the DiskTier; a plain record, not thread-safe.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from pipeline.broker.ids import ShapeKey
from pipeline.storage.diskio import fsync_directory
from pipeline.storage.identity import foreign_version
from pipeline.storage.paths import (
    MISSING_SUFFIX,
    StoreListing,
    Stray,
    list_store,
    make_dirs,
    quarantine_target,
    segment_path,
)
from pipeline.storage.scan import SegmentKeys
from pipeline.storage.scan_report import DamagedRange, LostEntries, RepairedState, ScanReport, TornRange
from pipeline.storage.storelog import (
    LOG_TMP_SUFFIX,
    SegmentRecords,
    encode_lifecycle,
    lifecycle_keys,
    log_path,
)
from pipeline.wire import fileops
from pipeline.wire.errors import SegmentFormatError, StoreReadError
from pipeline.wire.layouts.segments import ENTRY_LIVE, SEGMENT_HEADER_SIZE_BYTES, SEGMENT_VERSION
from pipeline.wire.layouts.storelog import (
    LOG_COUNT_UNKNOWN,
    LOG_MISSING,
    LOG_RECORD_SIZE_BYTES,
    STORE_LOG_FILE,
    record_words,
    valid_rows,
)
from pipeline.wire.shapes import POOL_SIGNATURE
from pipeline.wire.status import DAMAGE_KEYS, REPAIR_KEYS

# Side files whose records the store log holds since its version 2: a store that has them is
# refused (`refuse_earlier_releases`), never migrated.
EARLIER_RELEASE_FILES = {"segments.catalog": "segment catalog", "segments.catalog.mirror": "segment catalog",
                         "shapes.lineage": "lineage file"}


@dataclass(slots=True)
class RecoveredSegment:
    """One segment as recovery kept it: its state (segments.SegmentState) and its scan."""

    state: object
    report: ScanReport


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A segment moved to quarantine/ (never truncated or deleted by us). `offset`: where the
    damage is (0: the header). `entries`: entries found in it that nothing else counts
    (walked without the header, for a segment whose identity cannot be established;
    `item_ids` name them); 0 for a damaged segment whose damage is counted in `damaged`."""

    path: str
    offset: int
    reason: str
    moved_to: str
    entries: int = 0
    item_ids: tuple[int, ...] = ()
    identity_refused: bool = False  # True: quarantined whole, its keys not established

    def describe(self) -> str:
        held = f"; {self.entries} entries in it are not delivered" if self.entries else ""
        ids = f" (items {', '.join(map(str, self.item_ids[:5]))}{' ...' if len(self.item_ids) > 5 else ''})" \
            if self.item_ids else ""
        return f"{self.path}: offset {self.offset}: {self.reason} (moved to {self.moved_to}){held}{ids}"


@dataclass(frozen=True, slots=True)
class MissingSegment:
    """A segment the store log says exists and the disk does not have: lost. `entry_count`
    from its seal record, None when it was still open (unknown). `note`: the evidence left
    in quarantine/ so that `verify` keeps saying so until an operator removes it.
    `log_damaged`: the log held damage, which may have been this segment's DELETED record."""

    path: str
    keys: SegmentKeys
    entry_count: int | None
    note: str
    log_damaged: bool = False

    def describe(self) -> str:
        count = (f"{self.entry_count} entries (its seal record)" if self.entry_count is not None
                 else "entry count unknown, it was still open")
        maybe = "; the store log is damaged, and its DELETED record may be among the damage" if self.log_damaged else ""
        return (f"{self.path}: the store log holds this segment, the disk does not: {count} (noted in "
                f"{self.note}){maybe}")


@dataclass(slots=True)
class RecoveryReport:
    """What recovery did (module docstring). `segments` are the segments kept (with live
    entries); `deleted` sealed segments found with nothing live; `repaired_counts` segments
    whose logged boundary disagreed with their entries (the scan's now recorded);
    `adopted` segments on disk the store log did not name (a crash between a create and its
    record)."""

    segments: list[RecoveredSegment] = field(default_factory=list)
    damaged: list[DamagedRange] = field(default_factory=list)
    lost: list[LostEntries] = field(default_factory=list)
    missing: list[MissingSegment] = field(default_factory=list)
    quarantined: list[Quarantined] = field(default_factory=list)
    strays: list[Stray] = field(default_factory=list)
    torn_tails: list[TornRange] = field(default_factory=list)
    repaired_states: list[RepairedState] = field(default_factory=list)
    damaged_identities: list[str] = field(default_factory=list)
    damaged_segments: list[str] = field(default_factory=list)
    catalog_problems: list[str] = field(default_factory=list)
    catalog_notes: list[str] = field(default_factory=list)
    chains: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (model, chain), deepest last
    catalog_found: bool = False  # a store log was there to read (else it was made afresh)
    quarantine_files: int = 0  # files in quarantine/ after recovery, earlier ones included
    repaired_counts: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    abandoned_creates: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    segments_scanned: int = 0
    live_entries: int = 0
    bytes_scanned: int = 0
    entries_unread: int = 0  # answered entries a segment starts with, known from the store log (scan.py)
    seconds: float = 0.0

    @property
    def lineage_chains(self) -> int:
        return len(self.chains)

    def live_shapes(self) -> set[ShapeKey]:
        """The shapes whose items recovery kept: a segment's, or in a pool segment (signature
        POOL_SIGNATURE) each live entry's own. Before `release_scans`."""
        live: set[ShapeKey] = set()
        for kept in self.segments:
            lane = kept.state.lane
            if lane.signature != POOL_SIGNATURE:
                live.add(lane.shape)
                continue
            headers = kept.report.headers
            shapes = np.unique(headers["signature"][headers["state"] == ENTRY_LIVE]).tolist()
            live.update(ShapeKey(lane.model, signature) for signature in shapes)
        return live

    @property
    def scan_bytes_per_s(self) -> float:
        return self.bytes_scanned / self.seconds if self.seconds > 0 else 0.0

    def release_scans(self) -> None:
        """Drop the kept segments' per-entry arrays (64 bytes per entry) once the disk tier
        has rebuilt its queues from them; the counts and named lists stay."""
        for kept in self.segments:
            # Copies, not `[:0]` views: a view keeps its whole base array alive (a restart
            # with 1,000,000 queued entries held 61 MiB of headers that way).
            kept.report.offsets = kept.report.offsets[:0].copy()
            kept.report.headers = kept.report.headers[:0].copy()
            kept.report.done_offsets = kept.report.done_offsets[:0].copy()

    def damage_counts(self) -> dict[str, int]:
        """Counts with stable keys, in DAMAGE_KEYS' order, for status and the run report."""
        counts = {
            "entries_damaged": sum(r.entries for r in self.damaged),
            "entries_missing": sum(r.entries for r in self.lost)
            + sum(m.entry_count or 0 for m in self.missing),
            "entries_quarantined": sum(q.entries for q in self.quarantined),
            "segments_damaged": len(self.damaged_segments),
            "segments_missing": len(self.missing),
            "segments_missing_count_unknown": sum(m.entry_count is None for m in self.missing),
            "segments_quarantined": len(self.quarantined),
            "strays": len(self.strays),
            "catalog_problems": len(self.catalog_problems),
            "torn_tails": len(self.torn_tails),
            "entries_in_torn_tails": sum(t.entries for t in self.torn_tails),
            "state_words_repaired": len(self.repaired_states),
            "quarantine_files": self.quarantine_files,
        }
        assert set(counts) == set(DAMAGE_KEYS), set(counts) ^ set(DAMAGE_KEYS)
        return {key: counts[key] for key in DAMAGE_KEYS}

    @property
    def ok(self) -> bool:
        """Nothing that was acknowledged is damaged, lost, missing or quarantined, nothing is
        stray, and the store log could vouch for the store."""
        return not any(n for key, n in self.damage_counts().items() if key not in REPAIR_KEYS)

    def problems(self) -> list[str]:
        """One line per problem, naming path, offset and item id when known."""
        return [
            *(f"DAMAGED: {r.describe()}" for r in self.damaged),
            *(f"LOST: {r.describe()}" for r in self.lost),
            *(f"MISSING: {m.describe()}" for m in self.missing),
            *(f"QUARANTINED: {q.describe()}" for q in self.quarantined),
            *(f"STRAY: {s.describe()}" for s in self.strays),
            *(f"DAMAGED HEADER: {line}" for line in self.damaged_identities),
            *(f"STORE LOG: {line}" for line in self.catalog_problems),
        ]

    def summary(self) -> str:
        """One line for the log, then every problem and every repair on its own line."""
        counts = self.damage_counts()
        lost = counts["entries_damaged"] + counts["entries_missing"] + counts["entries_quarantined"]
        lines = [
            f"recovery: {self.segments_scanned} segments, {self.bytes_scanned:,} bytes scanned in "
            f"{self.seconds:.3f} s ({self.scan_bytes_per_s / 1e6:,.0f} MB/s; {self.entries_unread:,} answered "
            f"entries known from the store log, not read); {self.live_entries:,} "
            f"live entries in {len(self.segments)} segments; {len(self.deleted)} finished segments "
            f"deleted; {len(self.repaired_counts)} header counts repaired; "
            f"{len(self.abandoned_creates)} interrupted creates removed; {len(self.adopted)} segments "
            f"adopted (not in the store log); {self.lineage_chains} shapes' chains restored; "
            + ("no damage" if self.ok else f"DAMAGE: {lost:,} entries cannot be delivered"
               + (" (and more, in missing segments whose size is unknown)"
                  if counts["segments_missing_count_unknown"] else "") + ", "
               + ", ".join(f"{key} {n}" for key, n in counts.items() if n))
        ]
        lines += self.problems()
        lines += [f"state word repaired: {r.describe()}" for r in self.repaired_states]
        lines += [f"torn tail: {t.describe()}" for t in self.torn_tails]
        lines += [f"store log: {line}" for line in self.catalog_notes]
        return "\n".join(lines)


def refuse_other_layout(path: str) -> None:
    """SegmentFormatError, stopping recovery, for a whole segment of another layout version:
    its entries are intact, so quarantining it would take them from delivery. No migration:
    version 1 rewrote tombstones and header words in place (see `pipeline.wire.layouts`)."""
    with open(path, "rb") as file:
        version = foreign_version(file.read(SEGMENT_HEADER_SIZE_BYTES))
    if version is not None:
        raise SegmentFormatError(
            f"{path}: a segment of layout version {version}; this broker reads version {SEGMENT_VERSION} only and "
            f"does not migrate: finish this data directory with the release that wrote it, or move it away")


def refuse_earlier_releases(data_dir: str, journals: list[str]) -> None:
    """SegmentFormatError, stopping recovery, for segment journals, a segment catalog or a
    lineage file of an earlier release: they hold completions, lifecycles and chains this
    release keeps in the store log, and reading the segments without them would deliver
    every completed entry again or miss a lost segment. No migration."""
    sides = [name for name in EARLIER_RELEASE_FILES if os.path.lexists(os.path.join(data_dir, name))]
    found = journals or [os.path.join(data_dir, name) for name in sides]
    if found:
        what = "segment journal" if journals else EARLIER_RELEASE_FILES[sides[0]]
        raise SegmentFormatError(
            f"{found[0]}: a {what} of an earlier release ({len(found)} in this store); this broker keeps what it "
            f"held in {STORE_LOG_FILE} and does not migrate: finish this data directory with the release that "
            f"wrote it, or move it away")


def count_files(directory: str) -> int:
    """Files under `directory` (0 if it does not exist)."""
    return sum(len(files) for _root, _dirs, files in os.walk(directory))


def first_damage(scan: ScanReport) -> int:
    offsets = [r.offset for r in scan.damaged] + ([scan.lost.offset] if scan.lost else [])
    return min(offsets) if offsets else 0


def note_missing(data_dir: str, durable: bool, listing: StoreListing, live: dict[SegmentKeys, SegmentRecords],
                 log_damaged: bool) -> list[MissingSegment]:
    """Segments the store log holds and the disk does not: counted, named, and noted in
    quarantine/ (so `verify` keeps failing until an operator has looked)."""
    on_disk = {found.keys for found in listing.segments}
    missing = []
    for keys, records in sorted(live.items(), key=lambda item: _key_order(item[0])):
        if keys in on_disk:
            continue
        path = segment_path(data_dir, keys.model, keys.signature, keys.lane, keys.segment_seq)
        note = quarantine_target(data_dir, path, MISSING_SUFFIX)
        make_dirs(os.path.dirname(note))
        write_missing_note(note, keys, records.sealed_count, durable)
        if durable:
            fsync_directory(os.path.dirname(note))
        missing.append(MissingSegment(path, keys, records.sealed_count, note, log_damaged))
    return missing


def _key_order(keys: SegmentKeys) -> tuple[int, int, int, int]:
    return keys.model, keys.signature, keys.lane, keys.segment_seq


def read_store(data_dir: str, report: RecoveryReport) -> StoreListing:
    """The store's listing, once the files of an earlier release are refused and an
    interrupted compaction's temp file removed (noted)."""
    try:
        listing = list_store(data_dir)
    except OSError as exc:
        raise StoreReadError(f"{exc.filename or data_dir}: cannot list the segments "
                             f"({exc.strerror}, errno {exc.errno})") from exc
    refuse_earlier_releases(data_dir, listing.old_journals)  # before anything is touched
    leftover = log_path(data_dir) + LOG_TMP_SUFFIX
    if os.path.exists(leftover):
        fileops.unlink(leftover)  # an interrupted compaction: the log itself is whole
        report.catalog_notes.append(f"{leftover}: an interrupted compaction's temp file, removed")
    return listing


@dataclass(frozen=True, slots=True)
class MissingNote:
    """A note in quarantine/ that recovery found a segment missing (`write_missing_note`)."""

    path: str
    keys: SegmentKeys
    entry_count: int | None  # None: unknown, it was still open
    time_ns: int


def write_missing_note(path: str, keys: SegmentKeys, entry_count: int | None, durable: bool) -> None:
    """The evidence of a missing segment, kept until an operator removes it: one MISSING
    record (the store log's layout) in its own file."""
    count = LOG_COUNT_UNKNOWN if entry_count is None else entry_count
    fd = fileops.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        fileops.pwrite_all(fd, encode_lifecycle(LOG_MISSING, keys, count, time.time_ns()).tobytes(), 0)
        if durable:
            fileops.fsync(fd)
    finally:
        fileops.close_fd(fd)


def read_missing_note(path: str) -> MissingNote | str:
    """The note, or why it is not one."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise StoreReadError(f"{path}: cannot read the missing-segment note ({exc.strerror}, errno {exc.errno})") \
            from exc
    words = record_words(data)
    if len(data) != LOG_RECORD_SIZE_BYTES or not valid_rows(words, LOG_MISSING)[0] or \
            int(words[0, 0] >> np.uint64(48)) != LOG_MISSING:
        return f"{path}: not a missing-segment note ({len(data)} bytes, not one valid MISSING record)"
    count = int(words[0, 5])
    return MissingNote(path, lifecycle_keys(words[0]), None if count == LOG_COUNT_UNKNOWN else count, int(words[0, 6]))
