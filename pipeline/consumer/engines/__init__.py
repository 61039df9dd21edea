"""Engine runtimes behind one small interface (SPEC §6). `sim` is the embedded default."""

from __future__ import annotations

from pipeline.consumer.engines.base import Engine, EngineBatch, EngineCounters, EngineResult
from pipeline.consumer.engines.sim import SimConfig, SimEngine
from pipeline.consumer.engines.vllm import VllmEngine

# Engines by name, for `--engine`. vllm's module imports vLLM only when its first batch
# runs (in the consumer process), so every engine can be listed here without it installed.
ENGINES: dict[str, type[Engine]] = {"sim": SimEngine, "vllm": VllmEngine}


def make_engine(name: str, **options) -> Engine:
    """An engine by name, with its options (ValueError names the known engines)."""
    try:
        engine_class = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None
    return engine_class(**options)


__all__ = ["ENGINES", "Engine", "EngineBatch", "EngineCounters", "EngineResult", "SimConfig", "SimEngine", "VllmEngine", "make_engine"]
