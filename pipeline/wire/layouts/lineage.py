"""The lineage file's header and records (DATA_DIR/shapes.lineage): the shapes' chains."""

from __future__ import annotations

from shm.layout import checked_dtype, field_offset, struct_for

# The lineage file (DATA_DIR/shapes.lineage): the shapes' chains (SPEC §4b), so that shapes
# recovered from disk after a restart come back in prefix order although no producer sends
# their chains again. One record per trie node newly declared (a prefix level or a shape's
# own signature, with its parent), not per chain: a conversation of 60 turns is 60 records,
# where its 60 chains hold 1,830 signatures. A file header, then records appended in place
# into preallocated space (zeros past the last), rewritten at recovery holding only the
# nodes of live shapes' chains. A record whose checksum fails is damage; the last non-zero
# one is a torn append, ignored.
#   header:  off  size  field        meaning
#              0     8  magic        b"SBLINEA1"
#              8     4  version      LINEAGE_VERSION
#             12     4  record_size  LINEAGE_RECORD_SIZE_BYTES (the header takes one slot)
#             16     8  created_ns   wall clock when written (time.time_ns)
#             56     8  checksum     xxh3-64 of bytes 0..56
#   record:   off  size  field        meaning
#              0     2  kind         LINEAGE_NODE (zero: preallocated space)
#              2     2  depth        the node's chain level, 1 to MAX_CHAIN_DEPTH
#              4     4  model        model id
#              8     8  signature    the node: the prefix signature at that level
#             16     8  parent       the signature one level up (zero at depth 1)
#             24     8  time_ns      wall clock when recorded
#             56     8  checksum     xxh3-64 of bytes 0..56
LINEAGE_FILE = "shapes.lineage"
LINEAGE_MAGIC = b"SBLINEA1"
# Bump when a field below moves or changes meaning; a file of another version is not read
# (its chains are lost: those shapes come back as chains of one) and is rewritten.
LINEAGE_VERSION = 1
LINEAGE_NODE = 1
LINEAGE_HEADER_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S8", "b'SBLINEA1'"),
        ("version", 8, "<u4", "LINEAGE_VERSION"),
        ("record_size", 12, "<u4", "record bytes"),
        ("created_ns", 16, "<u8", "wall clock"),
        ("checksum", 56, "<u8", "xxh3 of bytes 0..56"),
    ],
    itemsize=64,
)
LINEAGE_RECORD_DTYPE = checked_dtype(
    [
        ("kind", 0, "<u2", "LINEAGE_NODE"),
        ("depth", 2, "<u2", "chain level"),
        ("model", 4, "<u4", "model id"),
        ("signature", 8, "<u8", "the node's prefix signature"),
        ("parent", 16, "<u8", "the level above's signature"),
        ("time_ns", 24, "<u8", "wall clock"),
        ("checksum", 56, "<u8", "xxh3 of bytes 0..56"),
    ],
    itemsize=64,
)
LINEAGE_RECORD_SIZE_BYTES = LINEAGE_RECORD_DTYPE.itemsize
assert LINEAGE_HEADER_DTYPE.itemsize == LINEAGE_RECORD_SIZE_BYTES  # the header takes slot 0
LINEAGE_CHECKSUM_FROM = field_offset(LINEAGE_RECORD_DTYPE, "checksum")
assert LINEAGE_CHECKSUM_FROM == field_offset(LINEAGE_HEADER_DTYPE, "checksum")
LINEAGE_HEADER_STRUCT = struct_for(LINEAGE_HEADER_DTYPE)
LINEAGE_RECORD_STRUCT = struct_for(LINEAGE_RECORD_DTYPE)
