"""Process settings from tables: the `[broker]` and `[consumer]` tables of a launch's TOML
file and `--set KEY=VALUE` on the command line both become the one settings object of each
process (`BrokerConfig`, `ConsumerConfig`), checked before anything starts.

    [broker]                       pipeline launch --set broker.max_age_s=30 \\
    max_age_s = 30                                 --set broker.lanes.max_lanes=512 \\
    [broker.lanes]                                 --set consumer.credit_max_batches=8
    max_lanes = 512
    measure = "queued_min"
    [consumer]
    credit_max_batches = 8

A key is a field of the process's settings object; a nested object (the broker's `lanes`,
a LaneConfig) takes a table. What has its own option (the data directory, the consumer's
contract, engine and name) is not a key here. An unknown key, a value of the wrong type or
one its object refuses is a SettingsError naming where it came from and the key.
"""

from __future__ import annotations

import enum
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, Field, asdict, fields, is_dataclass
from typing import Any

from pipeline.broker.config import BrokerConfig
from pipeline.consumer.config import ConsumerConfig
from pipeline.wire.errors import BadInputError, ConfigError, SettingsError

# Fields of the processes' settings objects that come from options of their own, never a table.
BROKER_OWN_OPTIONS = frozenset({"data_dir"})
CONSUMER_OWN_OPTIONS = frozenset({"socket_path", "results_dir", "name", "model", "max_batch_items",
                                  "max_batch_tokens", "max_input_len", "engine", "engine_options", "gpu"})
# The process tables a launch takes (`--set broker.x=1`, `[consumer]`).
PROCESS_TABLES = ("broker", "consumer")
# How deep `--set` keys nest: process, object, field (broker.lanes.max_lanes).
MAX_KEY_PARTS = 3


def broker_config(data_dir: str, table: Mapping[str, Any], source: str) -> BrokerConfig:
    """The broker's settings: BrokerConfig(data_dir) with `table` applied."""
    return _build(BrokerConfig, {"data_dir": data_dir}, table, BROKER_OWN_OPTIONS, _where(source, "broker"))


def consumer_settings(table: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The consumer fields `table` sets, checked (a ConsumerConfig is built to check them):
    keyword arguments for each consumer's ConsumerConfig."""
    where = _where(source, "consumer")
    values = _values(ConsumerConfig, table, CONSUMER_OWN_OPTIONS, where)
    _construct(ConsumerConfig, {"socket_path": "", "results_dir": "", "name": "any"}, values, where)
    return values


def parse_assignments(pairs: Sequence[str], source: str = "--set",
                      example: str = "broker.max_age_s or broker.lanes.max_lanes") -> dict[str, Any]:
    """`KEY=VALUE` pairs as nested tables: "broker.lanes.max_lanes=512" -> {"broker":
    {"lanes": {"max_lanes": 512}}}. VALUE is read as a TOML value (30, 0.5, true,
    "queued_min"); a bare word is taken as a string. `example` names keys in the error."""
    tables: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts) or len(parts) > MAX_KEY_PARTS:
            raise SettingsError(f"{source} {pair!r}: expected KEY=VALUE with KEY like {example} "
                                f"(at most {MAX_KEY_PARTS} parts)")
        table = tables
        for part in parts[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise SettingsError(f"{source} {pair!r}: {part} is set to a value and used as a table")
        table[parts[-1]] = _toml_value(text.strip())
    return tables


def parse_engine_options(values: Sequence[str], source: str = "--engine-options") -> dict[str, Any]:
    """`--engine-options KEY=VALUE,KEY=VALUE` (repeatable) as the `engine_options` table,
    each pair read as `--set engine_options.KEY=VALUE` reads it: "model=/m,enforce_eager=true,
    block_size=32" -> {"model": "/m", "enforce_eager": True, "block_size": 32}. A comma
    inside quotes or brackets does not split ('model="/a,b"', 'llm_kwargs={x=1,y=2}'); a
    later pair wins over an earlier one. Which keys an engine takes is the engine's check."""
    pairs = []
    for value in values:
        split = _split_pairs(value)
        if not all(pair.strip() for pair in split):
            raise SettingsError(f"{source} {value!r}: an empty KEY=VALUE (a doubled or trailing comma)")
        pairs += split
    return parse_assignments(pairs, source, example="model or llm_kwargs.max_num_seqs")


def _split_pairs(text: str) -> list[str]:
    """`text` cut at its commas outside TOML quotes, brackets and braces."""
    pairs, start, depth, quote, escaped = [], 0, 0, "", False
    for i, char in enumerate(text):
        if escaped:
            escaped = False
        elif quote:
            escaped = char == "\\" and quote == '"'  # a basic string's escape; a literal one has none
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            pairs.append(text[start:i])
            start = i + 1
    return pairs + [text[start:]]


def merged(base: Mapping[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """`more` over `base`, table by table (a later source overrides single keys)."""
    out = dict(base)
    for key, value in more.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def shown(config: object, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A settings object as plain JSON values (enums by value), for the run report."""
    assert is_dataclass(config), config
    return {key: _plain(value) for key, value in asdict(config).items() if key not in skip}


def run_settings(broker: BrokerConfig, consumer: ConsumerConfig, engine: str, consumers: int, engine_options: dict,
                 filled_in: dict) -> dict[str, Any]:
    """A run's broker and consumer settings as they ran, its engine's, and which of them differ
    from the defaults (the report's "settings")."""
    return {"broker": shown(broker, skip=BROKER_OWN_OPTIONS),
            "consumer": shown(consumer, skip=CONSUMER_OWN_OPTIONS),
            "engine": {"name": engine, "consumers": consumers, "options": dict(engine_options),
                       "filled_in": dict(filled_in)},
            "changed": {**{f"broker.{k}": v for k, v in non_defaults(broker, BROKER_OWN_OPTIONS).items()},
                        **{f"consumer.{k}": v for k, v in non_defaults(consumer, CONSUMER_OWN_OPTIONS).items()},
                        **({"engine": engine} if engine != "sim" else {}),
                        **{f"engine_options.{k}": v for k, v in engine_options.items()}}}


def non_defaults(config: object, skip: frozenset[str] = frozenset(), prefix: str = "") -> dict[str, Any]:
    """The fields of a settings object that differ from their defaults, dotted (lanes.max_lanes)."""
    out: dict[str, Any] = {}
    for f in fields(config):
        if f.name in skip:
            continue
        value = getattr(config, f.name)
        default = _default(f)
        if is_dataclass(value) and is_dataclass(default):
            out |= non_defaults(value, prefix=f"{prefix}{f.name}.")
        elif value != default:
            out[f"{prefix}{f.name}"] = _plain(value)
    return out


def _where(source: str, table: str) -> str:
    return f"{source}: {table}" if source else table


def _build(cls: type, fixed: dict[str, Any], table: Mapping[str, Any], own: frozenset[str], where: str):
    return _construct(cls, fixed, _values(cls, table, own, where), where)


def _construct(cls: type, fixed: dict[str, Any], values: dict[str, Any], where: str):
    """cls(**fixed, **values), its own refusal of a value turned into a SettingsError."""
    try:
        return cls(**fixed, **values)
    except (ConfigError, BadInputError, ValueError, TypeError) as exc:
        raise SettingsError(f"{where}: {exc}") from exc


def _values(cls: type, table: Mapping[str, Any], own: frozenset[str], where: str) -> dict[str, Any]:
    """`table`'s keys as checked keyword arguments of `cls` (nested objects built)."""
    if not isinstance(table, Mapping):
        raise SettingsError(f"{where}: expected a table of settings, got {table!r}")
    known = {f.name: f for f in fields(cls) if f.name not in own}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in table.items():
        if key not in known:
            raise SettingsError(f"{where}: unknown setting {key!r} (known: {', '.join(sorted(known))})")
        values[key] = _typed(value, hints[key], f"{where}.{key}")
    return values


def _typed(value: object, hint: object, where: str) -> object:
    """`value` as the type `hint` names, or SettingsError: bool, int, float (an int too),
    str, an Enum (by value), a dataclass (from a table), and X | None of those."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if option is type(None):
            continue
        if isinstance(option, type) and issubclass(option, enum.Enum):
            if value in {member.value for member in option}:
                return option(value)
        elif isinstance(option, type) and is_dataclass(option):
            if isinstance(value, Mapping):
                return _build(option, {}, value, frozenset(), where)
        elif option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        elif option in (int, str, bool) and type(value) is option:
            return value
    names = " or ".join(_type_name(option) for option in options if option is not type(None))
    raise SettingsError(f"{where} must be {names}, got {value!r}")


def _type_name(option: object) -> str:
    if isinstance(option, type) and issubclass(option, enum.Enum):
        return "one of " + ", ".join(repr(member.value) for member in option)
    if isinstance(option, type) and is_dataclass(option):
        return "a table"
    return getattr(option, "__name__", str(option))


def _toml_value(text: str) -> object:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string


def _default(f: Field) -> object:
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default


def _plain(value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value
