"""Shared-memory transport: moves records between processes and wakes them, nothing more.

This package imports nothing from `pipeline/`; it knows bytes, not work items.
"""

from shm.errors import (
    ObjectExistsError,
    ObjectMissingError,
    RecordTooLargeError,
    RingClosedError,
    RingTimeoutError,
    ShmError,
    ShmSpaceError,
    StaleObjectError,
)

__all__ = [
    "ObjectExistsError",
    "ObjectMissingError",
    "RecordTooLargeError",
    "RingClosedError",
    "RingTimeoutError",
    "ShmError",
    "ShmSpaceError",
    "StaleObjectError",
]
