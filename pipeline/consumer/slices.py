"""A batch as a consumer holds it, and the slices it runs in by the answers they may hold (no I/O here).

A consumer holds every answer of an engine run (token ids, texts, every sample, their log
probabilities) until the run ends and its result lines are written. The broker cuts a batch
by its prompts (max_batch_items, max_batch_tokens) and is blind to what each item asks the
engine for, so one batch may ask for far more answer than prompt: 64 requests of n=128
samples of 8,192 tokens are 67 million tokens, about 5 GB held at once (~77 bytes a token as
ids, text and result line). So the consumer runs a batch in slices of consecutive items, each
asking for at most MAX_SLICE_ANSWER_TOKENS (an item asking for more runs alone), and writes
each slice's lines as it ends. A batch of ordinary requests is one slice: 64 answers of a
whole 32,768-token context are 2 Mi tokens.

An item's share is what it may generate, `n x max_tokens`, with each token's log
probability entries counted as tokens too (an entry holds as much as a token's id and text).
A pipelined engine (vLLM) bounds the slices it runs at once by its KV cache, which holds
every sample's new tokens: the answers in flight stay within the cache's size plus a slice.

    weights = [answer_tokens(p, MAX_INPUT_LEN) for p in params]
    cut_slices([3, 3, 3], budget=6) -> [range(0, 2), range(2, 3)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.consumer.engines.base import EngineBatch, EngineCounters
from pipeline.consumer.reader import ReadBatch, ReadSpan
from pipeline.consumer.results import STATUS_CANCELLED, STATUS_CORRUPT, STATUS_ERROR, STATUS_OK, STATUS_TOO_LONG
from pipeline.wire.generation import GenerationParams
from pipeline.wire.layouts.descriptors import Descriptor

# The most answer tokens one engine run of a consumer may ask for: ~320 MB held at ~77 bytes
# a token (measured: 64 requests of 1 Mi tokens each held 1,233 MB at 16 of them). Four of
# the largest answer a job takes (sampling.MAX_ANSWER_TOKENS, 1 Mi tokens) fit in one slice,
# so slicing costs those batches a few more engine runs and ordinary batches nothing.
MAX_SLICE_ANSWER_TOKENS = 1 << 22


def answer_tokens(params: GenerationParams | None, unnamed_max_tokens: int) -> int:
    """What one item may generate, in tokens and log probability entries: `n x max_tokens`
    (`unnamed_max_tokens` where the item names no max_tokens: the engine's default, at most
    the context), times 1 + the entries of each token's logprobs. 0 for an item to embed."""
    if params is None:
        return unnamed_max_tokens
    if params.embed:
        return 0
    tokens = params.samples * (params.max_tokens if params.max_tokens is not None else unnamed_max_tokens)
    return tokens * (2 + params.logprobs) if params.logprobs is not None else tokens


def cut_slices(weights: Sequence[int], budget: int) -> list[range]:
    """Consecutive slices of items 0..len(weights)-1, each as long as it can be with its
    weights summing to at most `budget`; an item heavier than the budget is a slice alone.
    Every item in exactly one slice, in order; no slice for no item."""
    assert budget > 0, budget
    slices: list[range] = []
    start, held = 0, 0
    for i, weight in enumerate(weights):
        assert weight >= 0, (i, weight)
        if i > start and held + weight > budget:
            slices.append(range(start, i))
            start, held = i, 0
        held += weight
    if len(weights) > start:
        slices.append(range(start, len(weights)))
    return slices


@dataclass(slots=True)
class HeldBatch:
    """A batch taken from the ring and not completed yet. Owner: the consumer's main thread.

    `got`: the items the engine runs (their own payloads, the generation envelope split
    off), `params` theirs (empty: none has any); `lines`: result lines not written yet (of
    the items already answered: corrupt, too long, malformed parameters; then of each slice
    as it ends); `statuses`: items by status; `slices_left`: engine runs not ended
    (slices.py); `counted`: what the ended ones added to the engine's counters."""

    descriptor: Descriptor
    got: ReadBatch
    started_s: float
    params: list[GenerationParams | None] = field(default_factory=list)
    spans: list[ReadSpan] = field(default_factory=list)  # of the read: released once finished
    lines: list[str] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        (STATUS_OK, STATUS_TOO_LONG, STATUS_CORRUPT, STATUS_ERROR, STATUS_CANCELLED), 0))
    slices_left: int = 0
    counted: EngineCounters = field(default_factory=EngineCounters)

    def slices(self, unnamed_max_tokens: int) -> list[tuple[ReadBatch, EngineBatch]]:
        """The engine runs of the batch: consecutive items, each run's answers within
        MAX_SLICE_ANSWER_TOKENS (slices.py); none for a batch with nothing to run."""
        got, params, d = self.got, self.params, self.descriptor
        weights = [answer_tokens(params[i] if params else None, unnamed_max_tokens) for i in range(len(got.item_ids))]
        cuts = cut_slices(weights, MAX_SLICE_ANSWER_TOKENS)
        runs = []
        for rows in cuts:
            part = got if len(cuts) == 1 else select_rows(got, list(rows))
            runs.append((part, EngineBatch(part.tokens, d.pad_to_tokens, part.prefix_lens,
                                           params[rows.start:rows.stop] if params else [], int(d.model))))
        self.slices_left = len(runs)
        return runs


def select_rows(got: ReadBatch, rows: list[int]) -> ReadBatch:
    """The entries `rows` of a read batch (the ones a batch runs)."""
    return ReadBatch(*([column[i] for i in rows] for column in
                       (got.item_ids, got.tokens, got.lengths, got.prefix_lens, got.payloads, got.submit_ns,
                        got.digests)))
