"""The engine interface: what a consumer needs from an inference runtime, and nothing more.

An engine takes batches of prompts (token ids, all of one shape, with each item's
generation parameters) and returns, per prompt, the generated token ids, how many prompt
tokens its prefix cache served, why generation stopped and, where it has a tokenizer, the
text. Engines import nothing of the broker (SPEC §"Processes and layout"): a batch arrives
as numpy views that the consumer mapped from segment files, and leaves as plain results.

Two ways in, one engine. `run(batch)` runs one batch to the end (tests, benchmarks, and
the whole of a synchronous engine such as `sim`). The consumer drives the pipelined form,
so that a real engine's scheduler never waits on the consumer between batches:

    engine.submit(key, batch)      start it (a synchronous engine runs it here)
    engine.wants_more()            whether the engine has room for another batch now
    engine.poll()                  advance; [(key, EngineResult), ...] of batches finished
    engine.abort()                 drop every batch not finished; their keys

    engine = make_engine("sim", block_size_tokens=16, capacity_tokens=1 << 20)
    result = engine.run(EngineBatch(prompts=[view_a, view_b], pad_to_tokens=512,
                                    prefix_lens=[400, 400]))
    result.outputs[0], result.cached_tokens[0], result.counted.cache_hit_tokens
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from pipeline.wire.generation import MAX_ANSWER_TEXT_CHARS, GenerationParams

# The largest tensor or pipeline parallel size an engine takes (each its GPUs, or on vLLM's
# CPU build its worker processes): a node holds 8 GPUs (16 at most today), and 64 worker
# processes on one machine is past any use. An engine over several nodes is vLLM's
# multi-node mode, which the launcher does not start.
MAX_PARALLEL_SIZE = 64
# Why a prompt's generation stopped, as vLLM and OpenAI's API name it.
FINISH_LENGTH = "length"  # max new tokens reached
FINISH_STOP = "stop"  # an end-of-sequence token or a stop string


@dataclass(slots=True)
class EngineBatch:
    """One batch as the engine sees it.

    `model` is the batch's model id (every item's): 0 the base model, LORA_FIRST_MODEL + k
    (`pipeline/wire/generation.py`) the engine's adapter k. `prompts[i]` is item i's token ids (int32; a zero-copy view into a segment file, so
    engines must not write to it); every prompt is padded to `pad_to_tokens` for the cost of
    the batch. `prefix_lens[i]` is how many leading tokens the shape's components cover
    (cache accounting only). `params[i]`: item i's generation parameters, None for the
    engine's defaults (an empty `params`: None for every item).
    """

    prompts: Sequence[np.ndarray]
    pad_to_tokens: int
    prefix_lens: Sequence[int]
    params: Sequence[GenerationParams | None] = ()
    model: int = 0

    def params_of(self, i: int) -> GenerationParams | None:
        return self.params[i] if self.params else None


@dataclass(slots=True)
class EngineCounters:
    """Exact totals over batches an engine ran: over all of them (`Engine.counters`), or
    over one (`EngineResult.counted`: what that batch added)."""

    batches: int = 0
    prompts: int = 0
    prompt_tokens: int = 0
    padded_tokens: int = 0
    cacheable_tokens: int = 0  # whole cache blocks inside the shapes' components
    cache_hit_tokens: int = 0
    cacheable_hit_tokens: int = 0  # hits inside those blocks (at most cacheable_tokens)
    # Cacheable tokens missed on their first reference by this engine (the "compulsory"
    # misses of the 3C model): no cache and no schedule could have served them. For shapes
    # that share no prefix this is the cacheable tokens of each shape's first item; where
    # shapes share leading blocks (a trace's common system prompt), only the blocks new to
    # the engine count.
    compulsory_miss_tokens: int = 0
    output_tokens: int = 0
    # Nanoseconds the engine was busy running batches (an int: summed exactly on the wire).
    # A synchronous engine times each batch's run; a pipelined one its scheduler steps, each
    # finished batch carrying the steps since the one before (vllm.py), so the sum is the
    # engine's busy time however its batches overlap.
    busy_ns: int = 0
    # Engine-specific figures, not summed (the sim's evicted blocks; vLLM's own counters).
    extra: dict[str, int] = field(default_factory=dict)

    def add(self, other: EngineCounters) -> None:
        """Add another's totals (a batch's) to these; `extra` is the engine's to keep."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))


_SUMMED = tuple(f.name for f in fields(EngineCounters) if f.name != "extra")

# The totals a completion reports for its batch, by name (ConsumerWork's engine fields).
BATCH_TOTALS = ("prompt_tokens", "padded_tokens", "cacheable_tokens", "cache_hit_tokens", "cacheable_hit_tokens",
                "compulsory_miss_tokens", "output_tokens", "busy_ns")

# `Engine.check_totals`' keys: the engine's own prefix-cache counters, and ours over the same
# requests (ConsumerWork's engine check fields).
CHECK_KEYS = ("engine_prefix_cache_queries", "engine_prefix_cache_hits", "engine_checked_prompt_tokens",
              "engine_checked_cache_hit_tokens")


# One token's log probabilities as an engine gives them: the sampled token's (token id, log
# probability, its text where the engine decodes it) first, then the top alternatives in
# rank order (vLLM's per-position dict, in its order), the sampled one not repeated.
TokenLogprobs = list[tuple[int, float, str | None]]


@dataclass(slots=True)
class Sample:
    """One of an item's outputs (`GenerationParams.n` of them): its token ids, why it
    stopped, its text where the engine decodes it, and its tokens' log probabilities where
    the item asked for them (one TokenLogprobs per token id)."""

    token_ids: list[int]
    finish_reason: str
    text: str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class EngineResult:
    """Per prompt: generated token ids (a list of ints: what an engine's detokenizer-free
    output is, and what the results file stores), prompt tokens served from the cache, and
    why generation stopped (FINISH_*). `texts`: the generated text per prompt where the
    engine has a tokenizer, else None. `errors`, where an engine failed some prompts and ran
    the others (a real engine's refusal of one prompt, an out-of-memory): per prompt, the
    engine's message, or None for a prompt that ran; a failed prompt's output is [] and its
    cached tokens 0. None: every prompt ran. `counted`: what the prompts that ran added to
    the engine's counters. `samples`, where an item asked for more than one output or for
    log probabilities: per prompt, every Sample (outputs[i], finish_reasons[i] and texts[i]
    are then its first one's), or None for a prompt that asked for neither; None: no prompt
    did. `counted.output_tokens` counts every sample's tokens. `embeddings`, where some item
    was to embed (GenerationParams.embed): per prompt, each of its inputs' embedding (float32,
    in input order; its output is [] and its finish reason FINISH_STOP), or None for an item
    generated; None: no item was to embed."""

    outputs: list[list[int]]
    cached_tokens: list[int]
    finish_reasons: list[str]
    counted: EngineCounters
    texts: list[str | None] | None = None
    errors: list[str | None] | None = None
    samples: list[list[Sample] | None] | None = None
    embeddings: list[list[np.ndarray] | None] | None = None

    def fail_long_texts(self) -> None:
        """Prompts whose texts (every sample's, their logprob tokens') are longer than
        MAX_ANSWER_TEXT_CHARS become the engine's failures: their results row would be past
        what a job reads, and such text is the model's decoder expanding tokens."""
        for i in range(len(self.outputs)):
            chars = len(self.texts[i] or "") if self.texts is not None else 0
            for sample in (self.samples[i] or ()) if self.samples is not None else ():
                chars += len(sample.text or "") + sum(len(entry[2] or "") for token in sample.logprobs or ()
                                                      for entry in token)
            if chars > MAX_ANSWER_TEXT_CHARS and (self.errors is None or self.errors[i] is None):
                self.errors = self.errors if self.errors is not None else [None] * len(self.outputs)
                self.errors[i] = (f"the model's tokenizer decoded this answer to {chars:,} characters, more than "
                                  f"{MAX_ANSWER_TEXT_CHARS:,} (its decoder expands tokens)")


def embedding_inputs(prompt: np.ndarray, params: GenerationParams) -> list[np.ndarray]:
    """An item to embed's inputs: views of its prompt, cut at its input lengths; ValueError
    where they do not add up to the prompt (an envelope that is not this prompt's)."""
    ends = np.cumsum(params.input_lengths)
    if not len(ends) or int(ends[-1]) != len(prompt):
        raise ValueError(f"the inputs to embed are {int(ends[-1]) if len(ends) else 0} tokens together, and the "
                         f"prompt {len(prompt)}")
    return np.split(prompt, ends[:-1].tolist())


class Engine(abc.ABC):
    """An inference runtime behind the consumer. Owner: one consumer process; not
    thread-safe (the consumer's main thread drives it). `close()` releases the runtime.

    A synchronous engine implements `run`; the pipelined methods then run each batch as it
    is submitted. A pipelined engine (vllm) overrides them and `run` drives them."""

    name: str = "engine"

    def __init__(self) -> None:
        self.counters = EngineCounters()
        self._finished: list[tuple[int, EngineResult]] = []

    @abc.abstractmethod
    def run(self, batch: EngineBatch) -> EngineResult:
        """Run one padded batch to the end: one output, cached-token count and finish reason
        per prompt (and an error per prompt where some failed: EngineResult.errors)."""

    def start(self) -> None:
        """Load the runtime now (a model, minutes on a GPU), before the consumer registers:
        the broker then sees a consumer ready to run. Nothing by default."""

    def max_running_prompts(self) -> int:
        """How many prompts the engine runs at once when fed ahead (vLLM's max_num_seqs), so
        the consumer asks the broker for enough batches to keep that many in flight; 0 for
        an engine that runs one batch at a time."""
        return 0

    def submit(self, key: int, batch: EngineBatch) -> None:
        """Start a batch; its result comes out of `poll` under `key`."""
        self._finished.append((key, self.run(batch)))

    def wants_more(self) -> bool:
        """Whether a batch submitted now would start without waiting for others to end. A
        synchronous engine takes the next one only once the last one's result was polled:
        each batch is written and completed before the next runs."""
        return not self._finished

    def poll(self) -> list[tuple[int, EngineResult]]:
        """Advance the batches submitted (a step of a real engine's scheduler) and return
        those that finished, in no particular order."""
        done, self._finished = self._finished, []
        return done

    def abort(self) -> list[int]:
        """Drop every batch not yet returned by `poll`; their keys."""
        dropped = [key for key, _ in self._finished]
        self._finished = []
        return dropped

    def check_totals(self) -> dict[str, int]:
        """The engine's own prefix-cache counters beside ours over the same prompts, where
        it keeps any (vllm.py): cumulative, and only ever taken when nothing was in flight,
        so both sides count exactly the same requests. Empty for an engine that counts
        nothing of its own (sim: its counters are ours)."""
        return {}

    def close(self) -> None:
        """Release the runtime (GPU memory, threads); nothing by default."""
