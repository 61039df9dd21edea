"""Where each item in flight of a cluster run is, and which answers count (pure: no I/O, no clock).

    ledger = JobLedger(keys=3, items=3)
    epoch = ledger.open("a")                  # node a's incarnation 1
    ledger.assign(0, "a", item0); ledger.take("a", batch=256, window=2048)   # [0]: sent to a
    ledger.work[0]                            # item0: what was sent, kept until it is answered
    ledger.accept("a", epoch, 0)              # "accepted": the one answer of item 0
    ledger.accept("a", epoch, 0)              # "duplicate": dropped
    moved = ledger.close("a")                 # a is lost: its unanswered items, to route again

The run streams its items: one is in the ledger from when the driver routes it to a node
(`assign`) until its answer is accepted, and only then; items not read yet are not here at
all. So the ledger holds what is in flight (each node's queue and what it was sent), and of
everything else one bit per key: answered or not.

Every item in flight is in exactly one place: the queue of the node that owns it (to send)
or what that node holds (sent, not answered). An answer counts only from the node that owns
the item, at that node's current epoch, and only the first time; `close` raises the node's
epoch first, so whatever the lost incarnation still says is "stale". This is what makes the
output exactly one line per key, whatever arrives late or twice.

Owner: the driver's main thread (`driver.py`); not thread-safe.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

ACCEPTED = "accepted"
DUPLICATE = "duplicate"  # the item has its answer already
STALE = "stale"  # from an incarnation of the node that was fenced off
NOT_OWNER = "not_owner"  # from a node the item was moved away from (or a key not in flight)


class JobLedger:
    """A run of `items` items named by keys in 0..keys-1: the items in flight (each one's
    owner node and work, the nodes' queues and holdings), the nodes' epochs, and the
    answered keys (a bit set)."""

    def __init__(self, keys: int, items: int) -> None:
        assert 0 <= items <= keys, (items, keys)
        self.keys = keys
        self.items = items
        self.answered_bits = np.zeros((keys + 7) // 8, dtype=np.uint8)
        self.answered = 0
        self.owner: dict[int, str] = {}  # in flight only
        self.work: dict[int, object] = {}  # in flight only: what to send (again, should its node be lost)
        self.epoch: dict[str, int] = {}
        self.queue: dict[str, deque[int]] = {}
        self.held: dict[str, set[int]] = {}

    def open(self, slot: str) -> int:
        """A new incarnation of node `slot` (a fresh agent): its epoch."""
        self.epoch[slot] = self.epoch.get(slot, 0) + 1
        self.queue.setdefault(slot, deque())
        self.held.setdefault(slot, set())
        return self.epoch[slot]

    def is_answered(self, k: int) -> bool:
        return bool(self.answered_bits[k >> 3] >> (k & 7) & 1)

    def assign(self, k: int, slot: str, work: object) -> None:
        """Item k (not answered, not in flight) and its work to `slot`'s queue."""
        assert 0 <= k < self.keys and not self.is_answered(k) and k not in self.owner and slot in self.queue, (k, slot)
        self.owner[k] = slot
        self.work[k] = work
        self.queue[slot].append(k)

    def queued(self, slot: str) -> int:
        """Items routed to `slot` and not sent yet."""
        return len(self.queue[slot])

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
        if not 0 <= k < self.keys:
            return NOT_OWNER
        if self.is_answered(k):
            return DUPLICATE
        if self.owner.get(k) != slot or k not in self.held[slot]:
            return NOT_OWNER
        self.answered_bits[k >> 3] |= np.uint8(1 << (k & 7))
        self.answered += 1
        self.held[slot].discard(k)
        del self.owner[k], self.work[k]
        return ACCEPTED

    def close(self, slot: str) -> list[tuple[int, object]]:
        """Node `slot` is lost: fence it off (its epoch goes up) and hand back every item it
        queued or held, with its work, for the caller to assign again (in key order)."""
        self.epoch[slot] = self.epoch.get(slot, 0) + 1
        moved = sorted(set(self.queue.get(slot, ())) | self.held.get(slot, set()))
        self.queue[slot] = deque()
        self.held[slot] = set()
        out = []
        for k in moved:
            del self.owner[k]
            out.append((k, self.work.pop(k)))
        return out

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

    def in_flight(self) -> int:
        return len(self.owner)

    def unanswered(self) -> int:
        return self.items - self.answered

    def check_invariants(self) -> None:
        seen: dict[int, str] = {}
        for slot in self.queue:
            for k in [*self.queue[slot], *self.held[slot]]:
                assert k not in seen, (k, seen.get(k), slot)  # in one place only
                assert not self.is_answered(k) and self.owner.get(k) == slot, (k, slot)
                seen[k] = slot
        assert seen.keys() == self.owner.keys() == self.work.keys()  # in flight exactly when somewhere
        assert self.answered == int(np.unpackbits(self.answered_bits).sum()) <= self.items
        assert self.keys % 8 == 0 or not self.answered_bits[-1] >> (self.keys % 8)  # no bit past the keys
