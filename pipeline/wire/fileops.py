"""Small file operations several writers share: an OSError's errno in words for a message,
and the directory fsync that makes a file's creation or rename durable. (The store has its
own, which turn a failed fsync into a DurabilityError: pipeline/broker/storage.)"""

from __future__ import annotations

import errno
import os


def errno_text(exc: OSError) -> str:
    """"ENOSPC (No space left on device)" for an OSError with an errno, else its text."""
    if exc.errno is None:
        return str(exc)
    name = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
    return f"{name} ({exc.strerror or os.strerror(exc.errno)})"


def fsync_directory(directory: str) -> None:
    """fsync a directory, so the names created or renamed in it survive a power cut."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
