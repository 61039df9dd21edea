"""A segment journal's records, their checksums, and the completions read back from them."""

from __future__ import annotations

import numpy as np

from pipeline.wire.layouts.segments import SYNC_ALIGN_BYTES
from shm.layout import checked_dtype

# A segment's journal (its path + SEGMENT_JOURNAL_SUFFIX): what changes about a segment once
# its entries are written, appended and never rewritten (storage/journal.py). Completions
# (one record per completed entry), the commit boundary (after each group commit) and the
# seal. Records are 32 bytes at multiples of 32 from offset 0; zeros are preallocated space
# or, in `power`, the padding to the next SYNC_ALIGN_BYTES boundary before each synced group
# of records. A record whose checksum fails is damage when a valid record follows it, and a
# torn append (ignored) when none does.
#   off  size  field     meaning
#     0     4  magic     b"SBJ1"
#     4     2  version   SEGMENT_JOURNAL_VERSION
#     6     2  kind      JOURNAL_COMPLETED / _BOUNDARY / _SEALED
#     8     8  value     COMPLETED: the entry's offset; BOUNDARY, SEALED: entry_count
#    16     8  value2    BOUNDARY: data_end (the end of the entries it counts); else zero
#    24     8  checksum  `journal_checksums` of bytes 0..24, seeded with the segment's
#                        sequence and lane (a journal put beside another segment fails)
SEGMENT_JOURNAL_MAGIC = b"SBJ1"
# Bump when a field above moves or changes meaning.
SEGMENT_JOURNAL_VERSION = 1
JOURNAL_COMPLETED = 1  # the entry at `value` is done (the segment itself is never rewritten)
JOURNAL_BOUNDARY = 2  # entries [SEGMENT_HEADER_SIZE_BYTES, value2) are written: `value` of them
JOURNAL_SEALED = 3  # no more appends; `value` entries in all
JOURNAL_KIND_NAMES = {JOURNAL_COMPLETED: "completed", JOURNAL_BOUNDARY: "boundary", JOURNAL_SEALED: "sealed"}
SEGMENT_JOURNAL_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S4", "b'SBJ1'"),
        ("version", 4, "<u2", "SEGMENT_JOURNAL_VERSION"),
        ("kind", 6, "<u2", "completed / boundary / sealed"),
        ("value", 8, "<u8", "offset or entry count"),
        ("value2", 16, "<u8", "data_end or zero"),
        ("checksum", 24, "<u8", "journal_checksums of bytes 0..24"),
    ],
    itemsize=32,
)
JOURNAL_RECORD_SIZE_BYTES = SEGMENT_JOURNAL_DTYPE.itemsize
assert SYNC_ALIGN_BYTES % JOURNAL_RECORD_SIZE_BYTES == 0
# The first word of a record (magic, version, kind) as one little-endian uint64.
JOURNAL_HEAD_WORD_BASE = int.from_bytes(SEGMENT_JOURNAL_MAGIC, "little") | SEGMENT_JOURNAL_VERSION << 32
_MIX_PRIMES = tuple(np.uint64(p) for p in (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9))
_MIX_SHIFTS = (np.uint64(31), np.uint64(29))


def journal_checksums(words: np.ndarray, seed: int) -> np.ndarray:
    """Checksums of journal records given as an (n, 3) uint64 array of their first three
    words: a 64-bit multiply-xorshift mix (the finaliser of xxh64) per word, one numpy pass
    for any n (uint64 array products wrap without a warning).
    NOTE: per-record xxh3 through the Python binding was rejected: one call per completion,
    about 0.2 us each, where this is about 5 us per batch of 64."""
    h = words[:, 0] ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    for column in range(3):
        if column:
            h ^= words[:, column]
        h *= _MIX_PRIMES[column]
        h ^= h >> _MIX_SHIFTS[0]
    h *= _MIX_PRIMES[0]
    h ^= h >> _MIX_SHIFTS[1]
    return h


def journal_seed(model: int, lane: int, segment_seq: int) -> int:
    """The checksum seed of a segment's journal (SEGMENT_JOURNAL_DTYPE): from its keys, so a
    journal beside the wrong segment fails its checksums instead of completing foreign offsets."""
    return (segment_seq * 0x100000001B3 ^ lane << 40 ^ model << 20) & 0xFFFFFFFFFFFFFFFF

