"""The chat batch file of the run-batch comparison (`pipeline bench run-batch` and
tools/bench_engine_process.py): OpenAI Batch requests in many shapes with Zipf-like popularity,
in shuffled (arrival) order; seeded.

A shape is a system prompt and a few-shot block (SYSTEMS system prompts unless told, each
with shapes / SYSTEMS few-shot blocks of 2 to 4 turns): the prefix vLLM can serve from its cache,
a few hundred tokens with the tiny tokenizer (tools/tiny_llama.py: about 1.5 tokens a word).
Shape k is drawn with weight 1 / (k + 1) ** ZIPF_S; every request has a short user turn of
its own (a question and a number), max_completion_tokens MAX_COMPLETION_TOKENS and
temperature 0. The file's order is the arrival order: a seeded shuffle. Pure code, standard
library only.
"""

from __future__ import annotations

import random

SYSTEMS = 16
ZIPF_S = 1.0
MAX_COMPLETION_TOKENS = 12
# Words of the made-up prompts (the text only has to tokenize like prose).
WORDS = (
    "the a of to and in is for on with as by at from that this be are it or an was which not have "
    "order customer store aisle price stock delivery invoice refund warranty account payment card "
    "shipping parcel address phone email ticket support agent manager policy return exchange item "
    "product size colour model serial number date time week month year report summary answer "
    "question reply request review check confirm cancel update change open close start finish "
    "careful polite short clear exact brief formal friendly helpful strict simple correct always "
    "never only first last next every each other same different new old large small quick slow "
    "code function variable list string error exception value type file line test module class "
    "translate french german spanish english word phrase sentence paragraph meaning tone style "
    "hardware tool drill hammer screw nail glue paint brush ladder pipe tape saw wrench bolt "
    "garden hose light bulb switch socket cable plug lamp shelf door window lock key hinge handle"
).split()
ROLES = ("assistant for a hardware store", "translator", "code reviewer", "support summariser",
         "travel planner", "recipe helper", "legal clerk", "tutor in arithmetic", "librarian",
         "sales assistant", "bank clerk", "weather reporter", "museum guide", "fitness coach",
         "gardening expert", "car mechanic")


def _sentence(rng: random.Random, low: int, high: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(low, high))]
    return " ".join(words).capitalize() + "."


def _text(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng, 6, 16) for _ in range(sentences))


def shapes(count: int, rng: random.Random, systems: int = SYSTEMS) -> list[list[dict]]:
    """Each shape's messages before the user turn: one of `systems` system prompts and its
    few-shot turns."""
    prompts = [f"You are a {ROLES[k % len(ROLES)]}. " + _text(rng, rng.randint(3, 8)) for k in range(systems)]
    out = []
    for k in range(count):
        messages = [{"role": "system", "content": prompts[k % systems]}]
        for _ in range(rng.randint(2, 4)):
            messages += [{"role": "user", "content": _text(rng, rng.randint(1, 3))},
                         {"role": "assistant", "content": _text(rng, rng.randint(1, 4))}]
        out.append(messages)
    return out


def requests(count: int, shape_count: int, model: str, seed: int = 0, systems: int = SYSTEMS) -> list[dict]:
    """Every request in arrival order; custom_id `req-K-sS`: K its index before the shuffle,
    S its shape."""
    rng = random.Random(seed)
    prefixes = shapes(shape_count, rng, systems)
    weights = [1 / (k + 1) ** ZIPF_S for k in range(shape_count)]
    # Every shape at least once, the rest by popularity.
    drawn = list(range(shape_count)) + rng.choices(range(shape_count), weights, k=count - shape_count)
    out = []
    for k, shape in enumerate(drawn):
        user = f"{_sentence(rng, 4, 12)} Case {rng.randrange(100000)}?"
        out.append({"custom_id": f"req-{k}-s{shape}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": model, "messages": prefixes[shape] + [{"role": "user", "content": user}],
                             "max_completion_tokens": MAX_COMPLETION_TOKENS, "temperature": 0}})
    rng.shuffle(out)
    return out
