"""Storage tiers behind one interface (SPEC §5): `MemoryTier` and `DiskTier` (the default),
sharing their queue bookkeeping (`queues.QueuedTier`).

Tiers import layouts and errors (and the broker's pure ids and pending map), never the
process loop.
"""

from pipeline.broker.storage.base import (
    AppendGroup,
    Peeked,
    PeekedEntry,
    RecoveredLane,
    Returned,
    StorageCounters,
    StorageTier,
)
from pipeline.broker.storage.disk import DiskTier
from pipeline.broker.storage.memory import MemoryTier
from pipeline.broker.storage.segment import Durability

__all__ = [
    "AppendGroup",
    "DiskTier",
    "Durability",
    "MemoryTier",
    "Peeked",
    "PeekedEntry",
    "RecoveredLane",
    "Returned",
    "StorageCounters",
    "StorageTier",
]
