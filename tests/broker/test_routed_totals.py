"""The broker's routed totals behind the report's padding efficiency and mean batch fill."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.broker.consumers import RoutedTotals
from pipeline.broker.packing import Contract


def batch(items: int, pad_to: int):
    return SimpleNamespace(entries=[None] * items, padded_tokens=items * pad_to)


def test_fill_is_the_binding_share_of_the_contract_and_at_most_one():
    contract = Contract(0, 64, 4096, 100_000)
    totals = RoutedTotals()
    totals.add(batch(16, 64), contract)  # items bind: 16/64 = 0.25 (tokens 1024/4096 = 0.25)
    totals.add(batch(4, 512), contract)  # tokens bind: 2048/4096 = 0.5
    totals.add(batch(1, 12_000), contract)  # a lone item over the budget: a full batch, not 2.9
    assert totals.batches == 3 and totals.padded_tokens == 1024 + 2048 + 12_000
    assert totals.fill_sum == 0.25 + 0.5 + 1.0
