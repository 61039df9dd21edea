"""Broker statuses for the tests of what reads them (metrics, progress, the report, the
plots): a real one, and a synthetic run's whose rates are known exactly (no wall clock)."""

from __future__ import annotations

import json

from pipeline.wire.status import STATUS_VERSION, BrokerStatus, ConsumerTotalsRow, ConsumerWork, TopShape

# Real output of `broker_status` after a 4000-item run (its wire form), top_shapes trimmed to
# 2 rows + "other".
SAMPLE_WIRE = json.loads("""
{"items_received": 4000, "tokens_received": 1580568, "items_routed": 4000, "tokens_routed": 1580568,
 "items_completed": 4000, "tokens_completed": 1580568, "items_returned": 0, "tokens_returned": 0,
 "items_recovered": 0, "items_adopted": 0,
 "tokens_recovered": 0, "duplicate_items": 0, "backlog_items": 0,
 "backlog_tokens": 0, "pending_items": 0, "shapes": 20, "shapes_seen": 20, "lanes_in_use": 923,
 "periodic_syncs": 0, "periodic_sync_failures": 0, "periodic_sync_max_s": 0.0, "pool_items": 0, "pool_shapes": 0,
 "lanes": {"opened": 923, "reused": 3077, "force_fits": 0, "raises": 726, "quiesced": 0, "released": 0,
           "revived": 0, "restored": 0, "max_in_use": 923},
 "switches": {"initial": 1, "drained": 19, "starvation": 0}, "batches_routed": 924,
 "padded_tokens_routed": 1615456, "batch_fill_sum": 63.1478271484375,
 "top_shapes": [
   {"model": 0, "signature": "1a35f69c347a5143", "lanes": 44, "queued_items": 0, "queued_tokens": 0,
    "pending_items": 0},
   {"model": 0, "signature": "1ae547ad907fc925", "lanes": 47, "queued_items": 0, "queued_tokens": 0,
    "pending_items": 0},
   {"model": -1, "signature": "other", "lanes": 190, "queued_items": 0, "queued_tokens": 0, "pending_items": 0}],
 "consumers": {
   "c1": {"id": 0, "pid": 6274, "credit": 2, "batches_held": 0, "model": 0, "max_batch_items": 64,
          "max_batch_tokens": 65536, "max_input_len": 8192},
   "c0": {"id": 1, "pid": 6273, "credit": 2, "batches_held": 0, "model": 0, "max_batch_items": 64,
          "max_batch_tokens": 65536, "max_input_len": 8192}},
 "per_consumer": {
   "c1": {"connected": true, "batches": 463, "switches": {"initial": 1, "drained": 9}, "shapes_served": 10, "split_prefix_tokens": 0, "compulsory_prefix_tokens": 2320, "items_ok": 1928, "items_too_long": 0, "items_corrupt": 0, "items_error": 0, "items_cancelled": 0,
          "prompt_tokens": 753713, "padded_tokens": 770784, "cacheable_tokens": 220816,
          "cache_hit_tokens": 218496, "cacheable_hit_tokens": 218496, "output_tokens": 7712,
          "compulsory_miss_tokens": 2320, "engine_prefix_cache_queries": 0,
          "engine_prefix_cache_hits": 0, "engine_checked_prompt_tokens": 0, "engine_checked_cache_hit_tokens": 0,
          "busy_ns": 1500000000},
   "c0": {"connected": true, "batches": 461, "switches": {"drained": 10}, "shapes_served": 10, "split_prefix_tokens": 0, "compulsory_prefix_tokens": 2320, "items_ok": 2072, "items_too_long": 0, "items_corrupt": 0, "items_error": 0, "items_cancelled": 0,
          "prompt_tokens": 826855, "padded_tokens": 844672, "cacheable_tokens": 240416,
          "cache_hit_tokens": 238096, "cacheable_hit_tokens": 238096, "output_tokens": 8288,
          "compulsory_miss_tokens": 2320, "engine_prefix_cache_queries": 0,
          "engine_prefix_cache_hits": 0, "engine_checked_prompt_tokens": 0, "engine_checked_cache_hit_tokens": 0,
          "busy_ns": 1250000000}},
 "uptime_s": 0.63, "pid": 6270, "generation": 1, "producers": {}, "consumers_lost": 0, "disk_full": false,
 "store_damage": {}, "peers_refused": 0, "peers_shed": 0, "stalls": 0, "stalled_s": 0.0,
 "compulsory_prefix_tokens": 4000, "compulsory_uncounted_starts": 0, "lineage_chains_unrecorded": 0}
""")


def status_of(wire: dict) -> BrokerStatus:
    return BrokerStatus.from_wire(wire, version=STATUS_VERSION)


SAMPLE = status_of(SAMPLE_WIRE)

# The synthetic run's rates, per second.
RECEIVED_ITEMS_PER_S = 100
ROUTED_ITEMS_PER_S = 90
COMPLETED_ITEMS_PER_S = 80
TOKENS_PER_ITEM = 400
# Consumer c1 changes pace at this time (padding and cache hit rate get better).
C1_CHANGE_S = 10.0


def consumer_row(prompt: float, padded: float, cacheable: float, hits: float, compulsory: int,
                 connected: bool = True) -> ConsumerTotalsRow:
    return ConsumerTotalsRow(connected=connected, batches=0, work=ConsumerWork(
        items_ok=0, prompt_tokens=int(prompt), padded_tokens=int(padded), cacheable_tokens=int(cacheable),
        cache_hit_tokens=int(hits), cacheable_hit_tokens=int(hits), compulsory_miss_tokens=compulsory))


def status_at(t: float, generation: int = 1, shapes: dict[str, int] | None = None) -> BrokerStatus:
    """The broker's status t seconds into the synthetic run: counters linear in t, so a rate
    over any interval is exact. c0 runs at 90 % padding efficiency and a 75 % hit rate
    (hits 300/s of cacheable 500/s less 100 compulsory, once); c1 at 50 % and 50 % until
    C1_CHANGE_S, then 80 % and 100 %."""
    received, routed, completed = (int(rate * t) for rate in (RECEIVED_ITEMS_PER_S, ROUTED_ITEMS_PER_S,
                                                              COMPLETED_ITEMS_PER_S))
    before, after = min(t, C1_CHANGE_S), max(0.0, t - C1_CHANGE_S)
    compulsory = 100 if t > 0 else 0
    top = tuple(TopShape(model=0, signature=name, lanes=3, queued_items=tokens // TOKENS_PER_ITEM,
                         queued_tokens=tokens, pending_items=0) for name, tokens in (shapes or {}).items())
    return BrokerStatus(
        items_received=received, tokens_received=received * TOKENS_PER_ITEM,
        items_routed=routed, tokens_routed=routed * TOKENS_PER_ITEM,
        items_completed=completed, tokens_completed=completed * TOKENS_PER_ITEM,
        items_recovered=0, tokens_recovered=0,
        backlog_items=received - routed, backlog_tokens=(received - routed) * TOKENS_PER_ITEM,
        pending_items=routed - completed, shapes=3, lanes_in_use=10 + int(t),
        switches={"initial": 1, "drained": int(t // 5)}, top_shapes=top, generation=generation,
        per_consumer={
            "c0": consumer_row(900 * t, 1000 * t, 500 * t, 300 * t, compulsory),
            "c1": consumer_row(500 * before + 800 * after, 1000 * t, 500 * t,
                               200 * before + 500 * after, compulsory, connected=t < 20),
        },
    )
