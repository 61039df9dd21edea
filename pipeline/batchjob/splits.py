"""Where a tokenizer cuts a text before anything else, and which tokenizations that makes
exact without tokenizing the whole text.

A `tokenizers` tokenizer first cuts its input at its added tokens matched on the raw text
(normalized=False): leftmost-longest, in one left-to-right pass. Each section between them is
then normalized, pre-tokenized and modeled on its own: what a section becomes depends on its
text and, in one place only, on where it starts (Metaspace with prepend_scheme "first" puts
"▁" before the section at offset 0 alone). So where the first pass cuts a prompt P + R at
len(P), with P not empty:

    tokens(P + R) == tokens(P) + tokens(LEAD + R)[1:]

LEAD being one of the tokenizer's added tokens: R's sections are tokenized as they are inside
the prompt, none of them at offset 0 (R tokenized alone would be its own first section). The
first pass cuts there exactly when no token's text crosses the cut (R does not start with the
rest of a token whose beginning ends P: `PrefixSplit.crossing`), and either P's own first pass
ends with a token at its end (read off P's encoding once) or R starts with a token's text
(leftmost-longest then matches a token at R's start). At LEAD's end the first pass cuts
unless a longer token starts with LEAD's text, and then the first id says so (`drop_lead`).

This reasoning needs the first pass to be plain leftmost-longest: every added token it
matches clean (normalized=False, no lstrip, rstrip or single_word: a token that strips
whitespace or must stand as a word moves or drops its cut by context), and
encode_special_tokens off (special tokens then do not cut at all). Elsewhere `clean` is empty,
nothing is claimed, and a prompt is tokenized whole.

    splits = AddedTokenSplits(tokenizer)
    info = splits.prefix_split(prefix_text, len(encoding.ids), encoding.ids, encoding)
    if info is not None and splits.rest_is_exact(info, rest):
        ids = prefix_ids + splits.drop_lead(tokenizer.encode(splits.lead + rest).ids)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenizers import AddedToken, Tokenizer


class Spans(Protocol):
    """Where an encoding's tokens sit in its text, in characters (a tokenizers Encoding)."""

    def char_to_token(self, char_pos: int) -> int | None: ...

    def token_to_chars(self, token_index: int) -> tuple[int, int] | None: ...


@dataclass(frozen=True, slots=True)
class PrefixSplit:
    """What a prefix text's own encoding says about cutting after it: whether its first pass
    ends with an added token at its very end, and the texts which, starting what follows,
    would complete an added token across the cut (usually none)."""

    ends_with_token: bool
    crossing: tuple[str, ...]


class AddedTokenSplits:
    """A tokenizer's added tokens, as the cuts they make (the module's doc). Pure: the
    tokenizer is read once, here; every method works on texts and token ids."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        """`clean`: id -> text of the added tokens the first pass cuts at (the module's doc);
        empty where its cuts are not plain."""
        added = tokenizer.get_added_tokens_decoder()
        first_pass = {token_id: token for token_id, token in added.items() if not token.normalized}
        # Cuts may be reasoned about only where the first pass is plain leftmost-longest.
        plain = not tokenizer.encode_special_tokens and all(_is_clean(t) for t in first_pass.values())
        self.clean: dict[int, str] = {token_id: token.content for token_id, token in first_pass.items()
                                      if token.content} if plain else {}
        # Every proper prefix of a first-pass token's text -> the texts that complete it.
        completions: dict[str, set[str]] = {}
        for token in first_pass.values():
            for k in range(1, len(token.content)):
                completions.setdefault(token.content[:k], set()).add(token.content[k:])
        self._completions = {prefix: tuple(sorted(rest)) for prefix, rest in completions.items()}
        self._longest = max((len(t.content) for t in first_pass.values()), default=0)
        # A look-up per length, not a scan of the tokens: some vocabularies add thousands.
        self._texts = frozenset(self.clean.values())
        self._lengths = sorted({len(text) for text in self._texts})
        self._firsts = frozenset(text[0] for text in self._texts)
        # LEAD: the clean token that fewest tokens could extend (none, in every tokenizer
        # seen), then the shortest, then the lowest id: a fixed choice.
        self.lead_id, self.lead = min(self.clean.items(), key=lambda item: (
            len(self.crossing(item[1])), len(item[1]), item[0]), default=(-1, ""))

    def crossing(self, text: str) -> tuple[str, ...]:
        """The texts which, right after `text`, would complete a first-pass token begun in it."""
        found: list[str] = []
        for k in range(1, min(self._longest, len(text) + 1)):
            found.extend(self._completions.get(text[-k:], ()))
        return tuple(found)

    def prefix_split(self, prefix_text: str, n: int, ids: Sequence[int], spans: Spans) -> PrefixSplit | None:
        """What cutting after `prefix_text` needs to know, from an encoding (`ids`, `spans`) of
        a text that starts with it and whose first `n` tokens are its tokens (its own, or a
        longer text's, `read_off`: a match ends at its end in the one exactly when in the
        other). None where nothing may be tokenized after it alone (no plain cuts here, or an
        empty prefix: what follows would start at offset 0)."""
        if not self.clean or not prefix_text or not n:
            return None
        span = spans.token_to_chars(n - 1)
        ends = span is not None and span[1] == len(prefix_text) and self._is_token_at(ids[n - 1], span, prefix_text)
        return PrefixSplit(ends_with_token=ends, crossing=self.crossing(prefix_text))

    def rest_is_exact(self, prefix: PrefixSplit, rest: str) -> bool:
        """tokens(prefix text + rest) == the prefix's tokens + `drop_lead(tokens(lead + rest))`
        (where that finds LEAD): the first pass cuts at the prefix's end, no token crossing it."""
        if not (prefix.ends_with_token or self.starts_with_token(rest)):
            return False
        return not any(rest.startswith(t) for t in prefix.crossing)

    def starts_with_token(self, rest: str) -> bool:
        """The first pass starts `rest` with an added token (a clean token's text begins it:
        leftmost-longest then matches some token at 0)."""
        return rest[:1] in self._firsts and any(rest[:k] in self._texts for k in self._lengths)

    def drop_lead(self, ids: Sequence[int]) -> Sequence[int] | None:
        """The ids of `lead + rest` without LEAD's; None if they do not start with it. LEAD is
        the first pass's first match there unless a longer token starts with its text (the
        leftmost-longest match at 0), and then the first id is not LEAD's: where they start
        with it, the first pass cut at LEAD's end and went on over the rest as over the rest
        alone."""
        return ids[1:] if ids and ids[0] == self.lead_id else None

    def read_off(self, text: str, prefix_text: str, ids: Sequence[int], spans: Spans) -> int | None:
        """The token count of `prefix_text` read off `text`'s own encoding (`ids`, `spans`),
        or None where that cannot be known without tokenizing it.

        Known when prefix_text is a non-empty character prefix of text and ends where a clean
        token of the encoding starts or ends: the first pass cut the text there, so it cut
        the prefix the same way, and the prefix's tokens are exactly the encoding's first ones."""
        cut = len(prefix_text)
        if cut == len(text):
            return len(ids) if prefix_text == text else None
        if not self.clean or not cut or not text.startswith(prefix_text):
            return None
        # A clean token's characters are its own (the first pass made it a section): the
        # token holding the character at the cut, or the one before, is the only candidate.
        k = spans.char_to_token(cut)
        span = spans.token_to_chars(k) if k is not None else None
        if k is not None and span is not None and span[0] == cut and self._is_token_at(ids[k], span, text):
            return k
        k = spans.char_to_token(cut - 1)
        span = spans.token_to_chars(k) if k is not None else None
        if k is not None and span is not None and span[1] == cut and self._is_token_at(ids[k], span, text):
            return k + 1
        return None

    def _is_token_at(self, token: int, span: tuple[int, int], text: str) -> bool:
        """`token` is a clean token and its span is its own text: the first pass matched it
        there (a clean token's text is always matched where it stands unless another match
        covers it, so no model token spans it)."""
        content = self.clean.get(token)
        return content is not None and text[span[0]:span[1]] == content


def _is_clean(token: AddedToken) -> bool:
    return not (token.normalized or token.lstrip or token.rstrip or token.single_word)
