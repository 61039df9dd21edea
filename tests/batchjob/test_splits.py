"""The added-token cuts (pipeline/batchjob/splits.py): which tokens cut plainly, the texts that
cross a cut, the lead token's choice, and the claim itself on random texts: where
`rest_is_exact` says so, tokens(P + R) == tokens(P) + drop_lead(tokens(LEAD + R)), and a
prefix read off an encoding is the prefix's own tokens, on tokenizers whose sections depend
on where they start (Metaspace "first"), that prepend per section (ByteLevel with a prefix
space, a Prepend normalizer), and whose added tokens overlap one another.

Tokenizers are built from small explicit vocabularies (no training).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.batchjob.splits import AddedTokenSplits

# Added tokens that overlap: "<a><b>" holds two others, "b>x" starts with the end of "<b>".
SPECIALS = ["<a>", "<b>", "<a><b>", "b>x"]
ALPHABET = list("ab x<>\n\u2581")


def _build(kind: str, specials: tuple[str, ...] = tuple(SPECIALS)):
    """A BPE tokenizer over ALPHABET with a few merges, shaped like one tokenizer family."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    if kind == "bytelevel":
        chars = sorted(pre_tokenizers.ByteLevel.alphabet())
        space, newline = "\u0120", "\u010a"
        merges = [("a", "b"), (space, "a"), (space, "x"), (newline, space)]
    else:
        chars = sorted(set(ALPHABET) | {"[UNK]"})
        space = newline = None
        merges = [("a", "b"), ("\u2581", "a"), ("\u2581", "x"), ("\n", "\u2581")]
    vocab = {c: k for k, c in enumerate(chars)}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None if kind == "bytelevel" else "[UNK]"))
    if kind == "bytelevel":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif kind == "prepend":  # the legacy Llama 2 tokenizer.json: ▁ by the normalizer, per section
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=kind)
    tokenizer.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    return tokenizer


KINDS = ["first", "always", "bytelevel", "prepend"]
TOKENIZERS = {kind: _build(kind) for kind in KINDS}
TEXT = st.lists(st.sampled_from(ALPHABET + SPECIALS + ["<a", "b>", "a>"]), max_size=10).map("".join)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=400, derandomize=True, deadline=None)
@given(prefix=TEXT, rest=TEXT)
def test_an_exact_rest_is_the_whole_texts_tokens(kind, prefix, rest):
    tokenizer = TOKENIZERS[kind]
    splits = AddedTokenSplits(tokenizer)
    own = tokenizer.encode(prefix, add_special_tokens=False)
    info = splits.prefix_split(prefix, len(own), own.ids, own)
    whole = tokenizer.encode(prefix + rest, add_special_tokens=False)
    if info is not None and splits.rest_is_exact(info, rest):
        tail = splits.drop_lead(_ids(tokenizer, splits.lead + rest))
        assert tail is not None and own.ids + list(tail) == whole.ids
    n = splits.read_off(prefix + rest, prefix, whole.ids, whole)
    if n is not None:
        assert whole.ids[:n] == own.ids
        # The split read off the longer text is the one of the prefix's own encoding.
        assert splits.prefix_split(prefix, n, whole.ids, whole) == info


def test_the_rule_is_taken_where_it_holds_and_refused_where_a_token_crosses():
    tokenizer = TOKENIZERS["first"]
    splits = AddedTokenSplits(tokenizer)

    def exact(prefix: str, rest: str) -> bool:
        own = tokenizer.encode(prefix, add_special_tokens=False)
        info = splits.prefix_split(prefix, len(own), own.ids, own)
        return info is not None and splits.rest_is_exact(info, rest)

    assert exact("ab x<b>", "ab")  # the prefix ends with a token
    assert exact("ab x", "<b>ab")  # the rest starts with one
    assert not exact("ab x", "ab")  # plain text on both sides: one section, tokenized whole
    assert not exact("ab <a>", "<b>x")  # "<a><b>" would cross the cut
    assert not exact("ab <b", ">x")  # so would "<b>" (the prefix does not end with a token)
    assert not exact("x<b", ">x ab")
    assert not exact("", "<b>ab")  # an empty prefix: the rest would start at offset 0
    # Metaspace "first": the rest alone would get a ▁ it does not get inside the text.
    assert _ids(tokenizer, "ab") != _ids(tokenizer, "<b>ab")[1:]
    assert _ids(tokenizer, "x<b>ab")[2:] == _ids(tokenizer, "<b>ab")[1:]


def test_the_lead_is_a_token_nothing_crosses():
    splits = AddedTokenSplits(TOKENIZERS["first"])
    # "<a>" then "<b>" make "<a><b>", "<b>" then "x" make "b>x": "b>x" ends no token's start.
    assert splits.crossing("<a>") == ("<b>",) and splits.crossing("<b>") == ("x",)
    assert splits.lead == "b>x" and splits.crossing(splits.lead) == ()
    assert set(splits.crossing("x<b")) == {">", ">x"} and splits.crossing("ab") == (">x",)
    assert splits.starts_with_token("<b>x") and not splits.starts_with_token("<c>")
    assert splits.drop_lead([splits.lead_id, 5, 6]) == [5, 6] and splits.drop_lead([5]) is None


def test_a_longer_token_starting_with_the_lead_is_seen_in_its_ids():
    tokenizer = _build("first", specials=("<a>", "<a><a>"))
    splits = AddedTokenSplits(tokenizer)
    assert splits.lead == "<a>" and splits.crossing("<a>") == ("<a>",)
    assert splits.drop_lead(_ids(tokenizer, "<a><a>x")) is None  # one token "<a><a>", not LEAD
    assert splits.drop_lead(_ids(tokenizer, "<a>x<a>")) == _ids(tokenizer, "ab<a>x<a>")[3:]


def test_tokens_that_strip_or_stand_alone_turn_the_rule_off():
    from tokenizers import AddedToken

    for flags in [{"lstrip": True}, {"rstrip": True}, {"single_word": True}]:
        tokenizer = _build("first")
        tokenizer.add_special_tokens([AddedToken("<c>", normalized=False, special=True, **flags)])
        splits = AddedTokenSplits(tokenizer)
        assert splits.clean == {} and splits.lead == ""
        encoding = tokenizer.encode("ab<a>x", add_special_tokens=False)
        assert splits.prefix_split("ab<a>", 2, encoding.ids, encoding) is None
        assert splits.read_off("ab<a>x", "ab<a>", encoding.ids, encoding) is None
    tokenizer = _build("first")
    tokenizer.encode_special_tokens = True  # special tokens no longer cut at all
    assert AddedTokenSplits(tokenizer).clean == {}
    # A normalized added token is matched after normalization, inside a section: it cuts
    # nothing the rule relies on, and leaves it on.
    tokenizer = _build("first")
    tokenizer.add_tokens([AddedToken("xx", normalized=True)])
    assert "<a>" in AddedTokenSplits(tokenizer).clean.values()


def test_read_off_needs_a_clean_token_at_the_cut():
    tokenizer = TOKENIZERS["bytelevel"]
    splits = AddedTokenSplits(tokenizer)
    text = "ab x<b>ab\n x"
    encoding = tokenizer.encode(text, add_special_tokens=False)
    for prefix in ["ab x", "ab x<b>"]:
        n = splits.read_off(text, prefix, encoding.ids, encoding)
        assert n is not None and encoding.ids[:n] == _ids(tokenizer, prefix)
    for prefix in ["ab", "ab x<b>ab\n", "", "zz"]:  # no token at the cut, empty, not a prefix
        assert splits.read_off(text, prefix, encoding.ids, encoding) is None
    assert splits.read_off(text, text, encoding.ids, encoding) == len(encoding.ids)
