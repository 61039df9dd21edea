"""The vllm engine: its options (checked without vLLM), and, marked `vllm`, the engine on the
tiny CPU model (tools/tiny_llama.py) against vLLM's own counters.

The `vllm` tests run in .venv-vllm (`python3 quickstart.py test-vllm` builds it and runs
them); elsewhere they skip, naming that command. They assert on counters, never on time:
vLLM's counters repeat exactly, its wall times on this shared machine vary tenfold.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import pytest

from pipeline.consumer.engines import ENGINES, EngineBatch, make_engine
from pipeline.consumer.engines import vllm as vllm_engine
from pipeline.consumer.engines import vllm_options
from pipeline.consumer.engines.vllm import VllmEngine, VllmOptions
from pipeline.wire.errors import EngineOptionsError, EngineUnavailableError
from tests.support.tiny_vllm import BLOCK, ENGINE_OPTIONS, MAX_MODEL_LEN, MODEL_DIR, TOKEN_HIGH, TOKEN_LOW


@pytest.fixture
def installed(monkeypatch):
    """As if vLLM were installed: the options are checked the same way."""
    monkeypatch.setattr(vllm_engine, "vllm_installed", lambda: True)


def test_vllm_is_an_engine_and_making_one_imports_nothing_of_vllm(installed):
    assert ENGINES["vllm"] is VllmEngine
    had = "vllm" in sys.modules
    engine = make_engine("vllm", model="some/dir", kv_cache_memory_bytes=1 << 30)
    engine.close()  # the launcher's settings check: made and closed, no batch, nothing loaded
    assert engine._llm is None
    assert ("vllm" in sys.modules) == had


def test_unknown_and_wrong_options_are_refused_by_name(installed):
    with pytest.raises(EngineOptionsError, match="unknown options bogus, gpu"):
        make_engine("vllm", model="m", bogus=1, gpu=2)
    with pytest.raises(EngineOptionsError, match="model .* is required"):
        make_engine("vllm")
    cases = [
        (dict(block_size=0), "block_size must be a positive integer"),
        (dict(max_model_len=True), "max_model_len must be a positive integer"),
        (dict(kv_cache_memory_bytes=1, gpu_memory_utilization=0.5), "not both"),
        (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
        (dict(top_p=0), "top_p"),
        (dict(temperature=-1), "temperature"),
        (dict(enforce_eager="yes"), "enforce_eager must be true or false"),
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be a positive integer"),
        (dict(llm_kwargs={"enable_prefix_caching": False}), "llm_kwargs may not set enable_prefix_caching"),
        (dict(llm_kwargs={"block_size": 64}), "llm_kwargs may not set block_size"),
    ]
    for options, message in cases:
        with pytest.raises(EngineOptionsError, match=message):
            make_engine("vllm", model="m", **options)
    assert isinstance(EngineOptionsError("x"), ValueError)  # the launcher's settings check catches it


def test_the_llm_keywords_carry_the_accounting_settings():
    kwargs = VllmOptions.parse(dict(model="m", kv_cache_memory_bytes=5, llm_kwargs={"max_num_seqs": 8})).llm_kwargs_all()
    assert kwargs["enable_prefix_caching"] is True and kwargs["disable_log_stats"] is False
    assert kwargs["block_size"] == vllm_options.DEFAULT_BLOCK_SIZE_TOKENS and kwargs["kv_cache_memory_bytes"] == 5
    assert kwargs["runner"] == "auto"  # vLLM's default: by the model's architecture
    assert "distributed_executor_backend" not in kwargs and kwargs["max_num_seqs"] == 8  # vLLM's own default
    assert "gpu_memory_utilization" not in kwargs
    inside = VllmOptions.parse(dict(model="m", in_process=True)).llm_kwargs_all()
    assert inside["distributed_executor_backend"] == "uni"  # one GPU, stepped in the consumer's process
    for in_process in (True, False):  # an engine over several GPUs: one worker process per GPU, either way
        multi = VllmOptions.parse(dict(model="m", tensor_parallel_size=2, pipeline_parallel_size=2,
                                       in_process=in_process)).llm_kwargs_all()
        assert multi["distributed_executor_backend"] == "mp"
        assert (multi["tensor_parallel_size"], multi["pipeline_parallel_size"]) == (2, 2)


def test_vllms_sockets_stay_where_their_names_fit_a_socket_path():
    longest = "/" + "t" * (vllm_engine.UNIX_SOCKET_PATH_MAX_CHARS - vllm_engine.RPC_SOCKET_NAME_CHARS - 1)
    assert vllm_engine.rpc_directory(longest) == longest  # at the limit: DIR/UUID4 is 107 characters
    assert vllm_engine.rpc_directory(longest + "t") == "/tmp"


def test_without_vllm_the_engine_is_refused_with_the_command_that_installs_it(monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_installed", lambda: False)
    with pytest.raises(EngineUnavailableError, match="quickstart.py test-vllm"):
        make_engine("vllm", model="m")


def test_the_tiny_model_config():
    from tools.tiny_llama import llama_config

    config = llama_config(4096)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 4096
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] == 32


# --- on vLLM ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    from tools.tiny_llama import build

    build(MODEL_DIR)
    # The engine points TMPDIR and VLLM_CACHE_ROOT of its process into cache_dir: in this
    # process they must not outlive the module (pytest's tmp_path would move there too).
    environ, tempdir = dict(os.environ), tempfile.tempdir
    engine = make_engine("vllm", **ENGINE_OPTIONS)
    yield engine
    engine.close()
    os.environ.clear()
    os.environ.update(environ)
    tempfile.tempdir = tempdir


def _shapes(count: int, seed: int) -> list[np.ndarray]:
    """`count` shape prefixes of 263 to 751 tokens (the issue's measured workload)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(TOKEN_LOW, TOKEN_HIGH, int(n), dtype=np.int32) for n in rng.integers(263, 752, count)]


def _item(prefix: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    suffix = rng.integers(TOKEN_LOW, TOKEN_HIGH, int(rng.integers(5, 40)), dtype=np.int32)
    return np.concatenate([prefix, suffix])


def _run(engine, items: list[tuple[np.ndarray, int]], batch_items: int) -> dict[str, int]:
    """Run `items` (prompt, prefix length) in batches of `batch_items`; the counters' and
    vLLM's own changes, and the sum of the results' cached tokens."""
    before = {**vars_of(engine.counters), **engine.counters.extra}
    cached = 0
    for start in range(0, len(items), batch_items):
        chunk = items[start:start + batch_items]
        result = engine.run(EngineBatch([p for p, _ in chunk], max(len(p) for p, _ in chunk), [n for _, n in chunk]))
        assert result.errors is None and all(len(o) == 2 for o in result.outputs)
        cached += sum(result.cached_tokens)
    after = {**vars_of(engine.counters), **engine.counters.extra}
    return {**{k: after[k] - before[k] for k in after}, "result_cached_tokens": cached}


def vars_of(counters) -> dict[str, int]:
    return {name: getattr(counters, name) for name in ("prompt_tokens", "padded_tokens", "cacheable_tokens",
                                                        "cache_hit_tokens", "cacheable_hit_tokens",
                                                        "compulsory_miss_tokens")}


@pytest.mark.vllm
def test_cached_tokens_are_vllms_own_counts(engine):
    engine.reset_cache()
    rng = np.random.default_rng(1)
    shapes = _shapes(4, seed=11)
    items = [(_item(shapes[int(s)], rng), len(shapes[int(s)])) for s in rng.integers(0, 4, 24)]
    got = _run(engine, items, batch_items=4)
    assert got["cache_hit_tokens"] > 0
    assert got["result_cached_tokens"] == got["cache_hit_tokens"] == got["prefix_cache_hits"]
    assert got["prompt_tokens"] == got["padded_tokens"] == got["prefix_cache_queries"] == sum(len(p) for p, _ in items)
    assert got["cache_hit_tokens"] % BLOCK == 0  # hits come in whole blocks
    assert got["cacheable_hit_tokens"] <= got["cacheable_tokens"] - got["compulsory_miss_tokens"]


@pytest.mark.vllm
def test_items_grouped_by_shape_get_more_cache_hits_than_round_robin(engine):
    """The same 16-shape item set through the same engine settings (the cache emptied in
    between): grouped by shape, then interleaved round-robin across the shapes."""
    per_shape = 3
    shapes = _shapes(16, seed=5)
    rng = np.random.default_rng(2)
    by_shape = [[(_item(prefix, rng), len(prefix)) for _ in range(per_shape)] for prefix in shapes]
    grouped = [item for items in by_shape for item in items]
    round_robin = [by_shape[s][k] for k in range(per_shape) for s in range(len(shapes))]
    engine.reset_cache()
    sticky = _run(engine, grouped, batch_items=per_shape)
    engine.reset_cache()
    mixed = _run(engine, round_robin, batch_items=per_shape)
    print(f"\ngrouped: {sticky}\nround robin: {mixed}")
    for got in (sticky, mixed):
        assert got["result_cached_tokens"] == got["cache_hit_tokens"] == got["prefix_cache_hits"]
        assert got["cacheable_tokens"] == sum(n // BLOCK * BLOCK for _, n in grouped)
    assert sticky["compulsory_miss_tokens"] == mixed["compulsory_miss_tokens"]  # the first of each shape
    assert sticky["prefix_cache_hits"] > mixed["prefix_cache_hits"]
    # Measured, and exact on every repeat: grouped, every cacheable token a warm cache can
    # serve (all but each shape's first item's) came from vLLM's cache; round-robin, none
    # (16 prefixes of ~500 tokens through a 2,048-token cache evict each other).
    assert sticky["cacheable_hit_tokens"] == sticky["cacheable_tokens"] - sticky["compulsory_miss_tokens"] > 0
    assert mixed["cacheable_hit_tokens"] == 0


@pytest.mark.vllm
def test_a_prompt_over_max_model_len_is_an_error_result_and_the_others_run(engine):
    engine.reset_cache()
    rng = np.random.default_rng(3)
    good = [rng.integers(TOKEN_LOW, TOKEN_HIGH, 100, dtype=np.int32) for _ in range(2)]
    too_long = rng.integers(TOKEN_LOW, TOKEN_HIGH, MAX_MODEL_LEN + 50, dtype=np.int32)
    before = dict(engine.counters.extra, prompt_tokens=engine.counters.prompt_tokens)
    result = engine.run(EngineBatch([good[0], too_long, good[1]], MAX_MODEL_LEN + 50, [0, 0, 0]))
    assert result.errors is not None and result.errors[0] is None and result.errors[2] is None
    assert "maximum context length" in result.errors[1] or "max" in result.errors[1]
    assert result.outputs[1] == [] and result.cached_tokens[1] == 0
    assert len(result.outputs[0]) == len(result.outputs[2]) == 2
    ran = engine.counters.prompt_tokens - before["prompt_tokens"]
    assert ran == 200 == engine.counters.extra["prefix_cache_queries"] - before["prefix_cache_queries"]


def _agree(engine) -> dict[str, int]:
    """The engine's check: vLLM's counters and ours over the same requests, which must agree."""
    check = engine.check_totals()
    assert check["engine_prefix_cache_queries"] == check["engine_checked_prompt_tokens"], check
    assert check["engine_prefix_cache_hits"] == check["engine_checked_cache_hit_tokens"], check
    return check


@pytest.mark.vllm
def test_each_item_has_its_own_generation_parameters(engine):
    from pipeline.wire.generation import GenerationParams

    engine.reset_cache()
    rng = np.random.default_rng(4)
    prompts = [rng.integers(TOKEN_LOW, TOKEN_HIGH, 40, dtype=np.int32) for _ in range(4)]
    # An item's parameters alone make its sampling (vLLM's own defaults for the rest, never the
    # engine options): these ask for greedy decoding themselves.
    free = engine.run(EngineBatch([prompts[0]], 40, [0], [GenerationParams(max_tokens=12, temperature=0)]))
    # The first text the model writes for prompts[0] (greedy): a stop string inside it ends
    # the generation there, with reason "stop", and the text stops before it.
    text = free.texts[0]
    assert free.finish_reasons == ["length"] and len(free.outputs[0]) == 12 and isinstance(text, str)
    stop = next((text[k:k + 3] for k in range(1, len(text) - 3) if text[k:k + 3].strip()), None)
    params = [GenerationParams(max_tokens=12, temperature=0, stop=(stop,) if stop else ()),
              GenerationParams(max_tokens=3, temperature=0), None,
              GenerationParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=7)]
    first = engine.run(EngineBatch(prompts, 40, [0] * 4, params))
    again = engine.run(EngineBatch(prompts, 40, [0] * 4, params))
    assert first.errors is None
    if stop:
        assert first.finish_reasons[0] == "stop" and stop not in first.texts[0] and text.startswith(first.texts[0])
    assert [len(o) for o in first.outputs[1:]] == [3, 2, 5]  # 2: the engine options' max_tokens
    assert first.finish_reasons[1:] == ["length"] * 3
    assert first.outputs == again.outputs  # greedy, and a seeded sampler: the same again
    _agree(engine)


@pytest.mark.vllm
def test_pipelined_batches_overlap_and_finish_under_their_keys(engine):
    engine.reset_cache()
    shapes = _shapes(3, seed=8)
    rng = np.random.default_rng(6)
    batches = {key: [_item(shapes[key % 3], rng) for _ in range(3)] for key in range(6)}
    waiting = list(batches)
    done: dict = {}
    most_in_flight = 0
    while len(done) < len(batches):
        while waiting and engine.wants_more():  # up to what vLLM's KV cache holds
            key = waiting.pop(0)
            engine.submit(key, EngineBatch(batches[key], max(map(len, batches[key])), [len(shapes[key % 3])] * 3))
        most_in_flight = max(most_in_flight, len(batches) - len(waiting) - len(done))
        done.update(engine.poll())
    assert most_in_flight >= 2  # the next batch went in while the last one still ran
    assert 1 <= engine.max_running_prompts() <= 2048 // 263  # the KV cache's tokens over a request's
    assert sorted(done) == list(batches) and all(r.errors is None for r in done.values())
    assert sum(r.counted.cache_hit_tokens for r in done.values()) == sum(
        sum(r.cached_tokens) for r in done.values()) > 0
    _agree(engine)


@pytest.mark.vllm
def test_an_abort_drops_unfinished_batches_and_the_check_still_agrees(engine):
    engine.reset_cache()
    rng = np.random.default_rng(9)
    prompts = [rng.integers(TOKEN_LOW, TOKEN_HIGH, 300, dtype=np.int32) for _ in range(4)]
    for key in (1, 2):
        engine.submit(key, EngineBatch(prompts[2 * key - 2:2 * key], 300, [0, 0]))
    engine.poll()  # vLLM schedules (and counts) some of them
    assert sorted(engine.abort()) == [1, 2] and engine.poll() == []
    before = _agree(engine)
    engine.run(EngineBatch(prompts[:1], 300, [0]))  # the aborted requests' counts arrive by its end
    engine.run(EngineBatch(prompts[3:], 300, [0]))  # checked again
    after = _agree(engine)
    assert after["engine_checked_prompt_tokens"] - before["engine_checked_prompt_tokens"] == 300, (before, after)


@pytest.mark.vllm
def test_a_request_of_several_samples_is_left_out_of_the_check_which_still_agrees(engine):
    """vLLM looks a prompt of n samples up n times, and its output reports one sample's
    cached tokens: that stretch is not checked, the next one is."""
    from pipeline.wire.generation import GenerationParams

    engine.reset_cache()
    rng = np.random.default_rng(13)
    prompts = [rng.integers(TOKEN_LOW, TOKEN_HIGH, 200, dtype=np.int32) for _ in range(3)]
    before = _agree(engine)
    result = engine.run(EngineBatch(prompts[:2], 200, [0, 0], [GenerationParams(max_tokens=3, temperature=1.0, n=2),
                                                               None]))
    assert result.errors is None and result.samples is not None and len(result.samples[0]) == 2
    skipped = _agree(engine)
    assert skipped["engine_checked_prompt_tokens"] == before["engine_checked_prompt_tokens"]
    engine.run(EngineBatch(prompts[2:], 200, [0]))
    after = _agree(engine)
    assert after["engine_checked_prompt_tokens"] - skipped["engine_checked_prompt_tokens"] == 200


def _engine_processes() -> dict[int, str]:
    """vLLM's engine core and worker processes under this one (by vLLM's process titles)."""
    import psutil

    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            name = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        if "VLLM::" in name:
            found[child.pid] = name
    return found


@pytest.mark.vllm
def test_by_default_the_engine_core_runs_in_a_process_of_its_own_which_close_stops(engine):
    """vLLM's default (in_process false): the engine core steps in its own process while the
    consumer works, and `close` stops it and its worker (a consumer ends with os._exit)."""
    had = set(_engine_processes())  # the module's engine's, itself in its own process
    assert any("EngineCore" in name for name in _engine_processes().values())
    environ = dict(os.environ)
    own = make_engine("vllm", **ENGINE_OPTIONS)
    try:
        result = own.run(EngineBatch([np.arange(TOKEN_LOW, TOKEN_LOW + 64, dtype=np.int32)], 64, [0]))
        assert result.errors is None and len(result.outputs[0]) == 2
        started = {pid: name for pid, name in _engine_processes().items() if pid not in had}
        assert any("EngineCore" in name for name in started.values()), started
        _agree(own)
    finally:
        own.close()
        os.environ.clear()
        os.environ.update(environ)
    import psutil

    assert not [pid for pid in started if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


@pytest.mark.vllm
def test_in_process_the_engine_core_steps_in_the_consumer_and_the_counters_agree(engine):
    environ = dict(os.environ)
    had = set(_engine_processes())
    inside = make_engine("vllm", **ENGINE_OPTIONS, in_process=True)
    try:
        rng = np.random.default_rng(12)
        prefix = rng.integers(TOKEN_LOW, TOKEN_HIGH, 96, dtype=np.int32)
        items = [np.concatenate([prefix, rng.integers(TOKEN_LOW, TOKEN_HIGH, 8, dtype=np.int32)]) for _ in range(3)]
        inside.run(EngineBatch(items[:1], 104, [96]))
        result = inside.run(EngineBatch(items[1:], 104, [96, 96]))
        assert result.errors is None and sum(result.cached_tokens) == 2 * (96 // BLOCK * BLOCK)
        assert set(_engine_processes()) == had  # no process of its own
        _agree(inside)
    finally:
        inside.close()
        os.environ.clear()
        os.environ.update(environ)
