"""Fixtures of the cluster tests: an item source in memory (`stream.ItemSource`)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from pipeline.producer.workload import WorkItem


class ListSource:
    """Items under sparse keys, each of a shape given as a path of component ids (component
    c is 2 + c % 3 tokens of c), made afresh on every read and counted."""

    def __init__(self, keys: int, shapes: dict[int, tuple[int, ...]], suffix_tokens: int = 3) -> None:
        self.keys = keys
        self.shapes = shapes  # key -> path of component ids
        self.suffix_tokens = suffix_tokens
        self.made: Counter = Counter()

    @staticmethod
    def components(path: tuple[int, ...]) -> list[np.ndarray]:
        return [np.full(2 + c % 3, c, dtype=np.int32) for c in path]

    def _item(self, key: int) -> WorkItem:
        self.made[key] += 1
        return WorkItem(model=0, components=self.components(self.shapes[key]),
                        suffix=np.zeros(self.suffix_tokens, dtype=np.int32), payload=b"%d" % key,
                        timestamp_ms=None, line=0)

    def scan(self):
        return ((k, self._item(k)) for k in sorted(self.shapes))

    def items(self, wanted):
        return ((k, self._item(k)) for k in sorted(self.shapes) if wanted(k))


@pytest.fixture(scope="session")
def list_source() -> type[ListSource]:
    """The class (session-scoped, so property tests may use it)."""
    return ListSource
