"""The targets of `pipeline bench run-batch-mix` judged on given figures: met, missed at
each one's limit, and not judged without vLLM; its section's text."""

from __future__ import annotations

from lab.bench import batch_sides, mix_batch, run_batch_mix
from lab.bench.harness import spread


def _side(cached: float, span: float, wall: float = 60.0) -> dict:
    by_kind = {k: {key: spread([cached]) for key in run_batch_mix.KIND_KEYS} for k in mix_batch.KINDS}
    return {**{key: spread([1.0]) for key in run_batch_mix.SIDE_KEYS}, "span_s": spread([span]),
            "wall_s": spread([wall]), "by_kind": by_kind}


def _agreement(same: int, requests: int = 100) -> dict:
    return {k: {"requests": requests, "same": same if k in mix_batch.GREEDY_KINDS else requests, "differ": [],
                "max_logprob_diff": 0.0 if k == "logprobs" else None} for k in mix_batch.KINDS}


def _figures(same: int, product_cached: float, product_span: float, product_wall: float = 60.0) -> dict:
    return {"vllm": "py", "tried": [], "requests": 400, "shapes": 36, "threads": 1, "cores": 2,
            "kinds": dict.fromkeys(mix_batch.KINDS, 100),
            "engine": batch_sides.engine_settings(3),
            "sides": {"vllm run-batch": _side(100, 5.0), "pipeline run-batch": _side(product_cached, product_span,
                                                                                    product_wall)},
            "answers": {"pairs": [_agreement(100), _agreement(same)], "vllm_self": [_agreement(100)],
                        "product_self": [_agreement(100)]}}


def test_targets_met_at_their_limits():
    # 297 of 300 greedy answers the same: 99%, the limit; cached tokens, span and wall equal.
    assert [t.met for t in run_batch_mix.judge(_figures(99, 100, 5.0))] == [True, True, True, True]


def test_targets_missed_past_their_limits():
    targets = run_batch_mix.judge(_figures(98, 99, 5.01, 60.1))
    assert [t.met for t in targets] == [False, False, False, False]
    assert targets[3].detail == "60.1 s against 60.0 s"
    assert "294 of 300" in targets[0].detail and "the worst of 2 pairs" in targets[0].detail


def test_one_kind_with_fewer_cached_tokens_misses_the_cache_target():
    figures = _figures(100, 100, 4.0)
    figures["sides"]["pipeline run-batch"]["by_kind"]["n2"]["cached_tokens"] = spread([99])
    assert [t.met for t in run_batch_mix.judge(figures)] == [True, False, True, True]


def test_nothing_is_judged_without_vllm():
    targets = run_batch_mix.judge({"vllm": None, "tried": ["x: no vllm"]})
    assert [t.met for t in targets] == [None, None, None, None] and "x: no vllm" in targets[0].detail
    assert "Not measured" in run_batch_mix.markdown({"vllm": None, "tried": ["x: no vllm"]})


def test_the_section_states_the_engine_flags_and_a_row_per_kind():
    text = run_batch_mix.markdown(_figures(99, 100, 5.0))
    for setting in ("--dtype bfloat16 ", "--max-model-len 2048 ", "--block-size 32 ", "--max-num-seqs 128 ",
                    "--kv-cache-memory-bytes 3145728 ", "KV cache 3 MiB", "1 engine thread(s) on 2 cores"):
        assert setting in text
    assert all(f"| {kind} | 100 |" in text for kind in mix_batch.KINDS)
    assert "| logprobs | 100 | 100 | 100 | 100 | 100 | 99 of 100 | 100 of 100 | 100 of 100 | 0 |" in text

