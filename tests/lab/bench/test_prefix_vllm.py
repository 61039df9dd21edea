"""The pure parts of `pipeline bench prefix`'s vLLM side (lab/bench/prefix_vllm.py): the
scaled template workload (every prompt fits the tiny model, its file reads back the same),
the KV cache arithmetic against the model's config, one run's figures from its report, and
the targets judged on given figures (met, missed, not judged, not run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.bench import prefix, prefix_vllm, runs
from lab.bench.harness import spread
from lab.bench.runs import BenchRunError
from pipeline.producer.demos import TemplateScale, demo_template_workload
from pipeline.producer.workload import load_workload
from tools import tiny_llama

VOCAB = tiny_llama.VOCAB_SIZE


def test_the_scale_fits_the_tiny_model_and_its_kv_arithmetic_is_the_models():
    assert prefix_vllm.MAX_MODEL_LEN == tiny_llama.MAX_POSITIONS
    assert prefix_vllm.SCALE.max_prompt_tokens + prefix_vllm.MAX_NEW_TOKENS <= prefix_vllm.MAX_INPUT_LEN
    assert prefix_vllm.SCALE.shapes >= 16 and prefix_vllm.BATCH_TOKENS >= prefix_vllm.MAX_INPUT_LEN
    # bfloat16 K and V of every layer and KV head.
    assert prefix_vllm.KV_BYTES_PER_TOKEN == 2 * tiny_llama.NUM_LAYERS * tiny_llama.NUM_KV_HEADS * tiny_llama.HEAD_DIM * 2
    # The small cache holds at least one longest request (vLLM refuses less), the large all prefixes.
    small, large = ((mib << 20) // prefix_vllm.KV_BYTES_PER_TOKEN for mib in prefix_vllm.CACHES_MIB)
    assert small >= prefix_vllm.MAX_MODEL_LEN
    items = list(prefix_vllm.scaled_workload(prefix_vllm.ITEMS, VOCAB))
    prefixes = {i.signature: i.prefix_len for i in items}
    assert len(prefixes) == prefix_vllm.SCALE.shapes
    assert small < sum(prefixes.values()) < large  # a few fit in the small one, all in the large one
    assert "kv_cache_memory_bytes=3145728" in prefix_vllm.engine_options(3)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), items=st.integers(1, 400))
def test_every_prompt_of_the_scaled_workload_fits_and_stays_in_the_vocabulary(seed, items):
    for item in prefix_vllm.scaled_workload(items, VOCAB, seed=seed):
        assert item.length <= prefix_vllm.SCALE.max_prompt_tokens <= prefix_vllm.MAX_INPUT_LEN
        assert int(item.tokens.max()) < VOCAB and int(item.tokens.min()) >= 0


@settings(max_examples=25, deadline=None)
@given(shapes=st.integers(1, 6), group=st.integers(1, 3), low=st.integers(1, 50), span=st.integers(0, 50),
       user=st.integers(1, 60), seed=st.integers(0, 1000))
def test_max_prompt_tokens_bounds_every_prompt_of_any_scale(shapes, group, low, span, user, seed):
    scale = TemplateScale(shapes=shapes * group, group=group, component_min_tokens=low,
                          component_max_tokens=low + span, user_median_tokens=max(1, user // 4), user_max_tokens=user)
    longest = max(i.length for i in demo_template_workload(60, seed=seed, scale=scale))
    # Reference: two components of at most component_max_tokens, a user part of at most user_max_tokens.
    assert longest <= 2 * (low + span) + user == scale.max_prompt_tokens


def test_the_written_file_reads_back_as_the_same_items(tmp_path: Path):
    workload = prefix_vllm.scaled_workload(150, VOCAB)
    shape = prefix_vllm.write_workload(workload, tmp_path / "w.jsonl")
    back = list(load_workload(str(tmp_path / "w.jsonl")))
    mine = list(workload)
    assert [(i.tokens.tobytes(), i.signature, i.payload, i.timestamp_ms) for i in back] == [
        (i.tokens.tobytes(), i.signature, i.payload, i.timestamp_ms) for i in mine]
    assert shape["items"] == 150 and shape["input_tokens"] == workload.total_tokens
    assert shape["longest_prompt"] == max(i.length for i in mine) and shape["shapes"] == len(shape["prefix_tokens"])


def report(hits: tuple[int, int], queries: tuple[int, int], errors: int = 0, agree: bool | None = True) -> dict:
    return {"items_error": errors, "engine_counters_agree": agree, "prefix_reuse": 0.5, "makespan_s": 2.0,
            "busy_fraction": 0.7, "shape_switches": 16, "wall_s": 14.0, "per_consumer": {
                f"c{k}": {"engine_prefix_cache_hits": h, "engine_prefix_cache_queries": q, "busy_fraction": 0.6 + k / 10}
                for k, (h, q) in enumerate(zip(hits, queries))}}


def test_run_figures_sum_vllms_own_counters_and_refuse_a_run_without_clean_ones():
    got = prefix_vllm.run_figures(report((30, 10), (40, 60)))
    assert got["vllm_reuse"] == 0.4 and got["busy_min"] == 0.6 and got["makespan_s"] == 2.0
    for bad in (report((0,), (0,)), report((1,), (2,), errors=1), report((1,), (2,), agree=False)):
        with pytest.raises(BenchRunError):
            prefix_vllm.run_figures(bad)


def row(reuse: float, makespan: float, busy: float) -> dict:
    return {"vllm_reuse": spread([reuse]), "makespan_s": spread([makespan]), "busy_min": spread([busy])}


def vllm_figures(policies: dict[str, dict]) -> dict:
    return {"python": "py", "caches": {"3": {"cache_tokens": 3072, "bound": 0.95, "policies": policies}}}


def test_vllm_targets_met_missed_not_engine_bound_and_not_run():
    met = prefix_vllm.judge(vllm_figures({runs.DEFAULT_POLICY: row(0.9, 2, 0.9), "fifo": row(0.8, 3, 0.9)}))
    assert [t.met for t in met] == [True, True] and "3 MiB (3,072 tokens)" in met[0].name
    assert "vLLM's prefix reuse" in met[0].name and "bound 95.0%" in met[0].detail
    missed = prefix_vllm.judge(vllm_figures({runs.DEFAULT_POLICY: row(0.8, 3, 0.9), "fifo": row(0.8, 2, 0.9)}))
    assert [t.met for t in missed] == [False, False] and "not behind: fifo" in missed[0].detail
    loose = prefix_vllm.judge(vllm_figures({runs.DEFAULT_POLICY: row(0.9, 2, 0.7), "fifo": row(0.8, 3, 0.9)}))
    assert loose[1].met is None and "not engine-bound: default's least busy consumer 70%" in loose[1].detail
    no_baseline = prefix_vllm.judge(vllm_figures({runs.DEFAULT_POLICY: row(0.9, 2, 0.9), "fifo": row(0.8, 3, 0.5)}))
    assert no_baseline[1].met is None and "no baseline" in no_baseline[1].detail
    absent = prefix_vllm.judge({"python": None, "tried": ["x: no vllm"]})
    assert [t.met for t in absent] == [None] and "x: no vllm" in absent[0].detail
    assert "x: no vllm" in prefix_vllm.markdown({"python": None, "tried": ["x: no vllm"]})


def test_the_vllm_side_is_a_comparison_of_its_own_and_the_sim_side_judges_only_its_workloads():
    from lab.bench import COMPARISON_MODULES, comparison

    assert comparison("prefix-vllm") is prefix_vllm.COMPARISON and "prefix-vllm" in COMPARISON_MODULES
    sim = {"prefix_reuse": spread([0.8]), "makespan_s": spread([1.0]), "busy_min": spread([0.9])}
    base = {"prefix_reuse": spread([0.5]), "makespan_s": spread([2.0]), "busy_min": spread([0.9])}
    figures = {"workloads": {"w": {"caches": {"1024": {"bound": 0.9, "policies": {"default": sim, "fifo": base}}}}}}
    assert [t.met for t in prefix.judge(figures)] == [True, True]
    ran = vllm_figures({runs.DEFAULT_POLICY: row(0.9, 2, 0.9), "fifo": row(0.95, 3, 0.9)})
    assert prefix_vllm.plot({"python": None, "tried": []}) is None and callable(prefix_vllm.plot(ran))


def test_where_all_prefixes_fit_two_consumers_run_and_the_table_says_so():
    # With one consumer every order reaches the bound where all fit (nothing to tell apart);
    # two make where each shape runs count, as on the sim lines.
    small, large = prefix_vllm.CACHES_MIB
    assert (prefix_vllm.CONSUMERS[small], prefix_vllm.CONSUMERS[large]) == (1, 2)
    full = {"vllm_reuse": spread([0.9]), "prefix_reuse": spread([0.9]), "makespan_s": spread([2.0]),
            "busy_fraction": spread([0.7]), "busy_min": spread([0.6]), "shape_switches": spread([16]),
            "wall_s": spread([14.0])}
    figures = {"python": "py", "threads": 2, "max_model_len": 2048, "block_tokens": 32, "max_new_tokens": 2,
               "scale": "s", "batch_tokens": 6144, "repeat": 2, "seconds": 10,
               "workload": {"items": 10, "shapes": 2, "input_tokens": 100, "longest_prompt": 20,
                            "prefix_tokens": [5, 7]},
               "caches": {str(mib): {"cache_tokens": mib * 1024, "consumers": prefix_vllm.CONSUMERS[mib],
                                     "bound": 0.95, "arrival_order": 0.5, "policies": {runs.DEFAULT_POLICY: full}}
                          for mib in prefix_vllm.CACHES_MIB}}
    text = prefix_vllm.markdown(figures)
    assert f"| {small} MiB (3,072 tokens) | 1 | 95.0 |" in text and f"| {large} MiB (32,768 tokens) | 2 | 95.0 |" in text
