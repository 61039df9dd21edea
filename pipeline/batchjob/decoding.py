"""An answer's text from its token ids, in the job's main process: the model's tokenizer
decoder is foreign code (its tokenizer.json), so its failures and its output's size are the
request's, never the job's.

    texts = AnswerDecoder(tokenizer.decode, tokenizer.token_text, vocab_size).texts()  # one answer's
    texts.decode(ids), texts.token(id)      # AnswerTextError: the request is answered 500
                                            # BatchOutputError: the row is not one (no ids)

Every decoder call of one answer (its samples' texts, an echoed token prompt, its logprob
tokens' texts) draws on one budget of MAX_ANSWER_TEXT_CHARS. Before a joint decode, the
ids' texts one token at a time (each token's length decoded once and kept) are added up:
an answer past the budget is refused before the decoder builds it, so the main process's
memory stays at one token's text, whatever the decoder expands a token to. A decoder that
joins tokens before it expands them (Fuse, then Replace) can still build more than the
sum: its text is checked after, and dropped at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipeline.batchjob.chat import foreign_failure
from pipeline.batchjob.choices import Texts
from pipeline.wire.errors import AnswerTextError, BatchOutputError
from pipeline.wire.generation import MAX_ANSWER_TEXT_CHARS



class AnswerDecoder:
    """The job's decoder, bounded: `texts()` gives one answer's Texts. Owner: the job's
    process (the collector); not thread-safe. Each token's decoded length is kept once it is
    known (at most the vocabulary's size of entries)."""

    def __init__(self, decode: Callable[[list[int]], str], token_text: Callable[[int], str], vocab_size: int,
                 limit_chars: int | None = None) -> None:
        self._decode = decode
        self._token_text = token_text
        self.vocab_size = vocab_size
        self.limit_chars = MAX_ANSWER_TEXT_CHARS if limit_chars is None else limit_chars  # read late: tests lower it
        self._lengths: dict[int, int] = {}

    def texts(self) -> Texts:
        """The decoding of one answer, on a budget of its own."""
        budget = _Budget(self.limit_chars)
        return Texts(lambda ids: self._joint(ids, budget), lambda token: self._one(token, budget))

    def _joint(self, ids: Sequence[int], budget: _Budget) -> str:
        if not isinstance(ids, (list, tuple)) or not all(type(token) is int for token in ids):
            raise BatchOutputError(f"a row's output {str(ids)[:60]} is not a list of token ids")
        ids = list(ids)
        estimate = 0
        for token in ids:
            estimate += self._length(token, budget)
            budget.check(budget.used + estimate)
        text = _call(self._decode, ids)
        budget.take(len(text))
        return text

    def _one(self, token: int, budget: _Budget) -> str:
        if type(token) is not int:
            raise BatchOutputError(f"a row's token {str(token)[:60]} is not a token id")
        budget.check(budget.used + self._length(token, budget))
        text = _call(self._token_text, token)
        budget.take(len(text))
        return text

    def _length(self, token: int, budget: _Budget) -> int:
        """The length of one token's text (decoded once: the answer's joint decode skips
        special tokens, so this counts them too, an upper bound)."""
        known = self._lengths.get(token)
        if known is None:
            known = len(_call(self._token_text, token))
            if 0 <= token < self.vocab_size:
                self._lengths[token] = known
        return known


class _Budget:
    """Characters one answer's texts may still take."""

    def __init__(self, limit_chars: int) -> None:
        self.limit_chars = limit_chars
        self.used = 0

    def check(self, chars: int) -> None:
        if chars > self.limit_chars:
            raise AnswerTextError(f"the model's tokenizer decodes this answer's tokens to more than "
                                  f"{self.limit_chars:,} characters (its decoder expands them); the answer is "
                                  f"not written")

    def take(self, chars: int) -> None:
        self.used += chars
        self.check(self.used)


def _call(decode: Callable, argument: object) -> str:
    """A decoder call; AnswerTextError for its failure (any exception, a Rust panic; an
    interrupt is not one)."""
    try:
        text = decode(argument)
    except BaseException as exc:
        if not foreign_failure(exc):
            raise
        words = " ".join(str(exc).split())
        raise AnswerTextError(f"the model's tokenizer failed to decode this answer's tokens: {type(exc).__name__}: "
                              f"{words if len(words) <= 200 else words[:197] + '...'}") from None
    if not isinstance(text, str):
        raise AnswerTextError(f"the model's tokenizer decoded this answer's tokens to {type(text).__name__}, not text")
    return text
