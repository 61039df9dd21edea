"""The storage tier (SPEC §5): `DiskTier`, segment files under a data directory, behind the
`StorageTier` interface the dispatcher uses (its queue bookkeeping is `queues.QueuedTier`).
One tier with two places to live: a data directory on disk (durable) or on tmpfs (the
broker's `--storage memory`: the same files in RAM).

Storage imports the wire (layouts, errors, status vocabulary), shm and the broker's leaf
`ids.py`, never the policy or the process loop (ARCHITECTURE.md's rules, tested). A folder of
its own beside the broker's, not inside it: the broker writes the store, and the consumers,
the runtime and the tools read it too.
"""

from pipeline.storage.base import (
    AppendGroup,
    Peeked,
    PeekedEntry,
    RecoveredLane,
    Returned,
    StorageCounters,
    StorageTier,
)
from pipeline.storage.disk import DiskTier
from pipeline.storage.diskio import Durability

__all__ = [
    "AppendGroup",
    "DiskTier",
    "Durability",
    "Peeked",
    "PeekedEntry",
    "RecoveredLane",
    "Returned",
    "StorageCounters",
    "StorageTier",
]
