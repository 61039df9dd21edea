"""The chat tokenizer: model directories loaded (and refused, naming the path), chat prompts
rendered as transformers renders them, their components (shared prefixes get one shape, a
conversation's turns chain, a merge across a message boundary moves the boundary back, at
most MAX_COMPONENTS of them), a shape's prefix tokenized by its first two requests only and the prompts equal to the
plain method on generated conversations for several tokenizer families, a prompt's work
linear in its turns, completion prompts, and every failure of the template or the tokenizer
a typed error of its request.

Tokenizers are trained here with the `tokenizers` library on a small corpus (well under a
second each, once per module): one whose messages are delimited by special tokens (ChatML),
one trained so that the end of one message and the start of the next merge into one token,
and one of each family `FAMILIES` names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.batchjob.chat import ChatPrompt, ChatTokenizer
from pipeline.batchjob.messages import check_messages, last_user_index
from pipeline.batchjob.prefixes import boundary_indices
from pipeline.producer.signature import signature
from pipeline.wire.errors import (
    BadInputError,
    ChatRequestError,
    ConfigError,
    ModelDirError,
    NoChatTemplateError,
    TokenArrayError,
)

BOS, EOS = "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML = ("{{ bos_token }}{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END
          + "\n{% endfor %}{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}")
# Messages back to back with no delimiter at all: a message ending "hel" and the next
# starting "lo" make "hello", which the merging tokenizer has as one token.
CONCAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}:{% endif %}"
# The last message is rendered differently from the others (as Llama 2's template does): a
# prefix render is then not a character prefix of the whole prompt.
LAST_DIFFERS = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                "{% if loop.last %}" + IM_END + "{% else %}\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
          "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
           "{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}")
BERT = ("[CLS]{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}[SEP]{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
# ChatML without the newline after <|im_end|>, and an added token that crosses the message
# boundary where the next user turn starts with "hel": a cut there is refused, elsewhere taken.
TIGHT = CHATML.replace(IM_END + "\n", IM_END)
CROSSING = IM_END + IM_START + "user\nhel"
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# name: (tokenizer kind for _train, its added tokens, template, prompts of a shape whose rest
# is tokenized alone in test_a_shapes_rest_is_tokenized_alone_only_where_exact).
FAMILIES = {
    "chatml": ("bytelevel", [BOS, EOS, IM_START, IM_END], CHATML, 3),
    "llama3": ("bytelevel+space", LLAMA3_TOKENS, LLAMA3, 3),
    "mistral-first": ("first", [BOS, EOS], MISTRAL, 3),
    "mistral-always": ("always", [BOS, EOS, "[INST]", "[/INST]"], MISTRAL, 3),
    "wordpiece": ("wordpiece", ["[UNK]", "[CLS]", "[SEP]"], BERT, 3),
    "crossing": ("bytelevel", [BOS, EOS, IM_START, IM_END, CROSSING], TIGHT, 2),
    "concat": ("merging", [BOS, EOS], CONCAT, 0),  # no special token between messages: never
    "last": ("bytelevel", [BOS, EOS, IM_START, IM_END], LAST_DIFFERS, 0),  # no prefix renders a prefix
}
WORDS = ["hello", "help", "world", "system", "user", "assistant", "answer", "question", "the", "of", "lo", "hel",
         "caf\u00e9", "\u4e16\u754c", "\u2581x", "Ab"]


def _train(specials: list[str], corpus: list[str], vocab_size: int, kind: str = "bytelevel"):
    """A tokenizer of one family: byte-level BPE (GPT-2; "bytelevel+space" with a prefix
    space, as Llama 3's), BPE over Metaspace ("first" or "always": Llama 2, Mistral), or
    WordPiece behind BERT's normalizer (lowercase, accents stripped)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "wordpiece":
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    elif kind in ("first", "always"):
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=kind)
        tokenizer.decoder = decoders.Metaspace(prepend_scheme=kind)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=kind == "bytelevel+space")
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def _corpus(seed: int, lines: int) -> list[str]:
    """Lines of WORDS; some end in " \n" so that the space-newline pair is a merge: a text
    cut between them is then tokenized otherwise alone than inside the whole prompt (the
    pre-tokenizer's whitespace rule looks ahead), which a cut read off token offsets misses."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS[:12], size=8)) + (" \n" if k % 2 else "\n") for k in range(lines)]


def _write_model(directory: Path, tokenizer, **config) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def trained():
    """(delimited, merging): Rust tokenizers, trained once per module."""
    delimited = _train([BOS, EOS, IM_START, IM_END], _corpus(0, 400), 400)
    merging = _train([BOS, EOS], _corpus(1, 400), 400)
    for tokenizer in (delimited, merging):  # the merges the tests need
        assert tokenizer.encode(" \n", add_special_tokens=False).tokens == ["Ġ\u010a"]
    assert merging.encode("hello", add_special_tokens=False).tokens == ["hello"]
    return delimited, merging


@pytest.fixture(scope="module")
def models(trained, tmp_path_factory) -> dict[str, Path]:
    delimited, merging = trained
    root = tmp_path_factory.mktemp("models")
    return {
        "chatml": _write_model(root / "chatml", delimited, chat_template=CHATML, bos_token=BOS,
                               eos_token={"__type": "AddedToken", "content": EOS}),
        "concat": _write_model(root / "concat", merging, chat_template=CONCAT, bos_token=BOS, eos_token=EOS),
        "last": _write_model(root / "last", delimited, bos_token=BOS, eos_token=EOS,
                             chat_template=[{"name": "tool_use", "template": "x"},
                                            {"name": "default", "template": LAST_DIFFERS}]),
    }


@pytest.fixture(scope="module")
def chatml(models) -> ChatTokenizer:
    return ChatTokenizer.load(models["chatml"])


@pytest.fixture(scope="module")
def families(trained) -> dict[str, ChatTokenizer]:
    """Each of FAMILIES, its memo small (20,000 bytes) so that entries are evicted too."""
    rng = np.random.default_rng(2)
    corpus = [" ".join(rng.choice(WORDS, size=8)) + "\n" for _ in range(400)]
    out = {}
    for name, (kind, specials, template, _) in FAMILIES.items():
        tokenizer = trained[1] if kind == "merging" else _train(specials, corpus, 600, kind)
        bos = "<|begin_of_text|>" if name == "llama3" else BOS
        out[name] = ChatTokenizer(tokenizer, template, bos_token=bos, eos_token=EOS, memo_bytes=20_000)
    return out


def reference_prompt(tokenizer: ChatTokenizer, messages: list[dict]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The plain method: render and tokenize the whole prompt and every prefix conversation
    that bounds a component, cut at the longest common token prefix with the whole prompt,
    drop cuts that do not advance."""
    checked = check_messages(messages)
    full = np.array(tokenizer.encode(tokenizer.render(checked, add_generation_prompt=True), False), dtype=np.int32)
    components, start = [], 0
    for j in boundary_indices(last_user_index(checked)):
        prefix = tokenizer.encode(tokenizer.render(checked[:j + 1], add_generation_prompt=False), False)
        end = 0
        while end < min(len(prefix), len(full)) and prefix[end] == full[end]:
            end += 1
        if end > start:
            components.append(full[start:end])
            start = end
    return full, components


def _chat(system: str, shots: list[tuple[str, str]], user: str) -> list[dict]:
    messages = [{"role": "system", "content": system}]
    for question, answer in shots:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": user}]


def _assert_prefix(prompt: ChatPrompt) -> None:
    if prompt.components:
        assert np.array_equal(np.concatenate(prompt.components), prompt.tokens[:prompt.prefix_len])
    assert all(len(c) for c in prompt.components)
    assert prompt.tokens.dtype == np.int32 and not prompt.tokens.flags.writeable


# -- shapes of chat requests -----------------------------------------------------------------

def test_requests_sharing_system_and_fewshot_get_the_same_components(chatml):
    shots = [("what is the answer", "the answer of the question"), ("hello world", "help the user")]
    first = chatml.chat_prompt(_chat("you are the system", shots, "hello"))
    second = chatml.chat_prompt(_chat("you are the system", shots, "a much longer question of the user"))
    assert len(first.components) == 1 + 2 * len(shots)  # system, then each few-shot message
    for a, b in zip(first.components, second.components, strict=True):
        assert np.array_equal(a, b)
    assert signature(first.components) == signature(second.components)
    other = chatml.chat_prompt(_chat("you are another system", shots, "hello"))
    assert signature(other.components) != signature(first.components)
    # Each boundary is where the prefix render's own tokens end (the delimiters are special
    # tokens, so nothing merges across them).
    messages = check_messages(_chat("you are the system", shots, "hello"))
    ends = [len(chatml.encode(chatml.render(messages[:j + 1], add_generation_prompt=False), False))
            for j in range(len(messages) - 1)]
    assert np.cumsum([len(c) for c in first.components]).tolist() == ends
    assert first.components[0][0] == chatml.encode(BOS, False)[0]  # the template writes bos, once
    _assert_prefix(first)


def test_turn_k_plus_1_starts_with_turn_k_components(chatml):
    messages = [{"role": "system", "content": "you are the system"}]
    previous: list[np.ndarray] = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"question {turn} of the user"})
        prompt = chatml.chat_prompt(messages)
        assert len(prompt.components) == len(previous) + (1 if turn == 0 else 2)
        for a, b in zip(previous, prompt.components):
            assert np.array_equal(a, b)
        # Turn k's whole prompt (with its generation prompt) is where turn k+1's tokens begin,
        # up to the answer's text.
        _assert_prefix(prompt)
        previous = prompt.components
        messages.append({"role": "assistant", "content": f"answer {turn} hello world"})


def test_a_merge_across_the_boundary_moves_it_back_to_the_common_prefix(models):
    tokenizer = ChatTokenizer.load(models["concat"])
    messages = [{"role": "system", "content": "the system hel"}, {"role": "user", "content": "lo world"}]
    prefix = tokenizer.encode(tokenizer.render(messages[:1], add_generation_prompt=False), False)
    prompt = tokenizer.chat_prompt(messages)
    # The precondition: the whole prompt has "hello" where the prefix render ends in "hel".
    assert prompt.tokens[:len(prefix)].tolist() != prefix
    common = next(k for k in range(len(prefix)) if prefix[k] != prompt.tokens[k])
    assert common > 0 and prompt.prefix_len == common
    _assert_prefix(prompt)
    full, components = reference_prompt(tokenizer, messages)
    assert np.array_equal(full, prompt.tokens) and len(components) == 1
    assert np.array_equal(components[0], prompt.components[0])


def test_a_cut_at_a_token_boundary_of_the_prompt_is_not_enough(models):
    # Why the fast path cuts only beside special tokens: "the \n" alone ends in the merged
    # " \n", but inside "the \nhello" the pre-tokenizer splits " " from "\n" (its
    # whitespace rule looks ahead), so the whole prompt has a token boundary at the cut while
    # the prefix render's tokens are not its first tokens.
    tokenizer = ChatTokenizer.load(models["concat"])
    messages = [{"role": "system", "content": "the \n"}, {"role": "user", "content": "hello"}]
    prompt = tokenizer.chat_prompt(messages)
    alone = tokenizer.encode("the \n", False)
    assert tokenizer.decode(prompt.tokens[:len(alone) + 1]) == "the \n"  # a boundary at the cut...
    assert prompt.tokens[:len(alone)].tolist() != alone  # ...yet not the prefix's own tokens
    full, components = reference_prompt(tokenizer, messages)
    assert [c.tolist() for c in components] == [c.tolist() for c in prompt.components]
    assert prompt.prefix_len == len(alone) - 1


def test_a_boundary_that_does_not_advance_is_dropped(models):
    tokenizer = ChatTokenizer.load(models["concat"])
    # The second system message is empty: its boundary is the first's, so one component.
    messages = [{"role": "system", "content": "the system "}, {"role": "system", "content": ""},
                {"role": "user", "content": "hello"}]
    prompt = tokenizer.chat_prompt(messages)
    assert len(prompt.components) == 1
    _assert_prefix(prompt)


def test_no_user_message_means_no_components(chatml):
    prompt = chatml.chat_prompt([{"role": "system", "content": "the system"}])
    assert prompt.components == [] and len(prompt.tokens) > 0


# -- a shape's prefix kept, and the prompts of every tokenizer family equal to the plain method

# Pieces of contents: letters the tokenizers merge, whitespace, non-ASCII, "▁", and the added
# tokens' own text, whole or in part (a request may contain them: they are tokenized as the
# added tokens, and may cross a message boundary).
PIECE = st.sampled_from(list("helowrd tsyquinA\n") + ["\u00e9", "\u4e16", "\u2581", "  ", " \n", "hel", "lo",
                                                      IM_START, IM_END, BOS, EOS, "<|im_", "[INST]", "[SEP]",
                                                      "<|eot_id|>", "<|start_header_id|>"])
TEXT = st.lists(PIECE, max_size=10).map("".join)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT})
USER = st.fixed_dictionaries({"role": st.just("user"), "content": TEXT})
# A shared start and a few endings (each ends with a user turn): requests of one shape, and
# conversations a turn or two apart.
BATCH = st.tuples(st.lists(MESSAGE, max_size=5),
                  st.lists(st.tuples(st.lists(MESSAGE, max_size=2), USER).map(lambda t: [*t[0], t[1]]),
                           min_size=1, max_size=3))


def _check_against_plain(tokenizer: ChatTokenizer, messages: list[dict]) -> None:
    try:
        full, components = reference_prompt(tokenizer, messages)
    except ChatRequestError:  # an empty render: refused by both
        with pytest.raises(ChatRequestError):
            tokenizer.chat_prompt(messages)
        return
    prompt = tokenizer.chat_prompt(messages)
    assert np.array_equal(prompt.tokens, full)
    assert [c.tolist() for c in prompt.components] == [c.tolist() for c in components]
    assert prompt.signature is None or prompt.signature == signature(components)
    _assert_prefix(prompt)


@pytest.mark.parametrize("family", list(FAMILIES))
@settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=BATCH)
def test_prompts_equal_the_plain_method(families, family, batch):
    start, endings = batch
    for ending in endings:
        _check_against_plain(families[family], start + ending)


@pytest.mark.parametrize("family", list(FAMILIES))
@settings(max_examples=30, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=BATCH)
def test_prompts_equal_the_plain_method_on_one_thread(families, family, batch, monkeypatch):
    """A producer's tokenizer (`one_thread`: rests tokenized without offsets) makes the
    same prompts."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # what one_thread sets is undone after
    tokenizer = ChatTokenizer(families[family]._tokenizer, FAMILIES[family][2], bos_token=families[family]._bos_token,
                              eos_token=EOS)
    tokenizer.one_thread()
    start, endings = batch
    for ending in endings * 2:  # a prefix's rest is tokenized alone from its third prompt
        _check_against_plain(tokenizer, start + ending)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_shapes_rest_is_tokenized_alone_only_where_exact(families, family):
    tokenizer = ChatTokenizer(families[family]._tokenizer, FAMILIES[family][2], bos_token=families[family]._bos_token,
                              eos_token=EOS)
    shots = [("what is the answer", "the answer of the question")]
    for user in ["hello", "world of help", "hel lo", "the question", "of the world"]:
        _check_against_plain(tokenizer, _chat("you are the system", shots, user))
    # The first two are tokenized whole (the shape's prefix is kept from its second sight),
    # each later one's rest alone where that is exact: not in "crossing" for the users
    # starting "hel", never where no special token ends a message.
    assert tokenizer.rests_tokenized == FAMILIES[family][3]
    assert tokenizer.prompts_tokenized == 5 - FAMILIES[family][3]
    # A prompt whose rest was exact has its shape signature from its prefix, hashed once.
    prompt = tokenizer.chat_prompt(_chat("you are the system", shots, "the question"))
    assert (prompt.signature is not None) == (FAMILIES[family][3] > 0)


def test_a_prefix_learns_its_split_only_once_the_memo_keeps_it(families):
    tokenizer = ChatTokenizer(families["llama3"]._tokenizer, LLAMA3, bos_token=families["llama3"]._bos_token,
                              eos_token=EOS)
    splits, learned = tokenizer._splits, []
    original = splits.prefix_split
    splits.prefix_split = lambda *args: learned.append(args[0]) or original(*args)
    # Each request's own system prompt, seen once: its prefix serves that prompt alone.
    for k in range(5):
        _check_against_plain(tokenizer, _chat(f"you are the system of customer {k}", [], "hello"))
    assert learned == []
    # A prefix seen a second time is kept, learns its split once, and its later prompts' rests
    # are tokenized alone.
    for user in ["hello", "world of help", "the question", "of the world"]:
        _check_against_plain(tokenizer, _chat("you are the system", [], user))
    assert len(learned) == 1 and learned[0].endswith("you are the system<|eot_id|>")
    assert tokenizer.rests_tokenized == 2


class CountingTokenizer:
    """A Rust tokenizer that records the texts it is asked to encode."""

    def __init__(self, inner) -> None:
        self.inner, self.texts = inner, []

    def encode(self, text: str, add_special_tokens: bool = True):
        self.texts.append(text)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_shapes_prefix_is_rendered_and_tokenized_twice_then_never(trained):
    counting = CountingTokenizer(trained[0])
    tokenizer = ChatTokenizer(counting, CHATML, bos_token=BOS, eos_token=EOS)  # type: ignore[arg-type]
    renders: list[int] = []
    render = tokenizer.render
    tokenizer.render = lambda messages, **kw: renders.append(len(messages)) or render(messages, **kw)  # type: ignore
    shots = [("hello", "world")]
    for user in ["question", "another question"]:  # the prompt, its prefixes; tokenized whole
        renders.clear(), counting.texts.clear()
        tokenizer.chat_prompt(_chat("the system", shots, user))
        assert renders == [4, 1, 2, 3] and len(counting.texts) == 1
    for user in ["a third question", "the last question"]:
        renders.clear(), counting.texts.clear()
        prompt = tokenizer.chat_prompt(_chat("the system", shots, user))
        rest = IM_START + f"user\n{user}" + IM_END + "\n" + IM_START + "assistant\n"
        assert renders == [4] and len(counting.texts) == 1 and counting.texts[0].endswith(rest)
        assert len(counting.texts[0]) <= len(rest) + max(len(t) for t in (BOS, EOS, IM_START, IM_END))
        assert len(prompt.components) == 3


# -- templates as transformers renders them ---------------------------------------------------

def test_template_environment_matches_transformers(trained):
    template = ("{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
                "{{ m | tojson }}{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}\n"
                "  {% if add_generation_prompt %}<go>{% endif %}")
    tokenizer = ChatTokenizer(trained[0], template, bos_token=BOS)
    text = tokenizer.render([{"role": "user", "content": "<a> & 'é'"}, {"role": "user", "content": "x"}],
                            add_generation_prompt=True)
    # tojson keeps <, &, ' and non-ASCII as they are; break works; trim/lstrip blocks eat
    # the newline after a block and the spaces before one.
    assert text == '{"role": "user", "content": "<a> & \'é\'"}<go>'
    with pytest.raises(ChatRequestError, match="no bad roles"):
        tokenizer.chat_prompt([{"role": "bad", "content": "x"}])


def test_messages_are_checked_and_text_parts_joined(chatml):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    assert check_messages([{"role": "user", "content": parts}])[0]["content"] == "hello\nworld"
    for bad, where in [([], "non-empty list"), ("hi", "non-empty list"), ([5], r"messages\[0\]"),
                       ([{"content": "x"}], r"messages\[0\]\.role"), ([{"role": "user", "content": 5}],
                                                                        r"messages\[0\]\.content"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\]")]:
        with pytest.raises(ChatRequestError, match=where):
            chatml.chat_prompt(bad)
    with pytest.raises(ChatRequestError, match="tools"):
        chatml.chat_prompt([{"role": "user", "content": "x"}], tools="all")


# -- foreign code fails per request ------------------------------------------------------------

# Renders each message's name and the tools, so that a surrogate in them reaches the tokenizer.
NAMED = ("{% for m in messages %}" + IM_START + "{{ m['role'] }}{% if m.name is defined %} {{ m.name }}{% endif %}\n"
         "{{ m['content'] }}" + IM_END + "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
         "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}")


def test_a_lone_surrogate_is_its_requests_error_naming_where(trained):
    tokenizer = ChatTokenizer(trained[0], NAMED, bos_token=BOS)
    shared = [{"role": "system", "content": "the system"}, {"role": "user", "content": "hello"}]
    tokenizer.chat_prompt(shared)  # the shape's prefix kept: the next ones tokenize their rest alone
    parts = [{"type": "text", "text": "ok"}, {"type": "text", "text": "\ud800"}]
    tool = [{"type": "function", "function": {"name": "f", "description": "x\ud83d"}}]
    for messages, tools, where in [
            (shared[:1] + [{"role": "user", "content": "a\ud800b"}], None, r"messages\[1\]\.content has a lone "
                                                                           r"surrogate U\+D800 at character 1"),
            ([{"role": "system", "content": "s", "name": "\udc80"}, shared[1]], None, r"messages\[0\]\.name .* 0"),
            ([{"role": "user", "content": parts}], None, r"messages\[0\]\.content .* character 3"),
            (shared, tool, r"tools\[0\]\.function\.description .*U\+D83D at character 1")]:
        with pytest.raises(ChatRequestError, match=where):
            tokenizer.chat_prompt(messages, tools)
    tokenizer = ChatTokenizer(trained[0], "{{ '\\udfff' }}" + CHATML, bos_token=BOS)  # the template's own
    with pytest.raises(ChatRequestError, match="the rendered prompt has a lone surrogate U\\+DFFF at character 0"):
        tokenizer.chat_prompt(shared)
    with pytest.raises(TokenArrayError, match=r"the completion prompt has a lone surrogate U\+D800 at character 2"):
        tokenizer.completion_prompt("ab\ud800")
    with pytest.raises(TokenArrayError, match=r"U\+D800 at character 0"):
        tokenizer.encode_batch(["fine", "\ud800"], False)


class PanicException(BaseException):
    """What a Rust panic in the tokenizer reaches Python as (pyo3's, by its name)."""


class FailingTokenizer(CountingTokenizer):
    """Raises `failure` for a text that holds "boom"."""

    def __init__(self, inner, failure: BaseException) -> None:
        super().__init__(inner)
        self.failure = failure

    def encode(self, text: str, add_special_tokens: bool = True):
        if "boom" in text:
            raise self.failure
        return super().encode(text, add_special_tokens)


def test_any_tokenizer_failure_is_its_requests_error(trained):
    for failure in [RuntimeError("the model broke"), PanicException("index out of bounds"), MemoryError()]:
        failing = FailingTokenizer(trained[0], failure)
        tokenizer = ChatTokenizer(failing, CHATML, bos_token=BOS)  # type: ignore[arg-type]
        with pytest.raises(ChatRequestError, match=f"the tokenizer failed on this request's prompt: "
                                                   f"{type(failure).__name__}"):
            tokenizer.chat_prompt([{"role": "user", "content": "boom"}])
        with pytest.raises(TokenArrayError, match=f"the tokenizer failed on the completion prompt: "
                                                  f"{type(failure).__name__}"):
            tokenizer.completion_prompt("boom")
        assert len(tokenizer.chat_prompt([{"role": "user", "content": "fine"}]).tokens)  # the next one works
    tokenizer = ChatTokenizer(FailingTokenizer(trained[0], KeyboardInterrupt()), CHATML)  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt):  # an interrupt is not the request's failure
        tokenizer.chat_prompt([{"role": "user", "content": "boom"}])


@pytest.mark.parametrize("template, failure", [
    ("{{ 'A' * 4611686018427387904 }}", "MemoryError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError: maximum recursion depth"),
    ("{{ raise_exception('no such role') }}", "TemplateError: no such role"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ messages.append(1) }}", "SecurityError"),
])
def test_a_template_failure_is_its_requests_error(trained, template, failure):
    tokenizer = ChatTokenizer(trained[0], template)  # it loads: nothing of it runs at load
    with pytest.raises(ChatRequestError, match=f"the chat template of <memory> failed on this request: {failure}"):
        tokenizer.chat_prompt([{"role": "user", "content": "x"}])


def test_a_template_that_does_not_compile_is_the_model_directorys_error(trained):
    with pytest.raises(ModelDirError, match="the chat template does not compile: RecursionError"):
        ChatTokenizer(trained[0], "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")


# -- model directories ------------------------------------------------------------------------

def test_model_dir_errors_name_the_path(trained, tmp_path):
    with pytest.raises(ModelDirError, match="not a model directory"):
        ChatTokenizer.load(tmp_path / "nowhere")
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(ModelDirError, match=r"tokenizer\.json: missing"):
        ChatTokenizer.load(model)
    (model / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelDirError, match=r"tokenizer\.json: not a tokenizer file") as caught:
        ChatTokenizer.load(model)
    assert str(model) in str(caught.value) and "\n" not in str(caught.value)
    trained[0].save(str(model / "tokenizer.json"))
    with pytest.raises(ModelDirError, match=r"tokenizer_config\.json: missing"):
        ChatTokenizer.load(model)
    config = model / "tokenizer_config.json"
    for text, why in [("[1", "not valid JSON"), ("[1]", "a JSON object"), ('{"chat_template": 5}', "chat_template"),
                      ('{"bos_token": 5}', "bos_token"), ('{"add_bos_token": "yes"}', "add_bos_token"),
                      ('{"chat_template": "{% for %}"}', "does not compile: line 1")]:
        config.write_text(text)
        with pytest.raises(ModelDirError, match=why) as caught:
            ChatTokenizer.load(model)
        assert str(config) in str(caught.value)
    assert issubclass(ModelDirError, ConfigError) and issubclass(ChatRequestError, BadInputError)


def test_without_a_template_chat_is_refused_and_completions_work(trained, tmp_path):
    model = _write_model(tmp_path / "plain", trained[0], bos_token=BOS)
    tokenizer = ChatTokenizer.load(model)
    assert not tokenizer.has_chat_template
    with pytest.raises(NoChatTemplateError, match=f"{model}: the model has no chat template"):
        tokenizer.chat_prompt([{"role": "user", "content": "hi"}])
    assert tokenizer.completion_prompt("hello world").tokens.tolist() == tokenizer.encode("hello world", True)
    # A named-templates list without "default" is no template either.
    named = _write_model(tmp_path / "named", trained[0], chat_template=[{"name": "tool_use", "template": "x"}])
    assert not ChatTokenizer.load(named).has_chat_template


def test_chat_template_jinja_file_wins_over_the_config(trained, tmp_path):
    model = _write_model(tmp_path / "jinja", trained[0], chat_template="config", bos_token=BOS)
    (model / "chat_template.jinja").write_text("file{{ messages[0]['content'] }}")
    assert ChatTokenizer.load(model).render([{"role": "user", "content": "x"}], add_generation_prompt=True) == "filex"


def test_a_template_given_on_the_command_line_wins_over_the_directorys(trained, tmp_path):
    model = _write_model(tmp_path / "jinja", trained[0], chat_template="config", bos_token=BOS)
    (model / "chat_template.jinja").write_text("file{{ messages[0]['content'] }}")
    tokenizer = ChatTokenizer.load(model, chat_template="flag{{ messages[0]['content'] }}")
    assert tokenizer.render([{"role": "user", "content": "x"}], add_generation_prompt=True) == "flagx"
    with pytest.raises(ModelDirError, match="--chat-template: the chat template does not compile"):
        ChatTokenizer.load(model, chat_template="{% for %}")


def test_named_default_template_and_token_objects(models):
    tokenizer = ChatTokenizer.load(models["last"])
    assert tokenizer.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) == \
        f"{BOS}user: hi{IM_END}assistant:"
    assert ChatTokenizer.load(models["chatml"]).eos_token_id == 1  # {"content": "</s>"}, trained as id 1


# -- completions ------------------------------------------------------------------------------

def test_completion_prompts(chatml):
    assert chatml.completion_prompt([3, 4, 5]).tokens.tolist() == [3, 4, 5]
    assert chatml.completion_prompt([3, 4, 5]).components == []
    for bad, why in [([1, True], r"prompt\[1\]"), ([-1], r"prompt\[0\]"), ([chatml.vocab_size], r"prompt\[0\]"),
                     ([2**70], r"prompt\[0\]"), ([1.0], r"prompt\[0\]"), ([], "no tokens"), ("", "no tokens"),
                     (5, "a string or a list")]:
        with pytest.raises(TokenArrayError, match=why):
            chatml.completion_prompt(bad)
    with pytest.raises(TokenArrayError) as caught:
        chatml.completion_prompt([1, chatml.vocab_size])
    assert str(caught.value) == (f"prompt[1] is an integer {chatml.vocab_size}: a token id is an integer in "
                                 f"[0, {chatml.vocab_size}) (the model's vocabulary)")


def test_add_bos_token_applies_to_plain_prompts_only(trained, tmp_path):
    model = _write_model(tmp_path / "bos", trained[0], chat_template=CHATML, bos_token=BOS, add_bos_token=True)
    tokenizer = ChatTokenizer.load(model)
    bos = tokenizer.encode(BOS, False)[0]
    assert tokenizer.completion_prompt("hello").tokens.tolist() == [bos, *tokenizer.encode("hello", False)]
    assert tokenizer.encode_batch(["hello", "world"], True)[1] == [bos, *tokenizer.encode("world", False)]
    chat = tokenizer.chat_prompt([{"role": "user", "content": "hello"}]).tokens.tolist()
    assert chat.count(bos) == 1  # the template's own bos, not a second one


# -- the tiny model of tools/tiny_llama.py ----------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> ChatTokenizer:
    from tools.tiny_llama import build

    return ChatTokenizer.load(build(tmp_path_factory.mktemp("tiny-llama")))


def test_tiny_llama_loads_and_renders(tiny):
    messages = _chat("You are a helpful assistant.", [("What is 2+2?", "4")], "And 3+3?")
    prompt = tiny.chat_prompt(messages)
    rendered = tiny.render(check_messages(messages), add_generation_prompt=True)
    for special in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        rendered = rendered.replace(special, "")  # decode skips special tokens
    assert tiny.decode(prompt.tokens) == rendered
    assert prompt.tokens[0] == 0 and tiny.eos_token_id == 1 and tiny.vocab_size == 4096
    assert len(prompt.components) == 3
    full, components = reference_prompt(tiny, messages)
    assert np.array_equal(full, prompt.tokens)
    assert [c.tolist() for c in components] == [c.tolist() for c in prompt.components]
    assert tiny.completion_prompt("def main():").tokens[0] != 0  # add_bos_token is false there


def test_a_text_past_the_size_bound_is_refused_before_it_is_tokenized(chatml: ChatTokenizer) -> None:
    text = "hello world " * 100
    size = len(text.encode())
    try:
        chatml.max_text_bytes = size  # at the bound: tokenized
        assert chatml.encode(text, False) == chatml.encode_batch([text], False)[0]
        chatml.max_text_bytes = size - 1  # one byte past it: refused, by both ways in
        with pytest.raises(BadInputError, match=f"the prompt's text is {size:,} bytes: tokenizing it takes about"):
            chatml.encode(text, False)
        with pytest.raises(BadInputError, match="--prompt-memory-limit-mb"):
            chatml.encode_batch(["short", text], False)
        chatml.max_text_bytes = len("é" * 10) * 2 - 1  # bytes, not characters
        with pytest.raises(BadInputError):
            chatml.encode("é" * 10, False)
    finally:
        chatml.max_text_bytes = None
