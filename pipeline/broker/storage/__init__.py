"""Storage tiers behind one interface (SPEC §5): `MemoryTier` here, the disk tier beside it.

Tiers import layouts and errors (and the broker's pure ids and pending map), never the
process loop.
"""

from pipeline.broker.storage.base import (
    AppendGroup,
    PeekedEntry,
    Returned,
    StorageCounters,
    StorageTier,
)
from pipeline.broker.storage.memory import MemoryTier

__all__ = [
    "AppendGroup",
    "MemoryTier",
    "PeekedEntry",
    "Returned",
    "StorageCounters",
    "StorageTier",
]
