"""Declaring fixed binary layouts once, and checking them at import time.

Every shared-memory and on-disk layout in this product is a numpy structured dtype with
explicit little-endian fields, written beside a comment table (offset, size, meaning).
`checked_dtype` builds the dtype from that table and asserts that numpy agrees with it, so
the table a reader sees is the layout the code uses. `struct_for` derives the `struct.Struct`
the hot paths use from the same dtype, and `Field` one word read or written in place, so
no format string is ever written by hand and the two can never drift apart.
"""

from __future__ import annotations

import struct

import numpy as np

# One row of a layout table: field name, byte offset, numpy type string (explicit '<'), meaning.
LayoutRow = tuple[str, int, str, str]

_STRUCT_CODES = {
    "<u1": "B", "<u2": "H", "<u4": "I", "<u8": "Q",
    "|u1": "B", "<i1": "b", "<i2": "h", "<i4": "i", "<i8": "q",
    "<f4": "f", "<f8": "d",
}


def checked_dtype(rows: list[LayoutRow], itemsize: int) -> np.dtype:
    """Build a structured dtype from a layout table and assert it matches the table.

    Gaps between fields are allowed (reserved bytes); overlaps are not.
    """
    names = [r[0] for r in rows]
    offsets = [r[1] for r in rows]
    formats = [r[2] for r in rows]
    for fmt in formats:
        assert fmt[0] in "<|", f"layout field type {fmt!r} must state its byte order"
    dtype = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize})
    end = 0
    for name, offset, fmt, _meaning in rows:
        field_dtype, field_offset = dtype.fields[name][:2]
        assert field_offset == offset, f"{name}: offset {field_offset} != table {offset}"
        assert offset >= end, f"{name} overlaps the field before it"
        end = offset + field_dtype.itemsize
    assert end <= itemsize, f"fields end at {end}, past itemsize {itemsize}"
    return dtype


def struct_for(dtype: np.dtype, fields: list[str] | None = None) -> struct.Struct:
    """A little-endian `struct.Struct` packing `fields` (default: the whole record, trailing
    reserved bytes included) of `dtype` at their offsets.

    Reserved gaps between the chosen fields become pad bytes, written as zero, so
    `pack_into(buf, base, *values)` writes what numpy would for a fresh record. `fields`
    must be named in offset order: values are packed and unpacked by position, so a list in
    another order would put each value in another field's place.
    """
    chosen = list(dtype.names) if fields is None else fields
    ordered = sorted(chosen, key=lambda n: dtype.fields[n][1])
    assert chosen == ordered, f"fields {chosen} are not in offset order {ordered}"
    fmt = "<"
    pos = dtype.fields[ordered[0]][1]
    start = pos
    for name in ordered:
        field_dtype, offset = dtype.fields[name][:2]
        if offset > pos:
            fmt += f"{offset - pos}x"
        if field_dtype.kind == "S":
            fmt += f"{field_dtype.itemsize}s"
        else:
            fmt += _STRUCT_CODES[field_dtype.str]
        pos = offset + field_dtype.itemsize
    if fields is None and dtype.itemsize > pos:
        fmt += f"{dtype.itemsize - pos}x"  # the whole record: trailing reserved bytes too
        pos = dtype.itemsize
    packer = struct.Struct(fmt)
    assert packer.size == pos - start, (fmt, packer.size, pos - start)
    return packer


def field_offset(dtype: np.dtype, name: str) -> int:
    """Byte offset of one field, for the hot paths that read a single word with struct."""
    return int(dtype.fields[name][1])


class Field:
    """One field of a layout, read and written alone, in place, at `base` + its offset, with
    a struct derived from the layout's dtype: the words a record keeps changing (counts,
    flags, state words) and the ones a reader needs alone. Immutable; thread-safe."""

    __slots__ = ("name", "offset", "end", "_struct")

    def __init__(self, dtype: np.dtype, name: str) -> None:
        self.name = name
        self.offset = field_offset(dtype, name)
        self._struct = struct_for(dtype, [name])
        self.end = self.offset + self._struct.size

    def read(self, buf, base: int = 0) -> int:
        """The field's value in the record at `base` of `buf`."""
        return self._struct.unpack_from(buf, base + self.offset)[0]

    def write(self, buf, value: int, base: int = 0) -> None:
        """Store `value` in the field of the record at `base` of `buf` (nothing else)."""
        self._struct.pack_into(buf, base + self.offset, value)
