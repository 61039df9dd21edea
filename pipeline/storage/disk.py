"""The disk tier (SPEC §5): the storage tier, over one data directory's segment files
(`SegmentStore`). On disk it is durable; `--storage memory` puts the same data directory on
tmpfs (the files then live in RAM and go with the broker): one tier, two places to live.

    tier = DiskTier.open(data_dir, Durability.PROCESS)   # recovery runs here; tier.recovery
    refs = tier.append(group)       # one write per lane group; refs = (segment id, byte offset)
    tier.flush()                    # once per loop turn, before releasing ring records
    ... peek_many / commit / complete_batch / return_consumer (queues.QueuedTier)
    tier.close()

Appends: a lane group is encoded whole (`encode_entries`: per-entry xxh3, validated before
writing) and written with one pwrite to its lane's open segment. `process`: the entries are
dispatchable as soon as the write returned (the page cache survives kill -9 of any process).
`power`: they wait, staged, until `flush()` has fdatasync'ed every segment that took appends
(group commit) and then become dispatchable, so a consumer never reads an unsynced byte.
A full disk raises DiskFullError with nothing recorded as stored; fsync failing raises
DurabilityError, which is fatal.

Completion records each entry in the store log (`SegmentStore.tombstone_many`,
`storelog.py`: a segment is never written in place); a sealed segment with nothing live left
is deleted whole.

Queued entries cost 8 bytes each in memory (their offsets, per segment run: see
`queues`); everything else dispatch needs (item id, lengths, producer, seq, submit time) is
read back from the entry header in the mapped segment at peek time.

Recovery (`open`): `SegmentStore.recover()` scans every segment and salvages every whole,
checksummed entry past any damage (`scan.py`), names and counts what cannot be delivered
(damaged ranges, truncation, missing segments per the store log, quarantined files, strays),
records the scan's boundaries, deletes finished segments; then every lane's queue is
rebuilt from the live entries in segment sequence order, file order within a segment; the (lane,
lengths) lists go to the dispatcher once (`take_recovered_lanes`) and every live entry's
(producer, seq) to the idempotent-ingest check (`queues.StoredSeqs`). The report stays in
`tier.recovery` (`summary()` for the log, `damage_counts()` for status and the run report);
a damaged segment moved to quarantine/ later, once it is done, is in `take_quarantined()`.
"""

from __future__ import annotations

import math
import mmap
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import groupby

import numpy as np

from pipeline.broker.ids import EntryRef, LaneKey, SegmentId
from pipeline.storage.base import AppendGroup, Peeked, RecoveredLane
from pipeline.storage.chains import LineageLog
from pipeline.storage.diskio import Durability
from pipeline.storage.pending import EntryColumns
from pipeline.storage.queues import HOT_ENTRIES_MAX, QueuedTier, RefRun
from pipeline.storage.segment import encode_entries, scan_segment
from pipeline.storage.storelog import read_store_log
from pipeline.storage.segments import Quarantined, RecoveryReport, SegmentStore
from pipeline.wire.errors import DiskFullError, SegmentCorruptError
from pipeline.wire.layouts.frames import TOKEN_DTYPE, TOKEN_SIZE_BYTES, ProducerId
from pipeline.wire.layouts.segments import ENTRY_HEADER_SIZE_BYTES, ENTRY_LIVE, entry_checksum, entry_size_bytes
from pipeline.wire.shapes import POOL_SIGNATURE

# flush() seals segments past the age limit at most this often: the check walks every lane's
# open segment, which is cheap once a second and wasteful once per loop turn.
AGE_CHECK_INTERVAL_S = 1.0
# Read-only mappings kept for read_tokens/read_payload (tools, tests, in-process readers).
# Each holds a descriptor (mmap keeps a dup), so far fewer than the store's open files.
READ_MAPS_MAX = 64


class DiskTier(QueuedTier):
    """Durable queues per lane over segment files (see the module docstring).

    Owner: the broker's single dispatch loop (through the Dispatcher); the only writer of
    its data directory. Not thread-safe. `close()` syncs and closes every file; the files
    are the durable store and stay.
    """

    def __init__(self, store: SegmentStore, recovery: RecoveryReport, clock: Callable[[], float],
                 hot_entries_max: int = HOT_ENTRIES_MAX) -> None:
        """Use `DiskTier.open`."""
        super().__init__(hot_entries_max)
        self._store = store
        self._lineage = LineageLog(store.log, {(model, signature) for model, chain in recovery.chains
                                               for signature in chain})
        self._recovered_chains = list(recovery.chains)
        self.recovery = recovery
        self._clock = clock
        self._staging = store.durability is Durability.POWER
        self._last_age_check_s = clock()
        self._read_maps: OrderedDict[SegmentId, memoryview] = OrderedDict()
        self._recovered_lanes: list[RecoveredLane] = []
        self.damaged_at_read = 0  # entries consumers found damaged while this tier ran
        self._rebuild(recovery)
        recovery.release_scans()

    @classmethod
    def open(
        cls,
        data_dir: str,
        durability: Durability = Durability.PROCESS,
        *,
        clock: Callable[[], float] = time.monotonic,
        hot_entries_max: int = HOT_ENTRIES_MAX,
        **store_options: int | float,
    ) -> DiskTier:
        """Open (or create) a data directory: recover it and rebuild the queues. The
        RecoveryReport is `tier.recovery` (`tier.recovery.summary()` for the log).
        `store_options` are SegmentStore's: segment_max_bytes, segment_max_age_s,
        open_files_max. `clock` (monotonic seconds) dates segments for sealing by age.
        `hot_entries_max`: queued entries a lane keeps offsets of in memory (queues.py)."""
        store = SegmentStore(data_dir, durability, **store_options)  # type: ignore[arg-type]
        return cls(store, store.recover(), clock, hot_entries_max)

    @property
    def store(self) -> SegmentStore:
        return self._store

    @property
    def durability(self) -> Durability:
        return self._store.durability

    # ----------------------------------------------------------------- recovery

    def _rebuild(self, recovery: RecoveryReport) -> None:
        """Queue every live entry recovery kept: per lane, segments in sequence order, entries
        in file order. Example: lane L kept l0000-0000000002.seg (live at 4096, 5184) and
        l0000-0000000005.seg (live at 4160): L's queue is [(s2, 4096), (s2, 5184), (s5, 4160)]."""
        kept = sorted(recovery.segments, key=lambda k: (tuple(k.state.lane), k.state.keys.segment_seq))
        seqs: dict[int, list[np.ndarray]] = {}
        for lane, segments in groupby(kept, key=lambda k: k.state.lane):
            lengths, submits, shapes = [], [], []
            for segment in segments:
                headers = segment.report.headers
                live = headers["state"] == ENTRY_LIVE
                lane_lengths = headers["length"][live].astype(np.int64)
                offsets = segment.report.offsets[live].astype(np.int64)
                # An undamaged segment's live entries can be a cold run (their offsets read
                # back, tombstoned entries skipped, when the front reaches them): its end is
                # the last live entry's. A damaged one's stay in memory: a walk would stop.
                end = -1
                if offsets.size and not segment.state.damage:
                    end = int(offsets[-1]) + entry_size_bytes(int(lane_lengths[-1]),
                                                              int(headers["payload_len"][live][-1]))
                self._record_recovered(lane, segment.state.id, offsets, int(lane_lengths.sum()), end)
                lengths.append(lane_lengths)
                submits.append(headers["submit_ns"][live])
                shapes.append(headers["signature"][live])
                for producer in np.unique(headers["producer_id"][live]).tolist():
                    mine = live & (headers["producer_id"] == producer)
                    seqs.setdefault(producer, []).append(headers["seq"][mine])
            self._recovered_lanes.append(RecoveredLane(lane, np.concatenate(lengths), np.concatenate(submits),
                                                       np.concatenate(shapes)))
        for producer, found in seqs.items():
            self._stored.add_recovered(ProducerId(producer), np.concatenate(found))

    def take_recovered_lanes(self) -> list[RecoveredLane]:
        taken, self._recovered_lanes = self._recovered_lanes, []
        return taken

    def take_recovered_chains(self) -> list[tuple[int, tuple[int, ...]]]:
        taken, self._recovered_chains = self._recovered_chains, []
        return taken

    def record_chains(self, chains: Sequence[tuple[int, Sequence[int]]]) -> None:
        self._lineage.record(chains)

    @property
    def chains_unrecorded(self) -> int:
        return self._lineage.unrecorded

    def keep_damaged(self, segments: np.ndarray, why: str) -> None:
        """Entries a consumer found damaged: their segments are never deleted, but moved to
        quarantine/ once everything in them is done (`damaged_at_read` counts the entries)."""
        self.damaged_at_read += int(segments.size)
        for segment in np.unique(segments).tolist():
            self._store.keep_damaged(SegmentId(segment), why)

    def take_quarantined(self) -> tuple[list[Quarantined], list[str]]:
        """Damaged segments moved to quarantine/ since the last call, once everything they
        could still deliver was completed (never deleted by us), and notes of what the store
        could not do that cost nothing: for the broker's log."""
        return self._store.take_quarantined()

    # ----------------------------------------------------------------- ingest

    def append(self, group: AppendGroup) -> Sequence[EntryRef]:
        """Encode the group (one buffer, per-entry checksums) and write it with one pwrite to
        the lane's open segment. DiskFullError: nothing of the group is recorded as stored."""
        frame, rows, lane = group.frame, group.rows, group.lane
        if not len(rows):
            return RefRun(SegmentId(-1), rows[:0].astype(np.int64))
        items = frame.items[rows]
        assert (items["model"] == lane.model).all(), lane
        assert lane.signature == POOL_SIGNATURE or (items["signature"] == lane.signature).all(), lane
        encoded = encode_entries(frame.items, frame.tokens, frame.token_starts, frame.payloads,
                                 frame.payload_starts, rows, group.producer_id)
        try:
            segment, base = self._store.append(lane, encoded, self._clock())
        except DiskFullError:
            # Completed work frees its space only once its segment is sealed (a sealed segment
            # is deleted whole when its last entry is tombstoned): seal every open segment now
            # rather than at its age limit, minutes later, so a disk the store filled drains
            # itself as consumers complete. NOTE: without it a full tmpfs stalled ingest until
            # the 300 s age limit sealed the segments (tests/runtime/test_disk_full.py).
            self._store.seal_aged(math.inf)
            raise
        offsets = encoded.offsets + base
        self._record_append(lane, segment, offsets, group.producer_id, int(items["seq"].max()),
                            int(items["length"].sum()), staged=self._staging, end=base + encoded.data.nbytes)
        return RefRun(segment, offsets)

    def flush(self) -> None:
        """Group commit: fdatasync every segment that took appends and then the store log
        (`power`; DurabilityError is fatal), then staged entries become dispatchable. Also
        seals segments past the age limit, at most once per AGE_CHECK_INTERVAL_S."""
        store = self._store
        store.sync()  # the chains this turn's items need too (store log records), before they are acknowledged
        if self._staging:
            store.flush_tombstones()
        super().flush()
        now_s = self._clock()
        if now_s - self._last_age_check_s >= AGE_CHECK_INTERVAL_S:
            self._last_age_check_s = now_s
            store.seal_aged(now_s)

    # ----------------------------------------------------------------- QueuedTier hooks

    def _describe(self, lane: LaneKey, segments: np.ndarray, offsets: np.ndarray) -> Peeked:
        """The entry headers, gathered from each segment's mapping as columns and checked
        (`SegmentFile.entry_header_columns`)."""
        parts = []
        for first, end in _runs(segments):
            segment = SegmentId(int(segments[first]))
            owner = self._store.segments[segment].lane
            assert owner == lane, f"segment {segment} of lane {tuple(owner)} queued in lane {tuple(lane)}"
            parts.append(self._store.entry_header_columns(segment, offsets[first:end]))
        headers = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return Peeked(lane, None, segments, offsets, headers["length"].astype(np.int64), headers["item_id"],
                      headers["producer_id"].astype(np.int64), headers["seq"], headers["prefix_len"].astype(np.int64),
                      headers["submit_ns"], headers["signature"])

    def _check_segments(self, segments: np.ndarray) -> str | None:
        known = self._store.segments
        for segment in set(segments.tolist()):
            if segment not in known:
                return f"segment {segment} is gone"
        return None

    def _dispatched(self, segments: np.ndarray, offsets: np.ndarray) -> None:
        last = np.flatnonzero(np.r_[segments[1:] != segments[:-1], True])  # each segment's last entry
        for at in last.tolist():
            self._store.release_below(int(segments[at]), int(offsets[at]))

    def _remove(self, lane: LaneKey, entries: EntryColumns) -> None:
        segments, offsets = entries.segments, entries.offsets
        for first, end in _runs(segments):  # a segment's refs are consecutive in a batch
            segment = SegmentId(int(segments[first]))
            done = self._store.tombstone_many(segment, offsets[first:end])
            assert done == end - first, (segment, done, end - first)  # the pending map held them
            if segment not in self._store.segments:  # deleted whole
                self._read_maps.pop(segment, None)

    def _cold_offsets(self, segment: SegmentId, start: int, end: int, count: int) -> tuple[np.ndarray, int]:
        return self._store.entry_offsets(segment, start, end, count)

    def _lane_dropped(self, lane: LaneKey) -> None:
        self._store.drop_lane(lane)

    def _lane_of(self, segment: SegmentId) -> LaneKey:
        return self._store.segments[segment].lane

    def _live_entries(self) -> dict[EntryRef, int]:
        """Every segment scanned (the recovery scan code): its live entries, and its counts
        checked against the store's."""
        live: dict[EntryRef, int] = {}
        log = read_store_log(self._store.data_dir)
        for segment, state in self._store.segments.items():
            scan = scan_segment(state.path, state.keys, records=log.of(state.keys))
            # damage a scan finds is the state's; the state's may have other witnesses (the log's
            # QUARANTINED record of a move not made, a consumer's read)
            assert scan.keys == state.keys and (bool(state.damage) or not scan.is_damaged), state.path
            assert (scan.entry_count, scan.tombstone_count) == (state.entry_count, state.deleted_count), state
            mask = scan.headers["state"] == ENTRY_LIVE
            for offset, length in zip(scan.offsets[mask].tolist(), scan.headers["length"][mask].tolist()):
                live[EntryRef(segment, offset)] = length
        return live

    # ----------------------------------------------------------------- reading

    def _view(self, ref: EntryRef) -> tuple[memoryview, int, int]:
        """A read-only mapping of the ref's segment, and the entry's length and payload size
        from its checked header (checksum verified). KeyError if the entry is not stored
        (completed, deleted, or never written)."""
        store = self._store
        if ref.segment not in store.segments or store.state_at(ref.segment, ref.offset) != ENTRY_LIVE:
            raise KeyError(ref)
        (header,) = store.entry_header_columns(ref.segment, np.array([ref.offset], dtype=np.int64))
        length, payload_len = int(header["length"]), int(header["payload_len"])
        end = ref.offset + entry_size_bytes(length, payload_len)
        view = self._read_maps.get(ref.segment)
        if view is None or len(view) < end:
            # NOTE: a view into the store's own (writable) mapping was rejected: that mapping
            # is resized as the file grows and closed by the open-file cache, which numpy
            # views exported from it would forbid. A read-only mapping of its own is
            # dropped, not closed: a view still held keeps it alive.
            with open(store.segments[ref.segment].path, "rb") as file:
                view = memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
            self._read_maps[ref.segment] = view
            while len(self._read_maps) > READ_MAPS_MAX:
                self._read_maps.popitem(last=False)
        self._read_maps.move_to_end(ref.segment)
        if entry_checksum(view, ref.offset, end, length) != int(header["checksum"]):
            raise SegmentCorruptError(f"{store.segments[ref.segment].path}: offset {ref.offset}: checksum mismatch")
        return view, length, payload_len

    def read_tokens(self, ref: EntryRef) -> np.ndarray:
        """A zero-copy, read-only int32 view of the entry's tokens in the mapped segment
        (checksum verified first)."""
        view, length, _payload_len = self._view(ref)
        return np.frombuffer(view, dtype=TOKEN_DTYPE, count=length, offset=ref.offset + ENTRY_HEADER_SIZE_BYTES)

    def read_payload(self, ref: EntryRef) -> bytes:
        view, length, payload_len = self._view(ref)
        start = ref.offset + ENTRY_HEADER_SIZE_BYTES + length * TOKEN_SIZE_BYTES
        return bytes(view[start:start + payload_len])

    def entry_locations(self, peeked: Peeked) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lane ids, segment sequences, byte offsets) of every peeked entry: its segment
        file is `paths.segment_path(data_dir, model, signature, lane, segment_seq)`."""
        segments = peeked.segments
        lanes = np.empty(segments.shape[0], dtype=np.int64)
        seqs = np.empty(segments.shape[0], dtype=np.int64)
        for first, end in _runs(segments):
            keys = self._store.segments[SegmentId(int(segments[first]))].keys
            lanes[first:end], seqs[first:end] = keys.lane, keys.segment_seq
        return lanes, seqs, peeked.offsets

    # ----------------------------------------------------------------- lifecycle

    def check_invariants(self) -> None:
        """QueuedTier's checks over a scan of every segment file; the store's and the
        recovered structures agree. O(stored bytes): for tests."""
        super().check_invariants()
        assert len(self._read_maps) <= READ_MAPS_MAX
        assert not self._staged_queues or self._staging, "only `power` stages appends"

    def close(self) -> None:
        self._read_maps.clear()
        self._store.close()

    def abandon(self) -> None:
        """Let go of every file without syncing (SegmentStore.abandon): a kill -9, in-process."""
        self._read_maps.clear()
        self._store.abandon()


def _runs(segments: np.ndarray) -> list[tuple[int, int]]:
    """[first, end) of each run of equal segment ids (a lane's front is runs of segments)."""
    cuts = (np.flatnonzero(segments[1:] != segments[:-1]) + 1).tolist()
    return list(zip([0, *cuts], [*cuts, segments.shape[0]]))
