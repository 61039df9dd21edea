"""What the broker says about its store's health: recovery's summary at start, damaged
segments moved to quarantine/ as they come, and the damage counts status reports.

Functions of the disk tier's state, no state of their own.
"""

from __future__ import annotations

import logging

from pipeline.broker.state import BrokerState
from pipeline.storage.disk import DiskTier

log = logging.getLogger("pipeline.broker")


def note_store_was_kept(storage: DiskTier, state: BrokerState, data_dir: str, durable: bool,
                        ran_before: bool) -> None:
    """A broker ran on this data directory before (its state file says so), yet the disk
    tier found neither a store log nor a segment: the store was removed (its log with it),
    and what it held cannot be named. Counted as a store log problem: never a fresh start in
    silence. A store on tmpfs (`durable` false) starts empty by contract."""
    recovery = storage.recovery
    if not durable or not ran_before or recovery.catalog_found or recovery.segments_scanned:
        return
    recovery.catalog_problems.append(
        f"{data_dir}: a broker ran here before ({state.path}: generation {state.generation - 1}), but the "
        f"store has no store log and no segment: it was removed, and whatever it held is lost; the next "
        f"producer id is kept ({state.next_producer_id})")


def log_recovery(storage: DiskTier) -> None:
    """What the disk tier's recovery found: one line, and one more per problem (every entry
    that cannot be delivered named by path, offset and item id where readable), at WARNING
    when anything accepted cannot be delivered."""
    recovery = storage.recovery
    log.log(logging.INFO if recovery.ok else logging.WARNING, "%s", recovery.summary())


def log_quarantined(storage: DiskTier) -> None:
    """Damaged segments moved to quarantine/ once their good entries were done, and what the
    store could not do and that cost nothing (a compaction of its log not made)."""
    moved_all, notes = storage.take_quarantined()
    for moved in moved_all:
        log.warning("QUARANTINED: %s", moved.describe())
    for note in notes:
        log.warning("%s", note)


def store_damage(storage: DiskTier) -> dict[str, int]:
    """Recovery's counts of what the store holds that cannot be delivered (and of its
    repairs), with entries consumers found damaged since."""
    counts = storage.recovery.damage_counts()
    found = storage.damaged_at_read
    return counts | {"entries_damaged_at_read": found} if found else counts
