"""The mixed batch file of `pipeline bench run-batch-mix` and the comparison of two output
files' answers, on made-up output lines."""

from __future__ import annotations

import json

import pytest

from lab.bench import mix_batch


def test_the_file_mixes_every_kind_over_its_own_system_prompts():
    reqs = mix_batch.requests(40, 8, "m", seed=0)
    kinds = [mix_batch.kind_of(r["custom_id"]) for r in reqs]
    assert {k: kinds.count(k) for k in mix_batch.KINDS} == dict.fromkeys(mix_batch.KINDS, 10)
    systems = {r["body"]["messages"][0]["content"] for r in reqs}
    assert len(systems) == 8
    for r, kind in zip(reqs, kinds):
        body = r["body"]
        assert body["temperature"] == (mix_batch.SAMPLED_TEMPERATURE if kind == "n2" else 0)
        assert ("response_format" in body) == (kind == "json_schema")
        assert body.get("top_logprobs") == (mix_batch.TOP_LOGPROBS if kind == "logprobs" else None)
        assert body.get("n") == (mix_batch.SAMPLES if kind == "n2" else None)
        assert body.get("min_tokens") == (body["max_completion_tokens"] if kind == "n2" else None)
        assert "seed" not in body
    assert mix_batch.requests(40, 8, "m", seed=0) == reqs


def test_kind_of_an_id_outside_the_file_is_our_bug():
    with pytest.raises(AssertionError):
        mix_batch.kind_of("req-1-s0")


def _line(custom_id: str, texts: list[str], tokens: list[list[str]] | None = None, cached: int = 0,
          logprob: float = -1.0) -> str:
    choices = [{"index": k, "message": {"role": "assistant", "content": t},
                "logprobs": None if tokens is None else
                {"content": [{"token": x, "logprob": logprob, "top_logprobs": []} for x in tokens[k]]}}
               for k, t in enumerate(texts)]
    usage = {"prompt_tokens": 100, "completion_tokens": sum(len(t) for t in texts),
             "prompt_tokens_details": {"cached_tokens": cached}}
    return json.dumps({"custom_id": custom_id, "response": {"status_code": 200,
                                                            "body": {"choices": choices, "usage": usage}}})


def test_answers_are_the_same_token_for_token_where_greedy_and_by_count_where_sampled():
    first = mix_batch.answers_of([
        _line("r-0-s0-plain", ["ab"], cached=64), _line("r-1-s0-logprobs", ["ab"], [["a", "b"]], 32),
        _line("r-2-s1-json_schema", ["{}"]), _line("r-3-s1-n2", ["x", "y"], cached=96), ""])
    second = mix_batch.answers_of([
        _line("r-0-s0-plain", ["ab"]), _line("r-1-s0-logprobs", ["ab"], [["ab", "?"]]),
        _line("r-2-s1-json_schema", ["{]"]), _line("r-3-s1-n2", ["z", "w"])])
    got = mix_batch.agreement(first, second)
    assert {k: (v["requests"], v["same"]) for k, v in got.items()} == {
        "plain": (1, 1), "json_schema": (1, 0), "logprobs": (1, 0), "n2": (1, 1)}
    assert got["logprobs"]["differ"] == ["r-1-s0-logprobs"] and got["logprobs"]["max_logprob_diff"] is None
    assert mix_batch.greedy_share(got) == (1, 3)
    usage = mix_batch.usage_by_kind(first, 32)
    assert usage["n2"] == {"requests": 1, "prompt_tokens": 100, "cached_tokens": 96, "completion_tokens": 2,
                           "cacheable_tokens": 96}
    assert usage["logprobs"]["cached_tokens"] == 32


def test_a_logprob_difference_is_measured_where_the_tokens_agree():
    first = mix_batch.answers_of([_line("r-1-s0-logprobs", ["ab"], [["a", "b"]], logprob=-1.0)])
    second = mix_batch.answers_of([_line("r-1-s0-logprobs", ["ab"], [["a", "b"]], logprob=-1.25)])
    got = mix_batch.agreement(first, second)["logprobs"]
    assert got["same"] == 1 and got["max_logprob_diff"] == pytest.approx(0.25)


def test_a_sampled_answer_with_fewer_choices_is_not_the_same():
    first = mix_batch.answers_of([_line("r-3-s1-n2", ["x", "y"])])
    second = mix_batch.answers_of([_line("r-3-s1-n2", ["x"])])
    assert mix_batch.agreement(first, second)["n2"]["same"] == 0


def test_the_cacheable_tokens_leave_the_last_prompt_token_to_compute():
    answers = mix_batch.answers_of([_line("r-0-s0-plain", ["a"]), _line("r-1-s0-plain", ["b"])])
    assert mix_batch.usage_by_kind(answers, 50)["plain"]["cacheable_tokens"] == 2 * 50  # 100 tokens: 1 block
    assert mix_batch.usage_by_kind(answers, 33)["plain"]["cacheable_tokens"] == 2 * 99
