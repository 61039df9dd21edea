"""Read-only views of the store for operators: dump a segment, list tombstones, verify.

Everything here goes through `scan_segment`, `list_store` and the store log's reader, the same
code the broker's recovery uses: the tools never parse a segment or a name a second way
(SPEC §"Processes and layout"). A directory or file that cannot be read raises
StoreReadError naming the path (the command line prints it as one line).
"""

from __future__ import annotations

import json
import os
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from pipeline.storage.chains import read_lineage
from pipeline.storage.paths import (
    MISSING_SUFFIX,
    QUARANTINE_DIR,
    SegmentPath,
    StoreListing,
    iter_segments,
    list_store,
    segment_path,
    store_dirs,
)
from pipeline.storage.scan import (
    EntryCensus,
    census_segment,
    data_dir_of,
    mapped_file,
    name_keys_of,
    scan_segment,
)
from pipeline.storage.scan_report import ScanReport
from pipeline.storage.recovery import MissingNote, read_missing_note
from pipeline.storage.storelog import LogReading, SegmentRecords, log_path, read_store_log
from pipeline.wire.errors import SegmentFormatError, StoreReadError
from pipeline.wire.layouts.frames import TOKEN_SIZE_BYTES
from pipeline.wire.layouts.names import BROKER_STATE_NAME, SEGMENTS_DIR
from pipeline.wire.layouts.segments import ENTRY_HEADER_SIZE_BYTES, ENTRY_LIVE, ENTRY_TOMBSTONE

_STATE_NAMES = {ENTRY_LIVE: "live", ENTRY_TOMBSTONE: "tombstone"}


def _unreadable(path: str, exc: OSError, what: str) -> StoreReadError:
    return StoreReadError(f"{exc.filename or path}: cannot read {what} ({exc.strerror}, errno {exc.errno})")


def _scan(path: str, keys=None, records: SegmentRecords | None = None) -> ScanReport:
    try:
        return scan_segment(path, keys, records=records)
    except OSError as exc:
        raise _unreadable(path, exc, "the segment") from exc


def _listing(root: str) -> StoreListing:
    try:
        if not stat.S_ISDIR(os.stat(root).st_mode):
            raise StoreReadError(f"{root}: not a data directory (not a directory)")
        return list_store(root)
    except OSError as exc:
        raise _unreadable(root, exc, "the store") from exc


def dump_segment(path: str, max_entries: int | None = None) -> dict:
    """A segment's header, entries and damage as plain data (JSON-ready)."""
    report = _scan(path)
    repaired = {r.offset for r in report.repaired_states}
    entries = []
    for k in range(report.entry_count if max_entries is None else min(max_entries, report.entry_count)):
        h, offset = report.headers[k], int(report.offsets[k])
        entries.append({
            "offset": offset,
            "state": "live (state word repaired)" if offset in repaired else _STATE_NAMES[int(h["state"])],
            "length": int(h["length"]),
            "item_id": int(h["item_id"]),
            "producer_id": int(h["producer_id"]),
            "seq": int(h["seq"]),
            "prefix_len": int(h["prefix_len"]),
            "payload_len": int(h["payload_len"]),
            "checksum": "ok",
        })
    return {
        "path": path,
        "header": {
            **asdict(report.keys),
            "created_ns": report.created_ns,
            "sealed": report.sealed,
            "entry_count": report.header_entry_count,
            "deleted_count": report.header_deleted_count,
            "data_end": report.header_data_end,
        },
        "log": None if report.records is None else {  # completions, boundary and seal: not header words
            "completed": int(report.records.completed.shape[0]), "entry_count": report.records.entry_count,
            "data_end": report.records.data_end, "sealed_count": report.records.sealed_count,
            "untrusted": report.records.untrusted},
        "scanned": _scan_summary(report),
        "entries": entries,
    }


def _scan_summary(report: ScanReport) -> dict:
    return {
        "entries": report.entry_count,
        "live": report.live_count,
        "tombstones": report.tombstone_count,
        "data_end": report.data_end,
        "file_size": report.file_size,
        "counts_agree": report.counts_agree,
        "identity_damage": report.identity_damage,
        "damaged": [asdict(r) for r in report.damaged],
        "lost": None if report.lost is None else asdict(report.lost),
        "torn": [asdict(r) for r in report.torn],
        "repaired_states": [asdict(r) for r in report.repaired_states],
        "problems": report.problems(),
    }


def tombstone_rows(data_dir: str) -> list[dict]:
    """Per segment: live, completed, the store log's completion count, and whether they agree."""
    rows = []
    log = read_store_log(store_dirs(data_dir)[0])
    for seg in _listing(data_dir).segments:
        try:
            report = _scan(seg.path, seg.keys, log.of(seg.keys))
        except SegmentFormatError as exc:
            rows.append({"path": seg.path, "error": str(exc)})
            continue
        rows.append({
            "path": seg.path,
            "entries": report.entry_count,
            "live": report.live_count,
            "tombstones": report.tombstone_count,
            "deleted_count": report.header_deleted_count,
            "sealed": report.sealed,
            "agree": report.counts_agree,
            "damaged": report.is_damaged,
        })
    return rows


def _scans(paths: list[str]) -> Iterator[tuple[str, ScanReport]]:
    """Each segment file's scan, the store log of its data directory read once for all of
    them. A file gone since it was named (completed and deleted) or not a segment is skipped
    (`verify` names the latter).
    NOTE: the log read again for each file was quadratic: 47 s where 2 would do to count a
    stopped run's live items (tests/runtime/test_launch.py's Ctrl-C then rerun)."""
    logs: dict[str, LogReading] = {}
    for path in paths:
        data_dir = data_dir_of(path)
        if data_dir is not None and data_dir not in logs:
            logs[data_dir] = read_store_log(data_dir)
        try:
            report = scan_segment(path, log=logs.get(data_dir) if data_dir is not None else None)
        except (SegmentFormatError, OSError):
            continue
        yield path, report


def live_items(paths: list[str]) -> tuple[set[int], set[int]]:
    """The item ids of the live (stored, not completed) entries of these segment files, and
    the models they are for (`_scans`)."""
    ids: set[int] = set()
    models: set[int] = set()
    for _path, report in _scans(paths):
        live = report.live_item_ids.tolist()
        if live:
            ids.update(live)
            models.add(report.keys.model)
    return ids, models


def live_payloads(paths: list[str]) -> Iterator[tuple[int, bytes]]:
    """(item id, payload) of each live entry of these segment files, one file at a time
    (what a job needs to know which of its requests a stopped run left in the store). Read
    with the code recovery uses (`_scans`)."""
    for path, report in _scans(paths):
        try:
            live = np.flatnonzero(report.headers["state"] == ENTRY_LIVE)
            if not live.size:
                continue
            with open(path, "rb") as f:
                found = []
                for row in live.tolist():
                    header = report.headers[row]
                    at = int(report.offsets[row]) + ENTRY_HEADER_SIZE_BYTES + int(header["length"]) * TOKEN_SIZE_BYTES
                    found.append((int(header["item_id"]), os.pread(f.fileno(), int(header["payload_len"]), at)))
        except (SegmentFormatError, OSError):
            continue
        yield from found


def live_payload_tails(paths: list[str], size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per segment file: the item ids of its live entries whose payload holds at least `size`
    bytes, and the last `size` bytes of each of those payloads (rows of a uint8 array),
    gathered as columns: what a job needs of a stopped run's store (its own payload ends
    every payload it stores) without a Python step per entry. Read with the code recovery
    uses (`_scans`)."""
    for path, report in _scans(paths):
        try:
            headers = report.headers
            live = (headers["state"] == ENTRY_LIVE) & (headers["payload_len"] >= size)
            if not live.any():
                continue
            ends = (report.offsets[live] + ENTRY_HEADER_SIZE_BYTES
                    + headers["length"][live].astype(np.int64) * TOKEN_SIZE_BYTES
                    + headers["payload_len"][live].astype(np.int64))
            with mapped_file(path) as (buf, file_size):
                if int(ends.max()) > file_size:
                    continue
                windows = np.lib.stride_tricks.sliding_window_view(np.frombuffer(buf, dtype=np.uint8), size)
                tails = windows[ends - size]  # a copy of the rows alone (the windows are a view)
                del windows
        except (SegmentFormatError, OSError):
            continue
        yield headers["item_id"][live].astype(np.uint64), tails


@dataclass(slots=True)
class VerifyResult:
    """The outcome of `verify`: `ok` only when every entry is accounted for. `problems` are
    failures; `notes` are findings that lose nothing (torn tails of unacknowledged writes,
    segments the store log does not name yet)."""

    segments: int = 0
    entries: int = 0
    live: int = 0
    tombstones: int = 0
    bytes_scanned: int = 0
    quarantined_files: int = 0
    counts: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(data_dir: str) -> VerifyResult:
    """Check the whole store: every segment's header, entries and checksums, through the
    recovery scan (damaged ranges, truncation losses, header words against the entries);
    the routing keys against the file name; strays; every file in quarantine/; every
    segment the store log holds and the disk lacks; the store log's records; and no live
    item stored twice. StoreReadError if something cannot be read."""
    result = VerifyResult()
    root_data_dir, _segments = store_dirs(data_dir)
    markers = (SEGMENTS_DIR, QUARANTINE_DIR, BROKER_STATE_NAME, os.path.basename(log_path(root_data_dir)))
    if not any(os.path.lexists(os.path.join(root_data_dir, name)) for name in markers):
        raise StoreReadError(f"{root_data_dir}: not a data directory (no segments/, quarantine/, store log "
                             f"or broker state): nothing to verify")
    log = read_store_log(root_data_dir)  # before the listing: see _check_missing
    listing = _listing(data_dir)
    live_ids: Counter[int] = Counter()
    vanished: list[SegmentPath] = []
    _check_log(log, result)
    for seg in listing.segments:
        _verify_segment(seg, result, live_ids, vanished, log.of(seg.keys))
    for stray in listing.strays:
        result.problems.append(f"STRAY: {stray.describe()} (its entries, if any, are never delivered)")
        result.counts["strays"] += 1
    _check_quarantine(root_data_dir, result)
    _check_missing(root_data_dir, log, listing, vanished, result)
    twice = sorted(item for item, n in live_ids.items() if n > 1)
    if twice:
        result.problems.append(f"{len(twice)} live item ids stored more than once, e.g. {twice[:5]}")
    return result


def _check_log(log: LogReading, result: VerifyResult) -> None:
    """The store log's damage (`storelog.py`, its chains' `chains.py`): a lost completion is
    a redelivery, a lost boundary makes a scan judge every bad byte acknowledged, a lost
    chain level costs its shapes' order after a restart, but it is damage on the disk
    all the same. Safe beside a running broker: a record being appended reads as a torn
    append, a note."""
    lineage = read_lineage(log).damaged
    for line in log.damaged + lineage:
        result.problems.append(f"STORE LOG: {line}")
    result.counts["log_problems"] += log.damaged_records + len(lineage)
    if log.torn:
        result.notes.append(f"store log: {log.torn}")


def _verify_segment(seg: SegmentPath, result: VerifyResult, live_ids: Counter, vanished: list,
                    records: SegmentRecords) -> None:
    result.segments += 1
    try:
        report = scan_segment(seg.path, seg.keys, records=records)
    except FileNotFoundError:
        vanished.append(seg)  # deleted since the listing, or lost: the store log says which
        return
    except SegmentFormatError as exc:
        census = _census(seg.path)
        result.problems.append(f"UNIDENTIFIED: {exc}: {census.entries} entries in it cannot be delivered")
        result.counts["entries_unidentified"] += census.entries
        return
    except OSError as exc:
        raise _unreadable(seg.path, exc, "the segment") from exc
    result.entries += report.entry_count
    result.live += report.live_count
    result.tombstones += report.tombstone_count
    result.bytes_scanned += report.data_end
    live_ids.update(report.live_item_ids.tolist())
    result.problems += report.problems()
    result.counts["entries_damaged"] += report.damaged_entries
    result.counts["entries_missing"] += report.lost_entries
    result.counts["state_words_bad"] += len(report.repaired_states)
    # A torn tail is what a crash in the middle of a write leaves past the commit boundary:
    # that write was never acknowledged (its producer still holds the items and presents
    # them again), so nothing acknowledged is lost. The bytes are kept and named, not failed.
    for torn in report.torn:
        result.notes.append(torn.describe())
        result.counts["torn_tails"] += 1
    if not report.counts_agree:
        result.problems.append(
            f"{seg.path}: the store log says {report.header_entry_count} entries / {report.header_deleted_count} "
            f"deleted / data to {report.header_data_end}, the scan accounts for {report.accounted_entries} / "
            f"{report.tombstone_count} / {report.boundary} (recovery records the scan's boundary)"
        )


def _census(path: str) -> EntryCensus:
    try:
        return census_segment(path)
    except OSError as exc:
        raise _unreadable(path, exc, "the segment") from exc


def _check_quarantine(data_dir: str, result: VerifyResult) -> None:
    """Every file in quarantine/ is a failure until an operator has looked at it and removed
    it: a segment moved there, or the note of a missing one."""
    base = os.path.join(data_dir, QUARANTINE_DIR)
    if not os.path.isdir(base):
        return
    found = []
    for dirpath, _dirnames, filenames in os.walk(base, onerror=_raise_unreadable):
        found += [os.path.join(dirpath, name) for name in filenames]
    for path in sorted(found):
        result.quarantined_files += 1
        if path.endswith(MISSING_SUFFIX):
            note = read_missing_note(path)
            if isinstance(note, MissingNote):
                count = "unknown entries (it was still open)" if note.entry_count is None else f"{note.entry_count} entries"
                result.problems.append(f"MISSING: {path}: a recovery found {note.keys} missing: {count}")
                result.counts["segments_missing"] += 1
                result.counts["entries_missing"] += note.entry_count or 0
                continue
        census = _census(path)
        result.problems.append(f"QUARANTINED: {path}: {census.entries} whole entries ({census.live} live) "
                               f"in {census.file_size} bytes, not delivered")
        result.counts["segments_quarantined"] += 1
        result.counts["entries_quarantined"] += census.live


def _raise_unreadable(exc: OSError) -> None:
    raise _unreadable(exc.filename or "", exc, "the quarantine")


def broker_ran_here(data_dir: str) -> bool:
    """A broker started on this data directory at least once (its state file says so)."""
    try:
        with open(os.path.join(data_dir, BROKER_STATE_NAME)) as file:
            return int(json.load(file).get("generation", 0)) >= 1
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def _check_missing(data_dir: str, before: LogReading, listing: StoreListing, vanished: list[SegmentPath],
                   result: VerifyResult) -> None:
    """Segments the store log holds and the disk lacks are missing. Safe beside a running
    broker: the log is read before the listing and again after it, and a segment counts as
    missing only if both readings hold it, because a delete is recorded before its unlink
    (a segment created after the first reading is on disk, not missing)."""
    if not before.found:
        if listing.segments:
            result.problems.append(f"{before.path}: no store log although {len(listing.segments)} segments exist: "
                                   f"a missing segment cannot be detected (the broker rebuilds it at its next start)")
        elif broker_ran_here(data_dir):
            result.problems.append(f"{before.path}: no store log although a broker ran here ({BROKER_STATE_NAME}): "
                                   f"the store may have been removed; what it held cannot be checked")
        return
    live = before.live()
    on_disk = {seg.keys for seg in listing.segments} - {seg.keys for seg in vanished}
    candidates = [keys for keys in live if keys not in on_disk]
    after = read_store_log(data_dir).live() if candidates else {}
    for keys in sorted(candidates, key=lambda k: (k.model, k.signature, k.lane, k.segment_seq)):
        records = after.get(keys)
        path = segment_path(data_dir, keys.model, keys.signature, keys.lane, keys.segment_seq)
        if records is None or os.path.exists(path):
            continue  # deleted (recorded) since the first reading, or there after all
        count = ("entry count unknown, it was still open" if records.sealed_count is None
                 else f"{records.sealed_count} entries")
        result.problems.append(f"MISSING: {path}: the store log holds this segment, the disk does not: {count}")
        result.counts["segments_missing"] += 1
        result.counts["entries_missing"] += records.sealed_count or 0
    for seg in listing.segments:
        if seg.keys not in live and seg not in vanished:
            result.notes.append(f"{seg.path}: not in the store log yet (a crash between its creation and its "
                                f"record, or created since; the broker adopts it)")


__all__ = ["VerifyResult", "dump_segment", "iter_segments", "live_items", "name_keys_of", "tombstone_rows",
           "verify"]
