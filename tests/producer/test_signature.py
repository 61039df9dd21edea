"""Shape signatures: fixed test vectors, order sensitivity, dtype independence, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.producer.signature import SIGNATURE_SEED, chain, check_signature, component_hash, reduce_hashes, signature
from pipeline.wire.errors import SignatureError, TokenArrayError
from pipeline.wire.shapes import EMPTY_SHAPE_SIGNATURE, POOL_SIGNATURE

SYSTEM = b"You are a helpful assistant."
FEWSHOT = np.array([101, 2023, 2003, 1037, 7099, 102], dtype=np.int32)

def test_xxh3_component_hash_matches_reference_values():
    # xxh3-64 of the empty input and of "abc" are published reference values.
    assert component_hash(b"") == 0x2D06800538D394C2
    assert component_hash(b"abc") == 0x78AF5F94892F3950


def test_fixed_signature_vectors():
    # These values are part of the protocol: a change means producers of another version
    # would declare different shapes for the same prompts.
    assert signature([]) == 1814494816123133764
    assert signature([SYSTEM]) == 10088404843962264903
    assert signature([SYSTEM, FEWSHOT]) == 6667015889525726805
    assert signature([FEWSHOT, SYSTEM]) == 14437888777119761887


def test_the_broker_knows_the_empty_shape_by_the_wire_constant():
    # The broker cannot hash (it never imports the producer): the constant it reads the
    # empty shape by must be what producers declare for prompts without components.
    assert signature([]) == reduce_hashes([]) == EMPTY_SHAPE_SIGNATURE
    assert chain([]) == (EMPTY_SHAPE_SIGNATURE,)
    assert signature([b""]) != EMPTY_SHAPE_SIGNATURE  # one empty component is a component


def test_reduction_is_xxh3_of_the_packed_hash_vector():
    hashes = [component_hash(SYSTEM), component_hash(FEWSHOT)]
    packed = b"".join(h.to_bytes(8, "little") for h in hashes)
    assert signature([SYSTEM, FEWSHOT]) == xxhash.xxh3_64_intdigest(packed, seed=SIGNATURE_SEED)
    assert reduce_hashes(hashes) == signature([SYSTEM, FEWSHOT])


def test_order_matters():
    assert signature([SYSTEM, FEWSHOT]) != signature([FEWSHOT, SYSTEM])


def test_one_component_shape_is_not_the_component_hash():
    assert signature([SYSTEM]) != component_hash(SYSTEM)


def test_token_ids_hash_the_same_whatever_their_integer_type():
    as_list = FEWSHOT.tolist()
    strided = np.repeat(FEWSHOT, 2)[::2]  # an int32 view that is not contiguous
    for variant in (as_list, FEWSHOT.astype(np.int64), FEWSHOT.astype(">i4"), FEWSHOT.astype(np.uint16), strided):
        assert signature([variant]) == signature([FEWSHOT])


def test_length_is_not_part_of_the_signature():
    # Same components, prompts of different lengths: the same shape (the suffix is not hashed).
    assert signature([SYSTEM, FEWSHOT]) == signature([bytes(SYSTEM), FEWSHOT.copy()])


@settings(max_examples=200, derandomize=True)
@given(st.lists(st.binary(max_size=64), min_size=2, max_size=6))
def test_signature_is_stable_and_order_sensitive(components):
    first = signature(components)
    assert first == signature(list(components))
    assert 0 <= first < 1 << 64
    reordered = components[1:] + components[:1]
    if reordered != components:
        assert signature(reordered) != first


@pytest.mark.parametrize(
    "component, match",
    [
        (np.array([1.5, 2.0]), "integers"),
        (np.array([[1, 2], [3, 4]]), "one-dimensional"),
        (np.array([[1, 2], [3, 4]], dtype=np.int32), "one-dimensional"),
        (np.array([1, 1 << 40]), "int32"),
        (np.array([-(1 << 31) - 1]), "int32"),
    ],
    ids=["float", "2-d", "2-d-int32", "too-big", "too-small"],
)
def test_bad_token_components(component, match):
    with pytest.raises(TokenArrayError, match=match):
        signature([component])


def test_signature_takes_a_list_not_one_component():
    with pytest.raises(TypeError):
        signature(SYSTEM)


@pytest.mark.parametrize("value", [-1, 1 << 64, 1.0, "7", True, None])
def test_check_signature_refuses_non_u64(value):
    with pytest.raises(SignatureError):
        check_signature(value)


def test_check_signature_refuses_the_solitary_pools_own():
    with pytest.raises(SignatureError, match="reserved: it names the broker's solitary pool"):
        check_signature(POOL_SIGNATURE)
    assert check_signature(POOL_SIGNATURE + 1) == POOL_SIGNATURE + 1  # the one value only


def test_check_signature_accepts_numpy_unsigned():
    assert check_signature(np.uint64((1 << 64) - 1)) == (1 << 64) - 1
