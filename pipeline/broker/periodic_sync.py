"""`process` durability's bound on what a power cut loses (BrokerConfig.sync_interval_s).

At `process` the broker never fsyncs: an acknowledged item is safe from kill -9 of any
process once it is in the page cache, and reaches the disk when the kernel writes it back,
vm.dirty_expire_centisecs after it was dirtied (30 s by default, checked every
vm.dirty_writeback_centisecs, 5 s): a power cut loses up to about 35 s of acknowledged work,
measured on a real kernel by tools/power_cuts.py (RELIABILITY.md). With `sync_interval_s`
set, a thread of the broker calls syncfs(2) on the data directory's filesystem that often
(the interval counted from the end of the last call): the store's segments and store log,
and the consumers' results files where they live under the data directory, are on
disk within the interval plus two syncfs durations of the moment they were written (a
write just after one call began may miss it, and the next starts an interval after it
ended): Redis's `appendfsync everysec`, PostgreSQL's `synchronous_commit = off` with its WAL
writer, a bounded loss with no fsync per write. Only at `process` on disk: `power` syncs
before it acknowledges, and the memory tier's files live in RAM.

NOTE: syncfs rather than fdatasync of each file written since the last sync: one call
covers the consumers' results files (written by other processes) and files created,
renamed and deleted in between (ext4 commits its journal with it), with no list of
descriptors shared with the loop thread. It also writes back other dirty files of that
filesystem, which a data directory on a filesystem of its own does not have.

A failed syncfs (the kernel reports a writeback error since Linux 5.8) is logged and
counted, not retried as if nothing happened: the pages that failed may be gone from the
cache, so nothing says they will be written by the next call; `process` promises only
kill -9 safety, which a writeback error does not take away. `power` durability is the
level that fdatasyncs before it acknowledges.

Owner: the broker process. One daemon thread of its own, which only calls syncfs on a
descriptor it opened; `close()` stops and joins it, syncs once more and closes the
descriptor. The counters are written by that thread alone (and by `close` after the join)
and read by anyone (ints and floats: no lock needed).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

# How long `close` waits for a syncfs in progress: one on a hung disk must not hold the
# broker's shutdown forever (the thread is a daemon; its descriptor is left to the exit).
CLOSE_JOIN_TIMEOUT_S = 10.0


class PeriodicSync:
    def __init__(self, directory: str, interval_s: float) -> None:
        self.directory = directory
        self.interval_s = interval_s
        self.syncs = 0
        self.failures = 0
        self.max_sync_s = 0.0  # the longest syncfs: the bound is interval_s plus twice this
        # ctypes releases the GIL around the call. Resolved here, so a libc without syncfs
        # fails the broker's start (AttributeError) rather than the thread, silently.
        self._syncfs = ctypes.CDLL(None, use_errno=True).syncfs
        self._fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="periodic-sync", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            os.close(self._fd)
            raise

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sync_now()
            except Exception:  # noqa: BLE001 - the thread must not end unseen: counted, logged
                self.failures += 1
                log.exception("periodic sync of %s: unexpected error (counted as a failure)", self.directory)

    def sync_now(self) -> None:
        """One syncfs of the directory's filesystem (the thread's step; also the last one at close)."""
        started = time.monotonic()
        if self._syncfs(self._fd) != 0:
            code = ctypes.get_errno()
            self.failures += 1
            log.error("syncfs of %s failed (%s, errno %d): what was written since the last sync may not "
                      "be on disk; the broker keeps serving (durability process promises kill -9 safety)",
                      self.directory, os.strerror(code), code)
        else:
            self.syncs += 1
        self.max_sync_s = max(self.max_sync_s, time.monotonic() - started)

    def close(self) -> None:
        """Stop the thread (after its syncfs in progress), sync once more (what the broker
        wrote while closing) and close the descriptor. Idempotent."""
        if self._fd < 0:
            return
        self._stop.set()
        self._thread.join(CLOSE_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("periodic sync of %s: a syncfs has not returned in %g s; the broker stops without "
                        "waiting for it", self.directory, CLOSE_JOIN_TIMEOUT_S)
            self._fd = -1
            return
        self.sync_now()
        os.close(self._fd)
        self._fd = -1
