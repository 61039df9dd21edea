"""Submitting work items through a producer: as fast as the broker takes them, or replayed
at their timestamps (SPEC §7).

    workload = load_workload("trace.jsonl")
    with BrokerProducer(socket_path) as producer:
        totals = feed(producer, workload.items(index, count), replay_speed=2.0)

Consecutive items of one model go into one `submit_many` call, up to `chunk_items` items
and `chunk_tokens` tokens; a call blocks while the producer's ring is full (backpressure).
With a replay speed X, an item stamped t ms is submitted no earlier than t / X ms after
`feed` started, and a call only ever holds items already due.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipeline.producer.producer import DEFAULT_FRAME_BYTES
from pipeline.producer.signature import chain as shape_chain
from pipeline.producer.workload import WorkItem
from pipeline.wire.generation import GenerationParams
from pipeline.wire.layouts.frames import TOKEN_SIZE_BYTES

# Items per submit_many call: enough that the per-call cost (validation, one frame header)
# vanishes, few enough that a replay's due items go out without waiting for a full call.
DEFAULT_CHUNK_ITEMS = 256
# Tokens per submit_many call: one default frame (4 MiB, 1 Mi tokens). It bounds the copy
# `feed` makes to join a call's prompts (256 Mooncake prompts would be ~16 MiB); an item
# longer than this still goes, alone.
DEFAULT_CHUNK_TOKENS = DEFAULT_FRAME_BYTES // TOKEN_SIZE_BYTES
# Shapes whose chains a feed keeps made (~200 bytes each): every shape of a workload with a
# few thousand, where a job whose requests each have their own shape churns through them.
MAX_CACHED_CHAINS = 4096
_MS_PER_S = 1000.0


class SubmitsMany(Protocol):
    """What `feed` needs of a producer (`Producer`, `BrokerProducer`)."""

    def submit_many(self, model: int, signature: np.ndarray, tokens: np.ndarray,
                    lengths: np.ndarray, prefix_len: np.ndarray,
                    payloads: Sequence[bytes] | None = None,
                    params: Sequence[GenerationParams | None] | None = None) -> np.ndarray: ...

    def declare_shape(self, model: int, chain: Sequence[int]) -> None: ...


@dataclass(slots=True)
class FeedTotals:
    """What `feed` has submitted so far: items, their tokens, and submit_many calls."""

    items: int = 0
    tokens: int = 0
    calls: int = 0


def feed(client: SubmitsMany, items: Iterable[WorkItem], *, replay_speed: float | None = None,
         chunk_items: int = DEFAULT_CHUNK_ITEMS, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
         on_progress: Callable[[FeedTotals], None] | None = None) -> FeedTotals:
    """Submit every item through `client`, in order; returns the totals.

    `replay_speed` None: as fast as the client accepts. X > 0: an item with timestamp t ms is
    submitted no earlier than start + t / X / 1000 s (`clock()` at the start of the call);
    items without a timestamp go as soon as those before them have. `on_progress(totals)`
    is called after each submit_many call (the live object: read it, do not keep it).

    Example with replay_speed 2 and timestamps [0, 0, 100, None]: items 0 and 1 go in one
    call at once; the feed sleeps 50 ms; items 2 and 3 go in one call.
    """
    if replay_speed is not None and not (math.isfinite(replay_speed) and replay_speed > 0):
        raise ValueError(f"replay speed {replay_speed}: must be a finite number above 0")
    if chunk_items < 1 or chunk_tokens < 1:
        raise ValueError(f"chunk of {chunk_items} items, {chunk_tokens} tokens: both must be >= 1")
    group = _Group(client, FeedTotals(), on_progress)
    start_s = clock()
    for item in items:
        if replay_speed is not None and item.timestamp_ms is not None:
            due_s = start_s + item.timestamp_ms / replay_speed / _MS_PER_S
            if clock() < due_s:
                group.submit()  # what is due goes now, not after the wait
                while (left_s := due_s - clock()) > 0:
                    sleep(left_s)
        length = item.length
        if group.items and (item.model != group.items[0].model or len(group.items) >= chunk_items
                            or group.tokens + length > chunk_tokens):
            group.submit()
        group.add(item, length)
    group.submit()
    return group.totals


class _Group:
    """The items of the next submit_many call (one model). Owner: one `feed` call."""

    def __init__(self, client: SubmitsMany, totals: FeedTotals,
                 on_progress: Callable[[FeedTotals], None] | None) -> None:
        self.client = client
        # Each shape's chain of prefix signatures, made once per feed while its shape is
        # among the last MAX_CACHED_CHAINS (a hash per component); the producer sends it
        # once per connection (`declare_shape`).
        self.chains: dict[tuple[int, int], tuple[int, ...]] = {}
        self.totals = totals
        self.on_progress = on_progress
        self.items: list[WorkItem] = []
        self.tokens = 0

    def add(self, item: WorkItem, length: int) -> None:
        self.items.append(item)
        self.tokens += length

    def submit(self) -> None:
        """One submit_many call with the group's items, if there are any."""
        items = self.items
        if not items:
            return
        self._declare(items)
        self.client.submit_many(
            items[0].model,
            np.array([item.signature for item in items], dtype=np.uint64),
            np.concatenate([part for item in items for part in (*item.components, item.suffix)]),
            np.array([item.length for item in items], dtype=np.int64),
            np.array([item.prefix_len for item in items], dtype=np.int64),
            payloads=[item.payload for item in items],
            params=[item.params for item in items] if any(item.params is not None for item in items) else None,
        )
        self.totals.items += len(items)
        self.totals.tokens += self.tokens
        self.totals.calls += 1
        self.items, self.tokens = [], 0
        if self.on_progress is not None:
            self.on_progress(self.totals)

    def _declare(self, items: list[WorkItem]) -> None:
        """Declare the group's shapes' chains (the producer skips those it sent already)."""
        for item in items:
            chain = None
            if item.known_signature is None:  # hashed once for both: a chain ends with the signature
                chain = shape_chain(item.components)
                item.known_signature = int(chain[-1])
            key = (item.model, item.known_signature)
            if key not in self.chains:
                if len(self.chains) >= MAX_CACHED_CHAINS:
                    self.chains.clear()
                self.chains[key] = chain or shape_chain(item.components)
            self.client.declare_shape(item.model, self.chains[key])
