"""Hypothesis strategies of fuzzed inputs for a target (`targets.py`): arbitrary bytes, and
valid encodings mutated (`mutations.py`) at positions and fields hypothesis chooses."""

from __future__ import annotations

from hypothesis import strategies as st

from tests.fuzz import mutations
from tests.fuzz.targets import Target

# Arbitrary inputs up to this size: past every fixed header, small enough to stay fast.
ARBITRARY_MAX_BYTES = 8192
# Mutations stacked on one seed.
MAX_MUTATIONS = 4

_small = st.integers(0, 1 << 20)


@st.composite
def _byte_mutation(draw, target: Target, seed_index: int, data: bytes) -> bytes:
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "field", "field"]))
    if kind == "flip":
        return mutations.flip(data, draw(_small), draw(st.integers(0, 7)))
    if kind == "truncate":
        return mutations.truncate(data, draw(_small))
    if kind == "insert":
        return mutations.insert(data, draw(_small), draw(st.binary(min_size=1, max_size=64)))
    if kind == "delete":
        return mutations.delete(data, draw(_small), draw(st.integers(1, 64)))
    fields = target.fields[seed_index]
    if not fields:
        return mutations.flip(data, draw(_small), draw(st.integers(0, 7)))
    offset, size = draw(st.sampled_from(fields))
    value = draw(st.sampled_from(mutations.interesting_ints(size)) | st.integers(0, (1 << (8 * size)) - 1))
    return mutations.overwrite(data, offset, size, value)


_json_leaf = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
              | st.sampled_from(mutations.ODD_JSON_VALUES))
_json_value = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@st.composite
def _text_mutation(draw, target: Target, data: bytes) -> bytes:
    new = draw(_json_value)
    if target.name == "control":
        return mutations.control_value(data, draw(_small), draw(_small), new)
    action = draw(st.sampled_from(["value", "value", "value", "drop", "repeat", "whole"]))
    return mutations.mutate_lines(data, draw(_small), action, draw(_small), new)


@st.composite
def mutants(draw, target: Target) -> bytes:
    """A seed of `target` with up to MAX_MUTATIONS mutations."""
    index = draw(st.integers(0, len(target.seeds) - 1))
    data = target.seeds[index]
    for _ in range(draw(st.integers(1, MAX_MUTATIONS))):
        if target.text and draw(st.booleans()):
            data = draw(_text_mutation(target, data))
        else:
            data = draw(_byte_mutation(target, index, data))
    return data


def arbitrary() -> st.SearchStrategy[bytes]:
    return st.binary(max_size=ARBITRARY_MAX_BYTES)
