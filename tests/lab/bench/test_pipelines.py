"""lab/bench/pipelines.py: the pure helpers against reference computations, and one
real pipeline (broker, two sim consumers, flood producers) that must count every item and
leave nothing behind."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab.bench.harness import spread
from lab.bench.pipelines import (
    FLOOD_CALL_ITEMS,
    FLOOD_PREFIX_TOKENS,
    FLOOD_TOKENS,
    Pipeline,
    PipelineSpec,
    cores_by_role,
    flood_arrays,
    flood_targets,
    latencies_ms,
    paced,
    padding_efficiency,
    percentiles_ms,
    scaled,
)
from pipeline.broker.peers import namespace_for, object_prefix
from pipeline.runtime.processes import memory_tier_dir
from shm.objects import named_objects

batches = st.lists(st.lists(st.integers(1, 5000), min_size=1, max_size=20), min_size=1, max_size=20)


@given(batches)
def test_padding_efficiency_is_real_over_padded_tokens(groups):
    real = sum(sum(g) for g in groups)
    padded = sum(len(g) * max(g) for g in groups)
    assert padding_efficiency(groups) == pytest.approx(real / padded)
    assert 0 < padding_efficiency(groups) <= 1


def test_padding_efficiency_examples_and_empty():
    assert padding_efficiency([[10, 10], [4]]) == 1.0
    assert padding_efficiency([[1, 3]]) == pytest.approx(4 / 6)
    assert padding_efficiency([[], [2, 4]]) == pytest.approx(6 / 8)  # an empty batch counts nothing
    with pytest.raises(ValueError):
        padding_efficiency([])
    with pytest.raises(ValueError):
        padding_efficiency([[]])


def test_percentiles_ms_against_numpy_and_empty():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    got = percentiles_ms(values)
    assert got == {"items": 5, "p50_ms": 3.0, "p99_ms": pytest.approx(np.percentile(values, 99)), "max_ms": 5.0}
    with pytest.raises(ValueError):
        percentiles_ms([])


def test_latencies_are_done_less_submit_in_ms():
    assert latencies_ms([{"submit_ns": 1_000_000, "done_ns": 3_500_000}]) == [2.5]


def test_cores_by_role_sums_processes_of_a_role_over_wall_time():
    cores = cores_by_role({"broker": 2.0, "consumer 0": 1.0, "consumer 1": 3.0, "producer 0": 0.5}, 2.0)
    assert cores == {"broker": 1.0, "consumer": 2.0, "producer": 0.25, "all": 3.25}


def test_scaled_scales_every_figure_of_a_spread():
    assert scaled(spread([1.0, 3.0, 2.0]), 10.0) == spread([10.0, 30.0, 20.0])


def test_flood_arrays_shapes_prefixes_and_a_smaller_count_is_a_head():
    signatures, tokens, shapes = flood_arrays(3)
    assert signatures.shape == shapes.shape == (FLOOD_CALL_ITEMS,) and tokens.dtype == np.int32
    rows = tokens.reshape(FLOOD_CALL_ITEMS, FLOOD_TOKENS)
    for shape in np.unique(shapes):
        mine = rows[shapes == shape]
        assert (mine[:, :FLOOD_PREFIX_TOKENS] == mine[0, :FLOOD_PREFIX_TOKENS]).all()  # one prefix a shape
        assert len(set(signatures[shapes == shape].tolist())) == 1
    assert len(set(signatures.tolist())) == len(np.unique(shapes))
    head = flood_arrays(3, 10)
    assert (head[0] == signatures[:10]).all() and (head[1] == tokens[:10 * FLOOD_TOKENS]).all()


@pytest.mark.parametrize("items, producers", [(10, 3), (9, 3), (1, 4)])
def test_flood_targets_share_every_item(items, producers):
    targets = flood_targets("/sock", producers, items)
    assert len(targets) == producers and sum(args[1] for _, args in targets) == items
    assert len({args[2] for _, args in targets}) == producers  # a seed each


@pytest.mark.integration
@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_a_pipeline_completes_every_item_and_leaves_nothing(tmp_path, storage):
    root = tmp_path / "run"
    with Pipeline(root, PipelineSpec(storage, "process", consumers=2, batch_items=64)) as pipe:
        data_dir = pipe.data_dir
        flood_phase = pipe.run_producers(flood_targets(pipe.socket_path, 2, 5000), 5000)
        paced_phase = pipe.run_producers([(paced, (pipe.socket_path, 50, 2000.0, 7))], 50)
        rows = [row for rows in pipe.results().values() for row in rows]
        processes = [pipe.broker, *pipe.consumers]
    assert (flood_phase.items, flood_phase.tokens) == (5000, 5000 * FLOOD_TOKENS)
    assert (paced_phase.items, paced_phase.tokens) == (50, 50 * FLOOD_TOKENS)
    assert {"broker", "consumer 0", "consumer 1", "producer 0", "producer 1"} == set(flood_phase.cpu_s)
    assert len(rows) == 5050 and len({row["item_id"] for row in rows}) == 5050
    assert all(wait >= 0 for wait in latencies_ms(rows))
    assert not any(p.is_alive() for p in processes)
    assert not root.exists() and not os.path.exists(memory_tier_dir(data_dir))
    shared, semaphores = named_objects(object_prefix(namespace_for(data_dir)))
    assert not shared and not semaphores
