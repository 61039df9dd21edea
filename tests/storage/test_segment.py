"""Segment files on real disk: append, scan, tombstones, seal; and the salvage scan: torn
tails, corruption, truncation, damaged state words and identity blocks, on real byte flips."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pipeline.storage.diskio import Durability
from pipeline.storage.scan import SEARCH_FIRST_WINDOW_BYTES, census_segment
from pipeline.storage.segment import SegmentFile, encode_entries, scan_segment
from pipeline.storage.storelog import StoreLog, log_key, read_store_log
from pipeline.wire.errors import SegmentCorruptError, SegmentFormatError
from pipeline.wire.layouts.names import segment_relpath
from pipeline.wire.layouts.segments import (
    ENTRY_HEADER_SIZE_BYTES,
    ENTRY_LIVE,
    ENTRY_TOMBSTONE,
    SEGMENT_HEADER_SIZE_BYTES,
)
from tests.support.segments import KEYS, data_dir_of, log_records, make_items, segment_at, shared_log


def write_segment(path: str, count: int, seed: int = 0, groups: int = 3) -> tuple[SegmentFile, tuple]:
    frame = make_items(count, seed)
    segment = SegmentFile.create(path, KEYS, Durability.PROCESS, shared_log(data_dir_of(path)))
    for chunk in np.array_split(np.arange(count), groups):
        segment.append(encode_entries(*frame, indices=chunk, producer_id=4))
    return segment, frame


def test_append_then_scan_round_trips_every_field(tmp_path):
    path = segment_at(str(tmp_path / "a"))
    segment, (items, tokens, token_starts, payloads, payload_starts) = write_segment(path, 300)
    segment.close()
    report = scan_segment(path)
    assert report.keys == KEYS
    assert report.entry_count == 300 and report.live_count == 300
    assert not report.torn and not report.damaged and report.lost is None and report.counts_agree
    for name in ("item_id", "seq", "length", "prefix_len", "payload_len", "submit_ns"):
        assert np.array_equal(report.headers[name], items[name])
    assert (report.headers["producer_id"] == 4).all()
    data = np.fromfile(path, dtype=np.uint8)
    for i in (0, 150, 299):
        at = int(report.offsets[i]) + ENTRY_HEADER_SIZE_BYTES
        assert at % 16 == 0  # token ids can be viewed as int32 without copying
        got = data[at:at + 4 * int(items["length"][i])].view(np.int32)
        assert np.array_equal(got, tokens[token_starts[i]:token_starts[i + 1]])


def test_tombstones_counts_seal_and_whole_file_delete(tmp_path):
    path = segment_at(str(tmp_path / "b"))
    segment, _ = write_segment(path, 10)
    offsets = scan_segment(path).offsets
    assert segment.tombstone_many([int(offsets[0])]) == 1
    assert segment.tombstone_many([int(offsets[0])]) == 0  # a duplicate completion is a no-op
    with pytest.raises(SegmentCorruptError, match="no entry can start"):
        segment.tombstone_many([int(offsets[0]) + 8])
    report = scan_segment(path)
    assert report.tombstone_count == 1 and report.header_deleted_count == 1
    assert segment.tombstone_many(offsets[1:].tolist()) == 9
    assert not segment.sealed and segment.deleted_count == segment.entry_count  # not sealed yet: kept
    segment.seal()
    assert segment.sealed and segment.deleted_count == segment.entry_count
    segment.close()
    segment.unlink()
    assert not os.path.exists(path)


def test_bulk_tombstones_and_header_columns_are_checked(tmp_path):
    path = segment_at(str(tmp_path / "c"))
    segment, _ = write_segment(path, 12)
    report = scan_segment(path)
    offsets = report.offsets
    assert np.array_equal(segment.entry_header_columns(offsets), report.headers)  # what the scan reads
    with pytest.raises(SegmentCorruptError, match=f"offset {int(offsets[2]) + 16}: no live entry"):
        segment.entry_header_columns(np.array([int(offsets[0]), int(offsets[2]) + 16]))  # off the grid of entries
    with pytest.raises(SegmentCorruptError, match="offset 64: no live entry there .* state -"):
        segment.entry_header_columns(np.array([64]))  # inside the segment header
    assert segment.tombstone_many([int(offsets[1]), int(offsets[4]), int(offsets[1])]) == 2  # duplicates once
    with pytest.raises(SegmentCorruptError, match=f"offset {int(offsets[4])}: no live entry"):
        segment.entry_header_columns(offsets[3:6])
    with pytest.raises(SegmentCorruptError, match="no entry can start"):  # nothing of the call applied
        segment.tombstone_many([int(offsets[3]) + 8, int(offsets[2])])
    assert scan_segment(path).header_deleted_count == 2
    assert segment.tombstone_many(offsets[:6].tolist()) == 4 and segment.deleted_count == 6
    segment.close()


def test_a_torn_last_log_record_is_ignored_and_cut_away_at_reopen(tmp_path):
    # A crash mid-append of a completion record: the completion is lost (a redelivery), the
    # records before it stand, and opening the log again writes it afresh without the garbage.
    path = segment_at(str(tmp_path / "c"))
    segment, _ = write_segment(path, 5)
    offsets = scan_segment(path).offsets
    segment.tombstone_many([int(offsets[2])])
    segment.tombstone_many([int(offsets[3])])
    segment.close()
    log_file = os.path.join(data_dir_of(path), "store.log")
    data = np.fromfile(log_file, dtype=np.uint8)
    data[-5] ^= 0x40  # the last record's checksum
    data.tofile(log_file)
    reading = read_store_log(data_dir_of(path))
    assert "torn write" in reading.torn and not reading.damaged
    report = scan_segment(path)
    assert report.tombstone_count == 1 and report.counts_agree and not report.problems()
    StoreLog.open(data_dir_of(path), False).close()
    again = read_store_log(data_dir_of(path))
    assert not again.torn and again.of(KEYS).completed.tolist() == [int(offsets[2])]


def test_a_damaged_log_record_before_the_last_is_named_by_offset(tmp_path):
    path = segment_at(str(tmp_path / "c"))
    segment, _ = write_segment(path, 5)
    offsets = scan_segment(path).offsets
    for offset in offsets[:3].tolist():
        segment.tombstone_many([offset])
        shared_log(data_dir_of(path)).sync()  # a group commit: each completion its own epoch
    segment.close()
    log_file = os.path.join(data_dir_of(path), "store.log")
    data = np.fromfile(log_file, dtype=np.uint8)
    damaged_at = data.shape[0] - 3 * 64  # the first completion of three: synced before the second
    data[damaged_at + 25] ^= 0x01
    data.tofile(log_file)
    reading = read_store_log(data_dir_of(path))
    assert reading.damaged == [f"{log_file}: offset {damaged_at}: store log record fails its checks "
                               f"(magic, version, kind or checksum)"] and reading.damaged_records == 1
    report = scan_segment(path)
    # The damaged record cannot be pinned on a segment: every segment's boundary is untrusted.
    assert report.tombstone_count == 2 and report.boundary_damage and report.is_damaged is False
    assert any(line.startswith("DAMAGED HEADER:") and "store log records damaged" in line for line in report.problems())


def test_completions_leave_the_segment_bytes_as_they_were(tmp_path):
    # Layout version 2: a segment is written once; completions are log records only.
    path = segment_at(str(tmp_path / "c"))
    segment, _ = write_segment(path, 20)
    before = np.fromfile(path, dtype=np.uint8)
    offsets = scan_segment(path).offsets
    assert segment.tombstone_many(offsets[::2].tolist()) == 10
    segment.seal()
    segment.close()
    assert np.array_equal(np.fromfile(path, dtype=np.uint8), before)
    report = scan_segment(path)
    assert report.tombstone_count == 10 and report.sealed and report.counts_agree
    # 3 boundaries, 10 completions (8 a record) and the seal
    assert os.path.getsize(os.path.join(data_dir_of(path), "store.log")) == 64 * (3 + 2 + 1)


def test_a_segment_holds_no_completion_bitmap_until_something_in_it_completes(tmp_path):
    # A backlog nothing has completed yet must not grow the broker with the store.
    segment, _ = write_segment(segment_at(str(tmp_path / "b")), 12)
    offsets = scan_segment(segment.path).offsets
    assert segment._done is None and segment.state_at(int(offsets[0])) == ENTRY_LIVE
    assert segment.entry_offsets(int(offsets[0]), segment.readable_end, 12)[0].tolist() == offsets.tolist()
    assert segment.tombstone_many([int(offsets[3])]) == 1
    assert segment._done is not None and segment.state_at(int(offsets[3])) == ENTRY_TOMBSTONE
    assert segment.entry_offsets(int(offsets[0]), segment.readable_end, 11)[0].tolist() == (
        [o for k, o in enumerate(offsets.tolist()) if k != 3])
    segment.close()


def unacknowledged_last_write(path: str, count: int) -> tuple[int, int, np.ndarray]:
    """A segment of `count - 1` acknowledged entries, then one more written but not yet
    acknowledged: its logged boundary still says `count - 1` (the state a crash right after
    the pwrite leaves, crash point segment.after_write). Returns (last offset, end, bytes)."""
    frame = make_items(count)
    segment = SegmentFile.create(path, KEYS, Durability.PROCESS, shared_log(data_dir_of(path)))
    segment.append(encode_entries(*frame, indices=np.arange(count - 1), producer_id=4))
    segment.append(encode_entries(*frame, indices=np.array([count - 1]), producer_id=4))
    segment.close()
    os.truncate(os.path.join(data_dir_of(path), "store.log"), 64)  # the second boundary record was never written
    data = np.fromfile(path, dtype=np.uint8)
    whole = scan_segment(path)
    return int(whole.offsets[-1]), whole.data_end, data


def test_torn_tail_at_every_byte_of_an_unacknowledged_last_write(tmp_path):
    path = segment_at(str(tmp_path / "d"))
    last, end, original = unacknowledged_last_write(path, 4)
    # Zeroing bytes that were zero already (pad, high bytes of small token ids) damages nothing.
    content_end = last + int(np.flatnonzero(original[last:end])[-1]) + 1
    for cut in range(content_end, end):
        damaged = original.copy()
        damaged[cut:end] = 0
        damaged.tofile(path)
        assert scan_segment(path).entry_count == 4, cut
    for cut in range(last, content_end):
        damaged = original.copy()
        damaged[cut:end] = 0  # the write stopped after `cut - last` bytes of the last entry
        damaged.tofile(path)
        report = scan_segment(path)
        assert not report.damaged and report.lost is None, cut  # past the boundary: not a loss
        assert report.entry_count == 3, cut
        if cut == last:
            assert not report.torn  # nothing of the last entry was written
        else:
            (torn,) = report.torn
            assert torn.offset == last and 0 < torn.size_bytes <= cut - last, cut
        reopened = SegmentFile.reopen(report, Durability.PROCESS, shared_log(data_dir_of(path)))
        reopened.close()
        again = scan_segment(path)  # kept, not zeroed: the same torn tail, counts agree
        assert [t.offset for t in again.torn] == [t.offset for t in report.torn], cut
        assert again.entry_count == 3 and again.counts_agree, cut
        assert np.array_equal(np.fromfile(path, dtype=np.uint8)[SEGMENT_HEADER_SIZE_BYTES:],
                              damaged[SEGMENT_HEADER_SIZE_BYTES:]), cut


def test_damage_in_the_last_acknowledged_entry_is_corruption_and_kept(tmp_path):
    # A checksum failure in the last entry was once taken for a torn write and zeroed.
    # Below the header's data_end it is corruption: named, counted, and the bytes stay.
    path = segment_at(str(tmp_path / "d"))
    segment, frame = write_segment(path, 4, groups=1)
    segment.close()
    whole = scan_segment(path)
    last, end = int(whole.offsets[-1]), whole.data_end
    original = np.fromfile(path, dtype=np.uint8)
    for victim in (last + 4, last + 20, last + ENTRY_HEADER_SIZE_BYTES + 1, end - 1):
        damaged = original.copy()
        damaged[victim] ^= 0x20
        damaged.tofile(path)
        report = scan_segment(path)
        assert report.entry_count == 3 and not report.torn, victim
        (bad,) = report.damaged
        assert (bad.offset, bad.end, bad.entries) == (last, end, 1), victim
        if victim != last + 20:  # the item id itself is what was flipped there
            assert bad.item_id == int(frame[0]["item_id"][3]), victim
        assert bad.walked == (victim != last + 4), victim  # a damaged length cannot be walked
        SegmentFile.reopen(report, Durability.PROCESS, shared_log(data_dir_of(path))).close()
        after = np.fromfile(path, dtype=np.uint8)
        assert np.array_equal(after[SEGMENT_HEADER_SIZE_BYTES:], damaged[SEGMENT_HEADER_SIZE_BYTES:]), victim
        again = scan_segment(path)  # the next restart judges the same bytes the same way
        assert [(r.offset, r.end) for r in again.damaged] == [(last, end)] and not again.torn, victim
        assert again.counts_agree, victim


def test_bit_flip_mid_segment_keeps_every_other_entry(tmp_path):
    # One flipped byte once quarantined the whole file; now only its entry is lost.
    path = segment_at(str(tmp_path / "e"))
    segment, frame = write_segment(path, 50)
    segment.close()
    whole = scan_segment(path)
    victim = int(whole.offsets[20]) + ENTRY_HEADER_SIZE_BYTES + 3
    data = np.fromfile(path, dtype=np.uint8)
    data[victim] ^= 0x10
    data.tofile(path)
    report = scan_segment(path)
    (bad,) = report.damaged
    assert (bad.offset, bad.end) == (int(whole.offsets[20]), int(whole.offsets[21]))
    assert "checksum" in bad.reason and bad.entries == 1 and bad.walked
    assert bad.item_id == int(frame[0]["item_id"][20]) and "unverified" in bad.describe()
    assert report.entry_count == 49 and report.offsets.tolist() == np.delete(whole.offsets, 20).tolist()
    assert report.counts_agree and report.is_damaged and not report.torn


def test_zeroed_state_word_with_a_good_checksum_is_delivered_again(tmp_path):
    # The state word is the one field the checksum does not cover: a damaged one is
    # delivered (again) as live, unless the log says the entry was completed.
    path = segment_at(str(tmp_path / "f"))
    segment, _ = write_segment(path, 10)
    offsets = scan_segment(path).offsets
    segment.tombstone_many([int(offsets[6])])
    segment.close()
    data = np.fromfile(path, dtype=np.uint8)
    data[int(offsets[4]):int(offsets[4]) + 4] = 0
    data[int(offsets[6]) + 1] ^= 0x01  # a completed entry's state word with a flipped bit
    data.tofile(path)
    report = scan_segment(path)
    assert report.entry_count == 10 and report.live_count == 9 and not report.damaged
    assert [(r.offset, r.word) for r in report.repaired_states] == [(int(offsets[4]), 0), (int(offsets[6]), 0x4556484C)]
    SegmentFile.reopen(report, Durability.PROCESS, shared_log(data_dir_of(path))).close()
    again = scan_segment(path)
    assert not again.repaired_states and again.live_count == 9 and again.tombstone_count == 1  # rewritten live


def test_zeroed_entry_header_mid_segment_is_damage_and_the_rest_is_kept(tmp_path):
    path = segment_at(str(tmp_path / "f"))
    segment, frame = write_segment(path, 10)
    whole = scan_segment(path)
    shared_log(data_dir_of(path)).sync()  # the group commit: the boundaries were synced
    segment.tombstone_many([int(whole.offsets[0])])  # a record after them
    segment.close()
    data = np.fromfile(path, dtype=np.uint8)
    at = int(whole.offsets[4])
    data[at:at + ENTRY_HEADER_SIZE_BYTES] = 0
    data.tofile(path)
    report = scan_segment(path)
    (bad,) = report.damaged
    assert (bad.offset, bad.end, bad.entries, bad.walked) == (at, int(whole.offsets[5]), 1, False)
    assert "zero state word" in bad.reason and bad.item_id is None
    assert report.entry_count == 9 and report.counts_agree


def test_truncation_mid_entry_counts_every_lost_entry(tmp_path):
    # Truncation once dropped the entries after the cut without a word.
    path = segment_at(str(tmp_path / "t"))
    segment, frame = write_segment(path, 28)
    segment.close()
    whole = scan_segment(path)
    cut = int(whole.offsets[14]) + 30
    os.truncate(path, cut)
    report = scan_segment(path)
    assert report.entry_count == 14 and not report.damaged
    lost = report.lost
    assert (lost.offset, lost.end, lost.file_size, lost.entries) == (int(whole.offsets[14]), whole.data_end, cut, 14)
    assert lost.item_ids == (int(frame[0]["item_id"][14]),)  # the one header still readable
    SegmentFile.reopen(report, Durability.PROCESS, shared_log(data_dir_of(path))).close()
    assert scan_segment(path).lost.entries == 14  # still counted at the next restart


def test_truncation_at_an_entry_boundary_is_counted_from_the_header(tmp_path):
    path = segment_at(str(tmp_path / "t"))
    write_segment(path, 28)[0].close()
    whole = scan_segment(path)
    os.truncate(path, int(whole.offsets[20]))
    report = scan_segment(path)
    assert report.entry_count == 20 and report.lost.entries == 8 and report.lost.item_ids == ()


def test_a_boundary_past_the_file_with_nothing_missing_is_not_a_loss(tmp_path):
    # A boundary whose entry count agrees with the entries but whose data_end runs past the
    # file: only the end word is wrong, so the counts disagree; nothing is lost.
    path = segment_at(str(tmp_path / "w"))
    segment, _ = write_segment(path, 5)
    shared_log(data_dir_of(path)).boundary(log_key(KEYS), 5, 1 << 40)
    segment.close()
    report = scan_segment(path)
    assert report.lost is None and not report.damaged and not report.counts_agree


def test_not_a_segment(tmp_path):
    path = tmp_path / "g.seg"
    path.write_bytes(b"x" * SEGMENT_HEADER_SIZE_BYTES)
    with pytest.raises(SegmentFormatError, match="magic"):
        scan_segment(str(path))
    path.write_bytes(b"short")
    with pytest.raises(SegmentFormatError, match="shorter"):
        scan_segment(str(path))


def test_damaged_routing_keys_are_refused(tmp_path):
    path = segment_at(str(tmp_path / "h"))
    segment, _ = write_segment(path, 3)
    segment.close()
    data = np.fromfile(path, dtype=np.uint8)
    data[24] ^= 1  # one bit of the signature
    data.tofile(path)
    with pytest.raises(SegmentFormatError, match="identity checksum"):
        scan_segment(path)


def named_segment(tmp_path, count: int = 6) -> str:
    path = str(tmp_path / "segments" / segment_relpath(KEYS.model, KEYS.signature, KEYS.lane, KEYS.segment_seq))
    os.makedirs(os.path.dirname(path))
    write_segment(path, count)[0].close()
    return path


@pytest.mark.parametrize("byte", [0, 9, 40, 49])  # magic, version, created_ns, checksum
def test_identity_damage_outside_the_keys_is_salvaged_under_the_name(tmp_path, byte):
    path = named_segment(tmp_path)
    data = np.fromfile(path, dtype=np.uint8)
    data[byte] ^= 0x40
    data.tofile(path)
    report = scan_segment(path)
    assert report.keys == KEYS and report.entry_count == 6 and report.identity_damage
    assert report.is_damaged and report.problems()[0].startswith("DAMAGED HEADER")


@pytest.mark.parametrize("byte", [16, 20, 24, 32])  # model, lane, signature, segment_seq
def test_identity_damage_in_a_key_is_refused_and_its_entries_counted(tmp_path, byte):
    path = named_segment(tmp_path)
    data = np.fromfile(path, dtype=np.uint8)
    data[byte] ^= 0x01
    data.tofile(path)
    with pytest.raises(SegmentFormatError, match="not the file name's"):
        scan_segment(path)
    census = census_segment(path)
    assert (census.entries, census.live, len(census.item_ids)) == (6, 6, 6)


def test_keys_that_disagree_with_the_file_name_are_refused(tmp_path):
    path = named_segment(tmp_path)
    other = path.replace("l0007-", "l0008-")
    os.rename(path, other)
    with pytest.raises(SegmentFormatError, match="not the file name's"):
        scan_segment(other)


def test_power_header_words_wait_for_the_fdatasync(tmp_path):
    # The commit boundary must never claim bytes that are not durable yet.
    path = segment_at(str(tmp_path / "p"))
    frame = make_items(20)
    segment = SegmentFile.create(path, KEYS, Durability.POWER, shared_log(data_dir_of(path), True))
    segment.append(encode_entries(*frame, indices=np.arange(10), producer_id=1))
    segment.sync()
    synced = scan_segment(path)
    segment.append(encode_entries(*frame, indices=np.arange(10, 20), producer_id=1))
    unsynced = scan_segment(path)
    assert (unsynced.header_entry_count, unsynced.header_data_end) == (10, synced.data_end)
    assert unsynced.entry_count == 20  # whole past the boundary: kept, not a loss
    segment.sync()
    assert (scan_segment(path).header_entry_count, scan_segment(path).header_data_end) == (20, unsynced.data_end)
    segment.close()


def test_file_grows_past_its_first_allocation(tmp_path):
    path = segment_at(str(tmp_path / "i"))
    frame = make_items(3000, seed=3)
    segment = SegmentFile.create(path, KEYS, Durability.POWER, shared_log(data_dir_of(path), True))
    for chunk in np.array_split(np.arange(3000), 6):
        segment.append(encode_entries(*frame, indices=chunk, producer_id=1))
        assert segment.readable_end < segment.data_end  # power: readable only after sync
        segment.sync()
        assert segment.readable_end == segment.data_end
    assert segment.allocated > 1 << 20
    segment.close()
    report = scan_segment(path)
    assert report.entry_count == 3000 and report.live_count == 3000
    assert os.stat(path).st_mode & 0o777 == 0o600



def test_a_flipped_boundary_word_cannot_turn_damage_into_a_torn_tail(tmp_path):
    # data_end tells corruption from a torn tail; log records carry checksums, so a
    # flipped bit in a boundary record before the last makes every bad byte count as
    # acknowledged damage instead.
    path = segment_at(str(tmp_path / "b"))
    segment, frame = write_segment(path, 10)
    whole = scan_segment(path)
    shared_log(data_dir_of(path)).sync()  # the group commit: the boundaries were synced
    segment.tombstone_many([int(whole.offsets[0])])  # a record after them
    segment.close()
    data = np.fromfile(path, dtype=np.uint8)
    data[int(whole.offsets[7]) + 90] ^= 0x08  # damage in entry 7 (of the third group)
    data.tofile(path)
    log_file = os.path.join(data_dir_of(path), "store.log")
    data = np.fromfile(log_file, dtype=np.uint8)
    data[64 + 32 + 1] ^= 0x20  # the second boundary's data_end: damage before the last record
    data.tofile(log_file)
    report = scan_segment(path)
    assert report.boundary_damage and not report.torn
    (bad,) = report.damaged
    assert bad.offset == int(whole.offsets[7]) and bad.item_id == int(frame[0]["item_id"][7])
    # The damaged record stays where it is (recovery keeps the log in quarantine/ before it
    # writes it afresh), and the scan's boundary is recorded after it.
    SegmentFile.reopen(report, Durability.PROCESS, shared_log(data_dir_of(path))).close()
    again = scan_segment(path)
    assert again.boundary_damage and [r.offset for r in again.damaged] == [bad.offset]


def test_resync_past_damage_longer_than_a_search_window(tmp_path):
    path = segment_at(str(tmp_path / "r"))
    frame = make_items(2000, seed=9)
    segment = SegmentFile.create(path, KEYS, Durability.PROCESS, shared_log(data_dir_of(path)))
    segment.append(encode_entries(*frame, indices=np.arange(2000), producer_id=1))
    segment.close()
    whole = scan_segment(path)
    assert whole.data_end > 4 * SEARCH_FIRST_WINDOW_BYTES
    data = np.fromfile(path, dtype=np.uint8)
    start, stop = int(whole.offsets[100]), int(whole.offsets[100]) + 3 * SEARCH_FIRST_WINDOW_BYTES + 999
    data[start:stop] = 0xA5  # garbage over many entries and several search windows
    data.tofile(path)
    report = scan_segment(path)
    first_after = int(whole.offsets[np.searchsorted(whole.offsets, stop)])
    (bad,) = report.damaged
    assert (bad.offset, bad.end) == (start, first_after) and not bad.walked
    lost = np.searchsorted(whole.offsets, first_after) - 100
    assert report.entry_count == 2000 - lost and bad.entries == lost  # topped up from the header's count
    assert report.offsets.tolist() == [o for o in whole.offsets.tolist() if o < start or o >= first_after]


def test_entry_offsets_walks_back_to_back_entries_and_refuses_a_non_entry(tmp_path):
    path = segment_at(str(tmp_path / "f"))
    frame = make_items(50, seed=5)
    segment = SegmentFile.create(path, KEYS, Durability.PROCESS, shared_log(data_dir_of(path)))
    group = encode_entries(*frame, indices=np.arange(50), producer_id=4)
    base = segment.append(group)
    offsets = scan_segment(path).offsets
    end = base + group.data.nbytes
    got, after = segment.entry_offsets(int(offsets[10]), end, 40)
    assert np.array_equal(got, offsets[10:]) and after == end
    got, after = segment.entry_offsets(int(offsets[0]), end, 3)
    assert np.array_equal(got, offsets[:3]) and after == offsets[3]
    with pytest.raises(SegmentCorruptError):
        segment.entry_offsets(int(offsets[0]) + 16, end, 2)  # inside an entry's tokens
    with pytest.raises(SegmentCorruptError):
        segment.entry_offsets(int(offsets[0]), end, 51)  # more than are there
    segment.tombstone_many([int(offsets[5]), int(offsets[6])])
    got, after = segment.entry_offsets(int(offsets[0]), end, 10)  # a recovered run: tombstones skipped
    assert np.array_equal(got, np.concatenate([offsets[:5], offsets[7:12]])) and after == offsets[12]
    segment.close()


def test_power_never_writes_into_a_sector_holding_synced_bytes(tmp_path):
    # Each synced group (of entries, and of log records) starts on a fresh 4 KiB sector:
    # a sector being written when the power goes can then only hold unacknowledged bytes.
    path = segment_at(str(tmp_path / "p"))
    frame = make_items(30, seed=5)
    segment = SegmentFile.create(path, KEYS, Durability.POWER, shared_log(data_dir_of(path), True))
    starts, ends = [], []
    for chunk in np.array_split(np.arange(30), 3):
        before = np.fromfile(path, dtype=np.uint8)
        log_file = os.path.join(data_dir_of(path), "store.log")
        log_before = np.fromfile(log_file, dtype=np.uint8)
        at = segment.append(encode_entries(*frame, indices=chunk, producer_id=4))
        segment.sync()  # readable from here on
        segment.tombstone_many([at])
        shared_log(data_dir_of(path), True).sync()
        starts.append(at)
        ends.append(segment.data_end)
        for old, new in ((before, np.fromfile(path, dtype=np.uint8)),
                         (log_before, np.fromfile(log_file, dtype=np.uint8))):
            synced_end = int(np.flatnonzero(old)[-1]) + 1 if old.any() else 0
            first_sector_written = synced_end - synced_end % 4096
            assert np.array_equal(new[first_sector_written:synced_end], old[first_sector_written:synced_end])
            assert not new[synced_end:-(-synced_end // 4096) * 4096].any()  # nothing after them in their sector
    assert starts[0] == SEGMENT_HEADER_SIZE_BYTES and all(s % 4096 == 0 and s > e for s, e in zip(starts[1:], ends))
    offsets, end = segment.entry_offsets(starts[0], ends[-1], 27)  # the walk skips the padding
    segment.close()
    report = scan_segment(path)
    assert report.entry_count == 30 and not report.damaged and not report.torn and report.tombstone_count == 3
    assert offsets.tolist() == [o for o in report.offsets.tolist() if o not in starts] and end == ends[-1]
    assert (report.header_entry_count, report.header_data_end) == (30, ends[-1])


def test_a_closed_file_keeps_its_completions_compressed_and_opens_with_them(tmp_path):
    # 20,000 entries, the first 12,000 completed a batch at a time (in file order, as dispatch
    # hands them out) and two stragglers: what the store keeps of the closed file is a fifth of
    # its bitmap or less, and the file opened from it knows exactly those completions.
    path = segment_at(str(tmp_path / "k"))
    segment, _ = write_segment(path, 20_000, groups=8)
    offsets = scan_segment(path).offsets
    for start in range(0, 12_000, 64):
        segment.tombstone_many(offsets[start:min(start + 64, 12_000)])
    segment.tombstone_many(offsets[[15_000, 19_999]])
    progress = segment.progress()
    # Entries of random lengths (1 to 400 tokens): which ones are done is about a byte each.
    bitmap_bytes = -(-segment.allocated // 128)
    assert len(progress.done) * 5 < bitmap_bytes, (len(progress.done), bitmap_bytes)
    segment.close()
    again = SegmentFile.open(path, Durability.PROCESS, shared_log(data_dir_of(path)), progress, keys=KEYS)
    assert again.deleted_count == 12_002
    assert again.tombstone_many(offsets[11_990:12_010]) == 10  # the ten past the completed run
    assert [again.state_at(int(o)) for o in offsets[[0, 11_999, 12_000, 15_000, 19_998]]] == [
        ENTRY_TOMBSTONE, ENTRY_TOMBSTONE, ENTRY_TOMBSTONE, ENTRY_TOMBSTONE, ENTRY_LIVE]
    again.close()
