"""Where each item of a cluster run is, and which answers count (pure: no I/O, no clock).

    ledger = JobLedger(items=3)
    epoch = ledger.open("a")                  # node a's incarnation 1
    ledger.assign(0, "a"); ledger.take("a", batch=256, window=2048)   # [0]: sent to a
    ledger.accept("a", epoch, 0)              # "accepted": the one answer of item 0
    ledger.accept("a", epoch, 0)              # "duplicate": dropped
    moved = ledger.close("a")                 # a is lost: its unanswered items, to route again

Every item not answered yet is in exactly one place: the queue of the node that owns it (to
send) or what that node holds (sent, not answered). An answer counts only from the node
that owns the item, at that node's current epoch, and only the first time; `close` raises
the node's epoch first, so whatever the lost incarnation still says is "stale". This is what
makes the output exactly one line per key, whatever arrives late or twice.

Owner: the driver's main thread (`driver.py`); not thread-safe.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

ACCEPTED = "accepted"
DUPLICATE = "duplicate"  # the item has its answer already
STALE = "stale"  # from an incarnation of the node that was fenced off
NOT_OWNER = "not_owner"  # from a node the item was moved away from


class JobLedger:
    """Items 0..count-1 of a run: each one's owner node, the nodes' queues, holdings and
    epochs, and the answered set."""

    def __init__(self, count: int) -> None:
        self.owner: list[str | None] = [None] * count
        self.answered: set[int] = set()
        self.epoch: dict[str, int] = {}
        self.queue: dict[str, deque[int]] = {}
        self.held: dict[str, set[int]] = {}

    def open(self, slot: str) -> int:
        """A new incarnation of node `slot` (a fresh agent): its epoch."""
        self.epoch[slot] = self.epoch.get(slot, 0) + 1
        self.queue.setdefault(slot, deque())
        self.held.setdefault(slot, set())
        return self.epoch[slot]

    def assign(self, k: int, slot: str) -> None:
        """Item k (not answered, in no node's queue or holding) to `slot`'s queue."""
        assert k not in self.answered and slot in self.queue, (k, slot)
        self.owner[k] = slot
        self.queue[slot].append(k)

    def take(self, slot: str, batch: int, window: int) -> list[int]:
        """Up to `batch` of `slot`'s queued items to send now, while it holds fewer than `window`."""
        queue, held = self.queue[slot], self.held[slot]
        room = max(0, min(batch, window - len(held)))
        taken = [queue.popleft() for _ in range(min(room, len(queue)))]
        held.update(taken)
        return taken

    def accept(self, slot: str, epoch: int, k: int) -> str:
        """Whether an answer of item k from `slot` at `epoch` counts (ACCEPTED, the first
        one) or is dropped, and why."""
        if epoch != self.epoch.get(slot):
            return STALE
        if k in self.answered:
            return DUPLICATE
        if self.owner[k] != slot or k not in self.held[slot]:
            return NOT_OWNER
        self.answered.add(k)
        self.held[slot].discard(k)
        return ACCEPTED

    def close(self, slot: str) -> list[int]:
        """Node `slot` is lost: fence it off (its epoch goes up) and hand back every item it
        queued or held, for the caller to assign again."""
        self.epoch[slot] = self.epoch.get(slot, 0) + 1
        moved = sorted(set(self.queue.get(slot, ())) | self.held.get(slot, set()))
        self.queue[slot] = deque()
        self.held[slot] = set()
        for k in moved:
            self.owner[k] = None
        return moved

    def move_queued(self, to: str, wins: Callable[[int], bool]) -> int:
        """Items queued (not sent) on other nodes that `to` now wins (a node that joined):
        moved to `to`'s queue; how many."""
        moved = 0
        for slot, queue in self.queue.items():
            if slot == to:
                continue
            keep: deque[int] = deque()
            for k in queue:
                if wins(k):
                    self.owner[k] = to
                    self.queue[to].append(k)
                    moved += 1
                else:
                    keep.append(k)
            self.queue[slot] = keep
        return moved

    def unanswered(self) -> int:
        return len(self.owner) - len(self.answered)

    def check_invariants(self) -> None:
        seen: dict[int, str] = {}
        for slot in self.queue:
            for k in [*self.queue[slot], *self.held[slot]]:
                assert k not in seen, (k, seen.get(k), slot)  # in one place only
                assert k not in self.answered and self.owner[k] == slot, (k, slot)
                seen[k] = slot
        for k, slot in enumerate(self.owner):
            if k not in self.answered:  # an unanswered item is somewhere exactly when it has an owner
                assert (slot is None) == (k not in seen), (k, slot)
