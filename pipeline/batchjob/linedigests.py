"""The job's line digests (`job/lines.bin`, `layout.LINE_DIGEST_DTYPE`), read a window at a
time: a producer checks every line it reads back against the digest the scan took of it.

    digests = LineDigests("DATA/job/lines.bin", requests=N)
    digests[17]          # xxh3-64 of request 17's line, as the scan read it

A producer takes its requests in index order, so one window serves DIGEST_WINDOW_ENTRIES of
them and is read again (one pread) only when an index falls outside it.
NOTE: a mapping of the whole file was rejected: every page a producer passed stayed in its
PSS, 8 bytes a request (76 MiB over the producers of a 10,000,000-request job).
"""

from __future__ import annotations

import os

import numpy as np

from pipeline.batchjob.layout import LINE_DIGEST_DTYPE
from pipeline.wire.errors import JobMismatchError
from pipeline.wire.textfiles import counted

# Digests read at a time (512 KiB): a pread per 65,536 requests costs nothing beside their
# lines, and what a producer holds of the file stays this whatever the job's size.
DIGEST_WINDOW_ENTRIES = 1 << 16
_DIGEST_BYTES = LINE_DIGEST_DTYPE.itemsize


class LineDigests:
    """See the module's doc. Opened in the process that reads it (a producer, after its
    fork); the file is closed with the object."""

    def __init__(self, path: str, requests: int, window_entries: int = DIGEST_WINDOW_ENTRIES) -> None:
        assert window_entries > 0, window_entries
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - held for the object's life
        except OSError as exc:
            raise JobMismatchError(f"{path}: cannot read the job's line digests ({exc.strerror}); use another "
                                   f"--data-dir") from exc
        size = os.fstat(self._file.fileno()).st_size
        if size != requests * _DIGEST_BYTES:
            self._file.close()
            raise JobMismatchError(f"{path}: {size:,} bytes, not the line digests of this job's "
                                   f"{counted(requests, 'request')} (damaged?); use another --data-dir")
        self.path = path
        self.requests = requests
        self.window_entries = window_entries
        self._first = 0  # the request index of the window's first digest
        self._window = np.zeros(0, dtype=np.uint64)

    def __getitem__(self, index: int) -> int:
        assert 0 <= index < self.requests, (index, self.requests)
        at = index - self._first
        if not 0 <= at < self._window.size:
            self._read_from(index)
            at = 0
        return int(self._window[at])

    def _read_from(self, index: int) -> None:
        count = min(self.window_entries, self.requests - index)
        raw = os.pread(self._file.fileno(), count * _DIGEST_BYTES, index * _DIGEST_BYTES)
        if len(raw) != count * _DIGEST_BYTES:
            raise JobMismatchError(f"{self.path}: ends at byte {index * _DIGEST_BYTES + len(raw):,}, before the "
                                   f"digest of request {index + count - 1} (the file was cut since the job began); "
                                   f"use another --data-dir")
        self._window = np.frombuffer(raw, dtype=LINE_DIGEST_DTYPE)["line_xxh3"]
        self._first = index

    @property
    def window(self) -> tuple[int, int]:
        """(first index, digests) the window holds now (what a check of its bound reads)."""
        return self._first, int(self._window.size)

    def close(self) -> None:
        self._file.close()
