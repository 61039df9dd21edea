"""Zero-copy reads of batch items from segment files, for one consumer.

A batch descriptor names each item by segment keys and byte offset. The reader maps each
segment file read-only, checks the entry it finds there against the descriptor (state word,
length, item id, and the checksum: a record is validated again just after reading), and
returns a numpy int32 view of its token ids: no token is copied between the segment and the
engine's input.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from pipeline.errors import EntryCompletedError, SegmentCorruptError
from pipeline.layouts import (
    ENTRY_HEADER_SIZE_BYTES,
    ENTRY_HEADER_STRUCT,
    ENTRY_LIVE,
    ENTRY_TOMBSTONE,
    SEGMENTS_DIR,
    TOKEN_DTYPE,
    TOKEN_SIZE_BYTES,
    entry_checksum,
    entry_size_bytes,
    segment_relpath,
)

# Segment mappings a consumer keeps open: a sticky shape drains a handful of lanes at a
# time, so 128 covers them with room while staying far from descriptor limits.
DEFAULT_OPEN_MAPS_MAX = 128
# Segment paths remembered (a few hundred bytes each); the cache restarts when full.
PATH_CACHE_MAX = 4096


@dataclass(slots=True)
class ReadItem:
    """One item as the consumer hands it on: a read-only view of its tokens and its fields."""

    item_id: int
    tokens: np.ndarray
    prefix_len: int
    payload: bytes
    submit_ns: int


class SegmentReader:
    """Read-only mappings of a data directory's segments, least recently used closed first.

    Owner: one consumer process. Not thread-safe. `close()` drops every mapping (a view the
    engine still holds keeps its mapping alive until the view goes).
    """

    def __init__(self, data_dir: str, open_maps_max: int = DEFAULT_OPEN_MAPS_MAX, verify_checksums: bool = True) -> None:
        self.root = os.path.join(data_dir, SEGMENTS_DIR)
        self.open_maps_max = open_maps_max
        self.verify_checksums = verify_checksums
        self._maps: OrderedDict[str, tuple[mmap.mmap, memoryview]] = OrderedDict()
        self._paths: dict[tuple[int, int, int, int], str] = {}

    def _view(self, path: str, end: int) -> memoryview:
        """A read-only view of `path` covering at least [0, end): the broker may have grown
        the file since it was mapped, so a short mapping is replaced."""
        entry = self._maps.get(path)
        if entry is not None and len(entry[1]) >= end:
            self._maps.move_to_end(path)
            return entry[1]
        if entry is not None:
            self._drop(path)
        with open(path, "rb") as file:
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        view = memoryview(mapping)
        if len(view) < end:
            raise SegmentCorruptError(f"{path}: {len(view)} bytes, but an entry is said to end at {end}")
        self._maps[path] = (mapping, view)
        while len(self._maps) > self.open_maps_max:
            self._drop(next(iter(self._maps)))
        return view

    def _drop(self, path: str) -> None:
        mapping, view = self._maps.pop(path)
        del view  # token views made from it keep the mapping alive until they go
        try:
            mapping.close()
        except BufferError:
            pass

    def read(self, model: int, signature: int, lane: int, segment_seq: int, offset: int,
             length: int, item_id: int, _retried: bool = False) -> ReadItem:
        """The entry at `offset`, checked against what the descriptor says it is."""
        key = (model, signature, lane, segment_seq)
        path = self._paths.get(key)
        if path is None:  # joining paths costs more than the rest of a read
            if len(self._paths) >= PATH_CACHE_MAX:
                self._paths.clear()
            path = self._paths[key] = os.path.join(self.root, segment_relpath(*key))
        view = self._view(path, offset + ENTRY_HEADER_SIZE_BYTES + length * TOKEN_SIZE_BYTES)
        state, got_length, checksum, got_id, _seq, _producer, prefix_len, payload_len, submit_ns = (
            ENTRY_HEADER_STRUCT.unpack_from(view, offset)
        )
        end = offset + entry_size_bytes(got_length, payload_len)
        if end > len(view):  # the payload (and pad) runs past what is mapped: map again
            view = self._view(path, end)
        if (got_length != length or got_id != item_id) and not _retried:
            # A mapping of a file that was deleted and made again under the same name (a
            # restarted broker reuses a lane's sequence numbers): map the path afresh.
            self._drop(path)
            return self.read(model, signature, lane, segment_seq, offset, length, item_id, _retried=True)
        if state == ENTRY_TOMBSTONE and got_length == length and got_id == item_id:
            raise EntryCompletedError(f"{path}: offset {offset}: item {item_id} was completed already")
        if state != ENTRY_LIVE or got_length != length or got_id != item_id or end > len(view):
            raise SegmentCorruptError(
                f"{path}: offset {offset}: entry has state {state:#x}, length {got_length}, item "
                f"{got_id}; the descriptor says a live entry of length {length}, item {item_id}"
            )
        if self.verify_checksums and entry_checksum(view, offset, end, got_length) != checksum:
            raise SegmentCorruptError(f"{path}: offset {offset}: checksum mismatch for item {item_id}")
        tokens_at = offset + ENTRY_HEADER_SIZE_BYTES
        tokens = np.frombuffer(view, dtype=TOKEN_DTYPE, count=length, offset=tokens_at)
        payload_at = tokens_at + length * TOKEN_SIZE_BYTES
        payload = bytes(view[payload_at:payload_at + payload_len])
        return ReadItem(item_id, tokens, prefix_len, payload, submit_ns)

    def close(self) -> None:
        for path in list(self._maps):
            self._drop(path)
