"""`--engine-options KEY=VALUE,...` (launch and the consumer stage), the made-up token ids'
vocabulary (a vllm model's config.json), and the vllm options a machine without a GPU gets
filled in. None of it needs vLLM: the vllm engine's options are checked without it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.producer.demos import demo_workload
from pipeline.producer.workload import MAX_VOCAB_SIZE, VOCAB_SIZE, load_workload
from pipeline.runtime.settings import (
    CPU_VLLM_BLOCK_SIZE_TOKENS,
    CPU_VLLM_KV_CACHE_BYTES,
    LaunchSettings,
    engine_options_for_host,
    model_vocab_size,
    workload_vocab_size,
)
from pipeline.runtime.tables import MAX_KEY_PARTS, parse_engine_options
from pipeline.wire.errors import SettingsError
from tests.support.commands import one_line_error, pipeline


def test_engine_options_are_typed_as_toml_scalars():
    parsed = parse_engine_options(["model=/models/x,gpu_memory_utilization=0.9,enforce_eager=true,block_size=32",
                                   "dtype=bfloat16", "seed=1,seed=2"])  # repeatable; a later pair wins
    assert parsed == {"model": "/models/x", "gpu_memory_utilization": 0.9, "enforce_eager": True,
                      "block_size": 32, "dtype": "bfloat16", "seed": 2}
    assert type(parsed["block_size"]) is int and type(parsed["enforce_eager"]) is bool


def test_commas_inside_quotes_and_tables_do_not_split():
    parsed = parse_engine_options(['model="/a,b\\",c",llm_kwargs={max_num_seqs=8,x=[1,2]}', "llm_kwargs.y='p,q'"])
    assert parsed == {"model": '/a,b",c', "llm_kwargs": {"max_num_seqs": 8, "x": [1, 2], "y": "p,q"}}


@pytest.mark.parametrize("text, words", [
    ("model", ["'model'", "expected KEY=VALUE"]),
    ("=3", ["'=3'", "expected KEY=VALUE"]),
    ("model=/m,,seed=1", ["'model=/m,,seed=1'", "empty KEY=VALUE"]),
    ("model=/m,", ["'model=/m,'", "empty KEY=VALUE"]),
])
def test_a_malformed_pair_is_named(text, words):
    with pytest.raises(SettingsError) as caught:
        parse_engine_options([text])
    for word in words:
        assert word in str(caught.value)


def test_keys_nest_up_to_the_limit_and_not_past_it():
    at_limit = ".".join(["llm_kwargs"] + ["k"] * (MAX_KEY_PARTS - 1))
    assert parse_engine_options([f"{at_limit}=1"]) == {"llm_kwargs": {"k": {"k": 1}}}
    with pytest.raises(SettingsError, match="at most 3 parts"):
        parse_engine_options([f"{at_limit}.k=1"])


def test_the_command_line_wins_over_the_file_key_by_key(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[engine_options]\nblock_size_tokens = 32\ncapacity_tokens = 4096\n")
    given = {"engine_options": parse_engine_options(["capacity_tokens=8192"])}
    settings = LaunchSettings.resolve(str(config), given)
    assert settings.engine_options == {"block_size_tokens": 32, "capacity_tokens": 8192}


def test_vllm_without_a_gpu_gets_the_cpu_options_it_lacks(tmp_path):
    options, filled = engine_options_for_host("vllm", {"model": "/m"}, gpus=0, consumers=2, cores=2,
                                              data_dir=str(tmp_path))
    expected = {"enforce_eager": True, "block_size": CPU_VLLM_BLOCK_SIZE_TOKENS, "cpu_threads": 1,
                "cache_dir": str(tmp_path / "engine-cache"), "kv_cache_memory_bytes": CPU_VLLM_KV_CACHE_BYTES}
    assert filled == expected and options == {"model": "/m", **expected}
    assert "load_format" not in options  # random weights are never a silent default
    given = {"model": "/m", "block_size": 64, "enforce_eager": False, "cpu_threads": 3, "cache_dir": "/c",
             "gpu_memory_utilization": 0.5}
    options, filled = engine_options_for_host("vllm", given, gpus=0, consumers=2, cores=2, data_dir=str(tmp_path))
    assert options == given and filled == {}  # what the user gave stands; no KV size beside a fraction


def test_vllms_flags_as_typed_are_what_the_user_gave_and_are_not_filled_in(tmp_path):
    given = {"model": "/m", "vllm_flags": ["--block-size", "64", "--no-enforce-eager", "--gpu-memory-utilization=0.5"]}
    options, filled = engine_options_for_host("vllm", given, gpus=0, consumers=2, cores=2, data_dir=str(tmp_path))
    assert filled == {"cpu_threads": 1, "cache_dir": str(tmp_path / "engine-cache")}  # no KV size beside a fraction
    assert options == {**given, **filled}


@pytest.mark.parametrize("cores, consumers, threads", [(2, 2, 1), (2, 1, 1), (2, 3, 1), (16, 4, 3), (16, 3, 5),
                                                     (1, 1, 1)])
def test_cpu_threads_share_out_the_cores(tmp_path, cores, consumers, threads):
    _, filled = engine_options_for_host("vllm", {"model": "/m"}, gpus=0, consumers=consumers, cores=cores,
                                        data_dir=str(tmp_path))
    assert filled["cpu_threads"] == threads


def test_nothing_is_filled_in_on_a_gpu_or_for_the_sim(tmp_path):
    for engine, gpus in (("vllm", 1), ("sim", 0)):
        options, filled = engine_options_for_host(engine, {"model": "/m"}, gpus=gpus, consumers=2, cores=2,
                                                  data_dir=str(tmp_path))
        assert options == {"model": "/m"} and filled == {}


def test_the_launcher_gives_each_consumer_the_filled_options(tmp_path, monkeypatch):
    from pipeline.runtime.launcher import Launcher

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU
    settings = LaunchSettings(data_dir=str(tmp_path), consumers=2, engine="vllm",
                              engine_options={"model": "/m", "kv_cache_memory_bytes": 1 << 20})
    launcher = Launcher(settings, demo_workload(10))
    configs = launcher.consumer_configs()
    assert [c.engine_options for c in configs] == [launcher.engine_options] * 2
    assert launcher.engine_options["kv_cache_memory_bytes"] == 1 << 20 and "kv_cache_memory_bytes" not in \
        launcher.engine_filled
    assert launcher.engine_options["cache_dir"] == str(tmp_path / "engine-cache")


def _model(tmp_path, config) -> str:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(model)


def test_a_vllm_launch_draws_ids_below_the_model_vocabulary(tmp_path):
    model = _model(tmp_path, {"vocab_size": 4096})
    settings = LaunchSettings(engine="vllm", engine_options={"model": model})
    assert workload_vocab_size(settings) == (4096, f"{model}/config.json")
    assert workload_vocab_size(LaunchSettings(engine="vllm", engine_options={"model": model}, vocab_size=7)) == \
        (7, "vocab_size")
    assert workload_vocab_size(LaunchSettings()) == (VOCAB_SIZE, "the default")  # sim: never reads a model
    assert model_vocab_size(_model(tmp_path, {"text_config": {"vocab_size": 262144}}) + "/config.json") == 262144


@pytest.mark.parametrize("config, words", [
    (None, ["config.json", "cannot read", "--vocab-size"]),
    ("{not json", ["config.json", "not a JSON model config"]),
    ({"hidden_size": 8}, ["config.json", "vocab_size None"]),
    ({"vocab_size": 0}, ["vocab_size 0"]),
    ({"vocab_size": MAX_VOCAB_SIZE + 1}, [f"vocab_size {MAX_VOCAB_SIZE + 1}"]),
    ({"vocab_size": True}, ["vocab_size True"]),
])
def test_a_config_without_a_usable_vocab_size_is_a_named_error(tmp_path, config, words):
    model = str(tmp_path / "model") if config is None else _model(tmp_path, config)
    with pytest.raises(SettingsError) as caught:
        workload_vocab_size(LaunchSettings(engine="vllm", engine_options={"model": model}))
    assert f"{model}/config.json" in str(caught.value)
    for word in words:
        assert word in str(caught.value)


def test_vocab_sizes_at_their_limits_and_past_them(tmp_path):
    assert model_vocab_size(_model(tmp_path, {"vocab_size": MAX_VOCAB_SIZE}) + "/config.json") == MAX_VOCAB_SIZE
    assert {int(t) for item in demo_workload(20, vocab_size=1) for t in item.tokens} == {0}
    assert max(int(item.tokens.max()) for item in demo_workload(50, vocab_size=4096)) < 4096
    demo_workload(5, vocab_size=MAX_VOCAB_SIZE)
    for past in (0, MAX_VOCAB_SIZE + 1):
        with pytest.raises(ValueError, match="vocab_size"):
            demo_workload(5, vocab_size=past)
        with pytest.raises(SettingsError, match="vocab_size must be in"):
            LaunchSettings.resolve(None, {"vocab_size": past})
    LaunchSettings.resolve(None, {"vocab_size": MAX_VOCAB_SIZE})


def test_the_default_vocabulary_keeps_the_demo_and_traces_as_they_were(tmp_path):
    assert repr(demo_workload(100, seed=3)) == repr(demo_workload(100, seed=3, vocab_size=VOCAB_SIZE))
    assert "vocab_size" not in repr(demo_workload(10)) and "vocab_size=4096" in repr(demo_workload(10, vocab_size=4096))
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [1, 2]}\n')
    small = next(iter(load_workload(str(trace), vocab_size=100))).tokens
    wide = next(iter(load_workload(str(trace)))).tokens
    assert len(small) == len(wide) == 700 and small.max() < 100 and wide.max() >= 100
    assert np.array_equal(wide, next(iter(load_workload(str(trace), vocab_size=VOCAB_SIZE))).tokens)


@pytest.mark.integration
@pytest.mark.parametrize("args, words", [
    (["--engine-options", "block_size_tokens"], ["--engine-options 'block_size_tokens'", "expected KEY=VALUE"]),
    (["--engine-options", "bogus=1"], ["bogus"]),  # the sim engine's own refusal
    (["--engine", "vllm", "--engine-options", "model=/m,bogus=1,block_size=32"], ["vllm engine: unknown options bogus"]),
    (["--engine", "vllm", "--engine-options", "model=/m,block_size=0"], ["block_size must be a positive integer"]),
])
def test_launch_refuses_bad_engine_options_in_one_line(tmp_path, args, words):
    data = tmp_path / "data"
    one_line_error(pipeline("launch", "--items", "10", "--data-dir", str(data), *args), *words)
    assert not data.exists()  # refused before anything started


@pytest.mark.integration
def test_consumer_start_refuses_bad_engine_options_in_one_line(tmp_path):
    for args, word in ((["--engine-options", "x"], "--engine-options 'x'"),
                       (["--engine", "vllm", "--engine-options", "model=/m,nope=2"], "unknown options nope")):
        one_line_error(pipeline("consumer", "start", "--data-dir", str(tmp_path / "q"), *args), word)


@pytest.mark.integration
def test_a_launch_passes_its_engine_options_to_the_engine(tmp_path):
    """A real run with the sim engine's block size from --engine-options over the file's."""
    config = tmp_path / "run.toml"
    config.write_text("items = 300\nproducers = 1\n[engine_options]\nblock_size_tokens = 16\n")
    report = tmp_path / "report.json"
    done = pipeline("launch", "--config", str(config), "--engine-options", "block_size_tokens=64",
                    "--report", str(report))
    assert done.returncode == 0, done.stderr
    result = json.loads(report.read_text())
    blocks = sum(item.prefix_len // 64 * 64 for item in demo_workload(300))  # 16-token blocks: 103,440
    assert result["items_completed"] == 300 and result["cacheable_tokens"] == blocks
