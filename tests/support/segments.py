"""Items as the ring delivers them, and segment files holding them, for the tests of the
store and of the consumer's reader."""

from __future__ import annotations

import os

import numpy as np

from pipeline.storage.diskio import Durability
from pipeline.storage.paths import make_dirs, segment_path
from pipeline.storage.segment import SegmentFile, SegmentKeys, encode_entries
from pipeline.storage.storelog import StoreLog, SegmentRecords, read_store_log
from pipeline.wire.layouts.frames import ITEM_HEADER_DTYPE

KEYS = SegmentKeys(model=1, signature=0xDEADBEEF_12345678, lane=7, segment_seq=3)
# The shape signature of the segments `store` writes.
SIG = 0xFEED_0000_0000_0001


def make_items(count: int, seed: int = 0):
    """A frame's worth of items (as the ring delivers them): headers, tokens, payloads."""
    rng = np.random.default_rng(seed)
    items = np.zeros(count, dtype=ITEM_HEADER_DTYPE)
    items["item_id"] = np.arange(count) + 1000
    items["seq"] = np.arange(count)
    items["signature"] = KEYS.signature
    items["length"] = rng.integers(1, 400, size=count)
    items["prefix_len"] = np.minimum(items["length"], 5)
    items["payload_len"] = rng.integers(0, 30, size=count)
    items["submit_ns"] = 123
    token_starts = np.concatenate([[0], np.cumsum(items["length"])]).astype(np.int64)
    tokens = rng.integers(0, 50_000, size=int(token_starts[-1]), dtype=np.int32)
    payload_starts = np.concatenate([[0], np.cumsum(items["payload_len"])]).astype(np.int64)
    payloads = rng.integers(0, 256, size=int(payload_starts[-1]), dtype=np.uint8)
    return items, tokens, token_starts, payloads, payload_starts


def store(data_dir: str, lane: int, count: int, seed: int, first_id: int = 1000,
          payloads: list[bytes] | None = None) -> tuple[str, tuple, SegmentFile]:
    """`count` items of model 2, shape SIG, in segment 0 of `lane` under `data_dir`, ids from
    `first_id` (and `payloads`, else random ones): the segment's path, its frame and the open
    segment."""
    path = segment_path(data_dir, 2, SIG, lane, 0)
    make_dirs(os.path.dirname(path))
    frame = make_items(count, seed)
    frame[0]["item_id"] += first_id - 1000
    if payloads is not None:
        assert len(payloads) == count
        frame[0]["payload_len"] = [len(p) for p in payloads]
        starts = np.concatenate([[0], np.cumsum(frame[0]["payload_len"])]).astype(np.int64)
        frame = (*frame[:3], np.frombuffer(b"".join(payloads), dtype=np.uint8).copy(), starts)
    segment = SegmentFile.create(path, SegmentKeys(2, SIG, lane, 0), Durability.PROCESS, shared_log(data_dir))
    segment.append(encode_entries(*frame, indices=np.arange(count), producer_id=1))
    return path, frame, segment


_LOGS: dict[str, StoreLog] = {}


def shared_log(data_dir: str, durable: bool = False) -> StoreLog:
    """The store log of `data_dir` for segments a test makes by hand: one writer per data
    directory, as in the broker (a second StoreLog appending to the same file would write
    over the first's records)."""
    key = os.path.realpath(data_dir)
    log = _LOGS.get(key)
    # Made again when another writer (a store, a test's own StoreLog) changed the file since.
    if log is None or log.durable != durable or not os.path.exists(log.path) or os.path.getsize(log.path) > log.end:
        if log is not None:
            log.close()
        while len(_LOGS) >= 8:  # a test's few data directories; earlier tests' are done
            _LOGS.pop(next(iter(_LOGS))).close()
        log = _LOGS[key] = StoreLog.open(data_dir, durable)
    return log


def segment_at(data_dir: str, keys: SegmentKeys = KEYS) -> str:
    """The path of the segment of `keys` in `data_dir` (its directories made)."""
    path = segment_path(data_dir, keys.model, keys.signature, keys.lane, keys.segment_seq)
    make_dirs(os.path.dirname(path))
    return path


def data_dir_of(path: str) -> str:
    """The data directory of a segment at DATA_DIR/segments/m.../s.../its name; for a file
    elsewhere, its own directory (where a test keeps the log of a loose segment)."""
    segments = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(path))))
    return os.path.dirname(segments) if os.path.basename(segments) == "segments" else os.path.dirname(path)


def log_records(path: str, keys: SegmentKeys = KEYS) -> SegmentRecords:
    """What the store log of the segment's data directory says of it."""
    return read_store_log(data_dir_of(path)).of(keys)
