"""The segment catalog's records (DATA_DIR/segments.catalog and its mirror)."""

from __future__ import annotations

from shm.layout import checked_dtype, field_offset, struct_for

# The segment catalog (DATA_DIR/segments.catalog): what the store holds, so that a segment
# file that disappears is noticed. One record per segment lifecycle event, never per item;
# appended in place into preallocated space (zeros past the last record), rewritten whole
# (compacted) at recovery and when it grows. A record whose checksum fails is damage; one
# that is the last non-zero record is a torn append and is ignored. The file has a mirror,
# CATALOG_MIRROR_FILE, of the same layout and the same records at the same offsets, written
# after the catalog's fdatasync in `power` (pipeline/broker/storage/catalog.py says why).
#   off  size  field        meaning
#     0     4  magic        b"SBC1"
#     4     2  version      CATALOG_VERSION
#     6     2  kind         CATALOG_CREATED / _SEALED / _DELETED / _QUARANTINED / _MISSING
#     8     4  model        the segment's keys
#    12     4  lane
#    16     8  signature
#    24     8  segment_seq
#    32     8  entry_count  SEALED: entries in the segment; MISSING: as last known, or
#                           CATALOG_COUNT_UNKNOWN (it was still open); else zero
#    40     8  time_ns      wall clock when recorded (time.time_ns)
#    48     8  reserved     zero
#    56     8  checksum     xxh3-64 of bytes 0..56
CATALOG_FILE = "segments.catalog"
CATALOG_MIRROR_FILE = CATALOG_FILE + ".mirror"
CATALOG_MAGIC = b"SBC1"
# Bump when a field below moves or changes meaning.
CATALOG_VERSION = 1
CATALOG_CREATED = 1  # renamed into place (recorded after the rename)
CATALOG_SEALED = 2  # no more appends; entry_count is final (recorded before the seal)
CATALOG_DELETED = 3  # fully tombstoned (recorded before the unlink)
CATALOG_QUARANTINED = 4  # moved to quarantine/ (recorded before the move)
CATALOG_MISSING = 5  # a note file in quarantine/: recovery found the segment gone
CATALOG_KIND_NAMES = {CATALOG_CREATED: "created", CATALOG_SEALED: "sealed", CATALOG_DELETED: "deleted",
                      CATALOG_QUARANTINED: "quarantined", CATALOG_MISSING: "missing"}
CATALOG_COUNT_UNKNOWN = (1 << 64) - 1
CATALOG_RECORD_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S4", "b'SBC1'"),
        ("version", 4, "<u2", "CATALOG_VERSION"),
        ("kind", 6, "<u2", "lifecycle event"),
        ("model", 8, "<u4", "model id"),
        ("lane", 12, "<u4", "lane id"),
        ("signature", 16, "<u8", "shape"),
        ("segment_seq", 24, "<u8", "segment sequence"),
        ("entry_count", 32, "<u8", "entries (sealed, missing)"),
        ("time_ns", 40, "<u8", "wall clock"),
        ("checksum", 56, "<u8", "xxh3 of bytes 0..56"),
    ],
    itemsize=64,
)
CATALOG_RECORD_SIZE_BYTES = CATALOG_RECORD_DTYPE.itemsize
CATALOG_CHECKSUM_FROM = field_offset(CATALOG_RECORD_DTYPE, "checksum")
CATALOG_RECORD_STRUCT = struct_for(CATALOG_RECORD_DTYPE)
