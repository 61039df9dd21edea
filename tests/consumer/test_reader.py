"""The consumer's segment reader: zero-copy token views, checks against the descriptor."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pipeline.storage.segment import encode_entries, scan_segment
from pipeline.consumer.reader import SegmentReader
from pipeline.wire.dirpin import DirPin
from pipeline.wire.errors import SegmentCorruptError, SegmentReadError
from pipeline.wire.layouts.descriptors import DESCRIPTOR_ITEM_DTYPE
from pipeline.wire.layouts.segments import prompt_digest
from tests.support.segments import SIG, make_items, store


def test_tokens_are_zero_copy_views_of_the_segment(tmp_path):
    path, (items, tokens, starts, payloads, pstarts), segment = store(str(tmp_path), 0, 20, 1)
    offsets = scan_segment(path).offsets
    reader = SegmentReader(str(tmp_path))
    for i in (0, 7, 19):
        got = reader.read(2, SIG, 0, 0, int(offsets[i]), int(items["length"][i]), int(items["item_id"][i]))
        assert np.array_equal(got.tokens, tokens[starts[i]:starts[i + 1]])
        assert got.payload == payloads[pstarts[i]:pstarts[i + 1]].tobytes()
        assert not got.tokens.flags.writeable and not got.tokens.flags.owndata
        region = np.frombuffer(reader._maps[path].view, dtype=np.uint8).__array_interface__["data"][0]
        address = got.tokens.__array_interface__["data"][0]
        # The view points into the mapped file, right after the entry's header: no copy.
        assert address == region + int(offsets[i]) + 64
    reader.close()
    segment.close()


def test_reader_follows_a_growing_file_and_checks_entries(tmp_path):
    path, frame, segment = store(str(tmp_path), 1, 5, 2)
    reader = SegmentReader(str(tmp_path), open_maps_max=1)
    first = scan_segment(path).offsets
    items = frame[0]
    reader.read(2, SIG, 1, 0, int(first[0]), int(items["length"][0]), int(items["item_id"][0]))
    more = make_items(3000, seed=3)  # grows the file past its first allocation
    segment.append(encode_entries(*more, indices=np.arange(3000), producer_id=1))
    offsets = scan_segment(path).offsets
    last = len(offsets) - 1
    got = reader.read(2, SIG, 1, 0, int(offsets[last]), int(more[0]["length"][-1]), int(more[0]["item_id"][-1]))
    assert got.item_id == int(more[0]["item_id"][-1])
    with pytest.raises(SegmentCorruptError, match="descriptor says"):
        reader.read(2, SIG, 1, 0, int(offsets[0]), int(items["length"][0]) + 1, int(items["item_id"][0]))
    reader.close()
    segment.close()


def test_checksum_is_verified_after_reading(tmp_path):
    path, frame, segment = store(str(tmp_path), 2, 3, 4)
    segment.close()
    offsets = scan_segment(path).offsets
    data = np.fromfile(path, dtype=np.uint8)
    data[int(offsets[1]) + 64] ^= 1
    data.tofile(path)
    reader = SegmentReader(str(tmp_path))
    items = frame[0]
    with pytest.raises(SegmentCorruptError, match="checksum"):
        reader.read(2, SIG, 2, 0, int(offsets[1]), int(items["length"][1]), int(items["item_id"][1]))
    reader.close()


def test_entry_whose_payload_crosses_the_mapped_end(tmp_path):
    # Map the file while it ends inside an entry's payload (as a consumer may, between the
    # broker's file growth steps): the reader maps again instead of calling it damage.
    path, frame, segment = store(str(tmp_path), 3, 2, 5)
    offsets = scan_segment(path).offsets
    items = frame[0]
    reader = SegmentReader(str(tmp_path))
    mapping_end = int(offsets[1]) + 64 + 4 * int(items["length"][1])  # header and tokens only
    reader._view(path, 0)
    reader._maps[path].view = reader._maps[path].view[:mapping_end]
    got = reader.read(2, SIG, 3, 0, int(offsets[1]), int(items["length"][1]), int(items["item_id"][1]))
    assert got.payload == frame[3][frame[4][1]:frame[4][2]].tobytes()
    reader.close()
    segment.close()


def descriptor_items(lane: int, offsets, items) -> np.ndarray:
    rows = np.zeros(len(offsets), dtype=DESCRIPTOR_ITEM_DTYPE)
    rows["lane"], rows["offset"], rows["length"], rows["item_id"] = lane, offsets, items["length"], items["item_id"]
    return rows


def test_read_batch_gives_zero_copy_views_and_checks_every_entry(tmp_path):
    # Two segments in one descriptor, one entry damaged: the batch read gives what `read`
    # gives for each good entry (views into the mapped file, no copy) and lists the damaged
    # one with the error `read` raises. An entry the broker recorded as completed is read like
    # any other: whether a batch is stale is the broker's word (the session), not the store's.
    path_a, frame_a, segment_a = store(str(tmp_path), 4, 12, 6)
    path_b, frame_b, segment_b = store(str(tmp_path), 5, 9, 7, first_id=2000)
    offsets_a, offsets_b = scan_segment(path_a).offsets, scan_segment(path_b).offsets
    segment_a.tombstone_many([int(offsets_a[3])])
    segment_b.close()
    data = np.fromfile(path_b, dtype=np.uint8)
    data[int(offsets_b[5]) + 64] ^= 1
    data.tofile(path_b)
    rows = np.concatenate([descriptor_items(4, offsets_a, frame_a[0]), descriptor_items(5, offsets_b, frame_b[0])])
    rows = rows[np.random.default_rng(0).permutation(rows.shape[0])]  # segments interleaved
    reader = SegmentReader(str(tmp_path))
    got = reader.read_batch(2, SIG, rows)
    failed = {item_id: type(exc) for item_id, _length, exc in got.failed}
    assert failed == {int(frame_b[0]["item_id"][5]): SegmentCorruptError}
    expected = [int(i) for i in rows["item_id"] if int(i) not in failed]
    assert sorted(got.item_ids) == sorted(expected)
    for segment_ids in ([i for i in got.item_ids if i < 2000], [i for i in got.item_ids if i >= 2000]):
        assert segment_ids == [i for i in expected if (i < 2000) == (segment_ids[0] < 2000)]  # descriptor order
    one = SegmentReader(str(tmp_path))
    by_id = {int(r["item_id"]): r for r in rows}
    for k, item_id in enumerate(got.item_ids):
        row = by_id[item_id]
        ref = one.read(2, SIG, int(row["lane"]), 0, int(row["offset"]), int(row["length"]), item_id)
        assert np.array_equal(got.tokens[k], ref.tokens) and got.lengths[k] == ref.tokens.shape[0]
        assert (got.prefix_lens[k], got.payloads[k], got.submit_ns[k]) == (ref.prefix_len, ref.payload, ref.submit_ns)
        # The digest of the tokens as read, both ways: what the results line's prompt_xxh3 says.
        assert got.digests[k] == ref.digest == prompt_digest(np.array(ref.tokens, dtype=np.int64))
        path = path_a if row["lane"] == 4 else path_b
        region = np.frombuffer(reader._maps[path].view, dtype=np.uint8).__array_interface__["data"][0]
        assert got.tokens[k].__array_interface__["data"][0] == region + int(row["offset"]) + 64
        assert not got.tokens[k].flags.writeable
    one.close()
    reader.close()
    segment_a.close()


def test_entries_that_fail_leave_no_reference_cycle(tmp_path):
    # The consumer's processes collect cycles rarely (runtime/processes.py quiet_gc): a failed
    # read must not keep its frames, and through them the batch and a segment mapping, alive.
    import gc

    path, frame, segment = store(str(tmp_path), 0, 8, 3)
    segment.close()
    offsets = scan_segment(path).offsets
    data = np.fromfile(path, dtype=np.uint8)
    for offset in offsets[:4].tolist():
        data[int(offset) + 64] ^= 1  # a token of each of the first four entries
    data.tofile(path)
    reader = SegmentReader(str(tmp_path))
    rows = descriptor_items(0, offsets, frame[0])
    gc.collect()
    gc.disable()
    try:
        got = reader.read_batch(2, SIG, rows)
        assert len(got.failed) == 4 and all(isinstance(exc, SegmentCorruptError) for _i, _n, exc in got.failed)
        del got
        assert gc.collect() == 0  # nothing was left for the cycle collector
    finally:
        gc.enable()
        reader.close()


def test_segments_deleted_since_they_were_mapped_are_unmapped(tmp_path):
    """A mapping keeps a deleted file's space allocated: the sweep drops the mappings of
    segments the broker deleted (or deleted and made again), and keeps the others."""
    kept_path, kept, kept_segment = store(str(tmp_path), 0, 5, 1)
    gone_path, gone, gone_segment = store(str(tmp_path), 1, 5, 2)
    reader = SegmentReader(str(tmp_path))
    for lane, (items, *_rest), path in ((0, kept, kept_path), (1, gone, gone_path)):
        offset = int(scan_segment(path).offsets[0])
        reader.read(2, SIG, lane, 0, offset, int(items["length"][0]), int(items["item_id"][0]))
    assert reader.drop_deleted() == 0
    gone_segment.close()
    os.unlink(gone_path)
    assert reader.drop_deleted() == 1 and set(reader._maps) == {kept_path}
    os.rename(kept_path, kept_path + ".old")  # another file under the same name
    with open(kept_path, "wb") as other:
        other.write(b"\0" * 8192)
    assert reader.drop_deleted() == 1 and not reader._maps
    reader.close()
    kept_segment.close()


def test_a_segment_that_is_gone_fails_its_items_one_by_one_not_the_reader(tmp_path):
    path, (items, *_rest), segment = store(str(tmp_path), 0, 5, 1)
    offsets = scan_segment(path).offsets
    segment.close()
    os.unlink(path)
    rows = np.zeros(5, dtype=DESCRIPTOR_ITEM_DTYPE)
    rows["lane"], rows["offset"], rows["length"], rows["item_id"] = 0, offsets, items["length"], items["item_id"]
    got = SegmentReader(str(tmp_path)).read_batch(2, SIG, rows)
    assert got.item_ids == [] and [item for item, _n, _exc in got.failed] == items["item_id"].tolist()
    assert all(isinstance(exc, SegmentCorruptError) and "the segment file is gone" in str(exc) for *_x, exc in got.failed)


def test_a_segment_missing_because_the_data_directory_moved_is_not_damage(tmp_path):
    """The data directory moved away and a link to another folder put at its name: its
    segments are intact where the folder went, so nothing is failed as corrupt (that would
    answer intact items that never ran); the reader raises SegmentReadError naming it."""
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    path, (items, *_rest), segment = store(str(data), 0, 5, 1)
    offsets = scan_segment(path).offsets
    segment.close()
    reader = SegmentReader(str(data), pin=DirPin.take(str(data)))
    data.rename(tmp_path / "data.orig")
    elsewhere.mkdir()
    data.symlink_to(elsewhere)
    rows = np.zeros(5, dtype=DESCRIPTOR_ITEM_DTYPE)
    rows["lane"], rows["offset"], rows["length"], rows["item_id"] = 0, offsets, items["length"], items["item_id"]
    with pytest.raises(SegmentReadError, match=f"the data directory {data} is not the folder this run started in"):
        reader.read_batch(2, SIG, rows)
    assert os.listdir(elsewhere) == []
    data.unlink()
    (tmp_path / "data.orig").rename(data)
    got = reader.read_batch(2, SIG, rows)  # back: read as if nothing happened
    assert got.item_ids == items["item_id"].tolist() and not got.failed
    reader.close()


def test_a_segment_that_cannot_be_mapped_now_is_not_damage(tmp_path):
    """Out of descriptors (or memory, or permission): the entries are intact, so the reader
    raises SegmentReadError (the consumer hands its batches back and retries) instead of
    failing the items as corrupt, which would answer intact items that never ran."""
    import resource

    path, (items, *_rest), segment = store(str(tmp_path), 0, 5, 1)
    offsets = scan_segment(path).offsets
    rows = np.zeros(5, dtype=DESCRIPTOR_ITEM_DTYPE)
    rows["lane"], rows["offset"], rows["length"], rows["item_id"] = 0, offsets, items["length"], items["item_id"]
    reader = SegmentReader(str(tmp_path))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        with pytest.raises(SegmentReadError, match="cannot map the segment now"):
            reader.read_batch(2, SIG, rows)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert reader.read_batch(2, SIG, rows).item_ids == items["item_id"].tolist()  # descriptors back: all read
    reader.close()
    segment.close()


def _resident_kib(path: str) -> int:
    """Rss of this process's mapping of `path` (/proc/self/smaps), KiB."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0]:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1])
    return rss


def test_a_finished_batch_s_pages_leave_the_consumer_s_memory(tmp_path):
    # Without the release, every page a consumer read stays resident in its mapping until
    # the segment is deleted; with it, a finished batch's pages go and the views still
    # read the same tokens (from the page cache).
    path, (items, tokens, starts, _payloads, _pstarts), segment = store(str(tmp_path), 0, 4000, 3)
    offsets = scan_segment(path).offsets
    reader = SegmentReader(str(tmp_path))
    got = reader.read_batch(2, SIG, descriptor_items(0, offsets, items))
    assert not got.failed and got.spans
    before = _resident_kib(path)
    assert before >= os.path.getsize(path) // 1024 // 2  # the batch's read touched the segment
    SegmentReader.release(got.spans)
    # What stays is at the span's edges: the segment's header and the kernel's fault-around
    # (it maps up to 64 KiB of cached pages around each fault).
    assert _resident_kib(path) <= 64 + 4 < before
    for i in (0, 1999, 3999):
        assert np.array_equal(got.tokens[i], tokens[starts[i]:starts[i + 1]])
    SegmentReader.release(got.spans)  # twice, or after the mapping is closed: nothing to do
    del got
    reader.close()
    segment.close()
