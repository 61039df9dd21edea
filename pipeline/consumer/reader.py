"""Zero-copy reads of batch items from segment files, for one consumer.

A batch descriptor names each item by segment keys and byte offset. The reader maps each
segment file read-only, checks the entry it finds there against the descriptor (state word,
length, item id, and the checksum: a record is validated again just after reading), and
returns a numpy int32 view of its token ids: no token is copied between the segment and the
engine's input.

`read_batch` does this for a whole descriptor at once: the entry headers of each segment are
gathered and checked as numpy columns, and only the checksum (one xxh3 call) and the token
view remain per item. An entry that fails a column check goes through `read`, one at a time,
which remaps a file that changed and raises the error that says what is wrong.

The reader never asks whether an entry was completed elsewhere: a batch is stale only when
the broker took it back from this consumer (declared it lost), and the broker closes the
consumer's connection before it hands the batch to anyone else, so the consumer learns it
from its session (`BrokerSession.check_open`, before each batch it takes and before it
writes a batch's results), not from the store's files.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from pipeline.wire.dirpin import DirPin, moved_message
from pipeline.wire.errors import SegmentCorruptError, SegmentReadError
from pipeline.wire.layouts.frames import TOKEN_DTYPE, TOKEN_SIZE_BYTES
from pipeline.wire.layouts.names import SEGMENTS_DIR, segment_relpath
from pipeline.wire.layouts.segments import (
    ENTRY_CHECKSUM_FROM,
    ENTRY_HEADER_SIZE_BYTES,
    ENTRY_HEADER_STRUCT,
    ENTRY_LIVE,
    entry_checksum,
    entry_prompt_digest,
    entry_size_bytes,
    gather_entry_headers,
)

# Segment mappings a consumer keeps open: a sticky shape drains a handful of lanes at a
# time, so 128 covers them with room while staying far from descriptor limits.
DEFAULT_OPEN_MAPS_MAX = 128
# Segment paths remembered (a few hundred bytes each); the cache restarts when full.
PATH_CACHE_MAX = 4096


@dataclass(slots=True)
class _Mapping:
    """One read-only mapping of a segment file and the numpy views a batch read uses."""

    mapping: mmap.mmap
    view: memoryview
    words: np.ndarray  # uint64, for gathering entry headers
    tokens: np.ndarray  # int32, for slicing token views
    identity: tuple[int, int]  # (st_dev, st_ino) of the file mapped: a deleted one is dropped


# What a batch read touched in one segment: (its mapping, first byte, end byte).
ReadSpan = tuple[_Mapping, int, int]


@dataclass(slots=True)
class ReadBatch:
    """A descriptor's entries that read back good, by column in descriptor order, and the
    ones that did not: (item id, descriptor length, SegmentCorruptError)."""

    item_ids: list[int] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    submit_ns: list[int] = field(default_factory=list)
    digests: list[int] = field(default_factory=list)  # each prompt's prompt_digest
    failed: list[tuple[int, int, Exception]] = field(default_factory=list)
    # (mapping, first byte, end) of each segment the entries were read from: handed to
    # `SegmentReader.release` once the engine is done with the views.
    spans: list[ReadSpan] = field(default_factory=list)

    def add(self, item: ReadItem) -> None:
        self.item_ids.append(item.item_id)
        self.tokens.append(item.tokens)
        self.lengths.append(item.tokens.shape[0])
        self.prefix_lens.append(item.prefix_len)
        self.payloads.append(item.payload)
        self.submit_ns.append(item.submit_ns)
        self.digests.append(item.digest)


@dataclass(slots=True)
class ReadItem:
    """One item as the consumer hands it on: a read-only view of its tokens and its fields,
    and the prompt_digest of its tokens (the results line's `prompt_xxh3`)."""

    item_id: int
    tokens: np.ndarray
    prefix_len: int
    payload: bytes
    submit_ns: int
    digest: int


class SegmentReader:
    """Read-only mappings of a data directory's segments, least recently used closed first.

    Owner: one consumer process. Not thread-safe. `close()` drops every mapping (a view the
    engine still holds keeps its mapping alive until the view goes).
    """

    def __init__(self, data_dir: str, open_maps_max: int = DEFAULT_OPEN_MAPS_MAX, verify_checksums: bool = True,
                 pin: DirPin | None = None) -> None:
        """`pin`: the data directory as the consumer first found it: a segment missing because
        its path leads elsewhere now is not read (SegmentReadError), never taken for damage."""
        self.root = os.path.join(data_dir, SEGMENTS_DIR)
        self.pin = pin
        self.open_maps_max = open_maps_max
        self.verify_checksums = verify_checksums
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        self._paths: dict[tuple[int, int, int, int], str] = {}

    def _view(self, path: str, end: int) -> memoryview:
        """A read-only view of `path` covering at least [0, end)."""
        return self._mapped(path, end).view

    def _mapped(self, path: str, end: int) -> _Mapping:
        """A read-only mapping of `path` covering at least [0, end): the broker may have grown
        the file since it was mapped, so a short mapping is replaced."""
        entry = self._maps.get(path)
        if entry is not None and len(entry.view) >= end:
            self._maps.move_to_end(path)
            return entry
        if entry is not None:
            self._drop(path)
        try:
            with open(path, "rb") as file:
                info = os.fstat(file.fileno())
                if info.st_size < end:  # an empty file cannot even be mapped (ValueError)
                    raise SegmentCorruptError(f"{path}: {info.st_size} bytes, but an entry is said to end at {end}")
                mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError as exc:  # the broker deletes only what is completed: damage
            moved = self.pin.moved() if self.pin is not None else ""
            if moved:
                raise SegmentReadError(f"{path}: cannot be read: {moved_message(self.pin.path, moved)}") from None
            raise SegmentCorruptError(f"{path}: the segment file is gone ({exc.strerror})") from None
        except OSError as exc:  # EMFILE, ENOMEM, EACCES...: the entries are intact, try later
            raise SegmentReadError(f"{path}: cannot map the segment now ({exc.strerror})") from None
        view = memoryview(mapping)
        if len(view) < end:
            raise SegmentCorruptError(f"{path}: {len(view)} bytes, but an entry is said to end at {end}")
        entry = self._maps[path] = _Mapping(mapping, view, np.frombuffer(view, dtype=np.uint64, count=len(view) // 8),
                                            np.frombuffer(view, dtype=TOKEN_DTYPE, count=len(view) // TOKEN_SIZE_BYTES),
                                            (info.st_dev, info.st_ino))
        while len(self._maps) > self.open_maps_max:
            self._drop(next(iter(self._maps)))
        return entry

    def drop_deleted(self) -> int:
        """Unmap the segments deleted since they were mapped (the broker deletes a segment
        whole once every entry is completed); how many. A mapping keeps a deleted file's
        space allocated, so without this a consumer holding its last 128 segments kept a
        disk the store had filled from ever draining (tests/runtime/test_disk_full.py).
        One stat per mapping: for a caller that sweeps about once a second."""
        gone = []
        for path, entry in self._maps.items():
            try:
                info = os.stat(path)
            except FileNotFoundError:
                gone.append(path)
                continue
            if (info.st_dev, info.st_ino) != entry.identity:
                gone.append(path)  # deleted and made again under the same name
        for path in gone:
            self._drop(path)
        return len(gone)

    def _drop(self, path: str) -> None:
        entry = self._maps.pop(path)
        mapping = entry.mapping
        del entry  # token views made from it keep the mapping alive until they go
        try:
            mapping.close()
        except BufferError:
            pass

    def read(self, model: int, signature: int, lane: int, segment_seq: int, offset: int,
             length: int, item_id: int, _retried: bool = False) -> ReadItem:
        """The entry at `offset`, checked against what the descriptor says it is."""
        path = self._path(model, signature, lane, segment_seq)
        view = self._view(path, offset + ENTRY_HEADER_SIZE_BYTES + length * TOKEN_SIZE_BYTES)
        state, got_length, checksum, got_id, _seq, _producer, prefix_len, payload_len, submit_ns, _shape = (
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
        return ReadItem(item_id, tokens, prefix_len, payload, submit_ns,
                        entry_prompt_digest(view, tokens_at, payload_at))

    def _path(self, model: int, signature: int, lane: int, segment_seq: int) -> str:
        key = (model, signature, lane, segment_seq)
        path = self._paths.get(key)
        if path is None:  # joining paths costs more than the rest of a read
            if len(self._paths) >= PATH_CACHE_MAX:
                self._paths.clear()
            path = self._paths[key] = os.path.join(self.root, segment_relpath(*key))
        return path

    def read_batch(self, model: int, signature: int, items: np.ndarray) -> ReadBatch:
        """Every entry of a descriptor's items (DESCRIPTOR_ITEM_DTYPE), checked as `read`
        checks one; entries that fail are listed in `failed`, never dropped."""
        out = ReadBatch()
        lanes, seqs = items["lane"], items["segment_seq"]
        if (lanes == lanes[0]).all() and (seqs == seqs[0]).all():  # the common case: one segment
            self._read_segment(model, signature, int(lanes[0]), int(seqs[0]), items, out)
            return out
        order = np.lexsort((seqs, lanes))  # stable: descriptor order within a segment
        keys = np.stack([lanes[order].astype(np.uint64), seqs[order]])
        cuts = np.flatnonzero((np.diff(keys, axis=1) != 0).any(axis=0)) + 1
        for part in np.split(order, cuts):
            first = int(part[0])
            self._read_segment(model, signature, int(lanes[first]), int(seqs[first]), items[np.sort(part)], out)
        return out

    def _read_segment(self, model: int, signature: int, lane: int, segment_seq: int, items: np.ndarray,
                      out: ReadBatch) -> None:
        """Items of one segment: headers gathered and checked as columns, then a checksum per
        entry (SPEC §5: validated just after reading). Entries that fail a column check go
        through `read` one by one."""
        path = self._path(model, signature, lane, segment_seq)
        offsets = items["offset"].astype(np.int64)
        lengths = items["length"].astype(np.int64)
        token_starts = offsets + ENTRY_HEADER_SIZE_BYTES
        try:
            mapped = self._mapped(path, int((token_starts + lengths * TOKEN_SIZE_BYTES).max()))
        except SegmentCorruptError:  # gone, cut short, or one entry said to end past it:
            self._read_one_by_one(model, signature, lane, segment_seq, items, out)  # named per item
            return
        outside = items["offset"] > np.uint64(max(0, len(mapped.view) - ENTRY_HEADER_SIZE_BYTES))
        if outside.any():  # a header past the file (an offset of 2**63 wraps negative): named by `read`
            self._read_one_by_one(model, signature, lane, segment_seq, items[outside], out)
            inside = ~outside
            items, offsets, lengths, token_starts = items[inside], offsets[inside], lengths[inside], token_starts[inside]
        headers, ends, good = gather_entry_headers(mapped.words, offsets, len(mapped.view))
        if offsets.size:
            out.spans.append((mapped, int(offsets.min()), min(len(mapped.view), int(ends.max()))))
        good &= (headers["length"] == lengths) & (headers["item_id"] == items["item_id"])
        payload_lens = headers["payload_len"].astype(np.int64)
        if self.verify_checksums and good.any():  # entry_checksum, inlined: one call per entry
            view, digest = mapped.view, xxhash.xxh3_64_intdigest
            sums = [digest(view[at:end], seed=n) for at, end, n in
                    zip((offsets[good] + ENTRY_CHECKSUM_FROM).tolist(), ends[good].tolist(), lengths[good].tolist())]
            good[good] = np.array(sums, dtype=np.uint64) == headers["checksum"][good]
        if not good.all():  # rare: let `read` remap, retry and say what is wrong, item by item
            self._read_one_by_one(model, signature, lane, segment_seq, items[~good], out)
            items, lengths, headers, token_starts = items[good], lengths[good], headers[good], token_starts[good]
            payload_lens = payload_lens[good]
        tokens, view, digest = mapped.tokens, mapped.view, xxhash.xxh3_64_intdigest
        token_ends = token_starts + lengths * TOKEN_SIZE_BYTES
        out.tokens += [tokens[at:at + n] for at, n in zip((token_starts >> 2).tolist(), lengths.tolist())]
        # entry_prompt_digest, inlined: one call per entry
        out.digests += [digest(view[at:end]) for at, end in zip(token_starts.tolist(), token_ends.tolist())]
        out.item_ids += items["item_id"].tolist()
        out.lengths += lengths.tolist()
        out.prefix_lens += headers["prefix_len"].tolist()
        out.submit_ns += headers["submit_ns"].tolist()
        if payload_lens.any():
            out.payloads += [bytes(view[at:at + n]) for at, n in zip(token_ends.tolist(), payload_lens.tolist())]
        else:
            out.payloads += [b""] * lengths.shape[0]

    def _read_one_by_one(self, model: int, signature: int, lane: int, segment_seq: int, items: np.ndarray,
                         out: ReadBatch) -> None:
        for offset, length, item_id in zip(items["offset"].tolist(), items["length"].tolist(), items["item_id"].tolist()):
            try:
                out.add(self.read(model, signature, lane, segment_seq, offset, length, item_id))
            except SegmentCorruptError as exc:
                # Without its traceback: the frames it holds would hold `out`, a cycle that
                # keeps a segment's mapping open until the (rarely run) cycle collector.
                out.failed.append((item_id, length, exc.with_traceback(None)))

    @staticmethod
    def release(spans: list[ReadSpan]) -> None:
        """Drop the pages of a finished batch's `spans` from this process's mappings: they
        stay in the page cache (a later read is a minor fault), but what the consumer holds
        resident follows the batches in flight, not every segment it has read (up to
        DEFAULT_OPEN_MAPS_MAX mappings of a whole segment). A view still pointing there
        (a neighbour in another batch) reads the same bytes again: the file is not changed
        under a live entry."""
        page = mmap.PAGESIZE
        for entry, start, end in spans:
            low = start // page * page
            if entry.mapping.closed or end <= low:
                continue
            entry.mapping.madvise(mmap.MADV_DONTNEED, low, end - low)

    def close(self) -> None:
        for path in list(self._maps):
            self._drop(path)

