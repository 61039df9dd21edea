"""Settings of `pipeline launch`: embedded defaults, then a TOML file, then the command line.

    settings = LaunchSettings.resolve(config_path="run.toml", overrides={"items": 5000})

Every option of the command can come from the file under the same name (underscores, not
dashes), at the top level or in a `[launch]` table; `engine_options` is a table passed to the
engine (the sim engine's `block_size_tokens`, `capacity_tokens`, `cost_s_per_padded_token`,
`cost_s_per_batch`; on the command line `--engine-options KEY=VALUE,...`, over the file's key
by key). A vllm
engine on a machine without a GPU gets the CPU options it lacks filled in
(`engine_options_for_host`), and made-up token ids are drawn below its model's vocabulary
(`workload_vocab_size`, or `vocab_size`).
The `[broker]` and `[consumer]` tables (and `--set broker.KEY=VALUE`) set the broker's and
the consumers' own settings (pipeline/runtime/tables.py): the dispatch policy's lane
constants and starvation bound, the work slice, the credit window's bounds. An unknown key
or a value of the wrong type is an error naming the file and the key: a typo in a config
must not silently run with a default.

    # run.toml
    workload = "../shared/workloads/mooncake_synthetic_trace.jsonl"
    consumers = 2
    max_input_len = 262144
    [engine_options]
    capacity_tokens = 4194304
    [broker.lanes]
    max_lanes = 512
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import tomllib
from dataclasses import dataclass, field, fields, replace

from pipeline.broker.config import MAX_CONSUMERS, MAX_PRODUCERS
from pipeline.producer.workload import MAX_VOCAB_SIZE, VOCAB_SIZE
from pipeline.runtime.tables import PROCESS_TABLES, broker_config, consumer_settings, merged
from pipeline.wire.errors import EngineUnavailableError, SettingsError
from pipeline.wire.layouts.frames import MAX_SEQ

# The demo: enough items to show lanes, shape switches and a warm cache, and short enough to
# finish in seconds on a 2-core machine (the target: well under a minute including start-up).
DEMO_ITEMS = 20_000
# CPU consumers when the machine has no GPU (one per engine's GPUs otherwise).
DEFAULT_CPU_CONSUMERS = 2
DEFAULT_PRODUCERS = 2
# The consumer contract's defaults: a vLLM-like engine's max_num_seqs, a token budget of
# 64 Ki per batch and an 8 Ki context.
DEFAULT_MAX_BATCH_ITEMS = 64
DEFAULT_MAX_BATCH_TOKENS = 65_536
DEFAULT_MAX_INPUT_LEN = 8192


# Producer and consumer processes of one run: at most what one broker serves at once (each
# producer a 64 MiB ring, each consumer a descriptor ring and a connection), checked here so
# that a run is refused before it starts, not half-way through its registrations. A launch
# also checks that the rings an earlier run left (adopted, and counted) leave room.
MAX_PRODUCER_PROCESSES = MAX_PRODUCERS
MAX_CONSUMER_PROCESSES = MAX_CONSUMERS
# Items of one run (`items`): every producer numbers its items in 40 bits (layouts.MAX_SEQ),
# so one producer can never run out whatever the split.
MAX_ITEMS = MAX_SEQ
# A model's config.json is a few KiB; a file far larger is not one (read no more than this).
MAX_MODEL_CONFIG_BYTES = 16 << 20
# vLLM on a machine without a GPU (its CPU backend), where the user did not say otherwise
# (`engine_options_for_host`): CUDA graphs do not exist there; the CPU attention wants
# blocks of a multiple of 32 tokens; without a KV cache size vLLM takes a share of the RAM
# (about 10 GB here), so each consumer gets 1 GiB, room for ~100k tokens of a 0.5B model
# and far more than the tiny test model needs; the run's caches go in its data directory
# (a temporary one goes with the run, and nothing lands in a shared home directory).
CPU_VLLM_BLOCK_SIZE_TOKENS = 32
CPU_VLLM_KV_CACHE_BYTES = 1 << 30
ENGINE_CACHE_DIR = "engine-cache"
# Settings that took another name, so that no setting of ours reads as a vLLM flag of another
# meaning (vLLM's max_tokens is a request's new tokens, its seed the engine's sampling seed):
# the old name is refused, naming the new one.
RENAMED_SETTINGS = {
    "max_tokens": "max_batch_tokens (the consumer contract's padded tokens per batch; max_tokens is a request's)",
    "seed": "workload_seed (the seed of generated workloads; seed is the engine's, vLLM's --seed)",
}
# The demo's seed goes to numpy's generator, which takes any non-negative integer; 2**63 - 1
# keeps it a TOML integer.
MAX_SEED = 2**63 - 1


@dataclass(slots=True)
class LaunchSettings:
    """Everything `pipeline launch` needs. `data_dir` None: a temporary directory, removed
    after the run. `consumers` None: one per engine's GPUs (gpus.py), or DEFAULT_CPU_CONSUMERS
    without GPUs.
    `items` None: the whole workload file (or DEMO_ITEMS for the demo)."""

    data_dir: str | None = None
    workload: str = "demo"
    items: int | None = None
    producers: int = DEFAULT_PRODUCERS
    consumers: int | None = None
    engine: str = "sim"
    engine_options: dict = field(default_factory=dict)
    storage: str = "disk"
    durability: str = "process"
    max_batch: int = DEFAULT_MAX_BATCH_ITEMS
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_input_len: int = DEFAULT_MAX_INPUT_LEN
    replay_speed: float | None = None
    report: str | None = None
    plots: str | None = None
    metrics_port: int | None = None
    metrics_token_file: str | None = None  # the metrics need this bearer token (else: this user only)
    workload_seed: int = 0
    vocab_size: int | None = None  # made-up token ids below this (None: see workload_vocab_size)
    broker: dict = field(default_factory=dict)  # the broker's own settings (tables.py)
    consumer: dict = field(default_factory=dict)  # every consumer's own settings (tables.py)

    @classmethod
    def resolve(cls, config_path: str | None = None, overrides: dict | None = None) -> LaunchSettings:
        """Defaults, then the TOML file's values, then `overrides` (values that are None are
        skipped: an option not given on the command line). Tables (engine_options, broker,
        consumer) are merged key by key, so `--set broker.max_age_s=30` keeps the file's
        other broker settings."""
        settings = cls()
        if config_path is not None:
            settings = settings.updated(load_toml(config_path), source=config_path)
            settings.checked(config_path)  # an error names the file it came from
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        settings = settings.updated(given, source="the command line")
        settings.checked("the command line" if given else "the defaults")
        return settings

    def checked(self, source: str) -> None:
        """`check`, with `source` named in the error."""
        try:
            self.check()
        except SettingsError as exc:
            raise SettingsError(f"{source}: {exc}") from exc

    def updated(self, values: dict, source: str) -> LaunchSettings:
        known = {f.name: f for f in fields(self)}
        changes = {}
        for key, value in values.items():
            if key in RENAMED_SETTINGS:
                raise SettingsError(f"{source}: {key} is now {RENAMED_SETTINGS[key]}")
            if key not in known:
                raise SettingsError(f"{source}: unknown setting {key!r} (known: {', '.join(sorted(known))})")
            value = _typed(key, value, _TYPES[key], source)
            changes[key] = merged(getattr(self, key), value) if isinstance(value, dict) else value
        return replace(self, **changes)

    def check(self) -> None:
        for key in ("max_batch", "max_batch_tokens", "max_input_len"):
            if getattr(self, key) <= 0:
                raise SettingsError(f"{key} must be positive, got {getattr(self, key)}")
        _check_range("producers", self.producers, 1, MAX_PRODUCER_PROCESSES)
        if self.consumers is not None:
            _check_range("consumers", self.consumers, 1, MAX_CONSUMER_PROCESSES)
        if self.items is not None:
            _check_range("items", self.items, 1, MAX_ITEMS)
        _check_range("workload_seed", self.workload_seed, 0, MAX_SEED)
        if self.vocab_size is not None:
            _check_range("vocab_size", self.vocab_size, 1, MAX_VOCAB_SIZE)
        check_replay_speed(self.replay_speed)
        if self.metrics_port is not None:
            _check_range("metrics_port", self.metrics_port, 0, 65535)
        if self.metrics_token_file is not None:
            if self.metrics_port is None:
                raise SettingsError("metrics_token_file is given without metrics_port: no metrics are served")
            from pipeline.reporting.metrics_endpoint import read_token_file

            read_token_file(self.metrics_token_file)  # a 0600 file of ours with one token, or refused now
        for key in ("report", "plots"):
            if getattr(self, key) is not None:
                check_output_path(key, getattr(self, key), directory=key == "plots")
        self._check_choices()
        broker_config(self.data_dir or tempfile.gettempdir(), self.broker, "")  # `checked` names the source
        consumer_settings(self.consumer, "")

    def _check_choices(self) -> None:
        """Names and engine options are checked here, before any process starts: a typo
        must not surface as a child's traceback after the broker and producers started."""
        from pipeline.consumer.engines import ENGINES
        from pipeline.runtime.processes import DURABILITY_LEVELS, STORAGE_KINDS

        for key, allowed in (("storage", STORAGE_KINDS), ("durability", DURABILITY_LEVELS), ("engine", ENGINES)):
            if getattr(self, key) not in allowed:
                raise SettingsError(f"{key} must be one of {', '.join(sorted(allowed))}, got {getattr(self, key)!r}")
        if self.storage == "memory" and self.durability == "power":
            raise SettingsError("durability 'power' needs storage 'disk': the memory tier is not durable")
        check_engine_options(self.engine, self.engine_options)


def check_engine_options(engine: str, options: dict) -> None:
    """The engine made with `options` and closed at once (nothing loaded): its refusal of an
    option (EngineOptionsError, naming it), or a runtime not installed here, as a
    SettingsError. The launch and `pipeline consumer start` both check this way."""
    from pipeline.consumer.engines import make_engine

    try:
        make_engine(engine, **options).close()
    except (TypeError, ValueError, EngineUnavailableError) as exc:  # vllm not installed: refused here too
        raise SettingsError(f"engine_options {options} for engine {engine!r}: {exc}") from exc


# Cores a CPU launch keeps for the broker, the producers (they tokenize) and the launcher,
# outside the engines' OMP threads. Measured (`pipeline bench run-batch`'s sides, 2 cores, one vllm
# consumer): 2 threads gave a processing span of 5.4 to 12.9 s and 1 thread 5.1 to 5.7 s;
# an engine that takes every core competes with the processes that feed it.
CPU_CORES_KEPT = 1


def engine_options_for_host(engine: str, options: dict, *, gpus: int, consumers: int, cores: int,
                            data_dir: str) -> tuple[dict, dict]:
    """Each consumer's engine options, and the ones filled in here (the launch shows them).
    Only a vllm engine on a machine without a GPU gets any, and only those the user did not
    give: enforce_eager, block_size (CPU_VLLM_BLOCK_SIZE_TOKENS), kv_cache_memory_bytes
    (CPU_VLLM_KV_CACHE_BYTES, unless gpu_memory_utilization is given), cpu_threads (the
    cores less CPU_CORES_KEPT    cores shared out, at least 1 each) and cache_dir (DATA_DIR/engine-cache).
    NOTE: load_format is never filled in: "dummy" runs random weights, which a real model
    must not do silently. On a GPU vLLM's own defaults stand (its compile cache in the home
    directory outlives the run: worth minutes at each start)."""
    from pipeline.consumer.engines.vllm_options import flag_option_names

    if engine != "vllm" or gpus:
        return dict(options), {}
    given = flag_option_names(options)  # vLLM's flags among them, read off their words
    defaults = {"enforce_eager": True, "block_size": CPU_VLLM_BLOCK_SIZE_TOKENS,
                "cpu_threads": max(1, (cores - CPU_CORES_KEPT) // max(1, consumers)),
                "cache_dir": os.path.join(data_dir, ENGINE_CACHE_DIR)}
    if "gpu_memory_utilization" not in given:
        defaults["kv_cache_memory_bytes"] = CPU_VLLM_KV_CACHE_BYTES
    filled = {key: value for key, value in defaults.items() if key not in given}
    return {**options, **filled}, filled


def engine_option_items(options: dict) -> dict[str, object]:
    """`options` one by one, as the engine holds them: llm_kwargs' keys as llm_kwargs.KEY, and
    vLLM's flags (`vllm_flags`, as typed) where vLLM's parser puts them (`flag_words`:
    --max-num-seqs 8 as llm_kwargs.max_num_seqs, --dtype as dtype, a flag after an option
    of the same name winning). What a job's manifest judges, each on its own (a resource,
    or what answers depend on)."""
    from pipeline.consumer.engines.vllm_options import VllmOptions, flag_words

    flat = {key: value for key, value in options.items() if key not in ("llm_kwargs", "vllm_flags")}
    kwargs = options.get("llm_kwargs")
    if isinstance(kwargs, dict):
        flat |= {f"llm_kwargs.{key}": value for key, value in kwargs.items()}
    elif "llm_kwargs" in options:
        flat["llm_kwargs"] = kwargs
    own = {f.name for f in fields(VllmOptions)}
    for dest, value in flag_words(options.get("vllm_flags") or []):
        flat[dest if dest in own else f"llm_kwargs.{dest}"] = value
    return flat


def workload_vocab_size(settings: LaunchSettings) -> tuple[int, str]:
    """The vocabulary made-up token ids are drawn from, and where it came from: `vocab_size`
    when set; for a vllm engine its model directory's config.json (a SettingsError naming the
    file if that cannot be read: ids past the vocabulary would make every item an engine
    error); VOCAB_SIZE otherwise (the sim engine only hashes ids)."""
    if settings.vocab_size is not None:
        return settings.vocab_size, "vocab_size"
    if settings.engine != "vllm":
        return VOCAB_SIZE, "the default"
    path = os.path.join(str(settings.engine_options.get("model", "")), "config.json")
    return model_vocab_size(path), path


def model_vocab_size(path: str) -> int:
    """A Hugging Face config.json's `vocab_size` (top level, or a multimodal model's
    `text_config`), read as JSON: neither vLLM nor torch is imported for it."""
    fix = "give the model's vocabulary as vocab_size (--vocab-size N)"
    document = _model_config(path, "for its vocab_size", fix)
    text_config = document.get("text_config")
    value = document.get("vocab_size", text_config.get("vocab_size") if isinstance(text_config, dict) else None)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_VOCAB_SIZE:
        raise SettingsError(f"{path}: vocab_size {value!r} is not an integer in [1, {MAX_VOCAB_SIZE:,}]: {fix}")
    return value


# The longest context a model's config.json may declare: 16 Mi tokens, past every model's
# (Llama 4 Scout's 10 Mi is the longest seen); a larger number is a broken config.
MAX_CONTEXT_TOKENS = 1 << 24


def model_context_len(path: str) -> int | None:
    """A Hugging Face config.json's context length (`max_position_embeddings`, top level or
    in `text_config`); None where it names none. SettingsError if the file cannot be read.
    The fix it names is --max-model-len (the context itself, prompt and output tokens: a job
    checks max_tokens against it), not --max-input-len (which bounds prompts only)."""
    fix = "give the model's context with --max-model-len"
    document = _model_config(path, "for its context length", fix)
    text_config = document.get("text_config")
    value = document.get("max_position_embeddings",
                         text_config.get("max_position_embeddings") if isinstance(text_config, dict) else None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= MAX_CONTEXT_TOKENS:
        raise SettingsError(f"{path}: max_position_embeddings {value!r:.40} is not a context length (an integer "
                            f"from 2 to {MAX_CONTEXT_TOKENS:,}): fix the model's config.json, or {fix}")
    return value


def _model_config(path: str, why: str, fix: str) -> dict:
    """A model's config.json as a JSON object (SettingsError naming the path otherwise)."""
    try:
        with open(path, "rb") as file:
            document = json.loads(file.read(MAX_MODEL_CONFIG_BYTES))  # a cut one fails to parse
    except OSError as exc:
        raise SettingsError(f"cannot read the model's {path} {why} ({exc.strerror or exc}): {fix}") from exc
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise SettingsError(f"{path}: not a JSON model config ({exc}): {fix}") from exc
    if not isinstance(document, dict):
        raise SettingsError(f"{path}: not a JSON object: {fix}")
    return document


def _check_range(key: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise SettingsError(f"{key} must be in [{low:,}, {high:,}], got {value:,}")


def check_replay_speed(replay_speed: float | None) -> None:
    """A replay speed is a finite number above 0 (nan and inf are refused here, before any
    producer starts, not inside them)."""
    if replay_speed is not None and not (math.isfinite(replay_speed) and replay_speed > 0):
        raise SettingsError(f"replay_speed must be a finite number above 0, got {replay_speed}")


def check_output_path(key: str, path: str, directory: bool) -> None:
    """Where the run writes a file (`directory` False: the report) or a directory of files
    (the plots) must be writable before the run starts: a missing directory found after a
    long run loses its report."""
    if directory and os.path.isdir(path):
        parent = path
    elif os.path.isdir(path):
        raise SettingsError(f"{key} {path}: is a directory, not a file")
    else:
        parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise SettingsError(f"{key} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SettingsError(f"{key} {path}: the directory {parent} is not writable")


# The type each setting takes (what TOML and click give); float settings accept integers.
_TYPES: dict[str, tuple[type, ...]] = {
    "data_dir": (str,), "workload": (str,), "items": (int,), "producers": (int,), "consumers": (int,),
    "engine": (str,), "engine_options": (dict,), "storage": (str,), "durability": (str,),
    "max_batch": (int,), "max_batch_tokens": (int,), "max_input_len": (int,), "replay_speed": (float, int),
    "report": (str,), "plots": (str,), "metrics_port": (int,),
    "metrics_token_file": (str,), "workload_seed": (int,), "vocab_size": (int,),
    "broker": (dict,),
    "consumer": (dict,),
}
assert set(_TYPES) == {f.name for f in fields(LaunchSettings)}


def _typed(key: str, value: object, types: tuple[type, ...], source: str) -> object:
    if isinstance(value, bool) or not isinstance(value, types):
        raise SettingsError(f"{source}: {key} must be {' or '.join(t.__name__ for t in types)}, "
                            f"got {value!r}")
    return float(value) if float in types else value


def load_toml(path: str) -> dict:
    """The settings in a TOML file: its top level, or its `[launch]` table if it has one."""
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except OSError as exc:
        raise SettingsError(f"cannot read the config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from exc
    if "launch" in document:
        rest = {key: value for key, value in document.items() if key != "launch"}
        if not isinstance(document["launch"], dict) or not set(rest) <= set(PROCESS_TABLES):
            raise SettingsError(f"{path}: beside a [launch] table a file holds only "
                                f"{', '.join(f'[{t}]' for t in PROCESS_TABLES)} tables")
        return document["launch"] | rest
    return document
