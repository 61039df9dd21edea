"""The generation envelope (pipeline/wire/generation.py): per-item parameters carried in the
payload, the producer's own payload given back whole, limits at and past their bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.wire.errors import GenerationParamsError
from pipeline.wire.generation import (
    GENERATION_HEADER_SIZE_BYTES,
    GENERATION_MAGIC,
    MAX_NEW_TOKENS,
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    GenerationParams,
    decode_payload,
    encode_payload,
)

params_strategy = st.builds(
    GenerationParams,
    max_tokens=st.none() | st.integers(1, MAX_NEW_TOKENS),
    temperature=st.none() | st.floats(0, 100, allow_nan=False),
    top_p=st.none() | st.floats(0, 1, exclude_min=True),
    seed=st.none() | st.integers(-(1 << 63), (1 << 63) - 1),
    stop=st.lists(st.text(min_size=1, max_size=20), max_size=4).map(tuple),
)


@settings(max_examples=300, deadline=None)
@given(params=st.none() | params_strategy, payload=st.binary(max_size=64))
def test_an_envelope_gives_back_the_parameters_and_the_payload(params, payload):
    stored = encode_payload(params, payload)
    got, own = decode_payload(stored)
    assert own == payload
    if params is None:
        assert got is None or got == GenerationParams()  # a payload that looked like an envelope got an empty one
    else:
        assert got == params


def test_a_plain_payload_costs_nothing_and_one_that_looks_like_an_envelope_is_escaped():
    assert encode_payload(None, b"req-17") == b"req-17"
    assert encode_payload(None) == b""
    lookalike = GENERATION_MAGIC + b"not an envelope"
    stored = encode_payload(None, lookalike)
    assert len(stored) == GENERATION_HEADER_SIZE_BYTES + len(lookalike)
    assert decode_payload(stored) == (GenerationParams(), lookalike)


@settings(max_examples=500, deadline=None)
@given(tail=st.binary(max_size=80))
def test_garbage_after_the_magic_is_a_typed_error_or_an_envelope_never_a_crash(tail):
    try:
        params, own = decode_payload(GENERATION_MAGIC + tail)
    except GenerationParamsError:
        return
    assert isinstance(params, GenerationParams) and isinstance(own, bytes)


def test_malformed_envelopes_name_what_is_wrong():
    good = encode_payload(GenerationParams(max_tokens=4, stop=("END",)), b"x")
    with pytest.raises(GenerationParamsError, match="shorter than its 48-byte header"):
        decode_payload(good[:20])
    with pytest.raises(GenerationParamsError, match="stop strings end at byte"):
        decode_payload(good[:GENERATION_HEADER_SIZE_BYTES + 2])
    other_version = good[:4] + (9).to_bytes(2, "little") + good[6:]
    with pytest.raises(GenerationParamsError, match="version 9"):
        decode_payload(other_version)
    bad_utf8 = bytearray(good)
    bad_utf8[GENERATION_HEADER_SIZE_BYTES + 2] = 0xFF
    with pytest.raises(GenerationParamsError, match="not UTF-8"):
        decode_payload(bytes(bad_utf8))


@pytest.mark.parametrize("field, at_limit, past_limit", [
    ("max_tokens", MAX_NEW_TOKENS, MAX_NEW_TOKENS + 1),
    ("max_tokens", 1, 0),
    ("top_p", 1.0, 1.5),
    ("temperature", 0.0, -0.1),
    ("seed", (1 << 63) - 1, 1 << 63),
    ("stop", ("s",) * MAX_STOP_STRINGS, ("s",) * (MAX_STOP_STRINGS + 1)),
    ("stop", ("é" * (MAX_STOP_STRING_BYTES // 2),), ("é" * (MAX_STOP_STRING_BYTES // 2 + 1),)),
])
def test_limits_at_and_past(field, at_limit, past_limit):
    params = GenerationParams(**{field: at_limit})
    assert decode_payload(encode_payload(params))[0] == params
    with pytest.raises(GenerationParamsError, match=field if field != "stop" else "stop"):
        GenerationParams(**{field: past_limit})


@pytest.mark.parametrize("wrong", [dict(max_tokens=True), dict(temperature=float("nan")), dict(top_p="0.5"),
                                   dict(stop=["a list"]), dict(stop=("",))])
def test_wrong_types_are_refused(wrong):
    with pytest.raises(GenerationParamsError):
        GenerationParams(**wrong)


def test_a_stop_string_that_is_not_valid_unicode_is_refused_up_front():
    with pytest.raises(GenerationParamsError, match="not valid Unicode"):
        GenerationParams(stop=("\ud800",))
