"""A scan made before the job, kept and adopted: the batch service checks an input when it is
uploaded (`scan_input`, every rule run-batch checks) and keeps what the scan found beside the
file; the job of a batch on that file adopts it instead of reading the whole input again.

    keep_scan(scan, lines_path, "FILES/ID")          # FILES/ID.index and FILES/ID.lines
    scan = adopt_scan("FILES/ID", input_path, "DATA/job/lines.bin")  # None: scan the input

What is kept is the job's own index file (`write_index`: request count, size, xxh3-128 and
sparse index, a checksummed header) and its line digests (`lines.bin`, 8 bytes a request).
A kept scan is adopted only whole: an index that parses, line digests of its request count,
and an input of the size it names; anything else (missing, damaged, another file) leaves
the job to scan the input itself, as it would without one. The input's digest is then
checked beside the run, as a resumed job's is (`inputcheck.py`), and every line a producer
reads against its own digest: an input that changed since its upload stops the job.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

from pipeline.batchjob.layout import LINE_DIGEST_DTYPE
from pipeline.batchjob.manifest import LINES_NAME, SCAN_DIR
from pipeline.batchjob.scan import InputScan, parse_index, scan_input, write_index
from pipeline.wire import fileops

INDEX_SUFFIX = ".index"
LINES_SUFFIX = ".lines"
# An index holds one entry every INDEX_STRIDE requests: a few MiB at a hundred million
# requests. Anything longer is not one.
MAX_INDEX_BYTES = 64 << 20


def keep_scan(scan: InputScan, lines_path: str, prefix: str) -> None:
    """`scan`'s index written at `prefix`.index and its line digests (`lines_path`, the
    scan's own) moved to `prefix`.lines; the caller fsyncs the directory."""
    write_index(prefix + INDEX_SUFFIX, scan)
    fileops.rename(lines_path, prefix + LINES_SUFFIX)


def kept_paths(prefix: str) -> tuple[str, str]:
    return prefix + INDEX_SUFFIX, prefix + LINES_SUFFIX


def adopt_scan(prefix: str, input_path: str, lines_path: str) -> InputScan | None:
    """The scan kept at `prefix` as the new job's, its line digests linked (or copied) to
    `lines_path`; None where it cannot be (the module's doc): the job scans then."""
    index_path, kept_lines = kept_paths(prefix)
    try:
        if os.path.getsize(index_path) > MAX_INDEX_BYTES:
            return None
        with open(index_path, "rb") as f:
            scan = parse_index(f.read())
        if scan is None or os.path.getsize(input_path) != scan.input_bytes \
                or os.path.getsize(kept_lines) != scan.requests * LINE_DIGEST_DTYPE.itemsize:
            return None
        _link_or_copy(kept_lines, lines_path)
    except OSError:
        return None
    return InputScan(input_path, scan.input_bytes, scan.input_xxh3, scan.requests, scan.index)


def _link_or_copy(source: str, target: str) -> None:
    """`target` made a second name of `source` (read only, by both), or a copy of it where
    they lie on two file systems; fsynced, with its directory."""
    try:
        os.link(source, target)
    except OSError:
        temp = target + ".tmp"
        shutil.copyfile(source, temp)
        os.chmod(temp, 0o600)
        fd = os.open(temp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fileops.fsync(fd)
        finally:
            os.close(fd)
        fileops.rename(temp, target)
    fileops.fsync_directory(os.path.dirname(target))


def scan_or_adopt(input_path: str, job_dir: str, kept: str | None,
                  on_progress: Callable[[int, int], None] | None = None) -> tuple[InputScan, bool]:
    """A new job's scan of its input: the one kept at `kept` where it can be adopted, else a
    fresh `scan_input` (BatchFileError naming the bad lines); whether it was adopted."""
    lines_path = os.path.join(job_dir, LINES_NAME)
    adopted = adopt_scan(kept, input_path, lines_path) if kept is not None else None
    if adopted is not None:
        return adopted, True
    return scan_input(input_path, os.path.join(job_dir, SCAN_DIR), lines_path, on_progress=on_progress), False
