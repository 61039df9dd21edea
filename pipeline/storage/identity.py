"""Who a segment is: the routing keys its header holds once (checksummed, the identity
block) and its file name repeats, and the checksum of the header's commit boundary words.
Layout in `pipeline.wire.layouts` (SEGMENT_HEADER_DTYPE); names in `pipeline.wire.layouts` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from pipeline.wire.errors import SegmentFormatError
from pipeline.wire.layouts.names import parse_segment_relpath
from pipeline.wire.layouts.segments import (
    SEGMENT_HEADER_DTYPE,
    SEGMENT_HEADER_SIZE_BYTES,
    SEGMENT_IDENTITY_BYTES,
    SEGMENT_MAGIC,
    SEGMENT_VERSION,
)
from shm.layout import struct_for

# The header's identity block (bytes 0..48: the keys), with its checksum (bytes 48..56), and
# the (entry_count, data_end) pair the boundary checksum covers: all from the header's dtype.
_KEYS = ["magic", "version", "header_size", "model", "lane", "signature", "segment_seq", "created_ns"]
_HEAD = struct_for(SEGMENT_HEADER_DTYPE, _KEYS)
_IDENTITY = struct_for(SEGMENT_HEADER_DTYPE, [*_KEYS, "identity_checksum"])
_U64 = struct_for(SEGMENT_HEADER_DTYPE, ["identity_checksum"])
_BOUNDARY = struct_for(SEGMENT_HEADER_DTYPE, ["entry_count", "data_end"])
assert _HEAD.size == SEGMENT_IDENTITY_BYTES and _IDENTITY.size == SEGMENT_IDENTITY_BYTES + 8


@dataclass(frozen=True, slots=True)
class SegmentKeys:
    """The routing keys a segment holds once in its header."""

    model: int
    signature: int
    lane: int
    segment_seq: int


def identity_bytes(keys: SegmentKeys, created_ns: int) -> bytes:
    """The header's identity block for a new segment: keys, then their checksum."""
    head = _HEAD.pack(
        SEGMENT_MAGIC, SEGMENT_VERSION, SEGMENT_HEADER_SIZE_BYTES,
        keys.model, keys.lane, keys.signature, keys.segment_seq, created_ns,
    )
    assert len(head) == SEGMENT_IDENTITY_BYTES
    return head + _U64.pack(xxhash.xxh3_64_intdigest(head))


def read_identity(header: bytes | memoryview, path: str) -> tuple[SegmentKeys, int]:
    """Check a segment header's identity block; return (keys, created_ns) or raise
    SegmentFormatError naming the path and offset."""
    if len(header) < SEGMENT_HEADER_SIZE_BYTES:
        raise SegmentFormatError(f"{path}: {len(header)} bytes, shorter than a segment header")
    magic, version, header_size, model, lane, signature, seq, created_ns, checksum = (
        _IDENTITY.unpack_from(header, 0)
    )
    if magic != SEGMENT_MAGIC or version != SEGMENT_VERSION or header_size != SEGMENT_HEADER_SIZE_BYTES:
        raise SegmentFormatError(
            f"{path}: offset 0: magic {magic!r}, version {version}, header size {header_size}; "
            f"expected {SEGMENT_MAGIC!r}, {SEGMENT_VERSION}, {SEGMENT_HEADER_SIZE_BYTES}"
        )
    if xxhash.xxh3_64_intdigest(bytes(header[:SEGMENT_IDENTITY_BYTES])) != checksum:
        raise SegmentFormatError(f"{path}: offset 48: identity checksum does not match the routing keys")
    return SegmentKeys(model, signature, lane, seq), created_ns


def boundary_checksum(entry_count: int, data_end: int) -> int:
    """The checksum the header's (entry_count, data_end) pair carries."""
    return xxhash.xxh3_64_intdigest(_BOUNDARY.pack(entry_count, data_end))


def header_key_fields(header: bytes | memoryview) -> SegmentKeys:
    """The key fields of a header as they are stored, checked by nothing."""
    _magic, _version, _size, model, lane, signature, seq, _created, _sum = _IDENTITY.unpack_from(header, 0)
    return SegmentKeys(model, signature, lane, seq)


def establish_identity(header: bytes | memoryview, path: str, name_keys: SegmentKeys | None,
                       name_confirmed: bool = False) -> tuple[SegmentKeys, int, str]:
    """(keys, created_ns, damage) of a segment header, judged against its file name's keys.

    Intact and equal to the name (or no name to compare): damage "". A damaged identity block
    whose key fields still equal the name's keys (the damage is elsewhere in the block), or
    whose name another witness confirms (`name_confirmed`: the store log recorded a segment of
    exactly these keys, or the store itself established them earlier): the name's keys, and
    the damage named. Anything else (keys that disagree with an unconfirmed name, a damaged
    block with no name, another format version) raises SegmentFormatError: no item is ever
    delivered under keys that cannot be established.
    NOTE: the name alone was the first rule; one flipped byte in a header's lane field then
    quarantined all 57 intact entries of a segment the store log knew by that very name.
    """
    try:
        keys, created_ns = read_identity(header, path)
    except SegmentFormatError as exc:
        if len(header) < SEGMENT_HEADER_SIZE_BYTES or name_keys is None or _foreign_version(header):
            raise
        if name_confirmed and header_key_fields(header) != name_keys:
            return name_keys, 0, f"{exc} (the store log recorded a segment of its name's keys: salvaged under them)"
        if header_key_fields(header) != name_keys:
            raise SegmentFormatError(
                f"{exc}; its key fields {header_key_fields(header)} are not the file name's {name_keys}"
            ) from None
        return name_keys, 0, f"{exc} (the key fields equal the file name's: salvaged under them)"
    if name_keys is not None and keys != name_keys:
        raise SegmentFormatError(f"{path}: offset 0: header keys {keys} are not the file name's {name_keys}")
    return keys, created_ns, ""


def _foreign_version(header: bytes | memoryview) -> bool:
    """An intact identity block of another format version: not damage, a format we cannot read."""
    return foreign_version(header) is not None


def foreign_version(header: bytes | memoryview) -> int | None:
    """The layout version of an intact identity block of another version, else None."""
    if len(header) < SEGMENT_IDENTITY_BYTES + 8:
        return None
    magic, version, _size, *_rest, checksum = _IDENTITY.unpack_from(header, 0)
    intact = xxhash.xxh3_64_intdigest(bytes(header[:SEGMENT_IDENTITY_BYTES])) == checksum
    return int(version) if intact and magic == SEGMENT_MAGIC and version != SEGMENT_VERSION else None


def name_keys_of(path: str) -> SegmentKeys | None:
    """The keys a segment path's name carries (a quarantined copy's `.N` suffix ignored)."""
    head, dot, tail = path.rpartition(".")
    parsed = parse_segment_relpath(head if dot and tail.isdigit() else path)
    return None if parsed is None else SegmentKeys(*parsed)
