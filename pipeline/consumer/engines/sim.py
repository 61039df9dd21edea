"""The `sim` engine: a simulated inference runtime with a real block-hash prefix cache.

It is the embedded default (no GPU needed) and the yardstick for what the broker buys: it
counts exactly what a vLLM-style engine would pay for and save.

Prefix cache, as vLLM's automatic prefix caching: a prompt is cut into full blocks of
`block_size_tokens`; block i's hash chains every token of blocks 0..i, so two prompts share
a cached block only if they share everything before it. A prompt's cached tokens are its
leading blocks found in the cache (the first miss ends the run); at least one token is
always computed, as an engine must produce logits. Capacity is in tokens (whole blocks),
evicted least recently used, and a prompt's blocks are touched tail first so a prefix's head
outlives its tail, as vLLM frees a request's blocks in reverse order.

Output: a few made-up ids per prompt (`output_tokens`), finishing by length. An item with
generation parameters gets the shape of a real answer instead (`sim_sampling.py`: n
samples, an end of sequence after `output_tokens` tokens where `eos_token_id` is known,
max and min tokens, stop strings and token ids, logprobs), its text decoded with the model's
tokenizer where `tokenizer` names a model directory (`pipeline run-batch` sets both). An
item to embed gets one made-up embedding per input: `embedding_size` normal numbers drawn
from a generator seeded with the input's token ids (cut to the item's dimensions), scaled
to unit norm as vLLM normalizes an embedding; the same input, the same embedding. A batch of
a LoRA adapter's model id (EngineBatch.model) gets other made-up outputs than the base
model's for the same prompts, the same ones every time: its seeds are mixed with the id.

Cost model, to emulate a GPU's time (a consumer-bound run, as on GPUs, compared on
makespan): each batch sleeps `cost_s_per_padded_token` for every padded token its cache did
not serve (`len(prompts) * pad_to_tokens` less the cached tokens: a padded batch computes
its padding, but not what its prefix cache holds) plus `cost_s_per_batch` (a step's fixed
overhead). Both default to 0, so the embedded demo and the tests measure the broker, not a
simulated GPU; GPU_7B_PREFILL_S_PER_TOKEN and GPU_STEP_OVERHEAD_S are figures for a GPU-bound
run. What was charged is counted (`extra`: charged_tokens, charged_ns; a batch's own in its
`counted.extra`), and each batch's `busy_ns` is the time its `run` took, the sleep included.
"""

from __future__ import annotations

import math
import os
import time
from itertools import chain
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from pipeline.consumer.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    MAX_PARALLEL_SIZE,
    Engine,
    EngineBatch,
    EngineCounters,
    EngineResult,
    Sample,
    embedding_inputs,
)
from pipeline.consumer.engines.prefix_cache import BatchLayout, PrefixCache
from pipeline.consumer.engines.sim_sampling import (
    CharBudget,
    Decode,
    DecodeRows,
    MadeUpSampler,
    SimRefusal,
    TokenChars,
    is_plain,
)
from pipeline.consumer.engines.sim_sampling import mix_array as _mix
from pipeline.wire.errors import EngineOptionsError
from pipeline.wire.generation import MAX_ANSWER_TEXT_CHARS, GenerationParams
from pipeline.wire.status import NS_PER_S

# vLLM's default KV block size.
DEFAULT_BLOCK_SIZE_TOKENS = 16
# About what one 80 GB GPU holds for a 7B model in FP16 after weights (~1M tokens of KV).
DEFAULT_CAPACITY_TOKENS = 1 << 20
# Generated tokens per prompt: the sim stands for the prefill-heavy batch work the broker
# schedules; a few output ids are enough to carry a result.
DEFAULT_OUTPUT_TOKENS = 4
# A made-up embedding's size when no model's is given (`pipeline run-batch` gives the model's
# hidden size): a small embedding model's order.
DEFAULT_EMBEDDING_SIZE = 64
# vLLM's --runner values: what the engine serves (a job reads it; the sim does what each
# item asks).
SIM_RUNNERS = ("auto", "generate", "pooling")

# Cost-model figures for a GPU-bound run (engine options `cost_s_per_padded_token`,
# `cost_s_per_batch`; the defaults are 0). Prefill of a 7B model: ~2 * 7e9 = 14 GFLOP per
# prompt token, on an A100 (312 dense BF16 TFLOP/s) at ~45% utilisation, ~10k tokens/s.
GPU_7B_PREFILL_S_PER_TOKEN = 1e-4
# A step's fixed cost beside its tokens (scheduling, input preparation, kernel launches):
# a few milliseconds in vLLM; an order of magnitude, measure your own engine.
GPU_STEP_OVERHEAD_S = 5e-3

# Made-up output ids are 15 bits wide.
OUTPUT_ID_RANGE = 1 << 15
_U64 = np.uint64
# Chained block hash, computed for every block of a prompt at once with numpy:
#   c_j = mix(sum_k tokens[j*B + k] * W_k + S)      block j's content (mod 2**64)
#   H_i = mix(sum_{j<=i} c_j * P**(i-j))            chains every block before it
# NOTE: two ids a 64-bit word (the batch's int32 tokens viewed in place, half the products:
# 19 against 40 us for 4,096 blocks) was rejected in review: an id in a word's high half
# enters the sum as id * W * 2**32, through only W's low 32 bits, so blocks that differ
# only there collided at 2**-32 (5 pairs in 200,000 random blocks). Each id gets a whole
# 64-bit weight (tests/consumer/test_sim_engine.py builds such a pair).
# NOTE: xxh3 per block was rejected: one call per block from Python costs ~5 us for a
# 256-token prompt, which would make the simulator, not the broker, the bottleneck. A 64-bit
# polynomial hash with a strong finaliser is ample for a simulator's cache keys.
_CHAIN_P = _U64(0x9E3779B97F4A7C15)  # odd, so invertible mod 2**64
_CHAIN_P_INV = _U64(pow(int(_CHAIN_P), -1, 1 << 64))
# S: any nonzero constant. Without it a block of zero tokens has content mix(0) = 0, and so
# every leading run of zero blocks (padding) would hash alike whatever its length.
_CONTENT_SEED = _U64(0x2545F4914F6CDD1D)


def _ragged_local(counts: np.ndarray) -> np.ndarray:
    """0..n-1 for each n of `counts`, back to back: [2, 0, 3] -> [0, 1, 0, 1, 2]."""
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


@dataclass(slots=True)
class SimConfig:
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    output_tokens: int = DEFAULT_OUTPUT_TOKENS
    # Made-up output ids fall below this: a model's vocabulary, so its tokenizer decodes them
    # (`pipeline run-batch` sets it); 2**15 by default, the ids' own 15-bit range.
    vocab_size: int = OUTPUT_ID_RANGE
    # The cost model (module docstring): seconds per padded token the cache did not serve,
    # and per batch. 0 by default: the embedded demo runs at the broker's speed.
    cost_s_per_padded_token: float = 0.0
    cost_s_per_batch: float = 0.0
    # The model directory whose tokenizer.json decodes made-up ids into text (stop strings
    # are found in it), and the model's end-of-sequence token: None for neither.
    tokenizer: str | None = None
    eos_token_id: int | None = None
    # vLLM's engine flags the product reads whatever the engine (the context a job checks
    # prompts against; GPUs per engine), taken so that one set of flags runs either engine.
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    runner: str = "auto"
    embedding_size: int = DEFAULT_EMBEDDING_SIZE
    # vLLM's --lora-modules ([{"name", "path"}]): a batch of an adapter's model id gets
    # answers of its own (module docstring); nothing is read from the adapters.
    lora_modules: list = field(default_factory=list)


class SimEngine(Engine):
    """Simulated engine with an LRU block-hash prefix cache.

    Owner: one consumer process. Not thread-safe.

    Example, block size 4, empty cache: prompt A = [1..10] has blocks [1-4], [5-8] (the last
    two tokens are no full block): 0 cached, both blocks stored. Prompt B = [1..8, 99] then
    finds both blocks: 8 cached tokens. Prompt C = [0, 2, 3, 4, 5..8] differs in its first
    token, so even its second block hashes differently: 0 cached.
    """

    name = "sim"

    def __init__(self, config: SimConfig | None = None, **overrides) -> None:
        super().__init__()
        known = {f.name for f in fields(SimConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise EngineOptionsError(f"sim engine: unknown options {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        self.config = config or SimConfig(**overrides)
        block = self.config.block_size_tokens
        if block <= 0 or self.config.capacity_tokens < block or self.config.output_tokens < 0 \
                or not 1 <= self.config.vocab_size <= OUTPUT_ID_RANGE or not _positive_sizes(self.config) \
                or self.config.runner not in SIM_RUNNERS or type(self.config.embedding_size) is not int \
                or self.config.embedding_size < 1:
            raise EngineOptionsError(f"sim engine: bad config {self.config}")
        costs = (self.config.cost_s_per_padded_token, self.config.cost_s_per_batch)
        if not all(type(c) in (int, float) and math.isfinite(c) and c >= 0 for c in costs):
            raise EngineOptionsError(f"sim engine: costs must be finite seconds >= 0, got {costs}")
        self._capacity_blocks = self.config.capacity_tokens // block
        self._cache = PrefixCache(self._capacity_blocks)
        rng = np.random.default_rng(0x5EED)
        self._weights = rng.integers(1, 1 << 63, size=block, dtype=np.uint64) | _U64(1)
        self._powers = np.ones(1, dtype=np.uint64)
        self._inverse_powers = np.ones(1, dtype=np.uint64)
        self.counters.extra.update(evicted_blocks=0, charged_tokens=0, charged_ns=0)
        eos = self.config.eos_token_id
        if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < self.config.vocab_size):
            raise EngineOptionsError(f"sim engine: eos_token_id {eos!r} must be a token id below vocab_size "
                                     f"{self.config.vocab_size}")
        self._sampler = MadeUpSampler(self.config.output_tokens, self.config.vocab_size, eos,
                                      *_decoder(self.config.tokenizer))

    def _ensure_powers(self, count: int) -> None:
        if count <= self._powers.shape[0]:
            return
        size = max(count, 2 * self._powers.shape[0])
        mask, p, p_inv = (1 << 64) - 1, int(_CHAIN_P), int(_CHAIN_P_INV)
        powers, inverse = [1] * size, [1] * size
        for i in range(1, size):  # Python ints: numpy scalars would warn on the wrap-around
            powers[i] = powers[i - 1] * p & mask
            inverse[i] = inverse[i - 1] * p_inv & mask
        self._powers = np.array(powers, dtype=np.uint64)
        self._inverse_powers = np.array(inverse, dtype=np.uint64)

    def block_hashes(self, prompts: list[np.ndarray]) -> list[list[int]]:
        """The chained hash of each full block of each prompt, as lists (see `_hash_blocks`)."""
        flat, layout = self._hash_blocks(prompts, np.array([p.shape[0] for p in prompts], dtype=np.int64))
        hashes = flat.tolist()
        return [hashes[a:a + n] for a, n in zip(layout.starts.tolist(), layout.counts.tolist())]

    def _hash_blocks(self, prompts: Sequence[np.ndarray], lengths: np.ndarray) -> tuple[np.ndarray, BatchLayout]:
        """The chained hash of each full block of each prompt, for a whole batch at once:
        every prompt's hashes back to back (uint64), and where each block sits.

        Example, block size 4, prompts of 9 and 4 tokens: blocks [p0[0:4], p0[4:8], p1[0:4]]
        are hashed together; local block numbers are [0, 1, 0]; the running sums restart at
        each prompt's first block, so p1's chain does not include p0's blocks.
        """
        block = self.config.block_size_tokens
        layout = BatchLayout.of(lengths // block)
        total = layout.prompt.shape[0]
        if total == 0:
            return np.zeros(0, dtype=np.uint64), layout
        self._ensure_powers(int(layout.counts.max()))
        tokens = np.concatenate(prompts)  # one copy of the batch, as an engine's input tensor
        whole = layout.counts * block
        if not (whole == lengths).all():  # drop each prompt's partial last block
            tails = np.repeat(np.cumsum(lengths) - lengths + whole, lengths - whole)
            tokens = np.delete(tokens, tails + _ragged_local(lengths - whole))
        # NOTE: a matrix product, not a multiply and a sum over axis 1: the same sums (uint64
        # arithmetic wraps either way) at half the cost, without a (blocks x B) temporary.
        content = _mix(tokens.reshape(total, block).astype(np.uint64) @ self._weights + _CONTENT_SEED)
        scaled = content * self._inverse_powers[layout.local]
        running = np.cumsum(scaled, dtype=np.uint64)
        before = (running - scaled)[layout.prompt_start]  # the sum before each block's prompt
        return _mix((running - before) * self._powers[layout.local]), layout

    def run(self, batch: EngineBatch) -> EngineResult:
        start_ns = time.perf_counter_ns()
        block = self.config.block_size_tokens
        prompts = batch.prompts
        count = len(prompts)
        lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=count)
        flat, layout = self._hash_blocks(prompts, lengths)
        cacheable = np.asarray(batch.prefix_lens, dtype=np.int64) // block * block
        hits, compulsory_blocks = self._cache.run(flat, layout, cacheable // block)
        cached = np.minimum(hits * block, (lengths - 1) // block * block)
        made_ids, seeds = self._outputs(prompts, flat, layout.counts, batch.model)
        if self.config.vocab_size != OUTPUT_ID_RANGE:
            made_ids %= _U64(self.config.vocab_size)
        outputs = made_ids.tolist()
        made = self._made_up(batch, seeds, outputs) if batch.params else None
        padded, hit = count * batch.pad_to_tokens, int(cached.sum())
        counted = EngineCounters(
            batches=1, prompts=count, prompt_tokens=int(lengths.sum()), padded_tokens=padded,
            cacheable_tokens=int(cacheable.sum()), cache_hit_tokens=hit,
            cacheable_hit_tokens=int(np.minimum(cached, cacheable).sum()), compulsory_miss_tokens=compulsory_blocks * block,
            output_tokens=sum(map(len, outputs)))
        self._charge(counted, padded - hit)
        counted.busy_ns = time.perf_counter_ns() - start_ns
        result = EngineResult(outputs, cached.tolist(), [FINISH_LENGTH] * count, counted)
        if made is not None:
            _fill(result, *made)
            if any(p is not None and p.embed for p in batch.params):
                self._embed(result, batch)
        self.counters.add(result.counted)
        self.counters.extra["evicted_blocks"] = self._cache.evicted_blocks
        return result

    def _made_up(self, batch: EngineBatch, seeds: list[int], outputs: list[list[int]]
                 ) -> tuple[list[list[Sample] | None], list[str | None]]:
        """Each item with parameters' samples (`sim_sampling.py`), or its refusal; None and
        no error for an item without parameters (it keeps its made-up `outputs`)."""
        budget = CharBudget()  # what the batch's answers hold until its results are written
        plain = self._plain_many(batch, seeds, budget)
        if plain is not None:
            return plain, [None] * len(seeds)
        samples: list[list[Sample] | None] = []
        errors: list[str | None] = []
        budget = CharBudget()
        for i, seed in enumerate(seeds):
            params = batch.params_of(i)
            try:
                samples.append(self._sampler.samples(seed, params, budget) if params is not None and not params.embed
                               else None)
                errors.append(None)
            except SimRefusal as refusal:
                samples.append(None)
                errors.append(str(refusal))
        return samples, errors

    def _plain_many(self, batch: EngineBatch, seeds: list[int], budget: CharBudget) -> list[list[Sample] | None] | None:
        """`_made_up`'s samples where every item with parameters is plain (`is_plain`), made
        for the items of each parameters at once (`MadeUpSampler.plain_many`, the same
        samples); None where some item is not, or might be refused: item by item then.
        NOTE: item by item, the made-up ids and their texts were 26 us of an item's 67 us in
        a consumer of a job of 16-token answers; at once, 4 us."""
        groups: dict[GenerationParams, list[int]] = {}
        for i in range(len(seeds)):
            params = batch.params_of(i)
            if params is not None and not params.embed:
                if not is_plain(params):
                    return None
                groups.setdefault(params, []).append(i)
        samples: list[list[Sample] | None] = [None] * len(seeds)
        for params, items in groups.items():
            made = self._sampler.plain_many([seeds[i] for i in items], params, budget)
            if made is None:
                return None
            for i, sample in zip(items, made):
                samples[i] = [sample]
        return samples

    def _embed(self, result: EngineResult, batch: EngineBatch) -> None:
        """Each item to embed's made-up embeddings (module docstring) in place of its output."""
        size = self.config.embedding_size
        embeddings: list[list[np.ndarray] | None] = [None] * len(batch.prompts)
        errors = result.errors or [None] * len(batch.prompts)
        for i, prompt in enumerate(batch.prompts):
            params = batch.params_of(i)
            if params is None or not params.embed or errors[i] is not None:
                continue
            result.counted.output_tokens -= len(result.outputs[i])
            result.outputs[i], result.finish_reasons[i] = [], FINISH_STOP
            dims = params.dimensions or size
            if dims > size:
                errors[i], result.cached_tokens[i] = f"the sim's embeddings have {size} dimensions, not {dims}", 0
                continue
            try:
                parts = embedding_inputs(prompt, params)
            except ValueError as exc:
                errors[i], result.cached_tokens[i] = str(exc), 0
                continue
            embeddings[i] = [_unit(np.random.default_rng(part.astype(np.uint32)).standard_normal(size)[:dims])
                             for part in parts]
        result.errors = errors if any(e is not None for e in errors) else None
        result.embeddings = embeddings

    def charge_ns(self, tokens: int) -> int:
        """What the cost model charges a batch whose cache did not serve `tokens` of its
        padded tokens, in whole nanoseconds (what is slept and counted)."""
        cost_s = tokens * self.config.cost_s_per_padded_token + self.config.cost_s_per_batch
        return round(cost_s * NS_PER_S)

    def _charge(self, counted: EngineCounters, tokens: int) -> None:
        """Sleep what the cost model charges for one batch, and count it (module docstring)."""
        charged_ns = self.charge_ns(tokens)
        counted.extra.update(charged_tokens=tokens, charged_ns=charged_ns)
        self.counters.extra["charged_tokens"] += tokens
        self.counters.extra["charged_ns"] += charged_ns
        if charged_ns > 0:
            time.sleep(charged_ns / NS_PER_S)

    def _outputs(self, prompts: Sequence[np.ndarray], flat: np.ndarray, counts: np.ndarray, model: int = 0
                 ) -> tuple[np.ndarray, list[int]]:
        """Each prompt's output ids: bytes of its last block's hash (of its last token when
        it has no full block), a deterministic stand-in for generated tokens; and that hash
        (the seed of an item's made-up samples)."""
        shifts = np.arange(self.config.output_tokens, dtype=np.uint64) * _U64(8)
        seeds = flat[np.maximum(np.cumsum(counts) - 1, 0)] if flat.shape[0] else np.zeros(len(prompts), dtype=np.uint64)
        outputs = (seeds[:, None] >> shifts) & _U64(0x7FFF)
        short = np.flatnonzero(counts == 0)
        if short.size:  # a last token may be negative: shift it as a signed number
            last = np.array([int(prompts[i][-1]) for i in short.tolist()], dtype=np.int64)
            outputs[short] = ((last[:, None] >> shifts.astype(np.int64)) & 0x7FFF).astype(np.uint64)
            seeds = seeds.copy()
            seeds[short] = last.astype(np.uint64)
        if model:  # an adapter's answers: the base model's seeds mixed with its id
            seeds = _mix(seeds ^ _mix(np.full(len(prompts), model, dtype=np.uint64)))
            outputs = (seeds[:, None] >> shifts) & _U64(0x7FFF)
        return outputs, seeds.tolist()


def _fill(result: EngineResult, samples: list[list[Sample] | None], errors: list[str | None]) -> None:
    """Put the made-up samples into a batch's result: each item's first sample as its output,
    every sample where an item asked for several or for logprobs, refusals as errors (no
    output, nothing cached), and the output tokens counted again over every sample."""
    texts: list[str | None] = [None] * len(samples)
    for i, mine in enumerate(samples):
        if errors[i] is not None:
            result.outputs[i], result.cached_tokens[i] = [], 0
        elif mine is not None:
            first = mine[0]
            result.outputs[i], result.finish_reasons[i], texts[i] = first.token_ids, first.finish_reason, first.text
    result.texts = texts if any(t is not None for t in texts) else None
    if any(e is not None for e in errors):
        result.errors = errors
    if any(m is not None and (len(m) > 1 or m[0].logprobs is not None) for m in samples):
        result.samples = [m if m is not None and (len(m) > 1 or m[0].logprobs is not None) else None
                          for m in samples]
    result.counted.output_tokens = sum(
        sum(len(s.token_ids) for s in samples[i]) if samples[i] is not None else len(result.outputs[i])  # type: ignore[union-attr]
        for i in range(len(samples)) if errors[i] is None)


def _unit(vector: np.ndarray) -> np.ndarray:
    return (vector / np.linalg.norm(vector)).astype(np.float32)


def _decoder(model_dir: str | None) -> tuple[Decode | None, TokenChars | None, DecodeRows | None]:
    """decode(ids, skip_special_tokens), token_chars(id) and decode_rows(rows, skip) of a
    model directory's tokenizer.json; Nones without one."""
    if model_dir is None:
        return None, None, None
    from tokenizers import Tokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as exc:  # the Rust side raises plain Exception for every parse error
        raise EngineOptionsError(f"sim engine: tokenizer {path}: {exc}") from exc

    # Each token's decoded length (-1: not learned yet), by skip_special_tokens, learned once.
    lengths = {False: np.full(0, -1, dtype=np.int64), True: np.full(0, -1, dtype=np.int64)}

    def raw(ids: list[int], skip: bool) -> str:
        try:
            return tokenizer.decode(ids, skip_special_tokens=skip)
        except BaseException as exc:  # the model's decoder is foreign code: a Rust panic is a BaseException
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise
            words = " ".join(str(exc).split())[:200]
            raise SimRefusal(f"the model's tokenizer failed to decode the answer: {type(exc).__name__}: "
                             f"{words}") from None

    def table(tokens: np.ndarray, skip: bool) -> np.ndarray:
        """The lengths table, with every token of `tokens` learned."""
        known = lengths[skip]
        top = int(tokens.max()) + 1 if tokens.size else 0
        if top > known.shape[0]:
            known = lengths[skip] = np.concatenate((known, np.full(max(top, 2 * known.shape[0]) - known.shape[0], -1)))
        for token in np.unique(tokens[known[tokens] < 0]).tolist():
            known[token] = len(raw([token], skip))
        return known

    def token_chars(token: int, skip: bool = False) -> int:
        return int(table(np.array([token]), skip)[token])

    def decode(ids: list[int], skip: bool) -> str:
        """The text of `ids`, never built past MAX_ANSWER_TEXT_CHARS (by the tokens' own
        lengths, added up first): a decoder that expands tokens costs no memory here."""
        tokens = np.array(ids, dtype=np.int64)
        if int(table(tokens, skip)[tokens].sum()) > MAX_ANSWER_TEXT_CHARS:
            raise SimRefusal(f"the model's tokenizer decodes this answer to more characters than an answer "
                             f"holds, more than {MAX_ANSWER_TEXT_CHARS:,} (its decoder expands tokens)")
        return raw(ids, skip)

    def decode_rows(rows: list[list[int]], skip: bool) -> list[str] | None:
        sizes = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        tokens = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(sizes.sum()))
        try:  # a decoder that fails, on a token or on an answer: `decode` then refuses each that fails
            bounds = np.add.reduceat(table(tokens, skip)[tokens], np.cumsum(sizes) - sizes) if tokens.size else sizes
            if bounds.size and (int(bounds.max()) > MAX_ANSWER_TEXT_CHARS or (sizes == 0).any()):
                return None
            return [raw(ids, skip) for ids in rows]
        except SimRefusal:
            return None
    return decode, token_chars, decode_rows


def _positive_sizes(config: SimConfig) -> bool:
    """vLLM's sizes (max_model_len, tensor and pipeline parallel) are positive integers, as vLLM checks."""
    sizes = (config.tensor_parallel_size, config.pipeline_parallel_size)
    return all(type(size) is int and 0 < size <= MAX_PARALLEL_SIZE for size in sizes) and (
        config.max_model_len is None or type(config.max_model_len) is int and config.max_model_len > 1)
