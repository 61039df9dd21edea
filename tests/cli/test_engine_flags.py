"""vLLM's engine flags on run-batch and launch: the declared ones parsed as vLLM reads them,
each the engine option of its name, refused in one line where the engine cannot take them
(pure: no process started; the commands themselves are in tests/batchjob/test_run_batch_flags.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.cli.engine_flags import VERDICT_POLL_S, EngineFlags, parse_context_len
from pipeline.consumer.engines.vllm_args import REFUSED_FLAGS, engine_options_of, plain
from pipeline.runtime.settings import MAX_CONTEXT_TOKENS, LaunchSettings
from pipeline.wire.errors import EngineOptionsError, SettingsError

OWN = ["--max-batch-tokens", "--max-batch", "--max-input-len", "--consumers"]


@pytest.mark.parametrize("text, tokens", [("1024", 1024), ("8k", 8000), ("32K", 32768), ("25.6k", 25600),
                                          ("1M", 1 << 20), (" 2048 ", 2048), ("2", 2),
                                          (str(MAX_CONTEXT_TOKENS), MAX_CONTEXT_TOKENS)])
def test_a_context_length_reads_as_vllm_reads_it(text, tokens):
    assert parse_context_len(text) == tokens


@pytest.mark.parametrize("text, message", [("auto", "known only once vLLM has loaded"), ("-1", "known only once"),
                                           ("1.5K", "no decimals with a binary suffix"), ("x", "not a length"),
                                           ("1", "a context is 2 to"),
                                           (str(MAX_CONTEXT_TOKENS + 1), "a context is 2 to")])
def test_a_context_length_vllm_would_not_take_or_we_cannot_use_is_refused(text, message):
    import click

    with pytest.raises(click.BadParameter, match=message):
        parse_context_len(text)


def take(extra=(), given=None, **declared):
    options = {"max_model_len": None, "tensor_parallel_size": None, "pipeline_parallel_size": None, "seed": None,
               "chat_template": None, "producers": 3, **declared}
    flags = EngineFlags.take(options, list(extra), given or {})
    assert options == {"producers": 3}  # the flags are out of the command's own options
    return flags


def test_the_declared_flags_become_the_engine_options_of_their_names():
    flags = take(max_model_len="8k", tensor_parallel_size=2, pipeline_parallel_size=2)
    settings = flags.applied(LaunchSettings(), OWN)
    assert {k: settings.engine_options[k] for k in ("max_model_len", "tensor_parallel_size",
                                                    "pipeline_parallel_size")} == {
        "max_model_len": 8000, "tensor_parallel_size": 2, "pipeline_parallel_size": 2}


@pytest.mark.parametrize("extra, message", [
    (["--max-tokens", "4096"], "--max-tokens: now --max-batch-tokens"),
    (["input.jsonl"], "unexpected argument 'input.jsonl'"),
])
def test_flags_this_command_does_not_take_are_refused_before_anything(extra, message):
    with pytest.raises(SettingsError, match=message):
        take(extra)


def test_the_sim_takes_vllms_sizes_and_refuses_the_rest_naming_why():
    with pytest.raises(SettingsError, match="--seed: vLLM's engine flag, and the sim engine makes up its outputs.*"
                                            "--workload-seed"):
        take(seed=3).applied(LaunchSettings(), OWN)
    with pytest.raises(SettingsError, match="--gpu-memory-utilization, --dtype: not options of this command; vLLM's "
                                            "engine flags are the vllm engine's"):
        take(["--gpu-memory-utilization", "0.5", "--dtype=bfloat16"]).applied(LaunchSettings(), OWN)


def test_a_typo_of_our_own_option_is_named():
    with pytest.raises(SettingsError, match="--max-batch-token: did you mean --max-batch-tokens"):
        take(["--max-batch-token", "5"]).applied(LaunchSettings(), OWN)


def test_one_way_to_say_a_thing_a_flag_and_engine_options_giving_the_same_key_is_refused():
    with pytest.raises(SettingsError, match="--max-model-len and --engine-options max_model_len: give it once"):
        take(given={"max_model_len": 1024}, max_model_len="2k").applied(LaunchSettings(), OWN)
    flags = take(given={"llm_kwargs": {"max_num_seqs": 4}})
    with pytest.raises(SettingsError, match="--max-num-seqs and --engine-options llm_kwargs.max_num_seqs"):
        flags._refuse_clashes({"llm_kwargs": {"max_num_seqs": 8}})


def test_a_flag_over_the_config_files_engine_options_wins(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[engine_options]\nmax_model_len = 512\n")
    settings = take(max_model_len="1024").applied(LaunchSettings.resolve(str(config)), OWN)
    assert settings.engine_options["max_model_len"] == 1024


def test_vllms_parsed_flags_go_where_engine_options_put_them():
    options = engine_options_of({"gpu_memory_utilization": 0.8, "dtype": "bfloat16", "max_num_seqs": 64,
                                 "quantization": "fp8"})
    assert options == {"gpu_memory_utilization": 0.8, "dtype": "bfloat16",
                       "llm_kwargs": {"max_num_seqs": 64, "quantization": "fp8"}}


@pytest.mark.parametrize("dest", sorted(REFUSED_FLAGS))
def test_vllm_flags_the_product_sets_itself_are_refused_with_why(dest):
    with pytest.raises(EngineOptionsError, match=f"--{dest.replace('_', '-')}: "):
        engine_options_of({dest: True})


def test_parsed_values_become_plain_table_values():
    import enum
    from dataclasses import dataclass, field

    class Mode(enum.Enum):
        A = "a"

    @dataclass
    class Config:
        mode: Mode = Mode.A
        sizes: list = field(default_factory=list)
        level: int = 0

    assert plain(Config(level=3, sizes=[1])) == {"sizes": [1], "level": 3}  # defaults left out
    assert plain({"m": Mode.A, "s": {2, 1}, "t": (1, "x")}) == {"m": "a", "s": [1, 2], "t": [1, "x"]}


@pytest.mark.parametrize("flag", ["-tp", "-pp", "--tensor-parallel-size", "--pipeline-parallel-size"])
def test_parallel_sizes_are_taken_at_their_limit_and_refused_one_past(flag):
    import click

    from pipeline.cli.launch import launch
    from pipeline.consumer.engines.base import MAX_PARALLEL_SIZE

    context = launch.make_context("launch", [flag, str(MAX_PARALLEL_SIZE)])
    assert MAX_PARALLEL_SIZE in (context.params["tensor_parallel_size"], context.params["pipeline_parallel_size"])
    with pytest.raises(click.BadParameter, match=f"{MAX_PARALLEL_SIZE + 1} is not in the range"):
        launch.make_context("launch", [flag, str(MAX_PARALLEL_SIZE + 1)])


def test_flags_click_does_not_know_are_kept_in_order_for_vllms_parser():
    from pipeline.cli.batch import run_batch

    context = run_batch.make_context("run-batch", ["-i", "a", "-o", "b", "--model", ".", "-tp", "2",
                                                   "--gpu-memory-utilization", "0.8", "-q", "fp8", "--enforce-eager",
                                                   "--dtype=bfloat16", "--max-model-len", "8k"])
    assert context.args == ["--gpu-memory-utilization", "0.8", "-q", "fp8", "--enforce-eager", "--dtype=bfloat16"]
    assert (context.params["tensor_parallel_size"], context.params["max_model_len"]) == (2, "8k")


def _adapter(path, name: str = "adapter_config.json"):
    path.mkdir()
    (path / name).write_text("{}")
    return str(path)


def test_lora_modules_are_read_as_vllm_reads_them_name_path_or_json_several_to_a_flag(tmp_path):
    a, b, c = (_adapter(tmp_path / n) for n in "abc")
    flags = take(["--lora-modules", f"sql={a}", f'{{"name": "chat", "path": "{b}", "base_model_name": "x"}}',
                  "--dtype", "half", f"--lora-modules=third={c}"])
    assert flags.declared["lora_modules"] == [{"name": "sql", "path": a}, {"name": "chat", "path": b},
                                              {"name": "third", "path": c}]
    assert flags.extra == ["--dtype", "half"]  # what is left for vLLM's parser
    sim = take(["--lora-modules", f"sql={a}"])
    settings = sim.applied(LaunchSettings(), OWN)  # the sim takes adapters too: its answers differ by adapter
    assert settings.engine_options["lora_modules"][0] == {"name": "sql", "path": a}


@pytest.mark.parametrize("values, message", [
    ([], "expected at least one NAME=PATH"),
    (["{not json"], "invalid JSON format for --lora-modules"),
    (['{"name": "x"}'], "invalid fields for --lora-modules"),
    (['{"name": "x", "path": "/p", "rank": 8}'], "invalid fields for --lora-modules"),
    (["a=/nowhere"], "no adapter_config.json there"),
    (["=/p"], "adapter name '' is empty"),
])
def test_lora_modules_vllm_would_refuse_are_refused_in_one_line(values, message):
    with pytest.raises(SettingsError, match=message):
        take(["--lora-modules", *values])


def test_an_adapter_named_twice_or_past_the_limit_is_refused(tmp_path):
    from pipeline.wire.generation import MAX_LORA_MODULES

    a = _adapter(tmp_path / "a")
    with pytest.raises(SettingsError, match="'x' is given twice"):
        take(["--lora-modules", f"x={a}", "--lora-modules", f"x={a}"])
    assert len(take(["--lora-modules", *(f"m{k}={a}" for k in range(MAX_LORA_MODULES))]).declared["lora_modules"]) \
        == MAX_LORA_MODULES
    with pytest.raises(SettingsError, match=f"{MAX_LORA_MODULES + 1} adapters, at most {MAX_LORA_MODULES}"):
        take(["--lora-modules", *(f"m{k}={a}" for k in range(MAX_LORA_MODULES + 1))])


class FakeCheck:
    """In place of vLLM's check process: records what it was asked, answers as told."""

    made: list[FakeCheck] = []

    def __init__(self) -> None:
        self.asked: dict | None = None
        self.answer: dict | Exception | None = {}  # None: still running
        self.waits: list[float] = []
        self.closed = False
        FakeCheck.made.append(self)

    def start(self, options: dict) -> None:
        self.asked = options

    def verdict(self, wait_s: float) -> dict | None:
        self.waits.append(wait_s)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_vllm(monkeypatch):
    from pipeline.consumer.engines import vllm as vllm_engine
    from pipeline.consumer.engines import vllm_args

    monkeypatch.setattr(vllm_engine, "vllm_installed", lambda: True)
    monkeypatch.setattr(vllm_args, "VllmCheck", FakeCheck)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: nothing asks nvidia-smi
    FakeCheck.made.clear()
    return FakeCheck.made


def _vllm_settings(**engine_options) -> LaunchSettings:
    return LaunchSettings(engine="vllm", engine_options={"model": "/m", **engine_options})


def test_vllms_flags_go_to_the_engine_as_typed_and_vllms_check_starts_at_once(fake_vllm, tmp_path):
    words = ["--gpu-memory-utilization", "0.8", "-q", "fp8", "--enforce-eager", "--dtype=bfloat16"]
    flags = take(words, max_model_len="2k")
    settings = flags.applied(_vllm_settings(), OWN)
    assert settings.engine_options["vllm_flags"] == words and settings.engine_options["max_model_len"] == 2000
    assert len(fake_vllm) == 1 and fake_vllm[0].asked is None  # importing vLLM, asked nothing yet
    flags.start_check(replace(settings, data_dir=str(tmp_path)))
    assert fake_vllm[0].asked["vllm_flags"] == words  # what each consumer will run with
    fake_vllm[0].answer = {"gpu_memory_utilization": 0.8, "llm_kwargs": {"quantization": "fp8"}}
    assert flags.verdict(wait=True) == fake_vllm[0].answer
    flags.close()
    assert fake_vllm[0].closed


def test_vllms_refusal_is_one_line_naming_the_flag_a_typo_meant(fake_vllm, tmp_path):
    flags = take(["--max-batch-token", "5"])
    settings = flags.applied(_vllm_settings(), OWN)
    flags.start_check(replace(settings, data_dir=str(tmp_path)))
    fake_vllm[0].answer = EngineOptionsError("vLLM: unrecognized arguments: --max-batch-token 5")
    with pytest.raises(SettingsError, match=r"^vllm engine: vLLM: unrecognized arguments: --max-batch-token 5 "
                                            r"\(--max-batch-token: did you mean --max-batch-tokens\?\)$"):
        flags.verdict(wait=False)


def test_a_check_still_running_is_no_verdict_yet_and_without_vllms_check_there_is_nothing_to_wait_for(fake_vllm,
                                                                                                    tmp_path):
    flags = take(["--dtype", "half"])
    flags.start_check(replace(flags.applied(_vllm_settings(), OWN), data_dir=str(tmp_path)))
    fake_vllm[0].answer = None
    assert flags.verdict(wait=False) is None and fake_vllm[0].waits == [0.0]
    stops = iter([False, False, True])  # Ctrl-C while waiting: the wait ends, with no verdict
    assert flags.verdict(wait=True, stop=lambda: next(stops)) is None
    assert fake_vllm[0].waits[1:] == [VERDICT_POLL_S] * 3
    sim = take([])
    sim.applied(LaunchSettings(), OWN)
    sim.start_check(LaunchSettings())
    assert sim.verdict(wait=True) == {}


@pytest.mark.parametrize("words, message", [
    (["--no-enable-prefix-caching"], "--enable-prefix-caching: prefix caching stays on"),
    (["--served-model-name", "x", "--model=/other"], "--model: the model is the command's own --model; "
                                                     "--served-model-name: the name requests ask for"),
])
def test_flags_the_product_sets_itself_are_refused_before_vllm_is_asked(fake_vllm, words, message):
    with pytest.raises(SettingsError, match=message):
        take(words).applied(_vllm_settings(), OWN)


def test_a_flag_and_engine_options_giving_the_same_option_are_refused_as_typed(fake_vllm):
    with pytest.raises(SettingsError, match="--max-num-seqs and --engine-options llm_kwargs.max_num_seqs: give it once"):
        take(["--max-num-seqs", "8"], given={"llm_kwargs": {"max_num_seqs": 4}}).applied(_vllm_settings(), OWN)
    with pytest.raises(SettingsError, match="--dtype and --engine-options dtype: give it once"):
        take(["--dtype=half"], given={"dtype": "float16"}).applied(_vllm_settings(), OWN)
