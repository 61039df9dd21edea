"""The disk tier on real files (pipeline/storage/disk.py): what the interface tests
(test_storage_tier.py) cannot see: byte-offset refs and zero-copy
reads, the `power` group commit, recovery (queues, lane ids, the already-stored check, torn
tails, corruption), a full disk (a fake one, and a real 2 MiB tmpfs), a failing fsync, and
the open-file bound. Deterministic: seeded, no wall clock."""

from __future__ import annotations

import errno
import glob
import os
import shutil
import subprocess

import numpy as np
import pytest
from tests.support.frames import make_frame, token_ids

from pipeline.broker.dispatch import Dispatcher
from pipeline.broker.ids import BatchId, ConsumerId, LaneId, LaneKey, ShapeKey
from pipeline.broker.packing import Contract
from pipeline.storage import AppendGroup, DiskTier, Durability
from pipeline.storage.inspect import verify
from pipeline.storage.paths import iter_segments, segment_path
from pipeline.storage.queues import StoredSeqs
from pipeline.storage.segment import scan_segment
from pipeline.storage.storelog import StoreLog, log_key
from pipeline.wire.errors import DiskFullError, DurabilityError
from pipeline.wire.layouts.frames import ProducerId
from pipeline.wire.layouts.segments import ENTRY_HEADER_SIZE_BYTES

LANE_A = LaneKey(0, 0xA1, LaneId(0))
LANE_B = LaneKey(0, 0xA1, LaneId(1))
BIG = Contract(model=0, max_batch_items=64, max_batch_tokens=1 << 20, max_input_len=8192)


def append(tier: DiskTier, lane: LaneKey, producer: int, first_seq: int, lengths: list[int]) -> list:
    frame = make_frame(producer, first_seq, [(lane.model, lane.signature)] * len(lengths), lengths,
                       submit_ns=first_seq, payloads=[bytes([i]) * (i % 4) for i in range(len(lengths))])
    refs = tier.append(AppendGroup(lane, frame, np.arange(len(lengths))))
    tier.flush()
    return refs


def drain(dispatcher: Dispatcher, consumer: int = 1) -> list[int]:
    """Dispatch and complete everything; the item ids in dispatch order."""
    done = []
    while (batch := dispatcher.next_batch(ConsumerId(consumer), BIG, 0.0)) is not None:
        for entry in batch.entries:
            tokens = dispatcher.storage.read_tokens(entry.ref)
            assert np.array_equal(tokens, token_ids(entry.item_id, entry.length))
        dispatcher.commit(batch)
        dispatcher.complete_batch(ConsumerId(consumer), batch)
        done += [entry.item_id for entry in batch.entries]
    return done


def test_refs_are_byte_offsets_and_reads_are_zero_copy(tmp_path):
    tier = DiskTier.open(str(tmp_path))
    refs = append(tier, LANE_A, 3, 0, [5, 300, 17])
    (path,) = [s.path for s in tier.store.segments.values()]
    assert [r.offset for r in refs] == scan_segment(path).offsets.tolist()
    for ref, entry in zip(refs, tier.peek_many(LANE_A, 3)):
        tokens = tier.read_tokens(ref)
        assert entry.ref == ref and entry.producer_id == 3 and entry.lane == LANE_A
        assert np.array_equal(tokens, token_ids(entry.item_id, entry.length))
        assert not tokens.flags.writeable and not tokens.flags.owndata  # a view of the mapping
        assert tokens.ctypes.data % 16 == 0
    assert [tier.read_payload(r) for r in refs] == [b"", b"\x01", b"\x02\x02"]
    tier.check_invariants()
    tier.close()


def test_power_entries_wait_for_the_group_commit(tmp_path):
    tier = DiskTier.open(str(tmp_path), Durability.POWER)
    frame = make_frame(1, 0, [(0, 0xA1)] * 4, [8, 9, 10, 11])
    tier.append(AppendGroup(LANE_A, frame, np.arange(4)))
    assert tier.needs_flush and len(tier.peek_many(LANE_A, 10)) == 0 and tier.queued_items(LANE_A) == 4
    dispatcher = Dispatcher(tier)
    with pytest.raises(AssertionError, match="flush"):
        dispatcher.next_batch(ConsumerId(1), BIG, 0.0)
    tier.check_invariants()
    tier.flush()
    assert not tier.needs_flush and tier.peek_many(LANE_A, 10).lengths.tolist() == [8, 9, 10, 11]
    tier.close()


def test_recovery_rebuilds_queues_in_segment_then_file_order(tmp_path):
    tier = DiskTier.open(str(tmp_path), segment_max_bytes=8 << 10)
    seq = 0
    for round_ in range(6):  # segments of lane A rotate; lane B interleaves
        for lane in (LANE_A, LANE_B):
            lengths = [100 + 10 * round_ + i for i in range(5)]
            append(tier, lane, 9, seq, lengths)
            seq += 5
    assert len(set(tier.peek_many(LANE_A, 100).segments.tolist())) > 2
    front = tier.peek_many(LANE_A, 7)
    tier.commit(LANE_A, front[:3], ConsumerId(1), BatchId(0))
    tier.commit(LANE_A, front[3:], ConsumerId(1), BatchId(1))
    tier.complete_batch(ConsumerId(1), BatchId(0))  # batch 1's 4 stay pending: live again
    expected = {lane: tier.peek_many(lane, 100).item_ids.tolist() for lane in (LANE_A, LANE_B)}
    expected[LANE_A] = front[3:].item_ids.tolist() + expected[LANE_A]
    tier.close()

    again = DiskTier.open(str(tmp_path), segment_max_bytes=8 << 10)
    report = again.recovery
    assert report.live_entries == 60 - 3 and not report.quarantined and not report.torn_tails
    for lane in (LANE_A, LANE_B):
        assert again.peek_many(lane, 100).item_ids.tolist() == expected[lane]
    lanes = {found.lane: found.lengths.tolist() for found in again.take_recovered_lanes()}
    assert lanes == {lane: again.peek_many(lane, 100).lengths.tolist() for lane in (LANE_A, LANE_B)}
    assert again.take_recovered_lanes() == []
    seqs = np.arange(60, dtype=np.uint64)
    completed = {int(e.seq) for e in front[:3]}
    assert again.already_stored(ProducerId(9), seqs).tolist() == [s not in completed for s in range(60)]
    again.check_invariants()
    assert verify(str(tmp_path)).ok
    again.close()


def test_dispatcher_recovers_lane_ids_and_resumes(tmp_path):
    tier = DiskTier.open(str(tmp_path))
    dispatcher = Dispatcher(tier)
    shapes = [(0, 1)] * 6 + [(0, 2)] * 3
    dispatcher.ingest(make_frame(4, 0, shapes, [500, 510, 1000, 1004, 90, 505, 70, 71, 300]), 0.0)
    dispatcher.flush()
    before = {shape: [(v.lane_id, v.queued_items, v.queued_tokens) for v in dispatcher.lanes(shape).lanes()]
              for shape in dispatcher.shapes()}
    tier.close()

    tier = DiskTier.open(str(tmp_path))
    dispatcher = Dispatcher(tier)
    with pytest.raises(AssertionError, match="recover"):
        dispatcher.next_batch(ConsumerId(1), BIG, 0.0)
    assert dispatcher.recover(1.0) == 9
    after = {shape: [(v.lane_id, v.queued_items, v.queued_tokens) for v in dispatcher.lanes(shape).lanes()]
             for shape in dispatcher.shapes()}
    assert sorted(map(sorted, after.values())) == sorted(map(sorted, before.values()))
    dispatcher.check_invariants()
    report = dispatcher.ingest(make_frame(4, 0, shapes, [500, 510, 1000, 1004, 90, 505, 70, 71, 300]), 1.0)
    assert (report.items, report.duplicates) == (0, 9)  # the ring presented it again
    dispatcher.ingest(make_frame(4, 9, [(0, 1), (0, 3)], [507, 40]), 1.0)
    dispatcher.flush()
    dispatcher.check_invariants()
    assert sorted(drain(dispatcher)) == [(4 << 40) | s for s in range(11)]
    counters = dispatcher.counters()
    assert counters.items_recovered == 9 and counters.items_received == 2
    assert counters.items_completed == 11
    assert counters.lanes.restored == sum(len(lanes) for lanes in before.values())
    dispatcher.check_invariants()
    tier.close()


def test_partly_stored_frame_is_completed_exactly_on_reingest(tmp_path):
    """A crash between a frame's lane groups: recovery finds some of its items; the frame
    comes again from the ring and exactly the missing ones are stored (a high-water mark
    would skip seq 1, which sits below the stored seq 2)."""
    frame = make_frame(6, 0, [(0, 7)] * 4, [100, 900, 105, 910])
    tier = DiskTier.open(str(tmp_path))
    dispatcher = Dispatcher(tier)
    dispatcher.recover(0.0)
    tier.append(AppendGroup(LaneKey(0, 7, LaneId(0)), frame, np.array([0, 2])))  # seqs 0 and 2
    tier.close()  # ... and the broker died before the group of seqs 1 and 3

    tier = DiskTier.open(str(tmp_path))
    dispatcher = Dispatcher(tier)
    assert dispatcher.recover(0.0) == 2
    report = dispatcher.ingest(frame, 0.0)
    assert (report.items, report.duplicates) == (2, 2)
    dispatcher.flush()
    dispatcher.check_invariants()
    assert verify(str(tmp_path)).ok  # no item stored twice
    assert sorted(drain(dispatcher)) == [(6 << 40) | s for s in range(4)]
    tier.close()


def write_lane(data_dir: str, lengths: list[int], lane: LaneKey = LANE_A, producer: int = 1) -> str:
    tier = DiskTier.open(data_dir)
    for seq, length in enumerate(lengths):
        append(tier, lane, producer, seq, [length])
    (path,) = [s.path for s in tier.store.segments.values() if s.lane == lane]
    tier.close()
    return path


def test_torn_tail_of_an_unacknowledged_write_through_recovery(tmp_path):
    """A crash cut the last write short before the header's boundary moved (it was never
    acknowledged): the whole entries are queued, the torn bytes kept and named as a torn
    tail, and verify passes (nothing acknowledged is lost)."""
    pristine = str(tmp_path / "pristine")
    path = write_lane(pristine, [6, 7, 5, 8])
    whole = scan_segment(path)
    last, end = int(whole.offsets[-1]), whole.data_end
    log = StoreLog.open(pristine, durable=False)
    log.boundary(log_key(whole.keys), 3, last)  # the boundary before the last write (the last record is read back)
    log.close()
    original = np.fromfile(path, dtype=np.uint8)
    content_end = last + int(np.flatnonzero(original[last:end])[-1]) + 1
    work = str(tmp_path / "work")
    for cut in range(last + 1, content_end):  # the write stopped `cut - last` bytes in
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        damaged_path = path.replace(pristine, work)
        damaged = original.copy()
        damaged[cut:end] = 0
        damaged.tofile(damaged_path)
        tier = DiskTier.open(work)
        report = tier.recovery
        assert [(t.path, t.offset) for t in report.torn_tails] == [(damaged_path, last)], cut
        assert 0 < report.torn_tails[0].size_bytes <= cut - last
        assert tier.peek_many(LANE_A, 10).lengths.tolist() == [6, 7, 5] and report.ok, cut
        tier.check_invariants()
        tier.close()
        result = verify(work)
        assert result.ok and any("torn tail" in note for note in result.notes), cut


def test_bit_flip_in_entry_15_of_28_loses_that_entry_only(tmp_path):
    """One flipped byte in entry 15 of a 28-entry segment once quarantined the whole file.
    Now the 27 intact entries are queued and delivered, the damage is named with its
    offset and item id, and once the 27 are done the file goes to quarantine/, never
    deleted; verify fails throughout."""
    data_dir = str(tmp_path)
    path = write_lane(data_dir, [40 + n for n in range(28)])
    write_lane(data_dir, [30] * 3, lane=LANE_B, producer=2)
    whole = scan_segment(path)
    victim, victim_id = int(whole.offsets[14]), int(whole.headers["item_id"][14])
    with open(path, "r+b") as file:
        file.seek(victim + ENTRY_HEADER_SIZE_BYTES + 9)
        byte = file.read(1)
        file.seek(victim + ENTRY_HEADER_SIZE_BYTES + 9)
        file.write(bytes([byte[0] ^ 0x04]))
    assert not verify(data_dir).ok
    tier = DiskTier.open(data_dir)
    report = tier.recovery
    (damaged,) = report.damaged
    assert (damaged.path, damaged.offset, damaged.item_id, damaged.entries) == (path, victim, victim_id, 1)
    assert f"{path}: bytes {victim}.." in report.summary() and str(victim_id) in report.summary()
    assert report.damage_counts()["entries_damaged"] == 1 and not report.quarantined
    assert tier.queued_items(LANE_A) == 27 and tier.queued_items(LANE_B) == 3
    tier.check_invariants()
    dispatcher = Dispatcher(tier)
    assert dispatcher.recover(0.0) == 30
    done = drain(dispatcher)  # every one checked against its tokens
    assert sorted(done) == sorted(set(whole.headers["item_id"].tolist()) - {victim_id} | {(2 << 40) | s for s in range(3)})
    (moved,), _notes = tier.take_quarantined()
    assert moved.path == path and os.path.exists(moved.moved_to) and not os.path.exists(path)
    assert report.damage_counts()["entries_damaged"] == 1  # the report stays after release_scans
    tier.close()
    result = verify(data_dir)
    assert not result.ok and any(moved.moved_to in p and "QUARANTINED" in p for p in result.problems)


class FullDisk:
    """Wraps a store's append: after `room` more appends it raises DiskFullError, as ENOSPC
    would (None: room for everything)."""

    def __init__(self, tier: DiskTier) -> None:
        self.room: int | None = None
        self._append = tier.store.append
        tier.store.append = self.append  # type: ignore[method-assign]

    def append(self, lane, group, now_s):
        if self.room is not None:
            if not self.room:
                raise DiskFullError(f"fake: disk full writing {group.data.nbytes} bytes at offset 0")
            self.room -= 1
        return self._append(lane, group, now_s)


def test_full_disk_holds_back_what_it_did_not_store_and_retry_stores_it_once(tmp_path):
    tier = DiskTier.open(str(tmp_path))
    disk = FullDisk(tier)
    dispatcher = Dispatcher(tier)
    dispatcher.ingest(make_frame(1, 0, [(0, 5)] * 3, [100, 104, 900]), 0.0)
    dispatcher.flush()
    # The next frame spans three lanes: the first group is stored, the second hits the full disk.
    frame = make_frame(1, 3, [(0, 5), (0, 5), (0, 6)], [101, 905, 50])
    disk.room = 1
    with pytest.raises(DiskFullError):
        dispatcher.ingest(frame, 0.0)
    dispatcher.flush()
    assert dispatcher.pending_appends == 2
    dispatcher.check_invariants()
    with pytest.raises(AssertionError, match="retry_pending_appends"):
        dispatcher.ingest(make_frame(1, 6, [(0, 5)], [100]), 0.0)
    # Consumers are still served: the held frame's stored item (seq 3) too, so that its
    # completion can free space; its unstored ones (4, 5) stay held.
    served = []
    while (batch := dispatcher.next_batch(ConsumerId(1), BIG, 0.0)) is not None:
        dispatcher.commit(batch)
        dispatcher.complete_batch(ConsumerId(1), batch)
        served += [entry.seq for entry in batch.entries]
        dispatcher.check_invariants()
    assert sorted(served) == [0, 1, 2, 3]
    with pytest.raises(DiskFullError):
        dispatcher.retry_pending_appends()
    disk.room = None
    report = dispatcher.retry_pending_appends()
    assert (report.items, report.duplicates) == (3, 0) and dispatcher.pending_appends == 0
    assert dispatcher.retry_pending_appends() is None
    dispatcher.flush()
    dispatcher.check_invariants()
    assert sorted(drain(dispatcher)) == [(1 << 40) | s for s in (4, 5)]
    c = dispatcher.counters()
    assert c.items_received == c.items_completed == 6 and c.duplicate_items == 0
    tier.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs mounted for the test (we run as root), unmounted after."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.fail(f"cannot mount a tmpfs (root needed): {done.stderr.strip()}")
    try:
        yield str(mount_point)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.mark.integration
def test_the_store_leaves_its_reserve_free_for_results(small_tmpfs):
    """Allocation stops while less than the reserve would stay free (for the consumers'
    results on the same disk): a DiskFullError naming it, before the kernel's ENOSPC."""
    from pipeline.storage.diskio import disk_reserve_bytes

    data_dir = os.path.join(small_tmpfs, "data")
    tier = DiskTier.open(data_dir, segment_max_bytes=64 << 10)
    dispatcher = Dispatcher(tier)
    seq, full_error = 0, None
    while full_error is None:
        try:
            dispatcher.ingest(make_frame(2, seq, [(0, 1 + seq % 3)] * 8, [700] * 8), 0.0)
        except DiskFullError as exc:
            full_error = exc
        dispatcher.flush()
        seq += 8
    info = os.statvfs(small_tmpfs)
    reserve = disk_reserve_bytes(info.f_blocks * info.f_frsize)
    assert "kept free for results" in str(full_error) and full_error.__cause__ is None
    assert info.f_bavail * info.f_frsize >= reserve
    tier.close()


@pytest.mark.integration
def test_enospc_on_a_real_full_disk_loses_nothing(small_tmpfs, monkeypatch):
    # The kernel's ENOSPC itself (a disk someone else filled under the reserve's check):
    # with no reserve the appends run into it.
    monkeypatch.setattr("pipeline.storage.segment._check_room", lambda *args, **_kw: args[3])
    data_dir = os.path.join(small_tmpfs, "data")
    filler = os.path.join(small_tmpfs, "filler")
    with open(filler, "wb") as file:
        file.write(b"\xff" * (1200 << 10))  # leaves about 800 KiB for segments
    tier = DiskTier.open(data_dir, segment_max_bytes=64 << 10)
    dispatcher = Dispatcher(tier)
    rng = np.random.default_rng(5)
    seq, accepted, full_error = 0, 0, None
    while full_error is None:
        count = int(rng.integers(1, 12))
        shapes = [(0, int(s)) for s in rng.integers(1, 4, count)]
        frame = make_frame(2, seq, shapes, rng.integers(50, 900, count).tolist())
        try:
            dispatcher.ingest(frame, 0.0)
        except DiskFullError as exc:
            full_error = exc
        else:
            accepted += count
        dispatcher.flush()
        seq += count
    assert data_dir in str(full_error) and "offset" in str(full_error)
    assert isinstance(full_error.__cause__, OSError) and full_error.__cause__.errno == errno.ENOSPC
    dispatcher.check_invariants()
    held = dispatcher.pending_appends
    assert held > 0 and dispatcher.counters().items_received == accepted + (count - held)
    with pytest.raises(DiskFullError):  # still full: backpressure goes on
        dispatcher.retry_pending_appends()
    os.unlink(filler)  # space comes back
    assert dispatcher.retry_pending_appends().items == count
    dispatcher.flush()
    frame = make_frame(2, seq, [(0, 1)] * 3, [60, 61, 62])
    assert dispatcher.ingest(frame, 0.0).items == 3
    dispatcher.flush()
    dispatcher.check_invariants()
    assert verify(data_dir).ok  # every item stored exactly once
    assert sorted(drain(dispatcher)) == [(2 << 40) | s for s in range(seq + 3)]
    dispatcher.check_invariants()
    tier.close()


def test_failing_fdatasync_is_a_fatal_durability_error(tmp_path, monkeypatch):
    tier = DiskTier.open(str(tmp_path), Durability.POWER)
    tier.append(AppendGroup(LANE_A, make_frame(1, 0, [(0, 0xA1)], [8]), np.arange(1)))

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(DurabilityError, match="fdatasync failed.*must stop") as caught:
        tier.flush()
    assert str(tmp_path) in str(caught.value)
    assert len(tier.peek_many(LANE_A, 1)) == 0  # never made dispatchable
    monkeypatch.undo()
    tier.close()


def test_many_lanes_with_a_small_open_file_bound(tmp_path):
    tier = DiskTier.open(str(tmp_path), open_files_max=4)
    lanes = [LaneKey(m, 0xC0 + m, LaneId(lane)) for m in range(3) for lane in range(40)]
    for n, lane in enumerate(lanes):
        append(tier, lane, 1, 2 * n, [10 + lane.lane, 11 + lane.lane])
    for n, lane in enumerate(lanes):
        front = tier.peek_many(lane, 5)
        assert len(front) == 2
        tier.commit(lane, front, ConsumerId(1), BatchId(n))
        tier.complete_batch(ConsumerId(1), BatchId(n))
        tier.drop_lane(lane)  # sealed, fully tombstoned: deleted whole
    assert len(tier.store._open) <= 4 and tier.store.files_closed_by_cache > 0
    assert not list(iter_segments(str(tmp_path)))
    tier.check_invariants()
    tier.close()


def test_stored_seqs_exact_after_recovery_and_trimmed_as_ingest_advances():
    stored = StoredSeqs()
    producer = ProducerId(1)
    stored.add_recovered(producer, np.array([7, 3, 9, 12], dtype=np.uint64))
    seqs = np.arange(14, dtype=np.uint64)
    assert np.flatnonzero(stored.mask(producer, seqs)).tolist() == [3, 7, 9, 12]
    assert stored.highest(producer) == 12 and stored.memory_bytes() == 32
    stored.appended(producer, 8)  # this process stored up to 8: everything <= 8 counts
    assert np.flatnonzero(stored.mask(producer, seqs)).tolist() == [*range(9), 9, 12]
    assert stored.memory_bytes() == 16
    stored.appended(producer, 13)
    assert stored.memory_bytes() == 0 and stored.mask(producer, seqs).all()
    assert not stored.mask(ProducerId(2), seqs).any()
    stored.check()


def test_shape_key_of_recovered_lanes_matches_segments(tmp_path):
    """Recovered lanes are keyed exactly as their segment files: model, signature, lane."""
    tier = DiskTier.open(str(tmp_path))
    lane = LaneKey(3, 0xFFFF_FFFF_FFFF_FFF0, LaneId(2047))
    append(tier, lane, 1, 0, [4])
    tier.close()
    tier = DiskTier.open(str(tmp_path))
    (found,) = tier.take_recovered_lanes()
    assert found.lane == lane and found.lane.shape == ShapeKey(3, 0xFFFF_FFFF_FFFF_FFF0)
    tier.close()


def test_entry_locations_name_the_segment_files(tmp_path):
    tier = DiskTier.open(str(tmp_path), segment_max_bytes=8 << 10)
    refs = [*append(tier, LANE_B, 1, 0, [600] * 3), *append(tier, LANE_B, 1, 3, [600] * 3)]
    front = tier.peek_many(LANE_B, 6)
    assert front.refs == refs and [e.ref for e in front] == refs  # columns, entries alike
    lanes, seqs, offsets = (column.tolist() for column in tier.entry_locations(front))
    for ref, lane, segment_seq, offset in zip(refs, lanes, seqs, offsets):
        path = segment_path(str(tmp_path), LANE_B.model, LANE_B.signature, lane, segment_seq)
        assert (lane, offset) == (1, ref.offset) and offset in scan_segment(path).offsets.tolist()
    assert len(set(seqs)) > 1  # it rotated
    tier.close()


@pytest.mark.campaign
@pytest.mark.slow
def test_one_hundred_thousand_lanes_with_bounded_open_files(tmp_path):
    # SPEC §5: 100,000 lanes across shapes must not exhaust descriptors (the soft limit here
    # is far below 100,000) and must not take the disk (64 KiB first allocation each).
    tier = DiskTier.open(str(tmp_path), open_files_max=64)
    lanes = [LaneKey(0, 0x1000 + n // 2000, LaneId(n % 2000)) for n in range(100_000)]
    for n, lane in enumerate(lanes):
        append(tier, lane, 1, n, [16])
    assert len(tier.store._open) <= 64
    assert sum(1 for _ in iter_segments(str(tmp_path))) == 100_000
    for n in (0, 54_321, 99_999):
        (entry,) = tier.peek_many(lanes[n], 5)
        assert tier.read_tokens(entry.ref).shape == (16,)
    tier.close()


@pytest.mark.integration
def test_running_out_of_inodes_is_backpressure_not_a_crash(tmp_path):
    """A file system with no inode left refuses a new shape's directory or segment file with
    ENOSPC: that is a full disk (DiskFullError, the frame held back), never an OSError that
    stops the broker; and a store with no inode to spare still opens (its store log is not
    compacted then), with every frame that was stored, once."""
    mount_point = tmp_path / "inodes"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,nr_inodes=24,mode=0700", "tmpfs",
                           str(mount_point)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs (root needed): {done.stderr.strip()}")
    try:
        data_dir = str(mount_point / "data")
        tier = DiskTier.open(data_dir)
        dispatcher = Dispatcher(tier)
        seq, full_error = 0, None
        while full_error is None:  # each frame is a new shape: a directory and a file
            try:
                dispatcher.ingest(make_frame(3, seq, [(0, 0x100 + seq)], [40]), 0.0)
            except DiskFullError as exc:
                full_error = exc
            dispatcher.flush()
            seq += 1
        assert "disk full" in str(full_error) and isinstance(full_error.__cause__, OSError)
        assert full_error.__cause__.errno == errno.ENOSPC
        dispatcher.check_invariants()
        with pytest.raises(DiskFullError):
            dispatcher.retry_pending_appends()  # still no inode
        tier.close()
        tier = DiskTier.open(data_dir)  # reopened with no inode to spare: every stored frame, once
        assert tier.queued_items() == seq - 1 and tier.recovery.ok
        tier.close()
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def test_a_recovered_lane_beyond_the_lane_budget_is_refused_by_name(tmp_path):
    """A store written with a larger lane budget (or a segment named by hand): the broker's
    lanes cannot hold the lane id, so recovery refuses it with the lane and its items named,
    a one-line start failure, never an assert."""
    from pipeline.broker.lanes import LaneConfig
    from pipeline.wire.errors import StorageError

    data_dir = str(tmp_path / "data")
    tier = DiskTier.open(data_dir)
    tier.append(AppendGroup(LaneKey(0, 0xA1, 3000), make_frame(1, 0, [(0, 0xA1)] * 4, [8] * 4), np.arange(4)))
    tier.flush()
    tier.close()
    reopened = DiskTier.open(data_dir)
    try:
        with pytest.raises(StorageError, match=r"\(4 items\): lane id 3000 is beyond this broker.s lane budget of 2048"):
            Dispatcher(reopened, lane_config=LaneConfig(max_lanes=2048)).recover(0.0)
    finally:
        reopened.close()
    wide = DiskTier.open(data_dir)
    try:
        assert Dispatcher(wide, lane_config=LaneConfig(max_lanes=4096)).recover(0.0) == 4  # a budget that holds it
    finally:
        wide.close()


def test_a_segment_whose_header_lane_field_flipped_is_salvaged_under_the_name_the_log_knows(tmp_path):
    """One flipped byte in a header's lane field: the identity checksum fails and the key
    fields disagree with the file name, but the store log recorded a segment of exactly the
    name's keys. Its entries are delivered under them, through the open-file cache's
    reopens too, and the file goes to quarantine/ once they are done, never deleted."""
    data_dir = str(tmp_path / "data")
    tier = DiskTier.open(data_dir)
    tier.append(AppendGroup(LANE_A, make_frame(1, 0, [(0, 0xA1)] * 6, [40] * 6), np.arange(6)))
    tier.append(AppendGroup(LaneKey(0, 0xA1, 1), make_frame(1, 6, [(0, 0xA1)] * 2, [80] * 2), np.arange(2)))
    tier.flush()
    tier.close()
    path = segment_path(data_dir, 0, 0xA1, LANE_A.lane, 0)
    with open(path, "r+b") as file:  # the lane field of the identity block
        file.seek(20)
        byte = file.read(1)
        file.seek(20)
        file.write(bytes([byte[0] ^ 0x04]))
    tier = DiskTier.open(data_dir, open_files_max=1)  # every other access reopens a file
    try:
        assert tier.recovery.damaged_identities and tier.queued_items() == 8
        dispatcher = Dispatcher(tier)
        dispatcher.recover(0.0)
        assert sorted(drain(dispatcher)) == [(1 << 40) | s for s in range(8)]
        dispatcher.check_invariants()
    finally:
        tier.close()
    assert not os.path.exists(path) and glob.glob(os.path.join(data_dir, "quarantine", "**", "*.seg"), recursive=True)
