"""The store log's records (DATA_DIR/store.log): what the store holds and what changes about
its segments once their entries are written, one append-only file for the whole data
directory."""

from __future__ import annotations

import numpy as np

from pipeline.wire.layouts.segments import ENTRY_ALIGN_BYTES, SEGMENT_HEADER_SIZE_BYTES, SYNC_ALIGN_BYTES
from shm.layout import checked_dtype

# The store log (pipeline/storage/storelog.py): each segment's life (created, sealed,
# deleted or quarantined), its completions (up to COMPLETED_PER_RECORD entries a record) and
# its commit boundary (after each group commit); and the shapes' chains (a LINEAGE record per
# trie node: pipeline/storage/chains.py). Records are 64 bytes at multiples of 64 from
# offset 0; zeros are the padding, in `power`, to the next SYNC_ALIGN_BYTES boundary before each
# synced group of records. Each record carries its group's `epoch` (one more after each
# sync; 0 only for what a compaction wrote, synced whole): a record that fails its checks
# before the last valid record of epoch 0 or of an earlier epoch than the newest is damage;
# one after it may have been written since the last sync, and a power cut may garble any
# sector of those (a torn write, ignored).
#   off  size  field        meaning
#     0     4  magic        b"SBL1"
#     4     2  version      STORE_LOG_VERSION
#     6     2  kind         LOG_COMPLETED ... LOG_SEQUENCE (LOG_MISSING: note files only)
#     8     8  segment_seq  the segment (one sequence per store names it alone); LINEAGE: 0;
#                           SEQUENCE: the highest any record named before a compaction
#    16     4  keys_tag     `keys_tag` of the segment's (model, signature, lane): a record
#                           read beside a segment of other keys under that sequence is not
#                           its; LINEAGE, SEQUENCE: 0
#    20     4  epoch        the sync group: 0 for what a compaction wrote (made durable
#                           whole before it was renamed in: always synced), appends from 1,
#                           one more after each sync that had records to sync
#    24    32  body         COMPLETED: u32 entry offsets / ENTRY_ALIGN_BYTES, unused slots
#                           zero (no entry starts at 0: the segment header is there);
#                           BOUNDARY: u64 entry_count, u64 data_end; SEALED: u64 entry_count;
#                           CREATED, DELETED, QUARANTINED, MISSING: u32 model, u32 lane,
#                           u64 signature, u64 entry_count (MISSING: as last known, or
#                           LOG_COUNT_UNKNOWN), u64 time_ns (MISSING: when noted);
#                           LINEAGE: u32 model, u32 depth (1 to MAX_CHAIN_DEPTH), u64 the
#                           node's signature, u64 its parent's (zero at depth 1), u64 zero;
#                           SEQUENCE: zero
#    56     8  checksum     `log_checksums` of bytes 0..56
STORE_LOG_FILE = "store.log"
STORE_LOG_MAGIC = b"SBL1"
# Bump when a field above moves or changes meaning: a record of another version is refused
# (the store is not opened), never taken for garbage.
STORE_LOG_VERSION = 2
LOG_COMPLETED = 1  # entries of the segment are done (the segment itself is never rewritten)
LOG_BOUNDARY = 2  # entries [SEGMENT_HEADER_SIZE_BYTES, data_end) are written: entry_count of them
LOG_SEALED = 3  # no more appends; entry_count entries in all
LOG_CREATED = 4  # renamed into place (recorded after the rename)
LOG_DELETED = 5  # fully completed (recorded, and in `power` synced, before the unlink)
LOG_QUARANTINED = 6  # moved to quarantine/ (recorded, and in `power` synced, before the move)
LOG_LINEAGE = 7  # a shape's chain level: a prefix signature under its parent
# A compaction's one record of the highest sequence the log named, so that a sequence whose
# segment's records it dropped is never taken again (a MISSING note in quarantine/ names it).
LOG_SEQUENCE = 8
LOG_MISSING = 9  # a note file in quarantine/ (one record): recovery found the segment gone
LOG_KIND_NAMES = {LOG_COMPLETED: "completed", LOG_BOUNDARY: "boundary", LOG_SEALED: "sealed", LOG_CREATED: "created",
                  LOG_DELETED: "deleted", LOG_QUARANTINED: "quarantined", LOG_LINEAGE: "lineage",
                  LOG_SEQUENCE: "sequence", LOG_MISSING: "missing"}
LOG_COUNT_UNKNOWN = (1 << 64) - 1  # a MISSING note of a segment that was still open
STORE_LOG_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S4", "b'SBL1'"),
        ("version", 4, "<u2", "STORE_LOG_VERSION"),
        ("kind", 6, "<u2", "LOG_COMPLETED ... LOG_MISSING"),
        ("segment_seq", 8, "<u8", "segment sequence"),
        ("keys_tag", 16, "<u4", "keys_tag(model, signature, lane)"),
        ("epoch", 20, "<u4", "sync group"),
        ("body", 24, "|V32", "offsets / 16, counts, or the segment's keys"),
        ("checksum", 56, "<u8", "log_checksums of bytes 0..56"),
    ],
    itemsize=64,
)
LOG_RECORD_SIZE_BYTES = STORE_LOG_DTYPE.itemsize
LOG_RECORD_WORDS = LOG_RECORD_SIZE_BYTES // 8
# Entries one COMPLETED record names: its 32-byte body as u32 slots, so a completion costs 8
# bytes of log where a record per entry would cost 64.
COMPLETED_PER_RECORD = 8
# A segment this large or larger cannot be named by a COMPLETED slot (u32 x 16 bytes): every
# segment size limit is checked against it where it is set.
LOG_SEGMENT_BYTES_LIMIT = (1 << 32) * ENTRY_ALIGN_BYTES
# Epochs a log file may reach: one a sync that wrote, so fewer than the records it holds,
# and a compaction starts again from 0.
LOG_EPOCH_LIMIT = 1 << 32
assert SYNC_ALIGN_BYTES % LOG_RECORD_SIZE_BYTES == 0
assert SEGMENT_HEADER_SIZE_BYTES > 0  # a zero COMPLETED slot names no entry
# The first word of a record (magic, version, kind) as one little-endian uint64.
LOG_HEAD_WORD_BASE = int.from_bytes(STORE_LOG_MAGIC, "little") | STORE_LOG_VERSION << 32
_HEAD_MASK = np.uint64(0xFFFFFFFFFFFF)
_MIX_PRIMES = tuple(np.uint64(p) for p in (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9))
_SHIFT_A, _SHIFT_B = np.uint64(31), np.uint64(29)


def _mix(words: np.ndarray) -> np.ndarray:
    """A 64-bit multiply-xorshift mix (the finaliser of xxh64) of each row of `words` (an
    (n, k) uint64 array), one numpy pass for any n (uint64 array products wrap silently).
    NOTE: per-record xxh3 through the Python binding was rejected: one call per record,
    about 0.2 us each, where this is about 5 us per 64 records."""
    h = np.zeros(words.shape[0], dtype=np.uint64)
    for column in range(words.shape[1]):
        h ^= words[:, column]
        h *= _MIX_PRIMES[column % 3]
        h ^= h >> _SHIFT_A
    h *= _MIX_PRIMES[0]
    h ^= h >> _SHIFT_B
    return h


def log_checksums(words: np.ndarray) -> np.ndarray:
    """Checksums of records given as an (n, 7) uint64 array of their first seven words."""
    return _mix(words)


def keys_tag(model: int, signature: int, lane: int) -> int:
    """The 32-bit tag of a segment's keys that every record of it carries."""
    words = np.array([[model, signature & 0xFFFFFFFFFFFFFFFF, lane]], dtype=np.uint64)
    return int(_mix(words)[0]) & 0xFFFFFFFF


def record_words(data: bytes | memoryview) -> np.ndarray:
    """The whole records at the start of `data` as an (n, 8) uint64 array (a view)."""
    whole = len(data) // LOG_RECORD_SIZE_BYTES
    return np.frombuffer(data, dtype="<u8", count=whole * LOG_RECORD_WORDS).reshape(whole, LOG_RECORD_WORDS)


def valid_rows(words: np.ndarray, last_kind: int = LOG_SEQUENCE) -> np.ndarray:
    """Which rows of `words` are records we write: head word, a kind up to `last_kind`
    (LOG_MISSING belongs in note files, never in the log), checksum."""
    kinds = words[:, 0] >> np.uint64(48)
    known = (kinds >= np.uint64(LOG_COMPLETED)) & (kinds <= np.uint64(last_kind))
    return ((words[:, 0] & _HEAD_MASK) == np.uint64(LOG_HEAD_WORD_BASE)) & known & (
        log_checksums(words[:, :7]) == words[:, 7])


def other_versions(words: np.ndarray) -> np.ndarray:
    """Which rows of `words` are whole records of another version of this layout (magic and
    checksum good, version not ours)."""
    magic = words[:, 0] & np.uint64(0xFFFFFFFF)
    version = (words[:, 0] >> np.uint64(32)) & np.uint64(0xFFFF)
    return (magic == np.uint64(LOG_HEAD_WORD_BASE & 0xFFFFFFFF)) & (version != np.uint64(STORE_LOG_VERSION)) & (
        log_checksums(words[:, :7]) == words[:, 7])
