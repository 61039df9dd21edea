#!/usr/bin/env python3
"""Tokens and requests per second one producer process makes into prompts for
`pipeline run-batch`: is tokenizing what limits a job? Optionally beside an older tree's.

    python tools/bench_tokenize.py [--requests 2000] [--model-dir DIR] [--baseline TREE] [--rounds 3]

On the tiny model of tools/tiny_llama.py (built into .cache/tiny-llama if no directory is
given; its chat template delimits messages with plain text, so each prompt is tokenized
whole), and on the same tokenizer with the template's role markers as special tokens (each
shared prefix tokenized by its first two requests, then only each prompt's rest). Workloads, all seeded: chat
requests of a system prompt, a few-shot block of three exchanges and a short user turn
(system and few-shot shared by groups of requests, as a batch file built from one template
has them); 14-message conversations (no two share a prefix); one long conversation (a
prompt's work must be linear in its turns); plain completions. Each row gets a fresh
tokenizer (a cold memo), and the best of `--rounds` runs is kept. Rates are per second of
the process's CPU time (all its threads): on 2 cores with 2 producers, CPU per token is what
bounds a job, and it moves far less than wall time on a machine shared with other work.

With --baseline TREE (a checkout of an older commit, e.g. `git worktree add /tmp/base
HEAD~1`), each round runs the same rows on TREE's `pipeline` and on this tree's, one after
the other, each in a process of its own, and prints both: before and after, in one run.

The last tables are the batch interface's question: the rests of the few-shot requests
(what a producer tokenizes per request after a shared prefix) tokenized one `encode` at a
time, or by `encode_batch` / `encode_batch_fast` (tokenizers' threaded calls) in groups, in
one process and in --rest-processes processes at once (as that many producers on this
machine's cores). Texts are slices of the standard library's sources.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The default model directory (the vLLM tests build the same one there).
DEFAULT_MODEL_DIR = ROOT / ".cache" / "tiny-llama"
# Distinct system prompts and few-shot blocks: groups of requests share one (a batch file of
# one task), so a prefix is tokenized by its group's first requests and the memo's hits are what is timed.
SHARED_PREFIXES = 20
# Characters of each part: a system prompt of ~400 tokens, few-shot turns of ~60, a user turn of ~150.
SYSTEM_CHARS, SHOT_CHARS, USER_CHARS = 1500, 200, 500
FEWSHOT_EXCHANGES = 3
# Turns of a multi-turn conversation request (user/assistant pairs before the last user turn).
CONVERSATION_TURNS = 6
# The long conversation: messages, characters each, and how many such requests are timed.
LONG_MESSAGES, LONG_CHARS, LONG_REQUESTS = 1000, 40, 3
# Requests per encode_batch call (what a producer would gather before submitting).
BATCH_SIZES = (16, 64, 256)
# Fixed seed for the slices: the same texts on every run.
SEED = 20240614
# The rates to compare with (the question this answers): the broker's ingest (~150k items/s
# of 256 tokens, BENCHMARKS.md) and a GPU prefilling a 7B model.
BROKER_TOKENS_PER_S = 150_000 * 256
GPU_PREFILL_TOKENS_PER_S = (10_000, 50_000)
MARKERS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


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


def conversations(texts: Texts, count: int, turns: int, chars: int) -> list[list[dict]]:
    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": texts.take(chars)}]
        for _ in range(turns):
            messages += [{"role": "user", "content": texts.take(chars)},
                         {"role": "assistant", "content": texts.take(chars)}]
        out.append(messages + [{"role": "user", "content": texts.take(chars)}])
    return out


def workloads(requests: int) -> dict[str, list]:
    texts = Texts(SEED)
    return {
        "system + few-shot + user": chat_requests(texts, requests),
        f"{2 * CONVERSATION_TURNS + 2}-message conversations": conversations(texts, requests // 4, CONVERSATION_TURNS,
                                                                             SHOT_CHARS),
        f"one {LONG_MESSAGES:,}-message conversation": conversations(texts, LONG_REQUESTS, LONG_MESSAGES // 2 - 1,
                                                                     LONG_CHARS),
        "completions": [texts.take(USER_CHARS * 2) for _ in range(requests)],
    }


def tokenizers_under_test(model_dir: Path):
    """(name, factory) of each ChatTokenizer timed: the tiny model as it is, and with its role
    markers as special tokens (as ChatML's <|im_start|> is) and a template that writes them."""
    from tokenizers import AddedToken, Tokenizer

    from pipeline.batchjob.chat import ChatTokenizer

    def special() -> ChatTokenizer:
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tokenizer.add_special_tokens([AddedToken(m, normalized=False, special=True) for m in MARKERS])
        return ChatTokenizer(tokenizer, SPECIAL_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")

    return [("plain-text markers", lambda: ChatTokenizer.load(model_dir)), ("markers as special tokens", special)]


def time_rows(model_dir: Path, requests: int) -> dict[str, tuple[float, float]]:
    """{row: (tokens/s, requests/s)} of this process's `pipeline`."""
    rows = {}
    for label, items in workloads(requests).items():
        for name, make in tokenizers_under_test(model_dir):
            if label == "completions" and name != "plain-text markers":
                continue
            tokenizer = make()
            prompt = tokenizer.completion_prompt if label == "completions" else tokenizer.chat_prompt
            start = time.process_time()
            tokens = sum(len(prompt(item).tokens) for item in items)
            elapsed = time.process_time() - start
            rows[f"{name:26s} {label}"] = (tokens / elapsed, len(items) / elapsed)
    return rows


def time_rests(model_dir: Path, requests: int) -> list[tuple[str, float, float]]:
    """(label, tokens per CPU second, tokens per wall second) of the few-shot requests' rests
    (what follows the shared prefix), one `encode` at a time or in groups, with the
    special-marker tokenizer (where only the rest is tokenized)."""
    tokenizer = tokenizers_under_test(model_dir)[1][1]()
    rust, lead = tokenizer._tokenizer, tokenizer._splits.lead
    rests = []
    for messages in workloads(requests)["system + few-shot + user"]:
        whole = tokenizer.render(messages, add_generation_prompt=True)
        rests.append(lead + whole[len(tokenizer.render(messages[:-1], add_generation_prompt=False)):])
    calls = [("encode, one at a time", lambda: [rust.encode(r, add_special_tokens=False) for r in rests])]
    for method in ("encode_batch", "encode_batch_fast"):
        for size in BATCH_SIZES:
            call = getattr(rust, method)
            calls.append((f"{method}, {size} per call", lambda call=call, size=size: [
                e for k in range(0, len(rests), size) for e in call(rests[k:k + size], add_special_tokens=False)]))
    rows = []
    for label, run in calls:
        cpu, wall = time.process_time(), time.perf_counter()
        tokens = sum(len(e.ids) for e in run())
        rows.append((label, tokens / (time.process_time() - cpu), tokens / (time.perf_counter() - wall)))
    return rows


def run_tree(tree: Path, model_dir: Path, requests: int) -> dict[str, tuple[float, float]]:
    """time_rows in a process of its own whose `pipeline` is TREE's."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--rows-only", "--model-dir", str(model_dir),
                          "--requests", str(requests)], env=env, check=True, capture_output=True, text=True).stdout
    return {row: tuple(rate) for row, rate in json.loads(out).items()}


def best(rounds: list[dict[str, tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    return {row: max(r[row] for r in rounds) for row in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--baseline", type=Path, default=None, help="an older tree to time beside this one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rest-processes", type=int, default=2,
                        help="processes timing the rests at once, as that many producers would")
    parser.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rests-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rows_only:  # a child of run_tree: `pipeline` is its PYTHONPATH's
        print(json.dumps(time_rows(args.model_dir, args.requests)))
        return
    if args.rests_only:  # a child of main: one of --rest-processes
        sys.path.insert(0, str(ROOT))
        print(json.dumps(time_rests(args.model_dir, args.requests)))
        return
    sys.path.insert(0, str(ROOT))
    from tools.tiny_llama import build

    model_dir = args.model_dir or build(DEFAULT_MODEL_DIR)
    print(f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}, {args.requests} requests, model {model_dir}, "
          f"best of {args.rounds} rounds")
    trees = {"after": ROOT} if args.baseline is None else {"before": args.baseline, "after": ROOT}
    results: dict[str, list] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            results[name].append(run_tree(tree, model_dir, args.requests))
    figures = {name: best(rounds) for name, rounds in results.items()}
    header = "".join(f"{name + ' tokens/s':>17s} {'req/s':>8s}" for name in trees)
    print(f"  {'tokenizer and workload':62s}{header}{'  after/before' if len(trees) > 1 else ''}")
    for row in figures["after"]:
        cells = "".join(f"{figures[n][row][0] / 1e3:16.0f}k {figures[n][row][1]:8.1f}" for n in trees)
        ratio = f"  {figures['after'][row][0] / figures['before'][row][0]:11.2f}x" if len(trees) > 1 else ""
        print(f"  {row:62s}{cells}{ratio}")
    for processes in sorted({1, args.rest_processes}):
        print(f"rests of the few-shot requests (special markers), this tree, {processes} process(es) at once:")
        children = [subprocess.Popen([sys.executable, __file__, "--rests-only", "--model-dir", str(model_dir),
                                      "--requests", str(args.requests)], stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}) for _ in range(processes)]
        outputs = [json.loads(child.communicate()[0]) for child in children]
        for k, (label, _, _) in enumerate(outputs[0]):
            cpu = sum(out[k][1] for out in outputs) / processes
            wall = sum(out[k][2] for out in outputs)
            print(f"  {label:32s} {cpu / 1e3:7.0f}k tokens per CPU second, {wall / 1e3:7.0f}k per wall second in all")
    low, high = GPU_PREFILL_TOKENS_PER_S
    print(f"compare: broker ingest ~{BROKER_TOKENS_PER_S / 1e6:.0f}M tokens/s; a GPU's 7B prefill "
          f"{low // 1000}-{high // 1000}k tokens/s")


if __name__ == "__main__":
    main()
