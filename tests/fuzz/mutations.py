"""Mutations of valid encodings, as plain functions of explicit choices: the hypothesis
strategies (`strategies.py`) and the seeded loop of `tools/fuzz_atheris.py` draw the
choices, these apply them.

Binary: flip a bit, cut the input short, insert or delete bytes, overwrite one header
field (by the target's field table) with a boundary value of its width. Text (JSON lines):
replace one JSON value anywhere in a line with an odd one (an integer past a float's
range, NaN, a lone surrogate, a long string, a container of many elements, nesting as
deep as the parser takes), or drop, repeat or replace whole lines.
"""

from __future__ import annotations

import json

# Nesting a JSON line may carry: past the interpreter's recursion limit, which json.loads
# turns into RecursionError.
DEEP_NESTING = 5_000
# Elements in the odd containers: many keys or items, a long message if one is repeated whole.
WIDE_ELEMENTS = 5_000

ODD_JSON_VALUES: list[object] = [
    0, -1, 1, 2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**400), 1e308, -0.0, 0.5,
    float("nan"), float("inf"), float("-inf"), True, False, None, "", "x", "\ud800", "\x00", "é" * 3,
    "y" * 70_000, [], {}, [[]], [1] * WIDE_ELEMENTS, {f"k{i}": i for i in range(WIDE_ELEMENTS)},
    [{"type": "text", "text": "t"}], {"role": "user", "content": "c"}, ["a", "b"],
]
# A marker that stands for nesting too deep to build as a Python value.
DEEP = "\x00deep\x00"
ODD_JSON_VALUES.append(DEEP)


def interesting_ints(size: int) -> list[int]:
    """Boundary values of an unsigned little-endian field of `size` bytes (signed ones read
    the top half as negatives)."""
    top = (1 << (8 * size)) - 1
    half = 1 << (8 * size - 1)
    values = {0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 63, 64, 255, 256, 4095, 4096, 4097, 65535, 1 << 20,
              1 << 24, (1 << 24) - 1, 1 << 31, 1 << 32, (1 << 40) - 1, 1 << 40, top, top - 1, half, half - 1}
    return sorted(v & top for v in values)


def flip(data: bytes, position: int, bit: int) -> bytes:
    if not data:
        return data
    at = position % len(data)
    return data[:at] + bytes([data[at] ^ (1 << (bit % 8))]) + data[at + 1:]


def truncate(data: bytes, at: int) -> bytes:
    return data[:at % (len(data) + 1)]


def insert(data: bytes, at: int, blob: bytes) -> bytes:
    at %= len(data) + 1
    return data[:at] + blob + data[at:]


def delete(data: bytes, at: int, count: int) -> bytes:
    at %= len(data) + 1
    return data[:at] + data[at + count:]


def overwrite(data: bytes, offset: int, size: int, value: int) -> bytes:
    """Field (offset, size) of `data` set to `value` (little-endian, masked to its width);
    an offset past the input leaves it as it is."""
    if offset + size > len(data):
        return data
    raw = (value & ((1 << (8 * size)) - 1)).to_bytes(size, "little")
    return data[:offset] + raw + data[offset + size:]


def _nodes(value: object, out: list) -> list:
    """Every (container, key) slot of a JSON value, depth first."""
    if isinstance(value, dict):
        for key in value:
            out.append((value, key))
            _nodes(value[key], out)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out.append((value, index))
            _nodes(item, out)
    return out


def dumps(value: object) -> bytes:
    """JSON text as a peer might write it: NaN and Infinity as Python writes them, lone
    surrogates escaped, DEEP as `[` nesting past what a parser takes."""
    text = json.dumps(value)
    return text.replace(json.dumps(DEEP), "[" * DEEP_NESTING + "]" * DEEP_NESTING).encode()


def replace_value(line: bytes, node: int, new: object) -> bytes:
    """The JSON line with its `node`-th value (depth first; the line itself when it has
    none) replaced by `new`; a line that is not JSON is left as it is."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, or nested past what it parses
        return line
    slots = _nodes(value, [])
    if not slots:
        return dumps(new) + b"\n"
    container, key = slots[node % len(slots)]
    container[key] = new
    return dumps(value) + b"\n"


def mutate_lines(data: bytes, line: int, action: str, node: int, new: object) -> bytes:
    """One line of a JSON-lines input changed: "value" (replace_value), "drop", "repeat"
    (the line twice: a duplicate id, say), "whole" (the line replaced by `new`)."""
    lines = data.splitlines(keepends=True) or [b""]
    at = line % len(lines)
    if action == "value":
        lines[at] = replace_value(lines[at].rstrip(b"\n"), node, new)
    elif action == "drop":
        del lines[at]
    elif action == "repeat":
        lines.insert(at, lines[at] if lines[at].endswith(b"\n") else lines[at] + b"\n")
    else:
        lines[at] = dumps(new) + b"\n"
    return b"".join(lines)


def control_value(data: bytes, message: int, node: int, new: object) -> bytes:
    """The control stream with one JSON value of its `message`-th message replaced (its
    length prefix rewritten to the new body's length)."""
    messages, at = [], 0
    while at + 4 <= len(data):
        length = int.from_bytes(data[at:at + 4], "little")
        messages.append(data[at + 4:at + 4 + length])
        at += 4 + length
    if not messages:
        return data
    index = message % len(messages)
    messages[index] = replace_value(messages[index], node, new).rstrip(b"\n")
    return b"".join(len(body).to_bytes(4, "little") + body for body in messages)
