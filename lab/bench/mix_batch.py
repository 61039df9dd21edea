"""The mixed chat batch file of `pipeline bench run-batch-mix` and the comparison of two
output files' answers: pure code, standard library only.

    reqs = requests(400, 36, "tiny-llama")             # kinds mixed, in arrival order
    answers = answers_of(lines)                         # {custom_id: Answer} of an output file
    agreement(vllm_answers, product_answers)            # per kind: same answers, token for token

The file is the run-batch comparison's chat requests (chat_batch.py: shapes of a system prompt
and few-shot turns, Zipf-like popularity, shuffled), each shape with a system prompt of its
own, and every request one of KINDS in turn (the shuffle spreads them over shapes and
arrival): `plain` (greedy), `json_schema` (greedy, `response_format` of SCHEMA), `logprobs`
(greedy, `logprobs` with TOP_LOGPROBS alternatives) and `n2` (SAMPLES choices, sampled at
SAMPLED_TEMPERATURE without a seed, `min_tokens` its max tokens). The kind is the
custom_id's last part.

vLLM's usage of a request of several samples reports the cached tokens of the sample that
finished last; the one started second has reused its sibling's blocks (every full block of
the prompt), the first has not. `min_tokens` at the max tokens makes every sample run its
full length, so the last to finish is the engine's order, not a sampled end of text.
NOTE: without it, one sample in a hundred requests stopped early in about half the runs of
either side, and that request's cached tokens fell a block short (51,904 against 51,936 on
vllm run-batch as on the product, 2 runs of 3 each).

Two answers to a greedy request are the same when every choice's message content, the
completion's token count and, where logprobs were asked, every chosen token are equal. A
sampled request's choices are random on each side: only their count is compared.
NOTE: a seed would make the n2 choices comparable, but a seeded request kills the engine
core of `vllm run-batch` on vLLM's CPU build (0.32: gpu_model_runner._bookkeeping_sync
rewinds the request's generator with set_offset, which a CPU generator refuses: "CPU
Generator does not use offset", every request then answered 500).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lab.bench import chat_batch

KINDS = ("plain", "json_schema", "logprobs", "n2")
GREEDY_KINDS = ("plain", "json_schema", "logprobs")
# Alternatives per position of a logprobs request (OpenAI allows up to 20).
TOP_LOGPROBS = 2
SAMPLES = 2
# n > 1 must sample: vLLM refuses several greedy samples ("n must be 1 when using greedy
# sampling"); 1 is OpenAI's and vLLM's default temperature.
SAMPLED_TEMPERATURE = 1.0
# Room for the schema's two keys and short values (the tiny tokenizer: ~3 tokens a key).
JSON_MAX_COMPLETION_TOKENS = 24
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["answer", "confidence"], "additionalProperties": False}
# Custom ids of differing requests kept per kind, to rerun them by hand.
MAX_EXAMPLES = 5


def requests(count: int, shape_count: int, model: str, seed: int = 0) -> list[dict]:
    """Every request in arrival order; custom_id `req-K-sS-KIND` (chat_batch's id and kind)."""
    out = chat_batch.requests(count, shape_count, model, seed=seed, systems=shape_count)
    for k, request in enumerate(out):
        kind = KINDS[k % len(KINDS)]
        request["custom_id"] += f"-{kind}"
        body = request["body"]
        if kind == "json_schema":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "reply", "strict": True, "schema": SCHEMA}}
            body["max_completion_tokens"] = JSON_MAX_COMPLETION_TOKENS
        elif kind == "logprobs":
            body.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        elif kind == "n2":
            body.update(n=SAMPLES, temperature=SAMPLED_TEMPERATURE, min_tokens=body["max_completion_tokens"])
    return out


def kind_of(custom_id: str) -> str:
    kind = custom_id.rsplit("-", 1)[-1]
    assert kind in KINDS, f"custom_id {custom_id!r} names no kind of this file"
    return kind


@dataclass(slots=True, frozen=True)
class Answer:
    """What one output line answered, as far as the comparison reads it."""

    kind: str
    texts: tuple[str, ...]  # each choice's message content
    tokens: tuple[tuple[str, ...], ...]  # each choice's chosen tokens (logprobs asked), else ()
    logprobs: tuple[tuple[float, ...], ...]  # their log probabilities
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def answer_of(row: Mapping[str, Any]) -> Answer:
    """An output line's answer (a successful one: check_output has seen every status)."""
    body = row["response"]["body"]
    choices = sorted(body["choices"], key=lambda c: c["index"])
    content = [((c.get("logprobs") or {}).get("content") or []) for c in choices]
    usage = body["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Answer(kind_of(row["custom_id"]), tuple(c["message"].get("content") or "" for c in choices),
                  tuple(tuple(t["token"] for t in lp) for lp in content if lp),
                  tuple(tuple(float(t["logprob"]) for t in lp) for lp in content if lp),
                  int(usage["prompt_tokens"]), int(cached), int(usage["completion_tokens"]))


def answers_of(lines: Iterable[str]) -> dict[str, Answer]:
    """Every answer of an output file's lines, by custom_id."""
    rows = (json.loads(line) for line in lines if line.strip())
    return {row["custom_id"]: answer_of(row) for row in rows}


def usage_by_kind(answers: Mapping[str, Answer], block: int) -> dict[str, dict[str, int]]:
    """Requests, prompt, cached and completion tokens summed per kind, and the cacheable
    tokens: the most a prefix cache of `block`-token blocks can serve, every full block of
    a prompt but one holding its last token (vLLM computes at least one)."""
    out = {kind: dict(requests=0, prompt_tokens=0, cached_tokens=0, completion_tokens=0, cacheable_tokens=0)
           for kind in KINDS}
    for a in answers.values():
        row = out[a.kind]
        row["requests"] += 1
        row["prompt_tokens"] += a.prompt_tokens
        row["cached_tokens"] += a.cached_tokens
        row["completion_tokens"] += a.completion_tokens
        row["cacheable_tokens"] += (a.prompt_tokens - 1) // block * block
    return out


def same(a: Answer, b: Answer) -> bool:
    """The same answer: token for token where greedy, as many choices where sampled."""
    if a.kind not in GREEDY_KINDS:
        return len(a.texts) == len(b.texts) == SAMPLES
    return (a.texts, a.tokens, a.completion_tokens) == (b.texts, b.tokens, b.completion_tokens)


def agreement(first: Mapping[str, Answer], second: Mapping[str, Answer]) -> dict[str, dict[str, Any]]:
    """Per kind over the custom_ids both answered: requests, how many are the same, a few
    that differ, and the largest difference of a chosen token's log probability where the
    tokens are the same (None where no logprobs were compared)."""
    out: dict[str, dict[str, Any]] = {kind: {"requests": 0, "same": 0, "differ": [], "max_logprob_diff": None}
                                      for kind in KINDS}
    for custom_id in sorted(first.keys() & second.keys()):
        a, b = first[custom_id], second[custom_id]
        row = out[a.kind]
        row["requests"] += 1
        if same(a, b):
            row["same"] += 1
        elif len(row["differ"]) < MAX_EXAMPLES:
            row["differ"].append(custom_id)
        if a.tokens and a.tokens == b.tokens:
            gap = max((abs(x - y) for xs, ys in zip(a.logprobs, b.logprobs) for x, y in zip(xs, ys)), default=0.0)
            row["max_logprob_diff"] = max(gap, row["max_logprob_diff"] or 0.0)
    return out


def greedy_share(kinds: Mapping[str, Mapping[str, Any]]) -> tuple[int, int]:
    """(same, requests) over the greedy kinds of an `agreement`."""
    return (sum(kinds[k]["same"] for k in GREEDY_KINDS), sum(kinds[k]["requests"] for k in GREEDY_KINDS))
