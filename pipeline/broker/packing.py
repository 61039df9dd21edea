"""Packing one lane's queue to a consumer's four-integer contract (SPEC §3).

Pure math: no I/O, no clock, no storage. The dispatcher asks ShapeLanes for the lane's
longest queued item, peeks `batch_items_limit(...)` entries from the front of the lane, and
`pack` says how many of them form the batch and what they are padded to:

    contract = Contract(model=0, max_batch_items=64, max_batch_tokens=65_536, max_input_len=8192)
    limit = batch_items_limit(lanes.queued_max(lane), contract)
    front = storage.peek(lane_key, limit)
    packing = pack([e.length for e in front], lanes.queued_max(lane), contract)
    batch = front[:packing.count]     # the rest stays at the front, in its order

The broker does NOT filter by `max_input_len` (SPEC §3): an oversized item reaches the
consumer, whose runtime returns it as an empty completion. The number is validated and kept
for the consumer's side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.wire.errors import ContractError

# SPEC §3: pad-to is the queue's longest item rounded up to a multiple of 8 (engines pad to
# tensor-core friendly sizes anyway; rounding here makes the budget what the GPU pays).
PAD_MULTIPLE_TOKENS = 8
# Model ids are u4 in the frame layout (pipeline.wire.layouts ITEM_HEADER_DTYPE "model").
MAX_MODEL_ID = 2**32 - 1


@dataclass(frozen=True, slots=True)
class Contract:
    """What a consumer registers (SPEC §3): the model it serves, at most `max_batch_items`
    items and `max_batch_tokens` padded tokens per batch, and the longest input its engine
    takes. Immutable; validated on construction (ContractError names the bad number).

    `model` is an id, so 0 is valid; the three limits must be >= 1. bool is refused although
    it is an int subclass (True would silently mean 1)."""

    model: int
    max_batch_items: int
    max_batch_tokens: int
    max_input_len: int

    def __post_init__(self) -> None:
        for name in ("model", "max_batch_items", "max_batch_tokens", "max_input_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ContractError(
                    f"contract: {name} must be an integer, got {value!r} ({type(value).__name__})"
                )
            floor = 0 if name == "model" else 1
            if value < floor:
                kind = "negative" if value < 0 else "zero"
                raise ContractError(f"contract: {name} must be >= {floor}, got {value} ({kind})")
        if self.model > MAX_MODEL_ID:
            raise ContractError(f"contract: model must be <= {MAX_MODEL_ID}, got {self.model}")


@dataclass(frozen=True, slots=True)
class Packing:
    """How many front items of the lane form the batch, and the padded length of each."""

    count: int
    pad_to_tokens: int
    real_tokens: int

    @property
    def padded_tokens(self) -> int:
        return self.count * self.pad_to_tokens


def pad_to_tokens(longest_tokens: int) -> int:
    """`longest_tokens` rounded up to a multiple of PAD_MULTIPLE_TOKENS. 1 -> 8, 8 -> 8, 9 -> 16."""
    assert longest_tokens >= 1, longest_tokens
    return -(-longest_tokens // PAD_MULTIPLE_TOKENS) * PAD_MULTIPLE_TOKENS


def batch_items_limit(queue_longest_tokens: int, contract: Contract) -> int:
    """The most items a batch of this lane can hold: as many as the contract allows with every
    item padded to the queue's longest (rounded up), and at least one, even when that one
    alone exceeds the token budget (otherwise the queue would stall). The dispatcher peeks
    this many entries. Example: longest 1001 -> pad 1008; 64 items / 4,096 tokens -> 4;
    longest 5000 -> pad 5000 > 4,096 -> 1."""
    pad = pad_to_tokens(queue_longest_tokens)
    return max(1, min(contract.max_batch_items, contract.max_batch_tokens // pad))


def pack(
    front_lengths: Sequence[int], queue_longest_tokens: int, contract: Contract
) -> Packing:
    """Pack the front of one lane's queue (SPEC §3).

    `front_lengths`: the lengths of the lane's first items in dispatch order (returned items
    first, then arrival order), as peeked; `queue_longest_tokens`: the longest item queued in
    the whole lane (ShapeLanes.queued_max), which every item is padded to, rounded up to a
    multiple of 8. Items are taken in order while `n_items <= max_batch_items` and
    `n_items * pad_to <= max_batch_tokens`; at least one is always taken. The rest (overflow)
    is not touched: it stays at the front of the lane in its original order, because a peek
    never advances. No item is skipped or filtered (not even one longer than max_input_len).

    Worked example: contract 64 items / 4,096 padded tokens; the queue holds 700, 650, 1001,
    690, 300 (longest 1001). pad_to = 1008; 4 * 1008 = 4032 <= 4096 but 5 * 1008 > 4096, so
    the batch is [700, 650, 1001, 690] (real 3041 of 4032 padded tokens) and 300 stays at
    the front. With a longest item of 5000 the batch is the first item alone, padded to 5000.
    """
    assert front_lengths, "pack needs at least one queued item"
    pad = pad_to_tokens(queue_longest_tokens)
    count = min(len(front_lengths), batch_items_limit(queue_longest_tokens, contract))
    taken = front_lengths[:count]
    # min/max run in C: a generator over 64 items per batch was a visible share of dispatch.
    assert 1 <= min(taken) and max(taken) <= queue_longest_tokens, (taken, queue_longest_tokens)
    return Packing(count=count, pad_to_tokens=pad, real_tokens=int(sum(taken)))


def within_contract(packing: Packing, contract: Contract) -> bool:
    """True when the batch keeps to the contract, or holds one item (the stall exception)."""
    if packing.count == 1:
        return True
    return (
        packing.count <= contract.max_batch_items
        and packing.padded_tokens <= contract.max_batch_tokens
    )
