"""The prefix memo (pipeline/batchjob/prefixes.py): which prefix renders bound a request's
components (MAX_COMPONENTS, at the limit and past it, in chat prompts too), entries found by
exactly the messages and tools the template saw, kept from their second sight, and the memory
bound kept (least recently used first, a parent never before its children); the work of a chat prompt
linear in its turns. A render here is a plain function of the messages (the memo never looks
inside it), or a chat template over a character-level tokenizer built without training."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.batchjob.chat import ChatTokenizer
from pipeline.batchjob.messages import last_user_index
from pipeline.batchjob import prefixes
from pipeline.batchjob.prefixes import MAX_COMPONENTS, SEEN_PREFIXES, PrefixMemo, boundary_indices
from pipeline.wire.layouts.frames import MAX_CHAIN_DEPTH


class Renders:
    """A render that records the prefixes it was asked for."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, messages) -> str:
        self.calls.append(len(messages))
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)


def _messages(count: int, tag: str = "") -> list[dict]:
    roles = ["system"] + ["user", "assistant"] * count
    return [{"role": roles[k], "content": f"{tag}m{k}"} for k in range(count)]


def test_boundaries_at_the_limit_and_past_it():
    assert MAX_COMPONENTS == MAX_CHAIN_DEPTH  # one chain level per component
    assert boundary_indices(-1) == [] and boundary_indices(0) == [] and boundary_indices(3) == [0, 1, 2]
    assert boundary_indices(MAX_COMPONENTS) == list(range(MAX_COMPONENTS))
    past = boundary_indices(MAX_COMPONENTS + 1)
    assert past == [*range(MAX_COMPONENTS - 1), MAX_COMPONENTS] and len(past) == MAX_COMPONENTS
    assert boundary_indices(3000) == [*range(MAX_COMPONENTS - 1), 2999]


def test_a_shared_prefix_is_rendered_twice_and_a_longer_conversation_reuses_it():
    memo, render = PrefixMemo(), Renders()
    messages = _messages(6)
    first = memo.ladder(messages, None, 5, render)
    assert [e.text for e in first] == [render(messages[:j + 1]) for j in range(5)]
    assert len(memo) == 0  # seen once: nothing kept
    second = memo.ladder(messages[:5] + [{"role": "user", "content": "other"}], None, 5, render)
    assert len(memo) == 5 and all(a is not b for a, b in zip(first, second))  # the whole chain, at once
    render.calls.clear()
    third = memo.ladder(messages, None, 5, render)
    assert render.calls == [] and all(a is b for a, b in zip(second, third, strict=True))
    longer = messages + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    for renders in ([6, 7], [6, 7], []):  # turn k+1 finds turn k's prefixes, and keeps its own
        render.calls.clear()
        ladder = memo.ladder(longer, None, 7, render)
        assert render.calls == renders and all(a is b for a, b in zip(second, ladder[:5]))
    assert (memo.hits, memo.misses) == (5 + 5 + 5 + 7, 5 + 5 + 2 + 2)
    memo.check_invariants()


def test_a_prefix_is_kept_only_if_seen_again_within_seen_prefixes():
    memo, render = PrefixMemo(), Renders()

    def sight(k: int) -> None:
        memo.ladder([{"role": "system", "content": f"s{k}"}, {"role": "user", "content": "u"}], None, 1, render)

    for k in range(SEEN_PREFIXES + 1):  # each seen once: only remembered, the first one forgotten
        sight(k)
    assert len(memo) == 0
    sight(1)  # SEEN_PREFIXES - 1 new prefixes since it: still remembered, kept
    sight(0)  # SEEN_PREFIXES new prefixes since it: forgotten, seen "once" again
    assert [e.text for e in memo._entries.values()] == [render([{"role": "system", "content": "s1"}])]
    memo.check_invariants()


def test_entries_are_keyed_by_exactly_what_the_template_sees():
    memo, render = PrefixMemo(), Renders()
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    memo.ladder(base, None, 1, render)
    entry = memo.ladder(base, None, 1, render)[0]
    for other, tools in [([{"content": "s", "role": "system"}], None),  # key order: a template may iterate it
                         ([{"role": "system", "content": "s", "name": "n"}], None),
                         ([{"role": "system", "content": "s "}], None),
                         ([{"role": "system", "content": "s"}], [{"type": "function"}]),
                         ([{"role": "system", "content": 1}], None), ([{"role": "system", "content": 1.0}], None),
                         ([{"role": "system", "content": True}], None)]:
        for _ in range(2):
            assert memo.ladder(other + base[1:], tools, 1, render)[0] is not entry
    assert memo.ladder(base, None, 1, render)[0] is entry
    memo.check_invariants()


def test_values_a_fast_encoder_writes_alike_are_kept_apart():
    # msgspec writes NaN and the infinities as null; json, which the key then falls back to, does not.
    memo, render = PrefixMemo(), Renders()
    entries = []
    for value in [None, math.nan, math.inf, -math.inf, "null", 0, "\x00null"]:
        messages = [{"role": "system", "content": value}, {"role": "user", "content": "u"}]
        memo.ladder(messages, None, 1, render)
        entries.append(memo.ladder(messages, None, 1, render)[0])
        assert entries[-1].key is not None and memo.ladder(messages, None, 1, render)[0] is entries[-1]
    assert len({id(entry) for entry in entries}) == len(entries)
    memo.check_invariants()
    # The fast encoder's text is the key where it reads back: a plain request's, tools or not.
    plain = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for tools in (None, [{"type": "function"}]):
        assert not prefixes._key(prefixes.ROOT_UID, plain, 0, 1, tools)[1].startswith(prefixes._JSON_MARK)


def test_values_json_cannot_write_are_rendered_each_time():
    memo, render = PrefixMemo(), Renders()
    messages = [{"role": "system", "content": "s", "extra": {1, 2}}, {"role": "user", "content": "u"},
                {"role": "user", "content": "v"}]
    for _ in range(3):
        ladder = memo.ladder(messages, None, 2, render)
        assert all(e.key is None for e in ladder)  # and their children are not kept either
    assert render.calls == [1, 2] * 3 and len(memo) == 0


@pytest.mark.parametrize("limit_bytes", [0, 3000, 20_000])
def test_memory_stays_under_the_limit_and_parents_outlive_children(limit_bytes):
    memo, render = PrefixMemo(limit_bytes), Renders()
    rng = np.random.default_rng(0)
    for k in range(300):
        messages = _messages(int(rng.integers(2, 9)), tag=str(rng.integers(0, 6)))
        ladder = memo.ladder(messages, None, len(messages) - 1, render)
        for entry in ladder:  # what chat.py fills in, accounted for
            if entry.ids is None:
                entry.ids = np.arange(len(entry.text), dtype=np.int32)
                memo.resize([entry])
        memo.check_invariants()
        kept = {e.uid for e in memo._entries.values()}
        assert all(e.key[0] == 0 or e.key[0] in kept for e in memo._entries.values())
    if limit_bytes:
        assert 0 < memo.size_bytes <= limit_bytes and memo.hits > 0 and memo.misses > 0
    else:
        assert len(memo) == 0 and memo.hits == 0


def test_an_entry_over_the_limit_is_not_kept_nor_its_children():
    memo, render = PrefixMemo(3000), Renders()
    messages = [{"role": "system", "content": "x" * 5000}, {"role": "user", "content": "a"},
                {"role": "user", "content": "b"}]
    for _ in range(3):
        memo.ladder(messages, None, 2, render)
    assert len(memo) == 0
    memo.check_invariants()


# -- chat prompts: MAX_COMPONENTS, and work linear in the turns ----------------------------------

BOS, START, END = "<s>", "<|im_start|>", "<|im_end|>"
CHATML = ("{{ bos_token }}{% for m in messages %}" + START + "{{ m['role'] }}\n{{ m['content'] }}" + END
          + "\n{% endfor %}{% if add_generation_prompt %}" + START + "assistant\n{% endif %}")
# No added token between messages: every prompt is tokenized whole.
CONCAT = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}:{% endif %}"


def _chat_tokenizer(template: str) -> ChatTokenizer:
    """A byte-level tokenizer of single characters and a few merges, ChatML's tokens added."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [("t", "u"), ("tu", "r"), ("tur", "n"), ("\u0120", "w")]
    vocab = {c: k for k, c in enumerate(chars)} | {a + b: len(chars) + k for k, (a, b) in enumerate(merges)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False) for t in (BOS, START, END)])
    return ChatTokenizer(tokenizer, template, bos_token=BOS)


def _conversation(messages: int) -> list[dict]:
    """A system prompt, then user and assistant turns, `messages` in all, the last a user's."""
    return [{"role": "system", "content": "the system"}] + [
        {"role": ("user", "assistant")[k % 2], "content": f"turn {k} hello world"} for k in range(messages - 2)] + [
        {"role": "user", "content": "the question"}]


@pytest.mark.parametrize("template", [CHATML, CONCAT])
def test_the_work_of_a_chat_prompt_is_linear_in_its_turns(template, monkeypatch):
    def work(messages: int) -> tuple[int, int, int, int]:
        """(renders, messages rendered, tokenizer calls, characters tokenized) of one prompt."""
        tokenizer, renders, texts = _chat_tokenizer(template), [], []
        render, tokenize = tokenizer.render, tokenizer._tokenize
        monkeypatch.setattr(tokenizer, "render", lambda m, **kw: renders.append(len(m)) or render(m, **kw))
        monkeypatch.setattr(tokenizer, "_tokenize",
                            lambda text, *a, **kw: texts.append(text) or tokenize(text, *a, **kw))
        prompt = tokenizer.chat_prompt(_conversation(messages))
        assert len(prompt.components) == MAX_COMPONENTS
        return len(renders), sum(renders), len(texts), sum(len(t) for t in texts)

    half, whole = work(1500), work(3000)
    assert whole[0] <= MAX_COMPONENTS + 1 and whole[2] <= MAX_COMPONENTS + 1
    # Doubling the turns doubles the work (rendering every prefix made it four times as much).
    assert whole[1] <= 2.1 * half[1] and whole[3] <= 2.1 * half[3]


def test_chat_components_at_max_components_and_past_it():
    tokenizer = _chat_tokenizer(CHATML)
    for last_user in (MAX_COMPONENTS - 1, MAX_COMPONENTS, MAX_COMPONENTS + 1, MAX_COMPONENTS + 2):
        messages = _conversation(last_user + 1)
        assert last_user_index(messages) == last_user
        prompt = tokenizer.chat_prompt(messages)
        # Each component ends where its prefix render ends (special tokens delimit messages).
        ends = [len(tokenizer.encode(tokenizer.render(messages[:j + 1], add_generation_prompt=False), False))
                for j in boundary_indices(last_user)]
        assert np.cumsum([len(c) for c in prompt.components]).tolist() == ends
        assert len(prompt.components) == min(last_user, MAX_COMPONENTS)
        if last_user > MAX_COMPONENTS - 1:  # turn k+1 still starts with turn k's first components
            for a, b in zip(previous.components[:MAX_COMPONENTS - 1], prompt.components[:MAX_COMPONENTS - 1],
                            strict=True):
                assert np.array_equal(a, b)
        previous = prompt
