"""pipeline.batchjob.sampling: a request's defaults as vLLM's server fills them in (the rest
of the context, the model's generation config, vLLM's neutral values), its token ids checked
against the vocabulary, and the size of its answer at and past its limits."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pipeline.batchjob.params import Refused
from pipeline.batchjob.sampling import (
    MAX_ANSWER_LOGPROBS,
    MAX_ANSWER_TOKENS,
    RESOLVED_MEMO_ENTRIES,
    VLLM_NEUTRAL,
    ModelFacts,
    SamplingDefaults,
    sim_answer_options,
)
from pipeline.wire.errors import ModelDirError
from pipeline.wire.generation import GenerationParams

FACTS = ModelFacts(SamplingDefaults(), vocab_size=1000)
HUGE = 1 << 30  # a context that bounds nothing


def test_nothing_given_is_vllms_neutral_values_and_the_rest_of_the_context():
    params = FACTS.params_for(GenerationParams(), prompt_tokens=100, context_tokens=2048)
    assert params.max_tokens == 1948
    assert {name: getattr(params, name) for name in VLLM_NEUTRAL} == VLLM_NEUTRAL
    assert FACTS.params_for(GenerationParams(), 100, None).max_tokens is None  # unknown context: the engine's


def test_a_kept_resolution_answers_as_resolving_does_for_each_prompt_length():
    # Kept by the parameters object: one object at every prompt length, equal objects, and
    # more objects than the memo holds all resolve as a fresh SamplingDefaults does.
    kept, shared = SamplingDefaults({"temperature": 0.6}, None), GenerationParams(top_p=0.5)
    for _ in range(2):
        for prompt in (100, 101, 2047, 100):
            fresh = SamplingDefaults({"temperature": 0.6}, None).resolve(shared, prompt, 2048)
            assert kept.resolve(shared, prompt, 2048) == fresh and fresh.max_tokens == 2048 - prompt
        assert kept.resolve(GenerationParams(top_p=0.5), 100, 2048) == kept.resolve(shared, 100, 2048)
        assert kept.resolve(GenerationParams(max_tokens=7), 100, 2048).max_tokens == 7
    for k in range(RESOLVED_MEMO_ENTRIES + 10):
        assert kept.resolve(GenerationParams(seed=k), 100, 2048).seed == k
    assert len(kept._resolved) <= RESOLVED_MEMO_ENTRIES
    assert kept.resolve(shared, 2000, 2048).max_tokens == 48


def test_the_generation_config_sets_defaults_and_the_request_wins(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 256, "do_sample": True,
         "top_p": None}))
    facts = ModelFacts.load(str(tmp_path), tokenizer_vocab_size=50)
    assert facts.vocab_size == 50  # no config.json: the tokenizer's
    params = facts.params_for(GenerationParams(top_k=5), 100, 2048)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.top_p, params.max_tokens) == (
        0.6, 5, 1.05, 1.0, 256)
    assert facts.params_for(GenerationParams(), 1900, 2048).max_tokens == 148  # the context is less
    assert facts.params_for(GenerationParams(max_tokens=1000), 100, 2048).max_tokens == 1000  # asked: not capped


def test_the_vocabulary_is_config_jsons_where_it_says(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    assert ModelFacts.load(str(tmp_path), tokenizer_vocab_size=31990).vocab_size == 32000


@pytest.mark.parametrize("config, why", [
    ("not json", "not valid JSON"), ("[1]", "not a generation config"), ('{"temperature": "hot"}', "temperature"),
    ('{"max_new_tokens": 0}', "max_new_tokens must be a positive integer"),
])
def test_a_broken_generation_config_is_named(tmp_path, config, why):
    (tmp_path / "generation_config.json").write_text(config)
    with pytest.raises(ModelDirError, match=why):
        SamplingDefaults.load(str(tmp_path))


def test_token_ids_at_the_vocabulary_and_past_it():
    at = GenerationParams(logit_bias=((999, 1.0),), stop_token_ids=(999,))
    assert FACTS.params_for(at, 10, HUGE).logit_bias == ((999, 1.0),)
    with pytest.raises(Refused, match=r"token_id\(s\) \[1000\] in logit_bias contain out-of-vocab token ids. "
                                      r"Vocabulary size: 1000") as refused:
        FACTS.params_for(GenerationParams(logit_bias=((1000, 1.0),)), 10, HUGE)
    assert refused.value.param == "logit_bias"
    with pytest.raises(Refused, match="in stop_token_ids"):
        FACTS.params_for(GenerationParams(stop_token_ids=(5, 1000)), 10, HUGE)


def test_several_greedy_samples_are_refused_as_vllm_refuses_them():
    assert FACTS.params_for(GenerationParams(n=2, temperature=1e-5), 10, 2048).n == 2
    with pytest.raises(Refused, match="n must be 1 when using greedy sampling, got 2.") as refused:
        FACTS.params_for(GenerationParams(n=2, temperature=0), 10, 2048)
    assert refused.value.param == "n"


def test_min_tokens_past_the_rest_of_the_context_is_refused():
    with pytest.raises(Refused, match="max_tokens=the rest of the context, got 100") as refused:
        FACTS.params_for(GenerationParams(min_tokens=100), 2000, 2048)
    assert refused.value.param == "min_tokens"


def test_an_answers_tokens_at_the_limit_and_past_it():
    n = 4
    at = GenerationParams(n=n, max_tokens=MAX_ANSWER_TOKENS // n)
    assert FACTS.params_for(at, 10, HUGE) == at.__class__(**{**_fields(at), **_neutral()})
    with pytest.raises(Refused, match=f"more than the {MAX_ANSWER_TOKENS:,}") as refused:
        FACTS.params_for(GenerationParams(n=n, max_tokens=MAX_ANSWER_TOKENS // n + 1), 10, HUGE)
    assert refused.value.param == "n"


def test_an_answers_logprobs_at_the_limit_and_past_it():
    per_token = 4  # the sampled token and 3 alternatives
    at = GenerationParams(max_tokens=MAX_ANSWER_LOGPROBS // per_token, logprobs=per_token - 1)
    assert FACTS.params_for(at, 10, HUGE).logprobs == per_token - 1
    with pytest.raises(Refused, match=f"more than the {MAX_ANSWER_LOGPROBS:,} log probabilities"):
        FACTS.params_for(GenerationParams(max_tokens=MAX_ANSWER_LOGPROBS // per_token + 1, logprobs=per_token - 1),
                         10, HUGE)


def test_the_sim_gets_the_models_tokenizer_and_its_eos_where_it_fits():
    tokenizer = SimpleNamespace(eos_token_id=7)
    assert sim_answer_options("/m", tokenizer, 100) == {"tokenizer": "/m", "eos_token_id": 7}
    assert sim_answer_options("/m", tokenizer, 5) == {"tokenizer": "/m"}
    assert sim_answer_options("/m", SimpleNamespace(eos_token_id=None), 100) == {"tokenizer": "/m"}


def _fields(params: GenerationParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def _neutral() -> dict:
    return dict(VLLM_NEUTRAL)
