"""The two consumers of the end-to-end runs, each with its own batch contract, and the
check of a run's results against them."""

from __future__ import annotations

import base64
from collections import Counter

from pipeline.consumer.config import ConsumerConfig
from tests.pipeline.harness import Workload, batches_of

CONTRACTS = [dict(max_batch_items=64, max_batch_tokens=32_768, max_input_len=100_000),
             dict(max_batch_items=16, max_batch_tokens=8_192, max_input_len=400)]


def consumer_config(tmp_path, socket_path: str, k: int, **engine_options) -> ConsumerConfig:
    return ConsumerConfig(socket_path, str(tmp_path / "results"), f"c{k}", **CONTRACTS[k],
                          engine_options=engine_options)


def check_run(rows: list[dict], workload: Workload, expected_items: int) -> Counter:
    """Every item has a result; batches are shape-pure and within their contract. Returns
    how many results each item id has (more than one: a counted duplicate)."""
    per_item = Counter(row["item_id"] for row in rows)
    assert len(per_item) == expected_items
    for (consumer, _batch, _at), batch in batches_of(rows).items():
        shapes = {base64.b64decode(row["payload"]) for row in batch}  # the payload is the shape
        assert len(shapes) == 1, f"batch of {consumer} mixes shapes {shapes}"
        contract = CONTRACTS[int(consumer[1])]
        assert len(batch) <= contract["max_batch_items"]
        if len(batch) > 1:
            assert len(batch) * batch[0]["pad_to_tokens"] <= contract["max_batch_tokens"]
        for row in batch:
            too_long = row["prompt_tokens"] > contract["max_input_len"]
            assert row["status"] == ("too_long" if too_long else "ok"), row
    return per_item
