"""The generation envelope (pipeline/wire/generation.py): per-item parameters carried in the
payload, the producer's own payload given back whole, limits at and past their bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.wire.errors import GenerationParamsError
from pipeline.batchjob.layout import JOB_PAYLOAD_SIZE_BYTES
from pipeline.producer.producer import DEFAULT_MAX_PAYLOAD_BYTES
from pipeline.wire.generation import (
    GENERATION_HEADER_SIZE_BYTES,
    GENERATION_MAGIC,
    MAX_EMBEDDING_DIMENSIONS,
    MAX_EMBEDDING_INPUTS,
    MAX_ENVELOPE_BYTES,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_NEW_TOKENS,
    MAX_SAMPLES,
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STRUCTURED_OUTPUT_BYTES,
    STRUCTURED_KINDS,
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
    stop=st.lists(st.text(min_size=1, max_size=20), max_size=MAX_STOP_STRINGS).map(tuple),
    n=st.none() | st.integers(1, MAX_SAMPLES),
    top_k=st.none() | st.integers(-1, 1000),
    min_p=st.none() | st.floats(0, 1),
    presence_penalty=st.none() | st.floats(-2, 2),
    frequency_penalty=st.none() | st.floats(-2, 2),
    repetition_penalty=st.none() | st.floats(0.01, 10),
    logprobs=st.none() | st.integers(0, MAX_LOGPROBS),
    ignore_eos=st.booleans(),
    skip_special_tokens=st.booleans(),
    include_stop_str_in_output=st.booleans(),
    stop_token_ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=8).map(tuple),
    logit_bias=st.dictionaries(st.integers(0, 1 << 20), st.floats(-100, 100), max_size=8).map(
        lambda d: tuple(d.items())),
    structured=st.none() | st.tuples(st.sampled_from(STRUCTURED_KINDS), st.text(max_size=40)),
    disable_any_whitespace=st.booleans(),
    disable_additional_properties=st.booleans(),
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
    with pytest.raises(GenerationParamsError, match=f"shorter than its {GENERATION_HEADER_SIZE_BYTES}-byte header"):
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
    ("n", MAX_SAMPLES, MAX_SAMPLES + 1),
    ("logprobs", MAX_LOGPROBS, MAX_LOGPROBS + 1),
    ("top_k", -1, -2),
    ("min_p", 1.0, 1.01),
    ("presence_penalty", -2.0, -2.01),
    ("frequency_penalty", 2.0, 2.01),
    ("repetition_penalty", 1e-9, 0.0),
    ("min_tokens", 0, -1),
    ("stop_token_ids", (7,) * MAX_STOP_TOKEN_IDS, (7,) * (MAX_STOP_TOKEN_IDS + 1)),
    ("logit_bias", tuple((k, 100.0) for k in range(MAX_LOGIT_BIAS_ENTRIES)),
     tuple((k, 1.0) for k in range(MAX_LOGIT_BIAS_ENTRIES + 1))),
    ("logit_bias", ((5, -100.0),), ((5, -100.5),)),
    ("structured", ("json", "x" * MAX_STRUCTURED_OUTPUT_BYTES), ("json", "x" * (MAX_STRUCTURED_OUTPUT_BYTES + 1))),
])
def test_limits_at_and_past(field, at_limit, past_limit):
    params = GenerationParams(**{field: at_limit})
    assert decode_payload(encode_payload(params))[0] == params
    with pytest.raises(GenerationParamsError, match=field.split("_")[0] if field != "structured" else "structured"):
        GenerationParams(**{field: past_limit})


@pytest.mark.parametrize("wrong", [dict(max_tokens=True), dict(temperature=float("nan")), dict(top_p="0.5"),
                                   dict(stop=["a list"]), dict(stop=("",))])
def test_wrong_types_are_refused(wrong):
    with pytest.raises(GenerationParamsError):
        GenerationParams(**wrong)


def test_a_stop_string_that_is_not_valid_unicode_is_refused_up_front():
    with pytest.raises(GenerationParamsError, match="not valid Unicode"):
        GenerationParams(stop=("\ud800",))


def test_the_largest_envelope_and_a_jobs_payload_fit_the_producers_payload_limit():
    largest = GenerationParams(
        stop=tuple(chr(0x100 + k) * (MAX_STOP_STRING_BYTES // 2) for k in range(MAX_STOP_STRINGS)),
        stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)),
        logit_bias=tuple((k, 1.5) for k in range(MAX_LOGIT_BIAS_ENTRIES)),
        structured=("json", "s" * MAX_STRUCTURED_OUTPUT_BYTES), embed=True,
        input_lengths=tuple(range(1, MAX_EMBEDDING_INPUTS + 1)), dimensions=MAX_EMBEDDING_DIMENSIONS)
    stored = encode_payload(largest, b"j" * JOB_PAYLOAD_SIZE_BYTES)
    assert len(stored) == MAX_ENVELOPE_BYTES + JOB_PAYLOAD_SIZE_BYTES <= DEFAULT_MAX_PAYLOAD_BYTES
    assert decode_payload(stored) == (largest, b"j" * JOB_PAYLOAD_SIZE_BYTES)


def test_min_tokens_past_max_tokens_is_refused_as_vllm_refuses_it():
    assert GenerationParams(max_tokens=5, min_tokens=5).min_tokens == 5
    with pytest.raises(GenerationParamsError, match="min_tokens 6 must be at most max_tokens 5"):
        GenerationParams(max_tokens=5, min_tokens=6)


def test_overrides_are_vllms_sampling_parameters_the_item_changes():
    params = GenerationParams(max_tokens=8, n=2, logprobs=3, stop=("x",), stop_token_ids=(4,),
                              logit_bias=((9, -100.0),), skip_special_tokens=False, structured=("regex", "a+"))
    assert params.overrides() == {"max_tokens": 8, "n": 2, "logprobs": 3, "stop": ["x"], "stop_token_ids": [4],
                                  "logit_bias": {9: -100.0}, "skip_special_tokens": False}
    assert GenerationParams().overrides() == {} and params.samples == 2 and GenerationParams().samples == 1


def test_an_item_to_embed_keeps_its_inputs_lengths_and_dimensions():
    params = GenerationParams(embed=True, input_lengths=(3, 1, 7), dimensions=64)
    assert decode_payload(encode_payload(params, b"job")) == (params, b"job")
    assert decode_payload(encode_payload(GenerationParams(embed=True, input_lengths=(5,)), b""))[0].dimensions is None


@pytest.mark.parametrize("inputs, dimensions, ok", [
    (MAX_EMBEDDING_INPUTS, MAX_EMBEDDING_DIMENSIONS, True), (MAX_EMBEDDING_INPUTS + 1, 1, False),
    (1, MAX_EMBEDDING_DIMENSIONS + 1, False), (1, 0, False), (0, None, False)])
def test_an_embeddings_inputs_and_dimensions_are_checked_at_their_limits(inputs, dimensions, ok):
    make = lambda: GenerationParams(embed=True, input_lengths=(1,) * inputs, dimensions=dimensions)  # noqa: E731
    if ok:
        assert len(make().input_lengths) == inputs
    else:
        with pytest.raises(GenerationParamsError):
            make()


def test_input_lengths_without_embed_are_refused():
    with pytest.raises(GenerationParamsError, match="an embedding's"):
        GenerationParams(input_lengths=(3,))


@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.tuples(st.integers(0, 3), st.binary(max_size=16)), max_size=40),
       params=st.lists(params_strategy, min_size=4, max_size=4), cut=st.none() | st.integers(0, 200))
def test_the_decoder_gives_what_decode_payload_gives_each_envelope_decoded_once(items, params, cut):
    """Against decode_payload as the reference, items drawn from four parameter sets, one of
    them (cut) perhaps torn, under a bound that forces the decoder to forget."""
    from pipeline.wire.generation import PayloadDecoder

    decoder = PayloadDecoder(max_bytes=2 * GENERATION_HEADER_SIZE_BYTES + 64)
    for which, payload in items:
        data = encode_payload(params[which], payload)
        if cut is not None and which == 3:
            data = data[:cut]
        try:
            expected = decode_payload(data)
        except GenerationParamsError as exc:
            with pytest.raises(GenerationParamsError) as got:
                decoder.decode(data)
            assert str(got.value) == str(exc)
        else:
            assert decoder.decode(data) == expected
        decoder.check_invariants()


def test_the_decoder_forgets_every_envelope_once_its_bound_is_reached_and_keeps_an_envelope_past_it():
    from pipeline.wire.generation import PayloadDecoder

    small, other = encode_payload(GenerationParams(max_tokens=1)), encode_payload(GenerationParams(max_tokens=2))
    decoder = PayloadDecoder(max_bytes=len(small) + len(other))  # at the bound: both kept
    first = decoder.decode(small + b"x")[0]
    decoder.decode(other)
    assert decoder.decode(small)[0] is first
    decoder.check_invariants()
    decoder = PayloadDecoder(max_bytes=len(small) + len(other) - 1)  # one past it: the second forgets the first
    first = decoder.decode(small)[0]
    decoder.decode(other)
    assert decoder.decode(small)[0] is not first and decoder.decode(small)[0] == first
    decoder.check_invariants()
    huge = encode_payload(GenerationParams(structured=("json", "x" * 1000)))
    decoder.decode(huge)  # larger than the bound: kept alone
    decoder.check_invariants()
