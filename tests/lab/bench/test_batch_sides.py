"""The run-batch comparisons' sides: one list of vLLM flags for both command lines, the
product's own options kept apart, and the engine threads both sides get."""

from __future__ import annotations

import os

import pytest

from lab.bench import batch_sides


def test_both_sides_get_the_same_vllm_flags_and_the_product_its_own_options_apart():
    flags = batch_sides.vllm_flags({**batch_sides.engine_settings(3), "in_process": True})
    assert flags[:3] == ["--load-format", "dummy", "--enforce-eager"]
    assert flags[flags.index("--max-num-batched-tokens") + 1] == str(batch_sides.MAX_NUM_BATCHED_TOKENS)
    assert not any("in-process" in f for f in flags)


def test_a_false_setting_is_our_bug():
    with pytest.raises(AssertionError):
        batch_sides.vllm_flags({"enforce_eager": False})


def test_the_engine_threads_keep_a_core_for_the_processes_around_the_engine():
    cores = len(os.sched_getaffinity(0))
    assert batch_sides.engine_threads() == max(1, cores - 1)
