"""Segment files on real disk: append, scan, tombstones, seal, torn tails, corruption."""

from __future__ import annotations

import mmap
import os
import resource

import numpy as np
import pytest

from pipeline.errors import SegmentCorruptError, SegmentFormatError
from pipeline.layouts import (
    ENTRY_HEADER_SIZE_BYTES,
    ITEM_HEADER_DTYPE,
    SEGMENT_HEADER_SIZE_BYTES,
)
from pipeline.broker.storage.segment import (
    Durability,
    SegmentFile,
    SegmentKeys,
    encode_entries,
    scan_segment,
)

KEYS = SegmentKeys(model=1, signature=0xDEADBEEF_12345678, lane=7, segment_seq=3)


def make_items(count: int, seed: int = 0):
    """A frame's worth of items (as the ring delivers them): headers, tokens, payloads."""
    rng = np.random.default_rng(seed)
    items = np.zeros(count, dtype=ITEM_HEADER_DTYPE)
    items["item_id"] = np.arange(count) + 1000
    items["seq"] = np.arange(count)
    items["signature"] = KEYS.signature
    items["length"] = rng.integers(1, 400, size=count)
    items["prefix_len"] = np.minimum(items["length"], 5)
    items["payload_len"] = rng.integers(0, 30, size=count)
    items["submit_ns"] = 123
    token_starts = np.concatenate([[0], np.cumsum(items["length"])]).astype(np.int64)
    tokens = rng.integers(0, 50_000, size=int(token_starts[-1]), dtype=np.int32)
    payload_starts = np.concatenate([[0], np.cumsum(items["payload_len"])]).astype(np.int64)
    payloads = rng.integers(0, 256, size=int(payload_starts[-1]), dtype=np.uint8)
    return items, tokens, token_starts, payloads, payload_starts


def write_segment(path: str, count: int, seed: int = 0, groups: int = 3) -> tuple[SegmentFile, tuple]:
    frame = make_items(count, seed)
    segment = SegmentFile.create(path, KEYS, Durability.PROCESS)
    for chunk in np.array_split(np.arange(count), groups):
        segment.append(encode_entries(*frame, indices=chunk, producer_id=4))
    return segment, frame


def test_append_then_scan_round_trips_every_field(tmp_path):
    path = str(tmp_path / "a.seg")
    segment, (items, tokens, token_starts, payloads, payload_starts) = write_segment(path, 300)
    segment.close()
    report = scan_segment(path)
    assert report.keys == KEYS
    assert report.entry_count == 300 and report.live_count == 300
    assert report.torn_at is None and report.corrupt_at is None and report.counts_agree
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
    path = str(tmp_path / "b.seg")
    segment, _ = write_segment(path, 10)
    offsets = scan_segment(path).offsets
    assert segment.tombstone(int(offsets[0])) is True
    assert segment.tombstone(int(offsets[0])) is False  # a duplicate completion is a no-op
    with pytest.raises(SegmentCorruptError, match="no entry can start"):
        segment.tombstone(int(offsets[0]) + 8)
    report = scan_segment(path)
    assert report.tombstone_count == 1 and report.header_deleted_count == 1
    for offset in offsets[1:]:
        segment.tombstone(int(offset))
    assert not segment.fully_deleted  # not sealed yet
    segment.seal()
    assert segment.fully_deleted
    segment.close()
    segment.unlink()
    assert not os.path.exists(path)


def test_bulk_tombstones_and_header_columns_check_like_one_by_one(tmp_path):
    path = str(tmp_path / "c.seg")
    segment, _ = write_segment(path, 12)
    offsets = scan_segment(path).offsets
    headers = segment.entry_header_columns(offsets)
    assert [tuple(h) for h in headers.tolist()] == [tuple(f) for f in segment.entry_headers(offsets.tolist())]
    assert segment.tombstone_many([int(offsets[1]), int(offsets[4]), int(offsets[1])]) == 2  # duplicates once
    with pytest.raises(SegmentCorruptError, match=f"offset {int(offsets[4])}: no live entry"):
        segment.entry_header_columns(offsets[3:6])
    with pytest.raises(SegmentCorruptError, match="no entry can start"):  # nothing of the call applied
        segment.tombstone_many([int(offsets[3]) + 8, int(offsets[2])])
    assert scan_segment(path).header_deleted_count == 2
    assert segment.tombstone_many(offsets[:6].tolist()) == 4 and segment.deleted_count == 6
    segment.close()


def test_crash_between_tombstone_and_count_is_repaired(tmp_path):
    path = str(tmp_path / "c.seg")
    segment, _ = write_segment(path, 5)
    offsets = scan_segment(path).offsets
    segment.tombstone(int(offsets[2]))
    segment.close()
    # Undo the count only: the state of a crash after the tombstone, before its count.
    with open(path, "r+b") as file:
        file.seek(88)
        file.write((0).to_bytes(8, "little"))
    report = scan_segment(path)
    assert not report.counts_agree and report.tombstone_count == 1
    repaired = SegmentFile.reopen(report, Durability.PROCESS)
    repaired.close()
    assert scan_segment(path).counts_agree


def test_torn_tail_at_every_byte_of_the_last_entry(tmp_path):
    path = str(tmp_path / "d.seg")
    segment, frame = write_segment(path, 4, groups=1)
    segment.close()
    whole = scan_segment(path)
    last = int(whole.offsets[-1])
    end = whole.data_end
    original = np.fromfile(path, dtype=np.uint8)
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
        assert report.corrupt_at is None, cut
        assert report.entry_count == 3, cut
        if cut == last:
            assert report.torn_at is None  # nothing of the last entry was written
        else:
            assert report.torn_at == last and report.torn_bytes <= cut - last, cut
        reopened = SegmentFile.reopen(report, Durability.PROCESS)
        reopened.close()
        again = scan_segment(path)
        assert again.torn_at is None and again.entry_count == 3 and again.counts_agree


def test_bit_flip_mid_segment_is_corruption_not_a_torn_tail(tmp_path):
    path = str(tmp_path / "e.seg")
    segment, _ = write_segment(path, 50)
    segment.close()
    whole = scan_segment(path)
    victim = int(whole.offsets[20]) + ENTRY_HEADER_SIZE_BYTES + 3
    data = np.fromfile(path, dtype=np.uint8)
    data[victim] ^= 0x10
    data.tofile(path)
    report = scan_segment(path)
    assert report.corrupt_at == int(whole.offsets[20])
    assert "checksum" in report.corrupt_reason
    assert report.entry_count == 20  # entries before the damage are still listed


def test_zeroed_state_word_mid_segment_is_corruption(tmp_path):
    path = str(tmp_path / "f.seg")
    segment, _ = write_segment(path, 10)
    segment.close()
    whole = scan_segment(path)
    data = np.fromfile(path, dtype=np.uint8)
    at = int(whole.offsets[4])
    data[at:at + 4] = 0
    data.tofile(path)
    report = scan_segment(path)
    assert report.corrupt_at == at


def test_not_a_segment(tmp_path):
    path = tmp_path / "g.seg"
    path.write_bytes(b"x" * SEGMENT_HEADER_SIZE_BYTES)
    with pytest.raises(SegmentFormatError, match="magic"):
        scan_segment(str(path))
    path.write_bytes(b"short")
    with pytest.raises(SegmentFormatError, match="shorter"):
        scan_segment(str(path))


def test_damaged_routing_keys_are_refused(tmp_path):
    path = str(tmp_path / "h.seg")
    segment, _ = write_segment(path, 3)
    segment.close()
    data = np.fromfile(path, dtype=np.uint8)
    data[24] ^= 1  # one bit of the signature
    data.tofile(path)
    with pytest.raises(SegmentFormatError, match="identity checksum"):
        scan_segment(path)


def test_file_grows_past_its_first_allocation(tmp_path):
    path = str(tmp_path / "i.seg")
    frame = make_items(3000, seed=3)
    segment = SegmentFile.create(path, KEYS, Durability.POWER)
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



def test_appended_pages_are_mapped_before_their_tombstones(tmp_path):
    # The broker tombstones through its mapping: an append maps the pages it wrote
    # (MADV_POPULATE_WRITE), so a batch's tombstones cost no page fault per 4 KiB page.
    probe = mmap.mmap(-1, 4096)
    try:
        probe.madvise(23, 0, 4096)
    except OSError:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    finally:
        probe.close()
    path = str(tmp_path / "f.seg")
    frame = make_items(600, seed=3)  # ~250 KiB of entries: about 60 pages
    segment = SegmentFile.create(path, KEYS, Durability.PROCESS)
    segment.append(encode_entries(*frame, indices=np.arange(600), producer_id=4))
    offsets = scan_segment(path).offsets
    pages = (int(offsets[-1]) - int(offsets[0])) // 4096
    assert pages >= 40
    segment.tombstone_many(offsets[:1].tolist())  # numpy's own first-use faults, out of the count
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert segment.tombstone_many(offsets[1:].tolist()) == 599
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    segment.close()
    assert faults < pages // 4, f"{faults} page faults for tombstones over {pages} pages"
