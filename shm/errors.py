"""Errors raised by shared-memory objects.

`shm/` knows nothing of `pipeline/`, so its errors live here; `pipeline.wire.errors` re-exports
them, and that module is the one users import. Every message names the object and the
offending value.
"""

from __future__ import annotations

import errno


class ShmError(Exception):
    """Base of every error from `shm/`."""


class RingClosedError(ShmError):
    """The ring was closed (by either side) and takes no more records."""


class RingTimeoutError(ShmError, TimeoutError):
    """A blocking call did not finish before its timeout (ring full, or nothing to read)."""


class RecordTooLargeError(ShmError, ValueError):
    """A record cannot fit in the ring even when the ring is empty."""


class StaleObjectError(ShmError):
    """A shared-memory object left by another run has a different layout, or is not ours.

    It is reported, never misread: the caller decides whether to unlink it.
    """


class ObjectExistsError(ShmError, FileExistsError):
    """`create` found an object of that name already there (a leftover from a crashed run,
    or another live run using the same name)."""


class ObjectMissingError(ShmError, FileNotFoundError):
    """`attach` found no object of that name."""


class ShmSpaceError(ShmError, OSError):
    """/dev/shm has no room for what is being created (ENOSPC): an object, at its creation,
    or a run, before it starts. The message names what, its size, and what is free. Its
    pages are reserved at creation, so a shortage is this error then and never a SIGBUS
    on a later write."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC
