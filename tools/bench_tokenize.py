#!/usr/bin/env python3
"""Tokens per second one producer process tokenizes for `pipeline run-batch`: is tokenizing
what limits a job?

    python tools/bench_tokenize.py [--requests 2000] [--model-dir DIR]

On the tiny model of tools/tiny_llama.py (built into .cache/tiny-llama if no directory is
given; its chat template delimits messages with plain text, so every component boundary is
found by tokenizing the prefix render, through the memo), and on the same tokenizer with the
template's role markers as special tokens (the fast path: boundaries read off the prompt's
own offsets). Workloads, all seeded: chat requests of a system prompt, a few-shot block of
three exchanges and a user turn (system and few-shot shared by groups of requests, as a
batch file built from one template has them); multi-turn conversations (no two requests
share a prefix render: the memo never hits); plain completions, with `encode` one at a time
and `encode_batch` in chunks. Texts are slices of the standard library's sources.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.batchjob.chat import ChatTokenizer  # noqa: E402
from tools.tiny_llama import build  # noqa: E402

# The default model directory (the vLLM tests build the same one there).
DEFAULT_MODEL_DIR = ROOT / ".cache" / "tiny-llama"
# Distinct system prompts and few-shot blocks: groups of requests share one (a batch file of
# one task), so a prefix is tokenized once per group and the memo's hits are what is timed.
SHARED_PREFIXES = 20
# Characters of each part: a system prompt of ~400 tokens, few-shot turns of ~60, a user turn of ~150.
SYSTEM_CHARS, SHOT_CHARS, USER_CHARS = 1500, 200, 500
FEWSHOT_EXCHANGES = 3
# Turns of a multi-turn conversation request (user/assistant pairs before the last user turn).
CONVERSATION_TURNS = 6
# Requests per encode_batch call (what a producer would gather before submitting).
BATCH_SIZES = (16, 64, 256)
# Fixed seed for the slices: the same texts on every run.
SEED = 20240614
# The rates to compare with (the question this answers): the broker's ingest (~150k items/s
# of 256 tokens, BENCHMARKS.md) and a GPU prefilling a 7B model.
BROKER_TOKENS_PER_S = 150_000 * 256
GPU_PREFILL_TOKENS_PER_S = (10_000, 50_000)


class Texts:
    """Seeded slices of the standard library's sources (real code and prose, not random bytes)."""

    def __init__(self, seed: int) -> None:
        import random

        root = Path(sysconfig.get_paths()["stdlib"])
        self._text = "".join(p.read_text(errors="replace") for p in sorted(root.glob("*.py"))[:200])
        self._rng = random.Random(seed)

    def take(self, chars: int) -> str:
        start = self._rng.randrange(0, len(self._text) - chars)
        return self._text[start:start + chars]


def chat_requests(texts: Texts, count: int) -> list[list[dict]]:
    prefixes = []
    for _ in range(SHARED_PREFIXES):
        messages = [{"role": "system", "content": texts.take(SYSTEM_CHARS)}]
        for _ in range(FEWSHOT_EXCHANGES):
            messages += [{"role": "user", "content": texts.take(SHOT_CHARS)},
                         {"role": "assistant", "content": texts.take(SHOT_CHARS)}]
        prefixes.append(messages)
    return [prefixes[k % SHARED_PREFIXES] + [{"role": "user", "content": texts.take(USER_CHARS)}]
            for k in range(count)]


def conversations(texts: Texts, count: int) -> list[list[dict]]:
    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": texts.take(SYSTEM_CHARS // 3)}]
        for _ in range(CONVERSATION_TURNS):
            messages += [{"role": "user", "content": texts.take(SHOT_CHARS)},
                         {"role": "assistant", "content": texts.take(SHOT_CHARS)}]
        out.append(messages + [{"role": "user", "content": texts.take(USER_CHARS)}])
    return out


def time_chat(tokenizer: ChatTokenizer, requests: list[list[dict]]) -> tuple[float, float, int]:
    """(tokens/s, requests/s, mean components) of chat_prompt over `requests`."""
    start = time.perf_counter()
    tokens = components = 0
    for messages in requests:
        prompt = tokenizer.chat_prompt(messages)
        tokens += len(prompt.tokens)
        components += len(prompt.components)
    elapsed = time.perf_counter() - start
    return tokens / elapsed, len(requests) / elapsed, components // len(requests)


def time_completions(tokenizer: ChatTokenizer, prompts: list[str]) -> list[tuple[str, float]]:
    rows = []
    start = time.perf_counter()
    tokens = sum(len(tokenizer.completion_prompt(p).tokens) for p in prompts)
    rows.append(("completion_prompt (encode, one at a time)", tokens / (time.perf_counter() - start)))
    for size in BATCH_SIZES:
        start = time.perf_counter()
        tokens = sum(len(ids) for k in range(0, len(prompts), size)
                     for ids in tokenizer.encode_batch(prompts[k:k + size], True))
        rows.append((f"encode_batch, {size} per call", tokens / (time.perf_counter() - start)))
    return rows


def with_special_markers(model_dir: Path) -> ChatTokenizer:
    """The tiny model's tokenizer with its role markers as special tokens (as ChatML's
    <|im_start|> is), and a template that writes them: the fast path's case."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    markers = ["<|system|>", "<|user|>", "<|assistant|>"]
    tokenizer.add_special_tokens([AddedToken(m, normalized=False, special=True) for m in markers])
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    return ChatTokenizer(tokenizer, template, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()
    model_dir = args.model_dir or build(DEFAULT_MODEL_DIR)
    texts = Texts(SEED)
    chats, convs = chat_requests(texts, args.requests), conversations(texts, args.requests // 4)
    prompts = [texts.take(USER_CHARS * 2) for _ in range(args.requests)]
    print(f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}, {args.requests} requests, model {model_dir}")
    for name, tokenizer in [("tiny model, no memo (the plain method)", ChatTokenizer.load(model_dir, memo_chars=0)),
                            ("tiny model (plain-text markers)", ChatTokenizer.load(model_dir)),
                            ("tiny model, markers as special tokens", with_special_markers(model_dir))]:
        for label, requests in [("system + few-shot + user", chats), ("multi-turn conversations", convs)]:
            tokenizer._memo.clear()  # each row starts cold
            tokens_s, requests_s, parts = time_chat(tokenizer, requests)
            print(f"  {name:40s} chat {label:26s} {tokens_s / 1e3:9.0f}k tokens/s {requests_s:8.0f} req/s "
                  f"({parts} components)")
    for label, rate in time_completions(ChatTokenizer.load(model_dir), prompts):
        print(f"  completions: {label:42s} {rate / 1e3:9.0f}k tokens/s")
    low, high = GPU_PREFILL_TOKENS_PER_S
    print(f"compare: broker ingest ~{BROKER_TOKENS_PER_S / 1e6:.0f}M tokens/s; a GPU's 7B prefill "
          f"{low // 1000}-{high // 1000}k tokens/s")


if __name__ == "__main__":
    main()
