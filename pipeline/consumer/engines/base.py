"""The engine interface: what a consumer needs from an inference runtime, and nothing more.

An engine takes one padded batch of prompts (token ids, all of one shape) and returns, per
prompt, the generated token ids and how many prompt tokens its prefix cache served. Engines
import nothing of the broker (SPEC §"Processes and layout"): a batch arrives as numpy views
that the consumer mapped from segment files, and leaves as plain results.

    engine = make_engine("sim", block_size_tokens=16, capacity_tokens=1 << 20)
    result = engine.run(EngineBatch(prompts=[view_a, view_b], pad_to_tokens=512,
                                    prefix_lens=[400, 400]))
    result.outputs[0], result.cached_tokens[0]
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class EngineBatch:
    """One batch as the engine sees it.

    `prompts[i]` is item i's token ids (int32; a zero-copy view into a segment file, so
    engines must not write to it); every prompt is padded to `pad_to_tokens` for the cost of
    the batch. `prefix_lens[i]` is how many leading tokens the shape's components cover
    (cache accounting only).
    """

    prompts: Sequence[np.ndarray]
    pad_to_tokens: int
    prefix_lens: Sequence[int]


@dataclass(slots=True)
class EngineResult:
    """Per prompt: generated token ids (a list of ints: what an engine's detokenizer-free
    output is, and what the results file stores) and prompt tokens served from the cache.
    `errors`, where an engine failed some prompts and ran the others (a real engine's
    refusal of one prompt, an out-of-memory): per prompt, the engine's message, or None for
    a prompt that ran; a failed prompt's output is [] and its cached tokens 0. None: every
    prompt ran."""

    outputs: list[list[int]]
    cached_tokens: list[int]
    errors: list[str | None] | None = None


@dataclass(slots=True)
class EngineCounters:
    """Exact totals over every batch an engine ran."""

    batches: int = 0
    prompts: int = 0
    prompt_tokens: int = 0
    padded_tokens: int = 0
    cacheable_tokens: int = 0  # whole cache blocks inside the shapes' components
    cache_hit_tokens: int = 0
    # Cacheable tokens missed on their first reference by this engine (the "compulsory"
    # misses of the 3C model): no cache and no schedule could have served them. For shapes
    # that share no prefix this is the cacheable tokens of each shape's first item; where
    # shapes share leading blocks (a trace's common system prompt), only the blocks new to
    # the engine count.
    compulsory_miss_tokens: int = 0
    output_tokens: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class Engine(abc.ABC):
    """An inference runtime behind the consumer. Owner: one consumer process; not
    thread-safe (the consumer runs one batch at a time). `close()` releases the runtime."""

    name: str = "engine"

    def __init__(self) -> None:
        self.counters = EngineCounters()

    @abc.abstractmethod
    def run(self, batch: EngineBatch) -> EngineResult:
        """Run one padded batch; return one output and one cached-token count per prompt
        (and an error per prompt where some failed: EngineResult.errors)."""

    def close(self) -> None:
        """Release the runtime (GPU memory, threads); nothing by default."""
