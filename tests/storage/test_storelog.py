"""The store log (`pipeline/storage/storelog.py`) against a reference: what was written
is what is read back, for seeded random runs of completions, boundaries and seals of
segments that share sequences, through syncs, torn tails, garbled unsynced sectors and
compactions; and at its edges (eight completions a record, the last slot, a sequence reused
under other keys)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pipeline.storage.identity import SegmentKeys
from pipeline.storage.storelog import StoreLog, decode_log, log_key, log_path, read_store_log
from pipeline.wire.errors import SegmentFormatError
from pipeline.wire.layouts.names import SEGMENT_SEQ_LIMIT
from pipeline.wire.layouts.segments import ENTRY_ALIGN_BYTES, SYNC_ALIGN_BYTES
from pipeline.wire.layouts.storelog import (
    COMPLETED_PER_RECORD,
    LOG_RECORD_SIZE_BYTES,
    LOG_SEGMENT_BYTES_LIMIT,
    log_checksums,
)

# Segments of the random runs: two pairs share a sequence under other keys (a test store may
# hold them; the keys tag keeps their records apart).
KEYS = [SegmentKeys(1, 0xAAA, 0, 0), SegmentKeys(1, 0xAAA, 1, 0), SegmentKeys(2, 0xBBB, 0, 5),
        SegmentKeys(2, 0xBBC, 0, 5), SegmentKeys(3, 1 << 63, 9999, SEGMENT_SEQ_LIMIT - 1)]


class Reference:
    """What the log should say of each segment: completions as a set, boundaries in order,
    the last seal."""

    def __init__(self) -> None:
        self.completed: dict[SegmentKeys, set[int]] = {k: set() for k in KEYS}
        self.boundaries: dict[SegmentKeys, list[tuple[int, int]]] = {k: [] for k in KEYS}
        self.sealed: dict[SegmentKeys, int | None] = {k: None for k in KEYS}

    def check(self, reading, keys: SegmentKeys, whole: bool = True) -> None:
        got = reading.of(keys)
        assert got.completed.tolist() == sorted(self.completed[keys])
        assert [tuple(b) for b in got.boundaries.tolist()] == self.boundaries[keys] or not whole
        last = self.boundaries[keys][-1] if self.boundaries[keys] else (None, None)
        assert (got.entry_count, got.data_end) == last
        assert got.sealed_count == self.sealed[keys]


def _step(rng: np.random.Generator, log: StoreLog, ref: Reference) -> None:
    keys = KEYS[int(rng.integers(len(KEYS)))]
    roll = rng.random()
    if roll < 0.6:
        offsets = (np.sort(rng.choice(4096, size=int(rng.integers(1, 30)), replace=False)) + 1) * ENTRY_ALIGN_BYTES
        log.completed(log_key(keys), offsets)
        ref.completed[keys] |= set(offsets.tolist())
    elif roll < 0.9:
        count, end = int(rng.integers(0, 1 << 20)), int(rng.integers(0, 1 << 40))
        log.boundary(log_key(keys), count, end)
        ref.boundaries[keys].append((count, end))
    else:
        count = int(rng.integers(0, 1 << 20))
        log.sealed(log_key(keys), count)
        ref.sealed[keys] = count


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("durable", [False, True])
def test_random_runs_read_back_as_the_reference(tmp_path, seed, durable):
    rng = np.random.default_rng(seed)
    log = StoreLog.open(str(tmp_path), durable)
    ref = Reference()
    for _ in range(200):
        _step(rng, log, ref)
        if rng.random() < 0.2:
            log.sync()
    log.close()
    reading = read_store_log(str(tmp_path))
    assert not reading.damaged and not reading.torn and reading.end == os.path.getsize(log_path(str(tmp_path)))
    for keys in KEYS:
        ref.check(reading, keys)
    assert reading.highest_seq == max(k.segment_seq for k in KEYS)


@pytest.mark.parametrize("seed", range(8))
def test_a_power_cut_garbles_only_what_was_not_synced(tmp_path, seed):
    # In `power` no write lands in a sector holding synced records: every sector written since
    # the last sync may read back as garbage (from the sector of the first write after it to
    # the end), and that costs only unsynced records and reads as a torn write, never damage.
    rng = np.random.default_rng(100 + seed)
    log = StoreLog.open(str(tmp_path), durable=True)
    ref = Reference()
    synced: Reference | None = None
    synced_end = 0
    for step in range(120):
        _step(rng, log, ref)
        if rng.random() < 0.25 or step == 60:
            log.sync()
            synced_end = log.end
            synced = _copy(ref)
    log.close()
    path = log_path(str(tmp_path))
    data = bytearray(open(path, "rb").read())
    written = np.flatnonzero(np.frombuffer(bytes(data[synced_end:]), dtype=np.uint8))
    if written.size:  # the sectors the writes after the sync touched, garbled whole
        at = (synced_end + int(written[0])) // SYNC_ALIGN_BYTES * SYNC_ALIGN_BYTES
        data[at:] = rng.integers(0, 256, size=len(data) - at, dtype=np.uint8).tobytes()
    reading = decode_log(bytes(data), path)
    assert not reading.damaged
    assert synced is not None
    for keys in KEYS:  # every synced record is there; more may be (those before the garbage)
        got = reading.of(keys)
        assert set(got.completed.tolist()) >= synced.completed[keys]
        assert [tuple(b) for b in got.boundaries.tolist()][:len(synced.boundaries[keys])] == synced.boundaries[keys]


def _copy(ref: Reference) -> Reference:
    out = Reference()
    out.completed = {k: set(v) for k, v in ref.completed.items()}
    out.boundaries = {k: list(v) for k, v in ref.boundaries.items()}
    out.sealed = dict(ref.sealed)
    return out


def test_a_record_damaged_before_the_last_is_named_and_untrusts_every_segment(tmp_path):
    # Damage is a bad record before the last valid one of an epoch older than the newest (it
    # was synced); a bad record after that may be one written since the last sync.
    log = StoreLog.open(str(tmp_path), durable=False)
    for keys in KEYS[:4]:
        log.completed(log_key(keys), np.array([4096]))
        log.sync()  # each its own epoch: the first three were synced once the fourth was written
    log.close()
    path = log_path(str(tmp_path))
    data = bytearray(open(path, "rb").read())
    data[LOG_RECORD_SIZE_BYTES + 30] ^= 0x10  # the second record's body
    reading = decode_log(bytes(data), path)
    assert reading.damaged == [f"{path}: offset {LOG_RECORD_SIZE_BYTES}: store log record fails its checks "
                               f"(magic, version, kind or checksum)"]
    assert reading.of(KEYS[0]).completed.tolist() == [4096] and reading.of(KEYS[1]).completed.size == 0
    assert all(reading.of(k).untrusted for k in KEYS)
    data[LOG_RECORD_SIZE_BYTES + 30] ^= 0x10  # whole again; now the third goes bad, after the last synced one
    data[2 * LOG_RECORD_SIZE_BYTES + 30] ^= 0x10
    torn = decode_log(bytes(data), path)
    assert not torn.damaged and "torn write" in torn.torn and not any(torn.of(k).untrusted for k in KEYS)


def test_compaction_keeps_the_live_segments_records_and_drops_the_rest(tmp_path):
    rng = np.random.default_rng(5)
    log = StoreLog.open(str(tmp_path), durable=True)
    ref = Reference()
    for _ in range(300):
        _step(rng, log, ref)
        if rng.random() < 0.3:
            log.sync()
    before = log.end
    live = KEYS[1:3]
    log.compact(str(tmp_path), live)
    assert log.end < before
    log.completed(log_key(KEYS[1]), np.array([16 * 4095]))  # the same object appends to the new file
    ref.completed[KEYS[1]].add(16 * 4095)
    log.close()
    reading = read_store_log(str(tmp_path))
    assert not reading.damaged and not reading.torn
    for keys in live:
        ref.check(reading, keys, whole=False)  # the last boundary is kept, not every one
    for keys in set(KEYS) - set(live):
        gone = reading.of(keys)
        assert gone.completed.size == 0 and gone.data_end is None and gone.sealed_count is None


def test_a_torn_tail_is_cut_away_when_the_log_is_opened(tmp_path):
    log = StoreLog.open(str(tmp_path), durable=False)
    log.completed(log_key(KEYS[0]), np.array([4096, 4160]))
    log.close()
    path = log_path(str(tmp_path))
    with open(path, "ab") as file:
        file.write(b"\x07" * 40)  # half a record: a crash mid-append
    assert "torn write" in read_store_log(str(tmp_path)).torn
    again = StoreLog.open(str(tmp_path), durable=False)
    again.completed(log_key(KEYS[0]), np.array([4224]))
    again.close()
    reading = read_store_log(str(tmp_path))
    assert not reading.torn and not reading.damaged and reading.of(KEYS[0]).completed.tolist() == [4096, 4160, 4224]


@pytest.mark.parametrize("count", [1, COMPLETED_PER_RECORD - 1, COMPLETED_PER_RECORD, COMPLETED_PER_RECORD + 1])
def test_completions_fill_records_eight_at_a_time(tmp_path, count):
    log = StoreLog.open(str(tmp_path), durable=False)
    offsets = (np.arange(count) + 256) * ENTRY_ALIGN_BYTES
    log.completed(log_key(KEYS[0]), offsets)
    log.close()
    assert os.path.getsize(log_path(str(tmp_path))) == LOG_RECORD_SIZE_BYTES * -(-count // COMPLETED_PER_RECORD)
    assert read_store_log(str(tmp_path)).of(KEYS[0]).completed.tolist() == offsets.tolist()


def test_the_last_offset_a_slot_holds_and_one_past_it(tmp_path):
    log = StoreLog.open(str(tmp_path), durable=False)
    last = LOG_SEGMENT_BYTES_LIMIT - ENTRY_ALIGN_BYTES
    log.completed(log_key(KEYS[0]), np.array([last]))
    assert read_store_log(str(tmp_path)).of(KEYS[0]).completed.tolist() == [last]
    for bad in (LOG_SEGMENT_BYTES_LIMIT, 0):  # no segment grows this large; no entry starts at 0: our bugs
        with pytest.raises(AssertionError):
            log.completed(log_key(KEYS[0]), np.array([bad]))
    log.close()


def test_a_sequence_reused_under_other_keys_keeps_its_records_apart(tmp_path):
    log = StoreLog.open(str(tmp_path), durable=False)
    log.completed(log_key(KEYS[2]), np.array([4096]))
    log.completed(log_key(KEYS[3]), np.array([8192]))
    log.close()
    reading = read_store_log(str(tmp_path))
    assert reading.of(KEYS[2]).completed.tolist() == [4096] and reading.of(KEYS[3]).completed.tolist() == [8192]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("sector_bytes", [512, 4096])
def test_each_sector_written_since_the_last_sync_may_read_back_anyhow(tmp_path, seed, sector_bytes):
    # A power cut leaves each sector written since the last sync as written, as before, or as
    # garbage, each sector on its own (`lab.reliability.faults.PowerCut`'s `mixed`): every
    # synced record reads back, and nothing is judged damage (what is lost was never synced).
    rng = np.random.default_rng(300 + seed)
    log = StoreLog.open(str(tmp_path), durable=True)
    ref = Reference()
    synced, synced_end = _copy(ref), 0
    for step in range(150):
        _step(rng, log, ref)
        if rng.random() < 0.15:
            log.sync()
            synced, synced_end = _copy(ref), log.end
    log.close()
    path = log_path(str(tmp_path))
    data = bytearray(open(path, "rb").read())
    written = np.flatnonzero(np.frombuffer(bytes(data[synced_end:]), dtype=np.uint8))
    first = (synced_end + int(written[0])) // sector_bytes * sector_bytes if written.size else len(data)
    for at in range(first, len(data), sector_bytes):  # every sector the writes since the sync touched
        fate = rng.integers(3)
        if fate == 1:
            data[at:at + sector_bytes] = bytes(len(data[at:at + sector_bytes]))  # as before: never written
        elif fate == 2:
            data[at:at + sector_bytes] = rng.integers(0, 256, size=len(data[at:at + sector_bytes]),
                                                      dtype=np.uint8).tobytes()
    reading = decode_log(bytes(data), path)
    assert not reading.damaged, reading.damaged
    for keys in KEYS:
        got = reading.of(keys)
        assert not got.untrusted and set(got.completed.tolist()) >= synced.completed[keys]
        assert [tuple(b) for b in got.boundaries.tolist()][:len(synced.boundaries[keys])] == synced.boundaries[keys]


def test_a_record_of_another_version_is_refused_not_dropped(tmp_path):
    log = StoreLog.open(str(tmp_path), durable=False)
    log.completed(log_key(KEYS[0]), np.array([4096]))
    log.close()
    path = log_path(str(tmp_path))
    words = np.fromfile(path, dtype="<u8").reshape(-1, 8)
    words[0, 0] += np.uint64(1 << 32)  # the version field, the record checksummed as its writer would
    words[0, 7] = log_checksums(words[:1, :7])[0]
    words.tofile(path)
    with pytest.raises(SegmentFormatError, match="version"):
        read_store_log(str(tmp_path))


def test_what_a_compaction_wrote_is_synced_and_what_followed_it_may_be_torn(tmp_path):
    """Epoch 0 is a compaction's, made durable whole before its rename: a bad record in it is
    damage even with nothing appended since; records appended after it (epoch 1, not yet
    synced) that read back garbled are a torn write, and the compacted ones stay whole."""
    log = StoreLog.open(str(tmp_path), durable=True)
    log.completed(log_key(KEYS[0]), np.array([4096, 4160]))
    log.boundary(log_key(KEYS[0]), 2, 4224)
    log.compact(str(tmp_path), [KEYS[0]])
    compacted = log.end
    log.completed(log_key(KEYS[0]), np.array([4224]))  # after the compaction, never synced
    path = log_path(str(tmp_path))
    with open(path, "r+b") as file:  # that sector garbled by a power cut
        file.seek(-(-compacted // SYNC_ALIGN_BYTES) * SYNC_ALIGN_BYTES)
        file.write(os.urandom(LOG_RECORD_SIZE_BYTES))
    log.close()
    reading = read_store_log(str(tmp_path))
    assert not reading.damaged and "torn write" in reading.torn
    assert reading.of(KEYS[0]).completed.tolist() == [4096, 4160] and reading.of(KEYS[0]).data_end == 4224
    with open(path, "r+b") as file:  # the compacted records' sector: synced, so damage
        file.truncate(compacted)
        file.seek(8)
        file.write(b"\xff")
    reading = read_store_log(str(tmp_path))
    assert reading.damaged and f"{path}: offset 0" in reading.damaged[0]
