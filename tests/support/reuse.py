"""A brute-force prefix cache for the analyzer's tests: the reference its replays are
checked against."""

from __future__ import annotations

from collections import OrderedDict


def reference_cached(prompts: list[list[int]], block: int, capacity: int | None) -> list[int]:
    """Each prompt's cached tokens, one LRU cache, prompts in the given order: the leading
    full blocks already cached (a block named by every token up to its end), touched tail
    first, least recently used evicted past `capacity` blocks; the last token computed."""
    cache: OrderedDict[tuple[int, ...], None] = OrderedDict()
    out = []
    for tokens in prompts:
        full = len(tokens) // block
        names = [tuple(tokens[:(i + 1) * block]) for i in range(full)]
        hits = 0
        while hits < full and names[hits] in cache:
            hits += 1
        out.append(min(hits * block, (len(tokens) - 1) // block * block))
        for name in reversed(names):
            cache[name] = None
            cache.move_to_end(name)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return out
