"""pipeline.consumer.engines.sim_sampling and the sim engine with parameters: the shape of a
real answer, made up and deterministic: n samples, an end of sequence, max and min tokens,
stop strings and token ids, ignore_eos, logprobs of the asked size."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.consumer.engines.base import FINISH_LENGTH, FINISH_STOP, EngineBatch
from pipeline.consumer.engines.sim import SimEngine
from pipeline.consumer.engines.sim_sampling import MadeUpSampler, SimRefusal
from pipeline.wire.generation import GenerationParams

EOS = 1
VOCAB = 64


def _decode(ids: list[int], skip_special_tokens: bool) -> str:
    """A toy tokenizer: token t is the letter chr(ord('a') + t % 26), the eos is "<eos>"."""
    return "".join("" if t == EOS and skip_special_tokens else "<eos>" if t == EOS else chr(97 + t % 26)
                   for t in ids)


SAMPLER = MadeUpSampler(natural_tokens=4, vocab_size=VOCAB, eos_token_id=EOS, decode=_decode)


def one(params: GenerationParams, seed: int = 12345, sampler: MadeUpSampler = SAMPLER):
    return sampler.samples(seed, params)


def test_a_made_up_answer_ends_with_the_eos_after_its_natural_length():
    (sample,) = one(GenerationParams(max_tokens=100))
    assert sample.token_ids[-1] == EOS and len(sample.token_ids) == 5 and sample.finish_reason == FINISH_STOP
    assert sample.text == _decode(sample.token_ids[:-1], True) and sample.logprobs is None
    assert one(GenerationParams(max_tokens=100)) == [sample]  # deterministic


def test_max_tokens_cuts_it_and_ignore_eos_runs_to_max_tokens():
    (short,) = one(GenerationParams(max_tokens=3))
    assert len(short.token_ids) == 3 and short.finish_reason == FINISH_LENGTH
    (long,) = one(GenerationParams(max_tokens=40, ignore_eos=True))
    assert len(long.token_ids) == 40 and long.finish_reason == FINISH_LENGTH
    (at,) = one(GenerationParams(max_tokens=5))  # the eos is the 5th token: a stop, not a length
    assert at.finish_reason == FINISH_STOP


def test_min_tokens_holds_the_eos_and_stop_tokens_back():
    (sample,) = one(GenerationParams(max_tokens=100, min_tokens=9, stop_token_ids=tuple(range(2, 40))))
    assert len(sample.token_ids) >= 10 and all(t not in range(1, 40) for t in sample.token_ids[:9])


def test_a_stop_token_id_ends_the_answer_there():
    (free,) = one(GenerationParams(max_tokens=100, ignore_eos=True))
    stop = free.token_ids[2]
    (sample,) = one(GenerationParams(max_tokens=100, ignore_eos=True, stop_token_ids=(stop,)))
    first = free.token_ids.index(stop)
    assert sample.token_ids == free.token_ids[:first + 1] and sample.finish_reason == FINISH_STOP
    assert sample.text == _decode(free.token_ids[:first], True)  # the stop token's text left out
    (kept,) = one(GenerationParams(max_tokens=100, ignore_eos=True, stop_token_ids=(stop,),
                                   include_stop_str_in_output=True))
    assert kept.text == _decode(free.token_ids[:first + 1], True)


def test_a_stop_string_cuts_the_tokens_and_the_text():
    (free,) = one(GenerationParams(max_tokens=30, ignore_eos=True))
    stop = free.text[6:8]
    (sample,) = one(GenerationParams(max_tokens=30, ignore_eos=True, stop=(stop,)))
    at = free.text.index(stop)
    assert sample.text == free.text[:at] and sample.finish_reason == FINISH_STOP
    assert sample.token_ids == free.token_ids[:at + len(stop)]  # one letter a token: up to the string's end
    (kept,) = one(GenerationParams(max_tokens=30, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True))
    assert kept.text == free.text[:at + len(stop)]


def test_special_tokens_stay_in_the_text_where_asked():
    (sample,) = one(GenerationParams(max_tokens=100, skip_special_tokens=False, include_stop_str_in_output=True))
    assert sample.text.endswith("<eos>")


def test_n_samples_differ_when_sampling_and_agree_when_greedy():
    samples = one(GenerationParams(max_tokens=20, n=3, temperature=0.8, seed=7))
    assert len(samples) == 3 and len({tuple(s.token_ids) for s in samples}) == 3
    assert one(GenerationParams(max_tokens=20, n=3, temperature=0.8, seed=8)) != samples  # the seed counts
    greedy = one(GenerationParams(max_tokens=20, n=3, temperature=0))
    assert len({tuple(s.token_ids) for s in greedy}) == 1


@pytest.mark.parametrize("count", [0, 1, 5])
def test_logprobs_of_the_asked_size_the_sampled_token_first(count):
    (sample,) = one(GenerationParams(max_tokens=6, ignore_eos=True, logprobs=count))
    assert len(sample.logprobs) == len(sample.token_ids)
    for token, entries in zip(sample.token_ids, sample.logprobs):
        assert len(entries) == max(count, 1) and entries[0][0] == token
        assert len({e[0] for e in entries}) == len(entries)
        assert [e[1] for e in entries] == sorted((e[1] for e in entries), reverse=True)
        assert all(e[2] == _decode([e[0]], False) for e in entries)


def test_stop_strings_without_a_tokenizer_are_refused_saying_why():
    bare = MadeUpSampler(natural_tokens=4, vocab_size=VOCAB, eos_token_id=EOS)
    with pytest.raises(SimRefusal, match="no tokenizer"):
        bare.samples(1, GenerationParams(stop=("x",)))
    (sample,) = bare.samples(1, GenerationParams(max_tokens=10))
    assert sample.text is None and len(sample.token_ids) == 5


def test_the_engine_returns_first_samples_as_outputs_every_sample_where_asked_and_refusals_as_errors():
    prompts = [np.arange(k, k + 20, dtype=np.int32) for k in range(4)]
    params = [None, GenerationParams(max_tokens=3), GenerationParams(max_tokens=9, n=2, temperature=1.0),
              GenerationParams(stop=("x",))]
    result = SimEngine(vocab_size=VOCAB, eos_token_id=EOS).run(EngineBatch(prompts, 24, [0] * 4, params))
    assert len(result.outputs[0]) == 4 and result.finish_reasons[0] == FINISH_LENGTH  # no parameters: as ever
    assert len(result.outputs[1]) == 3 and result.samples[1] is None
    pair = result.samples[2]
    assert len(pair) == 2 and result.outputs[2] == pair[0].token_ids
    assert result.errors == [None, None, None, result.errors[3]] and "no tokenizer" in result.errors[3]
    assert result.outputs[3] == [] and result.cached_tokens[3] == 0
    assert result.counted.output_tokens == 4 + 3 + sum(len(s.token_ids) for s in pair)


def _wide(chars_per_token: int) -> MadeUpSampler:
    """A sampler whose every token decodes to `chars_per_token` characters (a decoder that
    expands tokens), its lengths known without building the texts."""
    return MadeUpSampler(natural_tokens=4, vocab_size=VOCAB, eos_token_id=EOS,
                         decode=lambda ids, skip: "x" * chars_per_token * len(ids),
                         token_chars=lambda token: chars_per_token)


def test_logprob_tokens_count_into_the_answer_s_characters_before_they_are_made():
    from pipeline.wire.generation import MAX_ANSWER_TEXT_CHARS

    # 4 tokens of text and 4 x 4 logprob tokens: 20 tokens' characters in the answer.
    params = GenerationParams(max_tokens=4, ignore_eos=True, logprobs=4)
    (sample,) = one(params, sampler=_wide(MAX_ANSWER_TEXT_CHARS // 20))
    assert len(sample.logprobs) == 4 and len(sample.text) == 4 * (MAX_ANSWER_TEXT_CHARS // 20)
    with pytest.raises(SimRefusal, match="and its logprob tokens to more than"):
        one(params, sampler=_wide(MAX_ANSWER_TEXT_CHARS // 20 + 1))


def test_a_batch_s_answers_together_stay_within_their_budget():
    from pipeline.consumer.engines.sim_sampling import MAX_BATCH_ANSWER_CHARS, CharBudget

    params = GenerationParams(max_tokens=4, ignore_eos=True)
    sampler, budget = _wide(MAX_BATCH_ANSWER_CHARS // 64), CharBudget()  # an answer: 1/16 of the budget
    for seed in range(16):
        sampler.samples(seed, params, budget)
    assert budget.left == 0
    with pytest.raises(SimRefusal, match=f"more than {MAX_BATCH_ANSWER_CHARS:,} characters together"):
        sampler.samples(16, params, budget)
    assert budget.left == 0  # a refused answer charges nothing
    assert len(sampler.samples(16, params)[0].text) == MAX_BATCH_ANSWER_CHARS // 16  # alone it fits


def _rows(rows: list[list[int]], skip: bool) -> list[str]:
    return [_decode(ids, skip) for ids in rows]


def test_plain_many_makes_exactly_what_samples_makes_item_by_item():
    """Property, against the reference (`samples`, one item at a time): every plain
    parameter set, with and without an eos and a decoder, a budget charged the same."""
    from pipeline.consumer.engines.sim_sampling import CharBudget, is_plain

    rng = np.random.default_rng(7)
    samplers = [MadeUpSampler(natural_tokens=k, vocab_size=v, eos_token_id=e, decode=d, decode_rows=r)
                for k in (0, 1, 4) for v, e in ((VOCAB, EOS), (2, 0), (VOCAB, None))
                for d, r in ((_decode, _rows), (None, None))]
    for trial in range(300):
        sampler = samplers[trial % len(samplers)]
        params = GenerationParams(max_tokens=None if rng.random() < 0.2 else int(rng.integers(1, 12)),
                                  ignore_eos=bool(rng.random() < 0.4), temperature=float(rng.choice([0.0, 0.7])),
                                  seed=None if rng.random() < 0.5 else int(rng.integers(-9, 9)),
                                  skip_special_tokens=bool(rng.random() < 0.5),
                                  include_stop_str_in_output=bool(rng.random() < 0.5))
        assert is_plain(params)
        seeds = rng.integers(0, 1 << 63, size=int(rng.integers(1, 9))).tolist()
        bulk_budget, one_budget = CharBudget(), CharBudget()
        made = sampler.plain_many(seeds, params, bulk_budget)
        expected = [sampler.samples(seed, params, one_budget)[0] for seed in seeds]
        assert made == expected, (trial, params)
        assert bulk_budget.left == one_budget.left


def test_plain_many_leaves_a_batch_that_could_be_refused_to_the_item_by_item_path():
    from pipeline.consumer.engines.sim_sampling import MAX_BATCH_ANSWER_CHARS, CharBudget, is_plain

    wide = MadeUpSampler(natural_tokens=4, vocab_size=VOCAB, eos_token_id=EOS,
                         decode=lambda ids, skip: "x" * (MAX_BATCH_ANSWER_CHARS // 64) * len(ids),
                         decode_rows=lambda rows, skip: ["x" * (MAX_BATCH_ANSWER_CHARS // 64) * len(r) for r in rows])
    params = GenerationParams(max_tokens=4, ignore_eos=True)
    budget = CharBudget()
    assert wide.plain_many(list(range(16)), params, budget) is not None and budget.left == 0
    assert wide.plain_many([16], params, budget) is None and budget.left == 0  # nothing charged
    failing = MadeUpSampler(natural_tokens=4, vocab_size=VOCAB, eos_token_id=EOS, decode=_decode,
                            decode_rows=lambda rows, skip: None)
    assert failing.plain_many([1, 2], params, CharBudget()) is None
    no_rows = MadeUpSampler(natural_tokens=4, vocab_size=VOCAB, eos_token_id=EOS, decode=_decode)
    assert no_rows.plain_many([1], params, CharBudget()) is None  # a decoder without rows: item by item
    assert not any(is_plain(p) for p in (GenerationParams(n=2), GenerationParams(stop=("a",)),
                                         GenerationParams(stop_token_ids=(3,)), GenerationParams(min_tokens=1),
                                         GenerationParams(logprobs=0), GenerationParams(embed=True, input_lengths=(3,))))


def test_a_batch_of_plain_items_gets_the_same_answers_as_one_of_mixed_items(tmp_path):
    """The sim engine makes a batch whose items are all plain at once, any other item by
    item: the plain items' answers are the same either way."""
    from tests.support.jobs import build_model

    engine = SimEngine(tokenizer=build_model(tmp_path / "model"), vocab_size=2048, eos_token_id=2)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 2000, size=int(rng.integers(3, 40))).astype(np.int32) for _ in range(12)]
    plain = [GenerationParams(max_tokens=int(m), ignore_eos=bool(m % 2)) for m in rng.integers(1, 20, size=12)]
    together = engine.run(EngineBatch(prompts, 40, [0] * 12, plain))
    mixed = engine.run(EngineBatch(prompts + prompts[:1], 40, [0] * 13, plain + [GenerationParams(n=2)]))
    assert together.outputs == mixed.outputs[:12] and together.texts == mixed.texts[:12]
    assert together.finish_reasons == mixed.finish_reasons[:12] and together.errors is None
