"""The pure parts of `pipeline bench padding`, `prefix` and `run-batch`: the analyzer's bound
picked from its JSON, the sim's cost options, the targets judged on given figures (met,
missed, not judged), the log-normal workload file, the vLLM probe, and a chart drawn."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lab.bench import padding, prefix, run_batch, runs
from lab.bench.charts import Panel, grouped_bars
from lab.bench.harness import spread
from pipeline.producer.workload import load_workload


def test_bounds_of_takes_the_better_order_per_cache_size():
    data = {"items": 3, "input_tokens": 100, "shapes": {"count": 2}, "reuse": [
        {"order": "arrival", "cache_tokens": 64, "caches": 2, "reuse": 0.2},
        {"order": "prefix-sorted", "cache_tokens": 64, "caches": 2, "reuse": 0.5},
        {"order": "prefix-sorted", "cache_tokens": 64, "caches": 1, "reuse": 0.9},
        {"order": "arrival", "cache_tokens": 128, "caches": 2, "reuse": 0.7}]}
    got = runs.bounds_of(data, [64, 128], 2)
    assert got["bounds"] == {64: 0.5, 128: 0.7} and got["arrival"] == {64: 0.2, 128: 0.7}
    with pytest.raises(runs.BenchRunError):
        runs.bounds_of(data, [256], 2)


def test_sim_cost_options_keep_the_batch_to_token_ratio():
    assert runs.sim_cost_options(1e-5, 32768, 16) == (
        "cost_s_per_padded_token=1e-05,cost_s_per_batch=0.0005,block_size_tokens=16,capacity_tokens=32768")
    assert "capacity_tokens" not in runs.sim_cost_options(2e-6, None, 512)


def row(reuse: float, makespan: float, busy: float) -> dict:
    return {"prefix_reuse": spread([reuse]), "makespan_s": spread([makespan]), "busy_min": spread([busy])}


def prefix_figures(policies: dict[str, dict]) -> dict:
    return {"workloads": {"w": {"caches": {"1024": {"bound": 0.9, "policies": policies}}}}}


def test_prefix_targets_met_missed_and_not_judged():
    met = prefix.judge(prefix_figures({"default": row(0.8, 10, 0.9), "fifo": row(0.5, 12, 0.9)}))
    assert [t.met for t in met] == [True, True]  # reuse, makespan (vLLM: pipeline bench prefix-vllm)
    missed = prefix.judge(prefix_figures({"default": row(0.5, 12, 0.9), "fifo": row(0.5, 10, 0.9)}))
    assert [t.met for t in missed[:2]] == [False, False] and "fifo" in missed[0].detail
    # A default run that is not GPU-bound: its makespan is not judged.
    loose = prefix.judge(prefix_figures({"default": row(0.8, 10, 0.5), "fifo": row(0.5, 12, 0.9)}))
    assert loose[1].met is None and "not GPU-bound" in loose[1].detail
    # A baseline that is not GPU-bound is left out of the makespan comparison.
    only_bound = prefix.judge(prefix_figures({"default": row(0.8, 10, 0.9), "fifo": row(0.5, 9, 0.5),
                                              "round-robin": row(0.5, 11, 0.9)}))
    assert only_bound[1].met is True


def padding_figures(lanes: float, optimum: float, real: float) -> dict:
    return {"workloads": {"w": {"offline": {padding.LANES: {"efficiency": lanes},
                                            padding.OPTIMUM: {"efficiency": optimum}},
                                "real": {"default": {"efficiency": spread([real])}}}}}


def test_padding_targets():
    assert [t.met for t in padding.judge(padding_figures(0.99, 0.995, 0.99))] == [True, True]
    assert [t.met for t in padding.judge(padding_figures(0.97, 0.995, 0.98))] == [False, False]


def test_lognormal_file_is_one_shape_of_lengths_within_the_launch_limit(tmp_path: Path):
    workload = load_workload(str(padding.lognormal_file(tmp_path / "w.jsonl", 300)))
    items = list(workload)
    assert len(items) == 300 and {len(i.components) for i in items} == {0}
    lengths = [i.length for i in items]
    assert max(lengths) <= padding.LAUNCH_MAX_INPUT_LEN and 300 < sorted(lengths)[150] < 800


def test_run_batch_targets():
    absent = run_batch.judge({"vllm": None, "tried": ["x: no vllm"]})
    assert [t.met for t in absent] == [None, None] and "x: no vllm" in absent[0].detail

    def side(cached: float, span: float) -> dict:
        return {"cached_tokens": spread([cached]), "span_s": spread([span])}
    figures = {"vllm": "py", "sides": {"vllm run-batch": side(100, 5), "pipeline run-batch": side(300, 4)}}
    assert [t.met for t in run_batch.judge(figures)] == [True, True]
    figures["sides"]["pipeline run-batch"] = side(150, 6)
    assert [t.met for t in run_batch.judge(figures)] == [False, False]


@pytest.mark.skipif("vllm" in sys.modules or __import__("importlib").util.find_spec("vllm") is not None,
                    reason="this interpreter has vllm")
def test_quick_looks_only_at_this_interpreter():
    python, tried = run_batch.vllm_python(quick=True)
    assert python is None and len(tried) == 2


@pytest.mark.integration  # matplotlib runs fc-list the first time it builds its font cache
def test_a_chart_is_drawn(tmp_path: Path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "c.png"
    grouped_bars(path, "t", [Panel("p", "%", ["a", "b"], ["x", "y"], [[(1, 0.5, 2), None], [(3, 3, 3), (2, 1, 2)]])])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(padding_figures(1, 1, 1))  # figures are JSON-able
