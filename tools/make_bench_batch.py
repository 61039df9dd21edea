#!/usr/bin/env python3
"""Write the chat batch file of the run-batch benchmark (issue 14): OpenAI Batch requests
in many shapes with Zipf-like popularity, in shuffled (arrival) order; seeded.

    python3 tools/make_bench_batch.py bench-out/batch.jsonl [--requests 2000] [--shapes 32] [--seed 0]

A shape is a system prompt and a few-shot block (SYSTEMS system prompts, each with
shapes / SYSTEMS few-shot blocks of 2 to 4 turns): the prefix vLLM can serve from its cache,
a few hundred tokens with the tiny tokenizer (tools/tiny_llama.py: about 1.5 tokens a word).
Shape k is drawn with weight 1 / (k + 1) ** ZIPF_S; every request has a short user turn of
its own (a question and a number), max_completion_tokens MAX_COMPLETION_TOKENS and
temperature 0. The file's order is the arrival order: a seeded shuffle
(lab/bench/chat_batch.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One generator, shared with `pipeline bench run-batch`.
from lab.bench.chat_batch import requests  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--shapes", type=int, default=32)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.path, "w") as f:
        for request in requests(args.requests, args.shapes, args.model, args.seed):
            f.write(json.dumps(request) + "\n")


if __name__ == "__main__":
    main()
