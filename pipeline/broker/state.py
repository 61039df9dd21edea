"""What a broker keeps in its data directory across runs: the run directory's lock (one
broker per data directory) and the state file (the next producer id and the start count).
Owner: the broker process; neither is thread-safe."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterable

from pipeline.wire import fileops
from pipeline.wire.errors import PipelineError
from pipeline.wire.layouts.frames import MAX_PRODUCER_ID
from pipeline.wire.layouts.names import BROKER_STATE_NAME

log = logging.getLogger("pipeline.broker")

LOCK_NAME = "broker.lock"
STATE_NAME = BROKER_STATE_NAME
# A state file that does not parse is kept, renamed with this suffix (and a time), as evidence.
DAMAGED_SUFFIX = ".damaged"
# The state file is written under its name plus this suffix, then renamed over it.
TEMPORARY_SUFFIX = ".tmp"


class BrokerState:
    """The few numbers the broker keeps across restarts (a JSON file, replaced atomically):
    the next producer id and the start count. Owner: the broker process.

    A file that does not parse is kept aside (`damaged_to`, renamed with DAMAGED_SUFFIX) and
    the broker starts from zero; a missing or damaged file is `lost`, and the broker then
    takes the next producer id from what the store and /dev/shm hold (`keep_ids_above`): an id
    handed out again would make its new items look stored and be skipped.
    NOTE: a record kind of the store log was rejected: this file must outlive the store it
    vouches for (a memory tier's log lives on tmpfs, and a store removed takes its log with
    it, where this file still says a broker ran here: `store_health.note_store_was_kept`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.next_producer_id = 0
        self.generation = 0
        self.lost = not os.path.exists(path)
        self.damaged_to: str | None = None
        if not self.lost:
            try:
                with open(path) as file:
                    saved = json.load(file)
                self.next_producer_id = int(saved["next_producer_id"])
                self.generation = int(saved["generation"])
                if not (0 <= self.next_producer_id <= MAX_PRODUCER_ID + 1 and 0 <= self.generation < 2**63):
                    raise ValueError(f"next_producer_id {self.next_producer_id} or generation {self.generation} "
                                     f"out of range (at most {MAX_PRODUCER_ID + 1} and 2**63 - 1)")
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                self.next_producer_id, self.generation = 0, 0  # nothing of it is trusted
                self.damaged_to = f"{path}{DAMAGED_SUFFIX}-{time.time_ns()}"
                os.rename(path, self.damaged_to)
                log.warning("%s is damaged (%s): kept as %s; starting from what the store holds", path, exc,
                            self.damaged_to)
                self.lost = True

    def save(self) -> None:
        temporary = self.path + TEMPORARY_SUFFIX
        fd = fileops.open_fd(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # owner-only whatever the umask (SPEC §12)
            text = json.dumps({"next_producer_id": self.next_producer_id, "generation": self.generation})
            fileops.write_all(fd, text.encode())
            fileops.fsync(fd)
        finally:
            fileops.close_fd(fd)
        fileops.rename(temporary, self.path)
        # The rename is durable only once the directory is: else a power cut could bring the
        # older file back, and with it a producer id already handed out.
        fileops.fsync_directory(os.path.dirname(self.path) or ".")


    def save_or_warn(self) -> bool:
        """`save`, or a warning and False when the disk refuses (a full disk must not keep
        the broker from draining it)."""
        try:
            self.save()
        except OSError as exc:
            log.warning("could not save %s (%s)", self.path, exc)
            return False
        return True

    def keep_ids_above(self, held: Iterable[int]) -> None:
        """Never hand out a producer id the store or /dev/shm still holds work of (`held`),
        whatever the file says (it may be lost, damaged or older than the store): a new
        producer under an old id numbers its items from 0, and those that match stored
        items would be skipped as already stored, lost without a word."""
        held = list(held)
        floor = max(held) + 1 if held else 0
        if floor > self.next_producer_id:
            log.warning("%s says the next producer id is %d, but the store or a producer ring holds work of "
                        "producer %d: going on from %d", self.path, self.next_producer_id, floor - 1, floor)
            self.next_producer_id = floor
            self.save_or_warn()


def lock_run_dir(run_dir: str) -> int:
    """One broker per data directory: an exclusive lock held for the broker's lifetime.
    Take it before opening the storage: recovery changes files a running broker uses."""
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(run_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise PipelineError(f"another broker is running on {os.path.dirname(run_dir)}") from exc
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd

