"""Items whose owner ended: answered by the consumers without running them.

A payload that begins with OWNED_PAYLOAD_MAGIC names its owner in bytes 8 to 16 (a batch
job's items: `batchjob/layout.py`'s JOB_PAYLOAD_DTYPE begins so, checked there at import).
The broker never reads payloads; a consumer reads this much of them, and nothing else.

    add_ended_owner(data_dir, owner)      # the batch service: a batch cancelled or expired
    ended = EndedOwners(data_dir)         # a consumer
    ended.refresh()                       # a stat; the file read again only when it grew
    ended.positions(payloads)             # which items of a batch are an ended owner's

DATA_DIR/ENDED_OWNERS_NAME is an append-only array of owner ids (u64, little-endian, 8
bytes each, no header), written by one process (the service's scheduler). A torn tail (a
write cut short on a full disk) is ignored by readers and cut by the next write. The file is a hint, never fsynced: one lost in a
power cut only lets the items it named run after all, their answers read by nobody.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Sequence

import numpy as np

OWNED_PAYLOAD_MAGIC = b"SBJR"
# Where the owner id sits in an owned payload, and its size.
OWNER_OFFSET_BYTES = 8
OWNER_SIZE_BYTES = 8
OWNED_PAYLOAD_MIN_BYTES = OWNER_OFFSET_BYTES + OWNER_SIZE_BYTES
ENDED_OWNERS_NAME = "ended-owners"
# The most owners the file is read for: a service's batches over its whole life, at 8 bytes
# each (8 MiB); past it the oldest are not read (their items ran out long before).
MAX_ENDED_OWNERS = 1 << 20
OWNER_DTYPE = np.dtype("<u8")


def payload_owner(payload: bytes) -> int | None:
    """The owner a payload names, None for a payload that names none."""
    if len(payload) < OWNED_PAYLOAD_MIN_BYTES or payload[:len(OWNED_PAYLOAD_MAGIC)] != OWNED_PAYLOAD_MAGIC:
        return None
    return int.from_bytes(payload[OWNER_OFFSET_BYTES:OWNED_PAYLOAD_MIN_BYTES], "little")


def add_ended_owner(data_dir: str, owner: int) -> None:
    """Say that `owner` ended: the consumers of `data_dir` answer its items without running them."""
    fd = os.open(os.path.join(data_dir, ENDED_OWNERS_NAME), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                 0o600)
    try:
        size = os.fstat(fd).st_size
        if size % OWNER_SIZE_BYTES:  # a torn tail: cut, or every id after it would be read shifted
            os.ftruncate(fd, size - size % OWNER_SIZE_BYTES)
        record = int(owner).to_bytes(OWNER_SIZE_BYTES, "little")
        if os.write(fd, record) != len(record):
            raise OSError(errno.ENOSPC, "a short write", ENDED_OWNERS_NAME)
    finally:
        os.close(fd)


class EndedOwners:
    """The ended owners of a data directory, as one consumer knows them. Owner: its loop."""

    def __init__(self, data_dir: str | None) -> None:
        self.path = os.path.join(data_dir, ENDED_OWNERS_NAME) if data_dir is not None else None
        self.owners: frozenset[int] = frozenset()
        self._size = 0

    def refresh(self) -> None:
        """Read the file again where it grew since the last call (a stat otherwise)."""
        if self.path is None:
            return
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return
        whole = size - size % OWNER_SIZE_BYTES
        if whole == self._size:
            return
        with contextlib.suppress(OSError), open(self.path, "rb") as f:
            f.seek(max(0, whole - MAX_ENDED_OWNERS * OWNER_SIZE_BYTES))
            raw = f.read(min(whole, MAX_ENDED_OWNERS * OWNER_SIZE_BYTES))
            whole_raw = raw[:len(raw) // OWNER_SIZE_BYTES * OWNER_SIZE_BYTES]  # the file cut meanwhile
            self.owners = frozenset(int(o) for o in np.frombuffer(whole_raw, dtype=OWNER_DTYPE))
            self._size = whole

    def positions(self, payloads: Sequence[bytes]) -> list[int]:
        """The positions of the payloads that name an ended owner."""
        if not self.owners:
            return []
        return [k for k, payload in enumerate(payloads) if payload_owner(payload) in self.owners]
