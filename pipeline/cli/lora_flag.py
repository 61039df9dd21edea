"""vLLM's `--lora-modules`, read as vLLM reads it, out of a command line's left-over words.

    pipeline run-batch ... --lora-modules sql=/adapters/sql '{"name": "chat", "path": "/adapters/chat"}'

Each value is NAME=PATH, or a JSON object with vLLM's LoRAModulePath fields (`name`, `path`,
`base_model_name`); one flag takes several values (vLLM's nargs "+"), up to the next flag.
NOTE: vLLM keeps the last --lora-modules of a command line; here every one given adds its
adapters (a name given twice is refused), so a long list may be split over lines.
An adapter becomes the engine option `lora_modules` ([{"name", "path"}], in the order given):
adapter k (0-based) is model id k + 1 to the broker, the base model 0
(`pipeline/wire/generation.py`, LORA_FIRST_MODEL).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from pipeline.wire.generation import MAX_LORA_MODULES
from pipeline.wire.errors import SettingsError

FLAG = "--lora-modules"
# vLLM's LoRAModulePath fields.
MODULE_KEYS = frozenset({"name", "path", "base_model_name"})
# What vLLM reads of an adapter directory: it refuses one without it at load.
ADAPTER_CONFIG = "adapter_config.json"


def take_lora_modules(extra: Sequence[str]) -> tuple[list[dict[str, str]], list[str]]:
    """(the adapters of every --lora-modules in `extra`, the words left); SettingsError in
    one line for a value vLLM would refuse, a name given twice, or a path with no adapter."""
    modules: list[dict[str, str]] = []
    rest: list[str] = []
    words = list(extra)
    k = 0
    while k < len(words):
        word = words[k]
        if word != FLAG and not word.startswith(FLAG + "="):
            rest.append(word)
            k += 1
            continue
        values = [word.split("=", 1)[1]] if "=" in word else []
        k += 1
        while k < len(words) and not words[k].startswith("-"):
            values.append(words[k])
            k += 1
        if not values:
            raise SettingsError(f"{FLAG}: expected at least one NAME=PATH or JSON object")
        modules.extend(_module(value) for value in values if value)
    _check(modules)
    return modules, rest


def _module(value: str) -> dict[str, str]:
    if "=" in value and "," not in value:  # vLLM's test: NAME=PATH, else JSON
        name, path = value.split("=", 1)
        return {"name": name, "path": path}
    try:
        found = json.loads(value)
    except json.JSONDecodeError:
        raise SettingsError(f"{FLAG}: invalid JSON format for --lora-modules: {value}") from None
    if not isinstance(found, dict) or set(found) - MODULE_KEYS or not {"name", "path"} <= set(found) \
            or not all(isinstance(v, str) for v in found.values()):
        raise SettingsError(f"{FLAG}: invalid fields for --lora-modules: {value} (an object of string name, path "
                            f"and optionally base_model_name)")
    return {"name": found["name"], "path": found["path"]}


def _check(modules: list[dict[str, str]]) -> None:
    if len(modules) > MAX_LORA_MODULES:
        raise SettingsError(f"{FLAG}: {len(modules)} adapters, at most {MAX_LORA_MODULES}")
    seen: set[str] = set()
    for module in modules:
        name, path = module["name"], module["path"]
        if not name or name in seen:
            raise SettingsError(f"{FLAG}: adapter name {name!r} is {'empty' if not name else 'given twice'}")
        seen.add(name)
        if not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
            raise SettingsError(f"{FLAG} {name}={path}: no {ADAPTER_CONFIG} there (a PEFT LoRA adapter's directory)")
        module["path"] = os.path.abspath(path)
