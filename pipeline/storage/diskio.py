"""How the store's writes reach its disk: the durability levels, what the store leaves free on
its file system, and the typed errors of a full disk and of a failed sync."""

from __future__ import annotations

import errno
from enum import Enum

from pipeline.wire import fileops
from pipeline.wire.errors import DiskFullError, DurabilityError

# errno values that mean "no space": a full disk (blocks or inodes), or the user's quota on it.
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


# The store stops growing while less than this would stay free on its file system, so that
# what shares the disk (the consumers' results, the store log, the broker's state file) can
# still be written: results are what lets the store complete items and free its segments,
# and a disk full of segments with no room for results never drains (seen on a 6 MiB tmpfs
# holding both: tests/runtime/test_disk_full.py). 2% of the file system, within 1-256 MiB.
DISK_RESERVE_FRACTION = 0.02
DISK_RESERVE_MIN_BYTES = 1 << 20
DISK_RESERVE_MAX_BYTES = 256 << 20


def disk_reserve_bytes(total_bytes: int) -> int:
    """What the store leaves free on a file system of `total_bytes` (see above)."""
    return int(min(DISK_RESERVE_MAX_BYTES, max(DISK_RESERVE_MIN_BYTES, total_bytes * DISK_RESERVE_FRACTION)))


def no_space_error(exc: OSError, path: str, offset: int, nbytes: int, what: str) -> DiskFullError:
    return DiskFullError(
        f"{path}: disk full ({exc.strerror}) {what} {nbytes} bytes at offset {offset}; "
        f"appends stop until space comes back, nothing accepted is lost"
    )


def durability_error(exc: OSError, path: str, what: str) -> DurabilityError:
    return DurabilityError(
        f"{path}: {what} failed ({exc.strerror}, errno {exc.errno}): the kernel may have "
        f"dropped the dirty pages, so the broker must stop"
    )


class Durability(Enum):
    """How far an append must get before its entries become readable (SPEC §5)."""

    PROCESS = "process"  # written to the page cache: survives kill -9 of any process
    POWER = "power"  # also fdatasync'ed, with group commit: survives power loss


def fsync_directory(path: str) -> None:
    """Make a file's creation or removal durable (SPEC §5, `power`). DurabilityError if the
    fsync fails."""
    try:
        fileops.fsync_directory(path or ".")
    except OSError as exc:
        raise durability_error(exc, path, "fsync of the directory") from exc


def fdatasync(fd: int, path: str) -> None:
    try:
        fileops.fdatasync(fd)
    except OSError as exc:
        raise durability_error(exc, path, "fdatasync") from exc
