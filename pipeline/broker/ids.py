"""The broker's ids and keys, in one pure leaf module that the policy and the storage both
import (it imports nothing of the product).

    ShapeKey(model, signature)          the broker's key everywhere (SPEC §1)
    LaneId                              a lane's id within its shape (lanes/policy.py)
    LaneKey(model, signature, lane)     one lane of one shape: a run of segment files
    EntryRef(segment, offset)           where a stored entry lives: the pending map's key
                                        (SPEC §5); the offset is a byte offset in the segment
"""

from __future__ import annotations

from typing import NamedTuple, NewType

LaneId = NewType("LaneId", int)
"""A lane's id within its shape. Ids are reused after release (lowest free id first)."""
SegmentId = NewType("SegmentId", int)
"""A segment file; never reused while the store lives."""
ConsumerId = NewType("ConsumerId", int)
"""A registered consumer connection; a reconnecting consumer gets a new one."""
BatchId = NewType("BatchId", int)
"""A batch handed out by the dispatcher; unique per dispatcher."""


class ShapeKey(NamedTuple):
    model: int
    signature: int


class LaneKey(NamedTuple):
    model: int
    signature: int
    lane: LaneId

    @property
    def shape(self) -> ShapeKey:
        return ShapeKey(self.model, self.signature)


class EntryRef(NamedTuple):
    # NOTE: a NamedTuple, not a dataclass: it is a dict key on every pending entry, and tuple
    # hashing and equality are the fastest Python has.
    segment: SegmentId
    offset: int


__all__ = ["BatchId", "ConsumerId", "EntryRef", "LaneId", "LaneKey", "SegmentId", "ShapeKey"]
