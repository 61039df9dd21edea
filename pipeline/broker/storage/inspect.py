"""Read-only views of the store for operators: dump a segment, list tombstones, verify.

Everything here goes through `scan_segment`, the same code the broker's recovery uses: the
tools never parse a segment a second way (SPEC §"Processes and layout").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from pipeline.broker.storage.paths import iter_segments, stray_files
from pipeline.broker.storage.segment import ScanReport, scan_segment
from pipeline.errors import SegmentFormatError
from pipeline.layouts import ENTRY_LIVE, ENTRY_TOMBSTONE

_STATE_NAMES = {ENTRY_LIVE: "live", ENTRY_TOMBSTONE: "tombstone"}


def dump_segment(path: str, max_entries: int | None = None) -> dict:
    """A segment's header and entries as plain data (JSON-ready)."""
    report = scan_segment(path)
    entries = []
    for k in range(report.entry_count if max_entries is None else min(max_entries, report.entry_count)):
        h = report.headers[k]
        entries.append({
            "offset": int(report.offsets[k]),
            "state": _STATE_NAMES[int(h["state"])],
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
        "torn_at": report.torn_at,
        "torn_bytes": report.torn_bytes,
        "corrupt_at": report.corrupt_at,
        "corrupt_reason": report.corrupt_reason,
    }


def tombstone_rows(data_dir: str) -> list[dict]:
    """Per segment: live, tombstoned, the header's deleted count, and whether they agree."""
    rows = []
    for seg in iter_segments(data_dir):
        try:
            report = scan_segment(seg.path)
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
        })
    return rows


def live_item_ids(paths: list[str]) -> set[int]:
    """Item ids of the live (stored, not completed) entries of these segment files. A file
    gone since it was named (completed and deleted) or not a segment is skipped (`verify`
    names the latter)."""
    ids: set[int] = set()
    for path in paths:
        try:
            report = scan_segment(path)
        except (SegmentFormatError, OSError):
            continue
        ids.update(report.live_item_ids.tolist())
    return ids


@dataclass(slots=True)
class VerifyResult:
    """The outcome of `verify`: `ok` only when every entry is accounted for."""

    segments: int = 0
    entries: int = 0
    live: int = 0
    tombstones: int = 0
    bytes_scanned: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(data_dir: str) -> VerifyResult:
    """Check the whole store: every segment's header, entries and checksums; the header
    counts against the entries; the routing keys against the file name; no torn tail, no
    corruption, no stray file; and no live item stored twice."""
    result = VerifyResult()
    live_ids: Counter[int] = Counter()
    for seg in iter_segments(data_dir):
        result.segments += 1
        try:
            report = scan_segment(seg.path)
        except SegmentFormatError as exc:
            result.problems.append(str(exc))
            continue
        _check_report(seg, report, result)
        live_ids.update(report.live_item_ids.tolist())
    for path in stray_files(data_dir):
        result.problems.append(f"{path}: not a segment name")
    twice = sorted(item for item, n in live_ids.items() if n > 1)
    if twice:
        result.problems.append(f"{len(twice)} live item ids stored more than once, e.g. {twice[:5]}")
    return result


def _check_report(seg, report: ScanReport, result: VerifyResult) -> None:
    result.entries += report.entry_count
    result.live += report.live_count
    result.tombstones += report.tombstone_count
    result.bytes_scanned += report.data_end
    keys = report.keys
    if (keys.model, keys.signature, keys.lane, keys.segment_seq) != (seg.model, seg.signature, seg.lane, seg.segment_seq):
        result.problems.append(f"{seg.path}: header keys {keys} do not match the file name")
    if report.corrupt_at is not None:
        result.problems.append(f"{seg.path}: corrupt at offset {report.corrupt_at}: {report.corrupt_reason}")
    if report.torn_at is not None:
        result.problems.append(f"{seg.path}: torn tail of {report.torn_bytes} bytes at offset {report.torn_at}")
    if not report.counts_agree:
        result.problems.append(
            f"{seg.path}: header says {report.header_entry_count} entries / {report.header_deleted_count} "
            f"deleted, scan found {report.entry_count} / {report.tombstone_count}"
        )
