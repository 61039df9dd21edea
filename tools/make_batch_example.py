#!/usr/bin/env python3
"""Write the bundled example batch file (examples/chat_requests.jsonl): OpenAI Batch
requests for `pipeline run-batch`, deterministic, in a few shapes.

    python3 tools/make_batch_example.py examples/chat_requests.jsonl [--requests N] [--model NAME]

Chat requests under 4 system prompts, each with or without a 2-turn few-shot block (8
shapes), a user question each; every 10th request is a /v1/completions one. Standard
library only.
"""

from __future__ import annotations

import argparse
import json
import random

SYSTEM_PROMPTS = [
    "You are a careful assistant for a hardware store. Answer in two sentences, name the aisle.",
    "You translate short English phrases into French. Reply with the translation only.",
    "You are a code reviewer. Point out the single most important problem in the snippet.",
    "You summarise customer emails for a support team: one line, then the customer's mood.",
]
FEW_SHOT = [
    [{"role": "user", "content": "Where are the hinges?"},
     {"role": "assistant", "content": "Hinges are in aisle 7, beside the door handles. Brass ones are on the top shelf."}],
    [{"role": "user", "content": "Good morning"}, {"role": "assistant", "content": "Bonjour"}],
    [{"role": "user", "content": "x = [] ; x[0] = 1"},
     {"role": "assistant", "content": "Indexing an empty list raises IndexError: append instead."}],
    [{"role": "user", "content": "My order is late again and nobody answers the phone."},
     {"role": "assistant", "content": "Late order, phone unanswered. Mood: frustrated."}],
]
QUESTIONS = ["Where do I find {0}?", "Please translate: {0}.", "Review this: {0}", "Email: I want to return {0}."]
THINGS = ["wood glue", "a ladder", "paint rollers", "the garden hose", "light bulbs", "sandpaper", "a drill",
          "copper pipe", "duct tape", "a spirit level", "wall plugs", "a tile cutter"]


def requests(count: int, model: str, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for k in range(count):
        topic = rng.randrange(len(SYSTEM_PROMPTS))
        thing = rng.choice(THINGS)
        if k % 10 == 9:
            out.append({"custom_id": f"req-{k}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": model, "prompt": f"A short note about {thing}:", "max_tokens": 12}})
            continue
        messages = [{"role": "system", "content": SYSTEM_PROMPTS[topic]}]
        if rng.random() < 0.5:
            messages += FEW_SHOT[topic]
        messages.append({"role": "user", "content": QUESTIONS[topic].format(thing)})
        out.append({"custom_id": f"req-{k}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": model, "messages": messages, "max_completion_tokens": 16, "temperature": 0}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.path, "w") as f:
        for request in requests(args.requests, args.model, args.seed):
            f.write(json.dumps(request) + "\n")


if __name__ == "__main__":
    main()
