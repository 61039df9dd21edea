"""The output of an input-order job: its answer log's lines put in the input's order, in
memory that does not depend on the job's size.

    write_in_input_order(data_dir, log_path, requests, output, error_file, work_dir)

The answer log (`answers.py`) holds one line per request in the order answers came, and a
record per line (request index, where the line is, its status). The merge reads the records
once to size its buckets (contiguous ranges of request indices, each holding at most
BUCKET_BYTES of lines), reads the log once, sequentially, appending each line to its
bucket's file, then reads the buckets in order, each sorted in memory by request index, into
the output (and, with an error file, every line whose status is not 200 there instead).
Every read and write is sequential; memory is one bucket (and its lines in order, once),
the records of one chunk and DISTRIBUTE_READ_BYTES of lines.
NOTE: a heap merge of sorted runs reading lines back from the log by offset was rejected: its
reads are random over a log of gigabytes.

The output files are written whole or not at all (`paths.replace_file` semantics: a kill
leaves the older file, or none).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from pipeline.batchjob.answers import record_chunks
from pipeline.wire.errors import JobOutputError
from pipeline.runtime.madefiles import Made, matching, remove_made
from shm.layout import checked_dtype, struct_for

# Bytes of lines a bucket holds at most (a single request's line may exceed it alone): what
# the merge holds in memory at a time, besides one chunk of records.
BUCKET_BYTES = 64 << 20
# Index ranges the records are first counted in to cut the buckets: at 100 million requests
# a range is ~1,500 requests.
HISTOGRAM_RANGES = 1 << 16
# Most buckets open at once: a file descriptor each (a 64 GB log fits).
MAX_BUCKETS = 1024
# Bytes of the log read at a time while the lines go to their buckets (one line longer than
# it is read alone): what the merge holds besides a bucket, whatever the lines' sizes.
DISTRIBUTE_READ_BYTES = 16 << 20
# Lines of a bucket joined into one write: a few MiB of typical lines, a sliver of the bucket.
WRITE_LINES = 4096
# The merge's work folder (in the job directory) and what it holds: the buckets' files.
MERGE_DIR = "merge"
BUCKET_PREFIX = "bucket-"
MERGE_MADE = Made(files=matching(BUCKET_PREFIX + r"\d{4}\.bin"))

# A bucket file is blocks, one per part of the log that had lines for the bucket: a block's
# header, its entries, then their lines back to back in the entries' order.
#   off  size  field        meaning
#     0     8  lines_bytes  bytes of the lines after the entries
#     8     4  count        entries in the block
#    12     4  reserved     zero
BUCKET_BLOCK_DTYPE = checked_dtype(
    [
        ("lines_bytes", 0, "<u8", "bytes of the block's lines"),
        ("count", 8, "<u4", "entries in the block"),
    ],
    itemsize=16,
)
# An entry: one line of the block.
#   off  size  field        meaning
#     0     8  index        the request's index
#     8     4  line_bytes   bytes of the line, its newline included
#    12     2  status_code  the response's status (200 goes to the output, else maybe the error file)
#    14     2  reserved     zero
BUCKET_ENTRY_DTYPE = checked_dtype(
    [
        ("index", 0, "<u8", "request index"),
        ("line_bytes", 8, "<u4", "bytes of the line"),
        ("status_code", 12, "<u2", "HTTP status"),
    ],
    itemsize=16,
)
_BLOCK = struct_for(BUCKET_BLOCK_DTYPE)


def bucket_bounds(data_dir: str, requests: int, bucket_bytes: int = BUCKET_BYTES) -> np.ndarray:
    """Start indices of the buckets, then `requests`: ranges cut where the lines' bytes
    (counted per HISTOGRAM_RANGES range of indices) reach `bucket_bytes`."""
    ranges = min(HISTOGRAM_RANGES, max(requests, 1))
    width = -(-requests // ranges)
    ranges = -(-requests // width) if width else 1  # none past the last request
    sizes = np.zeros(ranges, dtype=np.int64)
    for records in record_chunks(data_dir):  # (float64 sums: exact below 2^53 bytes)
        sizes += np.bincount(records["index"] // width, records["line_bytes"], ranges).astype(np.int64)
    limit = max(bucket_bytes, int(sizes.sum()) // MAX_BUCKETS + 1)
    cuts, held = [0], 0
    for k, size in enumerate(sizes.tolist()):
        if held and held + size > limit:
            cuts.append(k * width)
            held = 0
        held += size
    return np.array(cuts + [requests], dtype=np.int64)


class Sink(Protocol):
    """A file written whole or not at all (`paths.ReplacingFile`, `outfiles.Publish`)."""

    def write(self, data: bytes) -> None: ...

    def commit(self) -> object: ...

    def abandon(self) -> None: ...


def write_in_input_order(data_dir: str, log_path: str, requests: int, out: Callable[[], Sink],
                         errors: Callable[[], Sink] | None, work_dir: str, bucket_bytes: int = BUCKET_BYTES) -> list:
    """The merge of the module's doc, into the sinks `out()` and `errors()` make (none: the
    errors go to the output too); what each commit returned, output first."""
    bounds = bucket_bounds(data_dir, requests, bucket_bytes)
    try:
        try:
            os.makedirs(work_dir, mode=0o700, exist_ok=True)
            _distribute(data_dir, log_path, bounds, work_dir)
        except OSError as exc:  # the merge's own copy, in the data directory: not the outputs' disk
            need = os.path.getsize(log_path) if os.path.exists(log_path) else 0
            raise JobOutputError(f"the merge into input order could not write its work files in {work_dir} "
                                 f"({exc.strerror or exc}): it needs about {need:,} bytes free on the data "
                                 f"directory's disk; every answer is kept in {data_dir}: make room there (or move "
                                 f"the data directory to a larger disk and give it as --data-dir) and the same "
                                 f"command writes the outputs without running anything") from exc
        output = out()
        failed = errors() if errors is not None else output
        try:
            for k in range(len(bounds) - 1):
                _write_bucket(_bucket_path(work_dir, k), output, failed)
            made = [output.commit()]
            if failed is not output:
                made.append(failed.commit())
            return made
        finally:
            output.abandon()
            failed.abandon()
    finally:
        remove_made(work_dir, MERGE_MADE)


def _distribute(data_dir: str, log_path: str, bounds: np.ndarray, work_dir: str) -> None:
    """Each line of the log, with its header, appended to its bucket's file."""
    files = [open(_bucket_path(work_dir, k), "wb") for k in range(len(bounds) - 1)]
    try:
        with open(log_path, "rb") as log:
            for chunk in record_chunks(data_dir):
                for records in read_parts(chunk, DISTRIBUTE_READ_BYTES):
                    _distribute_part(log, records, bounds, files)
    finally:
        for f in files:
            f.close()


def read_parts(records: np.ndarray, read_bytes: int) -> Iterator[np.ndarray]:
    """`records` (in log order) cut into runs whose lines span at most `read_bytes` of the
    log, or one line alone where it is longer."""
    start = 0
    ends = np.cumsum(records["line_bytes"].astype(np.int64))
    while start < records.size:
        before = int(ends[start - 1]) if start else 0
        stop = max(start + 1, int(np.searchsorted(ends, before + read_bytes, side="right")))
        yield records[start:stop]
        start = stop


def _distribute_part(log, records: np.ndarray, bounds: np.ndarray, files: list) -> None:
    """A part's lines, each appended to its bucket's file: one block per bucket it touches."""
    start = int(records["log_offset"][0])
    log.seek(start)
    raw = log.read(int(records["log_offset"][-1]) + int(records["line_bytes"][-1]) - start)
    bucket = np.searchsorted(bounds, records["index"].astype(np.int64), side="right") - 1
    order = np.argsort(bucket, kind="stable")
    counts = np.bincount(bucket, minlength=len(files))
    ends = np.cumsum(counts)
    at = records["log_offset"][order] - start
    starts, stops = at.tolist(), (at + records["line_bytes"][order]).tolist()
    for k in np.flatnonzero(counts).tolist():
        first, last = int(ends[k]) - int(counts[k]), int(ends[k])
        rows = order[first:last]
        entries = np.zeros(rows.size, dtype=BUCKET_ENTRY_DTYPE)
        entries["index"], entries["line_bytes"] = records["index"][rows], records["line_bytes"][rows]
        entries["status_code"] = records["status_code"][rows]
        lines = b"".join([raw[a:b] for a, b in zip(starts[first:last], stops[first:last])])
        files[k].write(_BLOCK.pack(len(lines), rows.size) + entries.tobytes() + lines)


def _write_bucket(path: str, output: Sink, failed: Sink) -> None:
    """A bucket's lines in request order, each 200 to `output`, the others to `failed`."""
    with open(path, "rb") as f:
        raw = f.read()
    entries, starts = [], []
    at = 0
    while at < len(raw):
        lines_bytes, count = _BLOCK.unpack_from(raw, at)
        block = np.frombuffer(raw, dtype=BUCKET_ENTRY_DTYPE, count=count, offset=at + _BLOCK.size)
        first = at + _BLOCK.size + block.nbytes
        entries.append(block)
        starts.append(first + np.cumsum(block["line_bytes"], dtype=np.int64) - block["line_bytes"])
        at = first + lines_bytes
    if not entries:
        return
    found = np.concatenate(entries)
    order = np.argsort(found["index"], kind="stable")
    begin = np.concatenate(starts)[order]
    end = begin + found["line_bytes"][order]
    ok = found["status_code"][order] == 200
    for sink, chosen in ((output, ok), (failed, ~ok)) if failed is not output else ((output, slice(None)),):
        begins, ends = begin[chosen], end[chosen]
        for k in range(0, begins.size, WRITE_LINES):  # a run of lines at a time: not the bucket twice
            sink.write(b"".join([raw[a:b] for a, b in zip(begins[k:k + WRITE_LINES].tolist(),
                                                            ends[k:k + WRITE_LINES].tolist())]))


def _bucket_path(work_dir: str, k: int) -> str:
    return os.path.join(work_dir, f"{BUCKET_PREFIX}{k:04d}.bin")
