"""Walking a segment's back-to-back entries from a known entry (a queue's cold run read back).

A lane queue keeps at most its hot window of entry offsets in memory (the work lives on
disk, not in the broker); past it, the next entries are found by reading each
header's length and payload size to step to the one after. `walk_entries` does that for one
segment's mapping, skipping completed entries (the segment's done bitmap) and `power`'s
padding before a synced group, and raises SegmentCorruptError (with the file and offset)
where the walk meets no entry.

Runs of equal-size entries (a token-id job's fixed-length items: every entry the same length
and payload size) are taken as one column gather: the headers at the first entry's stride
are read at once and checked as columns, and the walk goes on entry by entry from the first
that differs (and tries again after `power`'s padding, where the next synced group starts).
Mixed lengths pay one extra header read a call for the attempt. A run that ends early has
had headers read up to `count` entries ahead: at most a batch's worth of pages.
NOTE: the entry-by-entry walk was 7% of the broker's turn in the flood of `pipeline bench
e2e` (300,000 items, 256-item batches; py-spy, 1,494 broker samples; ~0.4 us an entry), the largest leaf after the
pwrite.

Pure: no I/O beyond reading the buffer it is given; the caller (SegmentFile) owns the mapping.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np

from pipeline.wire.errors import SegmentCorruptError
from pipeline.wire.layouts.frames import TOKEN_SIZE_BYTES
from pipeline.wire.layouts.segments import (
    ENTRY_ALIGN_BYTES,
    ENTRY_HEADER_DTYPE,
    ENTRY_HEADER_SIZE_BYTES,
    ENTRY_LIVE,
    ENTRY_NONE,
    SYNC_ALIGN_BYTES,
    entry_size_bytes,
)
from shm.layout import struct_for

# The header fields a walk needs, as a struct (one entry) and as uint32 word indices from the
# entry's start (many entries at once), both derived from the dtype.
_STEP = struct_for(ENTRY_HEADER_DTYPE, ["state", "length", "payload_len"])
_STEP_WORDS = np.array([ENTRY_HEADER_DTYPE.fields[name][1] // 4 for name in ("state", "length", "payload_len")],
                       dtype=np.int64)
assert all(ENTRY_HEADER_DTYPE.fields[name][0].itemsize == 4 for name in ("state", "length", "payload_len"))
# Entries a strided gather must be able to take before it is tried: below this the walk
# is as quick as setting the gather up.
STRIDED_MIN_ENTRIES = 8


def walk_entries(mapped, done: np.ndarray | None, start: int, limit: int, count: int,
                 path: str, readable_end: int) -> tuple[np.ndarray, int]:
    """The offsets of the next `count` live entries of `mapped` from byte `start`, none
    ending past `limit` (at most `readable_end`, the file's readable boundary, which the
    mapping holds), those marked in `done` (a bit per 16-byte slot, or None) skipped; and
    the byte after the last entry looked at. SegmentCorruptError naming `path` and the
    offset where the walk finds no entry (short of `count`).

    Example: live entries of 112 and 176 bytes at 4096 -> ([4096, 4208], 4384) for count 2;
    with the first one done, ([4208], 4384) for count 1."""
    assert limit <= readable_end <= len(mapped), (limit, readable_end, len(mapped))
    out = np.empty(count, dtype=np.int64)
    found, offset = _strided(mapped, done, start, limit, count, out)
    unpack, mask = _STEP.unpack_from, ENTRY_ALIGN_BYTES - 1
    live = ENTRY_LIVE
    # Bytes of an entry past its tokens and payload, rounded up to the alignment:
    # following = offset + (round_up + 4 * length + payload_len) & ~mask.
    round_up = ENTRY_HEADER_SIZE_BYTES + mask
    assert TOKEN_SIZE_BYTES == 4
    while found < count:
        if offset + ENTRY_HEADER_SIZE_BYTES > limit or offset & mask:
            no_entry(path, offset, readable_end, None)
        state, length, payload_len = unpack(mapped, offset)
        following = offset + ((round_up + (length << 2) + payload_len) & ~mask)
        if state != live or not length or following > limit:
            if state == ENTRY_NONE and offset % SYNC_ALIGN_BYTES:  # padding before a synced group
                offset = -(-offset // SYNC_ALIGN_BYTES) * SYNC_ALIGN_BYTES
                more, offset = _strided(mapped, done, offset, limit, count - found, out[found:])
                found += more  # the group after it may be one run too (`power`: a group a sync)
                continue
            no_entry(path, offset, readable_end, state)
        if done is None or not (done[offset >> 7] >> ((offset >> 4) & 7)) & 1:
            out[found] = offset
            found += 1
        offset = following
    return out, offset


def _strided(mapped, done: np.ndarray | None, start: int, limit: int, count: int,
             out: np.ndarray) -> tuple[int, int]:
    """The leading run of entries from `start` that have the first one's length and payload
    size, back to back, at most `count` of them: written to `out` (done ones left out);
    (how many were written, the byte after the run). (0, start) when no such run of
    STRIDED_MIN_ENTRIES can be there; the walk then starts at `start` itself."""
    if count < STRIDED_MIN_ENTRIES or start & (ENTRY_ALIGN_BYTES - 1) or start + 2 * ENTRY_HEADER_SIZE_BYTES > limit:
        return 0, start
    state, length, payload_len = _STEP.unpack_from(mapped, start)
    size = entry_size_bytes(length, payload_len)
    fits = min(count, (limit - start) // size)
    if state != ENTRY_LIVE or not length or fits < STRIDED_MIN_ENTRIES \
            or _STEP.unpack_from(mapped, start + size) != (state, length, payload_len):
        return 0, start
    starts = start + size * np.arange(fits, dtype=np.int64)
    words = np.frombuffer(mapped, dtype=np.uint32, count=(start + fits * size) // 4)
    try:  # the view is dropped at once: a mapping with views cannot be resized or closed
        fields = words[(starts >> 2)[:, None] + _STEP_WORDS]
    finally:
        del words
    same = (fields == np.array([state, length, payload_len], dtype=np.uint32)).all(axis=1)
    run = fits if same.all() else int(np.argmin(same))
    taken = starts[:run]
    if done is not None:
        taken = taken[~done_at(done, taken)]
    out[:taken.shape[0]] = taken
    return taken.shape[0], start + run * size


def done_at(done: np.ndarray | None, offsets: np.ndarray) -> np.ndarray:
    """Whether each entry at `offsets` (int64) is marked completed in the done bitmap (a bit
    per 16-byte slot; None: nothing completed yet)."""
    if done is None:
        return np.zeros(offsets.shape[0], dtype=bool)
    slots = offsets >> 4
    return (done[slots >> 3] >> (slots & 7).astype(np.uint8)) & 1 == 1


def no_entry(path: str, offset: int, readable_end: int, state: int | None) -> NoReturn:
    """SegmentCorruptError: no live entry at `offset` of the segment file `path`."""
    raise SegmentCorruptError(
        f"{path}: offset {offset}: no live entry there (readable up to {readable_end}, "
        f"state {'-' if state is None else hex(state)})"
    )
