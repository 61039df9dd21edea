"""`analyze_workload`: a workload's shapes, shared prefixes and prefix-reuse bound, without
running anything (`pipeline tools analyze`). No I/O beyond building the items.

Block keys are the sim engine's own chained block hashes (`SimEngine.block_hashes`), so a
figure here is what the sim's cache would see for the same prompts, block for block.
NOTE: keying Mooncake blocks by their hash ids directly was rejected: it would model a
different cache from the engine's, and it cannot cut blocks at any other size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.analysis.reuse import ARRIVAL, PREFIX_SORTED, PromptBlocks, prefix_sorted_order, replay, shared_prefix
from pipeline.consumer.engines.sim import DEFAULT_BLOCK_SIZE_TOKENS, SimEngine
from pipeline.producer.producer import DEFAULT_MAX_ITEM_TOKENS
from pipeline.producer.signature import component_hash
from pipeline.producer.workload import WorkItem, Workload

# Block size when the workload names none: the sim engine's (vLLM's default).
DEFAULT_BLOCK_TOKENS = DEFAULT_BLOCK_SIZE_TOKENS
# Largest block: the longest prompt the producer takes; a larger block holds nothing.
MAX_BLOCK_TOKENS = DEFAULT_MAX_ITEM_TOKENS
# Cache sizes per analysis: each is two replays and two table rows; more is unreadable.
MAX_CACHE_SIZES = 8
# Caches replayed side by side (consumers): a node has at most 8 GPUs, 64 leaves room for
# several engines per GPU.
MAX_CACHES = 64
# Largest cache: the sim's PrefixCache counts blocks in int32.
MAX_CACHE_BLOCKS = (1 << 31) - 1
# Default cache sizes (tokens per cache): a small one (64 Ki) and about what one 80 GB GPU
# holds for a 7B model (1 Mi, the sim's default).
DEFAULT_CACHE_TOKENS = (1 << 16, 1 << 20)
# Shapes listed in the table by default (the JSON has as many as asked).
DEFAULT_TOP_SHAPES = 10
# Prompts hashed per call of the sim's block hash: one concatenation of their tokens.
HASH_BATCH_PROMPTS = 64


@dataclass(slots=True)
class ShapeFigures:
    """One shape (model, signature): its items and their tokens, its component count, and
    its chain depth: how many shapes of the workload (same model) have components that are
    a prefix of its own, itself included (0 for the shape with no components)."""

    model: int
    signature: int
    items: int = 0
    tokens: int = 0
    components: int = 0
    depth: int = 0
    hashes: tuple[int, ...] = field(default=(), repr=False)


def check_analysis_limits(block_tokens: int, cache_tokens: Sequence[int], caches: int) -> None:
    """The analysis's arguments, checked where they enter (ValueError naming the limit)."""
    if not 1 <= block_tokens <= MAX_BLOCK_TOKENS:
        raise ValueError(f"block of {block_tokens} tokens: must be in [1, {MAX_BLOCK_TOKENS:,}]")
    if not 1 <= caches <= MAX_CACHES:
        raise ValueError(f"{caches} caches: must be in [1, {MAX_CACHES}]")
    if len(cache_tokens) > MAX_CACHE_SIZES:
        raise ValueError(f"{len(cache_tokens)} cache sizes: at most {MAX_CACHE_SIZES}")
    for size in cache_tokens:
        if not block_tokens <= size <= MAX_CACHE_BLOCKS * block_tokens:
            raise ValueError(f"cache of {size:,} tokens: must hold one block of {block_tokens} tokens "
                             f"and at most {MAX_CACHE_BLOCKS:,} blocks")


def analyze_workload(workload: Workload, block_tokens: int | None = None,
                     cache_tokens: Sequence[int] = DEFAULT_CACHE_TOKENS, caches: int = 1,
                     top: int = DEFAULT_TOP_SHAPES) -> dict:
    """Every figure of `pipeline tools analyze`, as a JSON-ready dict. `block_tokens` None:
    the workload's own block size (Mooncake's 512), else DEFAULT_BLOCK_TOKENS."""
    block = block_tokens if block_tokens is not None else workload.block_tokens or DEFAULT_BLOCK_TOKENS
    check_analysis_limits(block, cache_tokens, caches)
    prompts, shapes = _scan(workload, block)
    shared = shared_prefix(prompts, block)
    arrival = list(range(len(prompts)))
    walk = prefix_sorted_order(prompts)
    bound = replay(prompts, walk, PREFIX_SORTED, block, None, 1, shared.distinct_blocks)
    runs = [replay(prompts, arrival, ARRIVAL, block, None, caches, shared.distinct_blocks)]
    if caches > 1:
        runs.append(replay(prompts, walk, PREFIX_SORTED, block, None, caches, shared.distinct_blocks))
    for size in cache_tokens:
        for name, order in ((ARRIVAL, arrival), (PREFIX_SORTED, walk)):
            runs.append(replay(prompts, order, name, block, size, caches, shared.distinct_blocks))
    input_tokens = sum(p.length for p in prompts)
    ranked = sorted(shapes, key=lambda s: (-s.items, -s.tokens, s.model, s.signature))
    return {
        "workload": workload.source, "items": len(prompts), "input_tokens": input_tokens,
        "block_tokens": block, "caches": caches,
        "shapes": {"count": len(shapes), "max_depth": max((s.depth for s in shapes), default=0),
                   "top": [_shape_row(s) for s in ranked[:top]]},
        "shared_prefix": {"item_tokens": shared.item_tokens, "distinct_tokens": shared.distinct_tokens,
                          "share": shared.item_tokens / input_tokens if input_tokens else 0.0},
        "bound": _run_row(bound),
        "reuse": [_run_row(r) for r in runs],
    }


def _shape_row(shape: ShapeFigures) -> dict:
    return {"model": shape.model, "signature": f"{shape.signature:#018x}", "items": shape.items,
            "tokens": shape.tokens, "components": shape.components, "depth": shape.depth}


def _run_row(run) -> dict:
    return {"order": run.order, "cache_tokens": run.cache_tokens, "caches": run.caches,
            "hit_tokens": run.hit_tokens, "input_tokens": run.input_tokens, "reuse": run.reuse}


def _scan(workload: Workload, block: int) -> tuple[list[PromptBlocks], list[ShapeFigures]]:
    """Every item's block keys (in workload order) and the shapes' figures."""
    hasher = SimEngine(block_size_tokens=block, capacity_tokens=block)
    prompts: list[PromptBlocks] = []
    shapes: dict[tuple[int, int], ShapeFigures] = {}
    for batch in _batches(workload.items(), HASH_BATCH_PROMPTS):
        prompts.extend(prompt_blocks([item.tokens for item in batch], block, hasher))
        for item in batch:
            _count_shape(shapes, item)
    _set_depths(list(shapes.values()))
    return prompts, list(shapes.values())


def prompt_blocks(prompts: Sequence[np.ndarray], block: int, hasher: SimEngine | None = None) -> list[PromptBlocks]:
    """Each prompt (token ids) as its full blocks' chained keys, the sim engine's hashes."""
    hasher = hasher or SimEngine(block_size_tokens=block, capacity_tokens=block)
    out = []
    for tokens, keys in zip(prompts, hasher.block_hashes(list(prompts))):
        array = np.array(keys, dtype=np.uint64)
        array.flags.writeable = False
        out.append(PromptBlocks(array, int(tokens.shape[0])))
    return out


def _batches(items: Iterable[WorkItem], size: int) -> Iterable[list[WorkItem]]:
    batch: list[WorkItem] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _count_shape(shapes: dict[tuple[int, int], ShapeFigures], item: WorkItem) -> None:
    key = (item.model, item.signature)
    shape = shapes.get(key)
    if shape is None:
        hashes = tuple(component_hash(c) for c in item.components)
        shape = shapes[key] = ShapeFigures(item.model, item.signature, components=len(hashes), hashes=hashes)
    shape.items += 1
    shape.tokens += item.length


def _set_depths(shapes: list[ShapeFigures]) -> None:
    """Each shape's chain depth (see ShapeFigures), from its component hashes."""
    known = {(s.model, s.hashes) for s in shapes if s.hashes}
    for shape in shapes:
        shape.depth = sum((shape.model, shape.hashes[:k]) in known for k in range(1, len(shape.hashes) + 1))
