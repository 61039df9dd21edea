"""Reading JSON-lines files that come from outside (workloads, results) with bounded memory.

A line longer than the reader's limit is never held whole: it is skipped to its newline in
chunks and reported as too long, so a file of one endless line (`/dev/zero`, a torn file of
gigabytes) costs a chunk of memory, not all of it (seen in a hostile test run: `pipeline status` on a results
file linked to /dev/zero grew to 10 GB in 30 s).

    for number, line in bounded_lines(file, MAX_LINE_BYTES):
        if line is None: ...  # line `number` was longer than the limit

And how a message shows what came from outside: a path or string from a file or the user
through `printable` (escaped where a terminal would act on it), every message on its way to
the terminal through `for_terminal` (the net under the values that were not), counts through
`counted` ("1 request", "2 requests").
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from typing import BinaryIO

# How much of an over-long line is read at a time while it is skipped.
SKIP_CHUNK_BYTES = 1 << 20
# Names a message lists (a line's unknown keys, say) before "and N more": a line of 5,000
# keys made a 44 KB error message (found by tests/fuzz).
MAX_NAMES_LISTED = 10
# Characters of one listed name: a key may be as long as its line.
MAX_NAME_CHARS = 40


def listed(names: Sequence[object], limit: int = MAX_NAMES_LISTED) -> str:
    """The first `limit` names as reprs ("'a', 'b'"), each cut to MAX_NAME_CHARS, then "and N
    more": what a message about a line's keys says of them, bounded whatever the line."""
    shown = ", ".join(f"{name!r:.{MAX_NAME_CHARS}}" for name in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def printable(text: str) -> str:
    """A path or string from a file or the user, for a message: as it is where every
    character is printable; else as Python's repr (quoted, each control, format or lone
    surrogate character escaped: \\x1b, \\r, \\n, \\u202e, \\udcff), so a name can neither
    move the cursor, recolour or hide the terminal's text, nor start a line of its own."""
    return text if text.isprintable() else repr(text)


def for_terminal(message: str) -> str:
    """A message on its way to the terminal: its line breaks kept, every other character
    that is not printable escaped as `printable` escapes it (so a value that did not pass
    through `printable` still cannot act on the terminal)."""
    if message.replace("\n", "").isprintable():
        return message
    return "".join(c if c == "\n" or c.isprintable() else repr(c)[1:-1] for c in message)


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`count` with thousands separators and `noun`, plural (`plural`, else noun + "s") unless
    the count is 1: "1 request", "2,000 requests"."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"


def bounded_lines(file: BinaryIO, limit_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number from 1, the line with its newline) for every line of a binary file, or
    (number, None) for a line longer than `limit_bytes` (skipped, never held whole)."""
    number = 0
    while True:
        line = file.readline(limit_bytes + 1)
        if not line:
            return
        number += 1
        if line.endswith(b"\n") or len(line) <= limit_bytes:  # whole, or a last line cut short
            yield number, line
            continue
        while not line.endswith(b"\n"):  # the rest of the over-long line
            line = file.readline(SKIP_CHUNK_BYTES)
            if not line:
                break
        yield number, None


def external_lines(path: str, limit_bytes: int, error: type[Exception],
                   what: str) -> Iterator[tuple[int, bytes | None]]:
    """`bounded_lines` of the file at `path`, which must be a file or a pipe (a device such
    as /dev/zero would be read forever); `error(message)` for anything else, or an OSError
    reading it, naming the path and `what` it is ("workload", "batch file")."""
    try:
        with open(path, "rb") as file:
            kind = file_kind(file.fileno())
            if kind not in ("file", "pipe"):
                raise error(f"{path}: a {what} must be a file or a pipe, not a {kind}")
            yield from bounded_lines(file, limit_bytes)
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror or exc})") from exc


def file_kind(fd: int) -> str:
    """"file", "pipe" (a FIFO or socket: a stream that ends), or what else it is (a device,
    a directory) for messages."""
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        return "pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "directory" if stat.S_ISDIR(mode) else "special file"


def read_small_file(path: str, limit_bytes: int) -> bytes | None:
    """Up to `limit_bytes` + 1 bytes of the regular file at `path` (more than `limit_bytes`:
    the caller's "too long"); None where there is none. A FIFO or device is never waited on
    or read: OSError EINVAL naming its kind; a symlink is not followed (ELOOP)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        kind = file_kind(fd)
        if kind != "file":
            raise OSError(errno.EINVAL, f"not a regular file but a {kind}", path)
        return os.read(fd, limit_bytes + 1)
    finally:
        os.close(fd)
