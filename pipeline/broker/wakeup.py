"""How the broker's loop wakes for producers: the data directory's doorbell (a POSIX
semaphore every producer rings after it publishes) turned into bytes on a pipe that the
loop's `select` watches beside its sockets.

Owner: the broker process. A small thread waits on the semaphore (select cannot watch one)
and writes a byte to the pipe; it owns no state, so everything else stays in the loop.
"""

from __future__ import annotations

import os
import threading

from pipeline.wire.errors import PipelineError
from shm.objects import Doorbell, ObjectExistsError, StaleObjectError

# The watcher's wait on the doorbell: how long `close` may take to stop it.
DOORBELL_WAIT_S = 0.5
# How long `close` waits for the watcher thread.
WATCHER_JOIN_S = 2.0
# Bytes drained from the pipe at a time: one byte per ring of the doorbell, many coalesced.
DRAIN_BYTES = 4096


class Wakeup:
    """The doorbell, its watcher thread and the pipe it writes to. `fileno()` is the pipe's
    read end, for the loop's selector; `drain()` empties it once the loop woke.

    If the constructor fails, what it opened is released before the error goes on."""

    def __init__(self, doorbell_name: str) -> None:
        self.doorbell, self.doorbell_created = _open_doorbell(doorbell_name)
        try:
            self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            self._close_doorbell(unlink=self.doorbell_created)
            raise
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="doorbell", daemon=True)
        self._watcher.start()

    @property
    def doorbell_name(self) -> str:
        return self.doorbell.name

    def fileno(self) -> int:
        return self._read_fd

    def drain(self) -> None:
        try:
            os.read(self._read_fd, DRAIN_BYTES)
        except BlockingIOError:
            pass

    def _watch(self) -> None:
        while not self._stopping.is_set():
            if self.doorbell.wait(DOORBELL_WAIT_S):
                try:
                    os.write(self._write_fd, b"!")
                except BlockingIOError:
                    pass  # the pipe is full: the loop is awake already

    def close(self, unlink_doorbell: bool) -> None:
        """Stop the watcher, close the pipe and the doorbell; unlink the doorbell when no
        producer ring can still name it (`unlink_doorbell`): one a producer outlives a crash
        with stays for the next broker."""
        self._stopping.set()
        self._watcher.join(timeout=WATCHER_JOIN_S)
        os.close(self._read_fd)
        os.close(self._write_fd)
        self._close_doorbell(unlink_doorbell)

    def _close_doorbell(self, unlink: bool) -> None:
        self.doorbell.close()
        if unlink:
            self.doorbell.unlink()


def _open_doorbell(name: str) -> tuple[Doorbell, bool]:
    """The data directory's doorbell and whether it was created now: created, or reopened
    after a crash (producers' rings name it in their headers, so it must keep its name
    across broker restarts). One of another user, or not owner-only, is refused."""
    try:
        return Doorbell.create(name), True
    except ObjectExistsError:
        try:
            bell = Doorbell.attach(name)
        except StaleObjectError as exc:
            raise PipelineError(f"cannot use the doorbell semaphore: {exc}") from exc
        bell.is_creator = True
        return bell, False
