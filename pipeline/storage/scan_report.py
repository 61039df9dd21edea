"""What a salvage scan of a segment found (`scan.py`'s `scan_segment`): its whole entries, and
every byte range that is not whole entries, each able to describe itself in one line."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.storage.identity import SegmentKeys
from pipeline.storage.storelog import SegmentRecords
from pipeline.wire.layouts.segments import ENTRY_HEADER_DTYPE, ENTRY_LIVE, ENTRY_TOMBSTONE, SEGMENT_HEADER_SIZE_BYTES


@dataclass(slots=True)
class DamagedRange:
    """Bytes below the segment's commit boundary that are not whole, checksummed entries:
    acknowledged entries damaged on disk, kept as they are. `entries` is how many entries it
    held: counted by walking their headers when `walked`, else a lower bound. `item_ids` come
    from those headers, unverified (at most ITEM_IDS_NAMED_MAX)."""

    path: str
    offset: int
    end: int
    entries: int
    walked: bool
    item_ids: tuple[int, ...]
    reason: str

    @property
    def item_id(self) -> int | None:
        return self.item_ids[0] if self.item_ids else None

    def describe(self) -> str:
        count = _entries(self.entries) if self.walked else f"at least {_entries(self.entries)}"
        return f"{self.path}: bytes {self.offset}..{self.end}: {count} damaged ({self.reason}){_ids(self.item_ids)}"


@dataclass(slots=True)
class TornRange:
    """Bytes at or past the commit boundary that are not whole entries: what a write that was
    never acknowledged left (its producer still holds the items). Kept; not a loss."""

    path: str
    offset: int
    end: int
    entries: int
    item_ids: tuple[int, ...]

    @property
    def size_bytes(self) -> int:
        return self.end - self.offset

    def describe(self) -> str:
        return (f"{self.path}: torn tail of an unacknowledged write: {self.size_bytes} bytes at offset "
                f"{self.offset}, kept ({self.entries} entry headers readable{_ids(self.item_ids)})")


@dataclass(slots=True)
class LostEntries:
    """Entries the header says were written that the file no longer holds: the file ends
    (at `file_size`) before the commit boundary `end`. The entries from `offset` on are gone
    or cut; `entries` counts them (the header's count less what was found, and at least the
    entry headers that remain readable)."""

    path: str
    offset: int
    end: int
    file_size: int
    entries: int
    item_ids: tuple[int, ...]

    def describe(self) -> str:
        return (f"{self.path}: truncated at {self.file_size} bytes, the header says data runs to {self.end}: "
                f"{_entries(self.entries)} from offset {self.offset} lost{_ids(self.item_ids)}")


@dataclass(frozen=True, slots=True)
class RepairedState:
    """A whole, checksummed entry whose state word was neither live nor tombstone: delivered
    (again) as live; recovery rewrites the word."""

    path: str
    offset: int
    word: int
    item_id: int

    def describe(self) -> str:
        return (f"{self.path}: offset {self.offset}: state word {self.word:#010x} is neither live nor "
                f"tombstone; item {self.item_id} is whole and is delivered (again) as live")


def _entries(count: int) -> str:
    return f"{count} entry" if count == 1 else f"{count} entries"


def _ids(item_ids: tuple[int, ...]) -> str:
    if not item_ids:
        return ""
    shown = ", ".join(map(str, item_ids[:5]))
    more = f" and {len(item_ids) - 5} more" if len(item_ids) > 5 else ""
    return f"; item {shown}{more} (unverified)"


@dataclass(slots=True)
class ScanReport:
    """What a scan of one segment found.

    `offsets[i]` and `headers[i]` (ENTRY_HEADER_DTYPE) describe the whole, checksummed
    entries in file order, as they are delivered: an entry in `repaired_states` reads live.
    `done_offsets`: the completed entries before them that a restart's scan took from the
    store log without reading them (`scan_segment(skip_done=True)`); they count as entries
    and tombstones.
    `data_end` is the end of the last of them; `header_data_end` the commit boundary and
    `header_entry_count` its count, `header_deleted_count` the completions and `sealed` the
    seal, all from the store log (the segment's header holds none of them).
    `damaged`, `torn` and `lost` name every byte range that is not whole entries (see the
    module docstring); `identity_damage` says why the identity block was salvaged, if it was.
    """

    path: str
    keys: SegmentKeys
    created_ns: int
    sealed: bool
    header_entry_count: int
    header_deleted_count: int
    header_data_end: int
    file_size: int
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    headers: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=ENTRY_HEADER_DTYPE))
    done_offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    walk_start: int = SEGMENT_HEADER_SIZE_BYTES  # where the walk began: the end of what it took unread
    data_end: int = SEGMENT_HEADER_SIZE_BYTES
    damaged: list[DamagedRange] = field(default_factory=list)
    torn: list[TornRange] = field(default_factory=list)
    lost: LostEntries | None = None
    repaired_states: list[RepairedState] = field(default_factory=list)
    identity_damage: str = ""
    boundary_damage: str = ""  # the boundary cannot be trusted (a checksum fails, the log is damaged)
    records: SegmentRecords | None = None  # what the store log said of the segment

    @property
    def entry_count(self) -> int:
        return int(self.done_offsets.shape[0] + self.offsets.shape[0])

    @property
    def live_item_ids(self) -> np.ndarray:
        """Item ids of the live entries, in file order."""
        return self.headers["item_id"][self.headers["state"] == ENTRY_LIVE]

    @property
    def tombstone_offsets(self) -> np.ndarray:
        """Offsets of the completed entries, in file order."""
        return np.concatenate((self.done_offsets, self.offsets[self.headers["state"] == ENTRY_TOMBSTONE]))

    @property
    def live_count(self) -> int:
        return int(np.count_nonzero(self.headers["state"] == ENTRY_LIVE))

    @property
    def tombstone_count(self) -> int:
        return int(self.done_offsets.shape[0] + np.count_nonzero(self.headers["state"] == ENTRY_TOMBSTONE))

    @property
    def damaged_entries(self) -> int:
        return sum(r.entries for r in self.damaged)

    @property
    def lost_entries(self) -> int:
        return 0 if self.lost is None else self.lost.entries

    @property
    def accounted_entries(self) -> int:
        """Whole entries plus those counted damaged or lost: what the header should count."""
        return self.entry_count + self.damaged_entries + self.lost_entries

    @property
    def is_damaged(self) -> bool:
        """Acknowledged entries damaged or lost, or a salvaged identity: the segment is never
        deleted, only moved to quarantine/ once what it still delivers is done."""
        return bool(self.damaged or self.lost is not None or self.identity_damage)

    @property
    def boundary(self) -> int:
        """The commit boundary recovery writes back, so that the next scan judges the same
        bytes the same way: never lowered (a damaged last entry stays corruption, not a torn
        tail; a truncation stays counted), and raised over whole entries past it (recovery
        adopts them: the restarted broker's catch-up releases their ring records) up to the
        first torn range only (raising it over a torn range would make it corruption)."""
        adopted = min(self.data_end, self.torn[0].offset) if self.torn else self.data_end
        ends = [SEGMENT_HEADER_SIZE_BYTES, adopted, *(r.end for r in self.damaged),
                *([self.lost.end] if self.lost else [])]
        return max(ends)

    @property
    def counts_agree(self) -> bool:
        """The header's words match the scan (a crash between a tombstone and its count, or
        between a write and the header words, leaves them apart until recovery repairs them)."""
        return (self.header_deleted_count == self.tombstone_count and not self.boundary_damage
                and self.header_entry_count == self.accounted_entries
                and max(self.header_data_end, SEGMENT_HEADER_SIZE_BYTES) == self.boundary)

    def problems(self) -> list[str]:
        """One line per damaged, lost or repaired thing (torn tails are not problems)."""
        lines = [f"DAMAGED HEADER: {self.path}: {self.identity_damage}"] if self.identity_damage else []
        lines += [f"DAMAGED HEADER: {self.path}: {self.boundary_damage}"] if self.boundary_damage else []
        lines += [f"DAMAGED: {r.describe()}" for r in self.damaged]
        lines += [] if self.lost is None else [f"LOST: {self.lost.describe()}"]
        lines += [f"STATE WORD: {r.describe()}" for r in self.repaired_states]
        return lines
