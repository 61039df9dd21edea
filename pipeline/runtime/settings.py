"""Settings of `pipeline launch`: embedded defaults, then a TOML file, then the command line.

    settings = LaunchSettings.resolve(config_path="run.toml", overrides={"items": 5000})

Every option of the command can come from the file under the same name (underscores, not
dashes), at the top level or in a `[launch]` table; `engine_options` is a table passed to the
engine (the sim engine's `block_size_tokens`, `capacity_tokens`, `cost_s_per_padded_token`).
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

import math
import os
import tempfile
import tomllib
from dataclasses import dataclass, field, fields, replace

from pipeline.broker.config import MAX_CONSUMERS, MAX_PRODUCERS
from pipeline.runtime.tables import PROCESS_TABLES, broker_config, consumer_settings, merged
from pipeline.wire.errors import EngineUnavailableError, SettingsError
from pipeline.wire.layouts import MAX_SEQ

# The demo: enough items to show lanes, shape switches and a warm cache, and short enough to
# finish in seconds on a 2-core machine (the target: well under a minute including start-up).
DEMO_ITEMS = 20_000
# CPU consumers when the machine has no GPU (one per GPU otherwise).
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
# The demo's seed goes to numpy's generator, which takes any non-negative integer; 2**63 - 1
# keeps it a TOML integer.
MAX_SEED = 2**63 - 1


@dataclass(slots=True)
class LaunchSettings:
    """Everything `pipeline launch` needs. `data_dir` None: a temporary directory, removed
    after the run. `consumers` None: one per GPU, or DEFAULT_CPU_CONSUMERS without GPUs.
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
    max_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_input_len: int = DEFAULT_MAX_INPUT_LEN
    replay_speed: float | None = None
    report: str | None = None
    plots: str | None = None
    metrics_port: int | None = None
    seed: int = 0
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
            if key not in known:
                raise SettingsError(f"{source}: unknown setting {key!r} (known: {', '.join(sorted(known))})")
            value = _typed(key, value, _TYPES[key], source)
            changes[key] = merged(getattr(self, key), value) if isinstance(value, dict) else value
        return replace(self, **changes)

    def check(self) -> None:
        for key in ("max_batch", "max_tokens", "max_input_len"):
            if getattr(self, key) <= 0:
                raise SettingsError(f"{key} must be positive, got {getattr(self, key)}")
        _check_range("producers", self.producers, 1, MAX_PRODUCER_PROCESSES)
        if self.consumers is not None:
            _check_range("consumers", self.consumers, 1, MAX_CONSUMER_PROCESSES)
        if self.items is not None:
            _check_range("items", self.items, 1, MAX_ITEMS)
        _check_range("seed", self.seed, 0, MAX_SEED)
        check_replay_speed(self.replay_speed)
        if self.metrics_port is not None:
            _check_range("metrics_port", self.metrics_port, 0, 65535)
        for key in ("report", "plots"):
            if getattr(self, key) is not None:
                check_output_path(key, getattr(self, key), directory=key == "plots")
        self._check_choices()
        broker_config(self.data_dir or tempfile.gettempdir(), self.broker, "")  # `checked` names the source
        consumer_settings(self.consumer, "")

    def _check_choices(self) -> None:
        """Names and engine options are checked here, before any process starts: a typo
        must not surface as a child's traceback after the broker and producers started."""
        from pipeline.consumer.engines import ENGINES, make_engine
        from pipeline.runtime.processes import DURABILITY_LEVELS, STORAGE_KINDS

        for key, allowed in (("storage", STORAGE_KINDS), ("durability", DURABILITY_LEVELS), ("engine", ENGINES)):
            if getattr(self, key) not in allowed:
                raise SettingsError(f"{key} must be one of {', '.join(sorted(allowed))}, got {getattr(self, key)!r}")
        if self.storage == "memory" and self.durability == "power":
            raise SettingsError("durability 'power' needs storage 'disk': the memory tier is not durable")
        try:
            make_engine(self.engine, **self.engine_options).close()
        except (TypeError, ValueError, EngineUnavailableError) as exc:  # vllm not installed: refused here too
            raise SettingsError(f"engine_options {self.engine_options} for engine {self.engine!r}: {exc}") from exc


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
    "max_batch": (int,), "max_tokens": (int,), "max_input_len": (int,), "replay_speed": (float, int),
    "report": (str,), "plots": (str,), "metrics_port": (int,), "seed": (int,), "broker": (dict,),
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
