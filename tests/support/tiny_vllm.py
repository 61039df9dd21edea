"""The tiny model (tools/tiny_llama.py) as the `vllm` tests run it: where it is built, the
engine options that make vLLM's counters repeat exactly on the CPU, and a consumer that
records its engine's counters as it stops (vLLM's own counters live in that process alone)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.process import Consumer
from tests.support.repo import ROOT

# The tiny model, and vLLM's caches across runs (its first start writes a model-info cache
# and takes 12 to 19 s; later starts 2 to 5 s). Both gitignored.
MODEL_DIR = ROOT / ".cache" / "tiny-llama"
CACHE_DIR = ROOT / ".cache" / "vllm-test"
# Block size 32: the CPU backend wants multiples of 32.
BLOCK = 32
# 2 MiB of KV cache: 2,048 tokens of the tiny model (bf16: 1 KiB a token), about 4 of the
# prefixes of tests/consumer/test_vllm_engine.py, so 16 shapes in round-robin order evict
# each other's blocks.
KV_CACHE_BYTES = 2 << 20
MAX_MODEL_LEN = 1024
ENGINE_OPTIONS = dict(model=str(MODEL_DIR), load_format="dummy", enforce_eager=True, block_size=BLOCK,
                      kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_tokens=2,
                      seed=0, cache_dir=str(CACHE_DIR))
# Token ids of the prompts: above the tokenizer's 3 special tokens, below its vocabulary.
TOKEN_LOW, TOKEN_HIGH = 3, 4096


def serve_and_record(config: ConsumerConfig, stop_path: str, counters_path: str) -> None:
    """A consumer until `stop_path` exists; then its engine's counters into `counters_path`."""
    consumer = Consumer(config)
    consumer.run(lambda: os.path.exists(stop_path))
    c = consumer.engine.counters
    Path(counters_path).write_text(json.dumps({**dataclasses.asdict(c), **c.extra}))
    consumer.engine.close()
