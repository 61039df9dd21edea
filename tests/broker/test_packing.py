"""Packing to the four-integer contract (pipeline/broker/packing.py, SPEC §3) against a small
reference written here. Deterministic: hypothesis is derandomised, stress runs are seeded."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.broker.packing import Contract, Packing, batch_items_limit, pack, pad_to_tokens, within_contract
from pipeline.wire.errors import BadInputError, ContractError

DETERMINISTIC = settings(derandomize=True, database=None, deadline=None, max_examples=300)


def reference_pack(queue: list[int], contract: Contract) -> tuple[list[int], list[int], int]:
    """SPEC §3 word for word: pad-to = the queue's longest item rounded up to a multiple of 8;
    add items in arrival order while n <= max items and n * pad <= max tokens; at least one.
    Returns (batch, overflow, pad)."""
    longest = max(queue)
    pad = longest if longest % 8 == 0 else longest + 8 - longest % 8
    batch: list[int] = []
    for length in queue:
        n = len(batch) + 1
        if batch and (n > contract.max_batch_items or n * pad > contract.max_batch_tokens):
            break
        batch.append(length)
    return batch, queue[len(batch):], pad


def pack_queue(queue: list[int], contract: Contract) -> tuple[Packing, list[int], list[int]]:
    """What the dispatcher does: peek batch_items_limit items, pack them, the rest stays."""
    longest = max(queue)
    front = queue[: batch_items_limit(longest, contract)]
    packing = pack(front, longest, contract)
    return packing, queue[: packing.count], queue[packing.count:]


contracts = st.builds(
    Contract,
    model=st.integers(0, 3),
    max_batch_items=st.one_of(st.integers(1, 4), st.integers(1, 300)),
    max_batch_tokens=st.one_of(st.integers(1, 64), st.integers(1, 200_000), st.just(65_536)),
    max_input_len=st.integers(1, 10_000),
)
queues = st.lists(
    st.one_of(st.integers(1, 9000), st.sampled_from([1, 7, 8, 9, 15, 16, 17, 511, 512, 513])),
    min_size=1, max_size=120,
)


@DETERMINISTIC
@given(queue=queues, contract=contracts)
def test_pack_matches_the_reference(queue, contract):
    packing, batch, overflow = pack_queue(queue, contract)
    want_batch, want_overflow, want_pad = reference_pack(queue, contract)
    assert batch == want_batch and overflow == want_overflow
    assert packing.pad_to_tokens == want_pad and packing.real_tokens == sum(want_batch)
    assert batch + overflow == queue  # nothing lost or duplicated; overflow order kept
    assert within_contract(packing, contract)
    assert packing.count >= 1


@DETERMINISTIC
@given(queue=queues, contract=contracts, peek_extra=st.integers(0, 50))
def test_pack_ignores_items_beyond_the_limit_and_never_filters_by_input_length(queue, contract, peek_extra):
    """However many front items are offered, the batch is the same prefix; items longer than
    max_input_len are packed like the rest (the consumer's runtime deals with them)."""
    longest = max(queue)
    limit = batch_items_limit(longest, contract)
    packing = pack(queue[: limit + peek_extra], longest, contract)
    assert packing.count == min(len(queue), limit)
    assert packing.padded_tokens == packing.count * pad_to_tokens(longest)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_drain_keeps_order_and_contracts(seed):
    """Drain random queues with a random contract per batch: every item leaves exactly once,
    in arrival order, and every batch keeps to its contract unless it holds one item."""
    rng = np.random.default_rng(seed)
    for _ in range(30):
        items = np.maximum(1, rng.lognormal(np.log(512), 1.0, int(rng.integers(1, 400)))).astype(int)
        queue = deque(items.tolist())
        drained: list[int] = []
        while queue:
            contract = Contract(0, int(rng.integers(1, 100)), int(rng.integers(1, 70_000)), 4096)
            packing, batch, overflow = pack_queue(list(queue), contract)
            assert packing.count == 1 or (
                packing.count <= contract.max_batch_items
                and packing.count * packing.pad_to_tokens <= contract.max_batch_tokens
            )
            assert packing.pad_to_tokens % 8 == 0 and packing.pad_to_tokens >= max(queue)
            for _ in range(packing.count):
                drained.append(queue.popleft())
            assert list(queue) == overflow
        assert drained == items.tolist()


def test_docstring_worked_example():
    contract = Contract(model=0, max_batch_items=64, max_batch_tokens=4096, max_input_len=8192)
    queue = [700, 650, 1001, 690, 300]
    packing = pack(queue, max(queue), contract)
    assert packing == Packing(count=4, pad_to_tokens=1008, real_tokens=3041)
    assert packing.padded_tokens == 4032
    alone = pack([5000, 10], 5000, contract)
    assert alone.count == 1 and alone.pad_to_tokens == 5000 and not alone.padded_tokens <= 4096
    assert within_contract(alone, contract)  # the one-item exception


def test_batch_items_limit_examples():
    contract = Contract(0, 64, 4096, 1)
    assert batch_items_limit(1001, contract) == 4
    assert batch_items_limit(5000, contract) == 1
    assert batch_items_limit(1, Contract(0, 64, 65_536, 1)) == 64  # pad 8: the item cap binds
    assert [pad_to_tokens(n) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 24]


def test_the_longest_queued_item_sets_the_pad_even_when_it_is_not_in_the_batch():
    contract = Contract(0, 64, 2048, 1)
    packing = pack([100, 100, 100], 1000, contract)  # the 1000 sits further back in the lane
    assert packing.pad_to_tokens == 1000 and packing.count == 2


@pytest.mark.parametrize("field", ["model", "max_batch_items", "max_batch_tokens", "max_input_len"])
@pytest.mark.parametrize("bad", [-1, 1.5, True, "7", None, 2.0])
def test_contract_rejects_bad_numbers(field, bad):
    numbers = dict(model=0, max_batch_items=64, max_batch_tokens=65_536, max_input_len=8192)
    numbers[field] = bad
    with pytest.raises(ContractError) as raised:
        Contract(**numbers)
    assert field in str(raised.value) and repr(bad) in str(raised.value)
    assert isinstance(raised.value, BadInputError)


@pytest.mark.parametrize("field", ["max_batch_items", "max_batch_tokens", "max_input_len"])
def test_contract_rejects_zero_limits_but_model_zero_is_an_id(field):
    numbers = dict(model=0, max_batch_items=64, max_batch_tokens=65_536, max_input_len=8192)
    Contract(**numbers)  # model 0 is valid
    numbers[field] = 0
    with pytest.raises(ContractError, match=f"{field} must be >= 1, got 0 \\(zero\\)"):
        Contract(**numbers)
    with pytest.raises(ContractError, match="model must be <="):
        Contract(2**32, 1, 1, 1)


def test_contract_is_immutable():
    contract = Contract(0, 1, 1, 1)
    with pytest.raises(AttributeError):
        contract.max_batch_items = 5  # type: ignore[misc]
