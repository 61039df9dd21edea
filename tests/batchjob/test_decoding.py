"""pipeline.batchjob.decoding: an answer's text decoded on a budget of characters, each
token's length known before the decoder joins them, and the decoder's failures (any
exception, a Rust panic) the request's own."""

from __future__ import annotations

import pytest

from pipeline.batchjob.decoding import MAX_ANSWER_TEXT_CHARS, AnswerDecoder
from pipeline.wire.errors import AnswerTextError, BatchOutputError


class PanicException(BaseException):
    """What a Rust panic in the tokenizer reaches Python as (pyo3's, by its name)."""


class Decoder:
    """Token t decodes to t characters; `joined` extra characters whenever tokens are joined
    (a Fuse then Replace decoder); every call recorded."""

    def __init__(self, joined: int = 0, failure: BaseException | None = None) -> None:
        self.joined = joined
        self.failure = failure
        self.calls: list[object] = []

    def decode(self, ids: list[int]) -> str:
        self.calls.append(list(ids))
        if self.failure is not None:
            raise self.failure
        return "x" * sum(ids) + "j" * (self.joined if len(ids) > 1 else 0)

    def token(self, token: int) -> str:
        self.calls.append(token)
        return self.decode([token])


def decoder_of(fake: Decoder, limit_chars: int = 100) -> AnswerDecoder:
    return AnswerDecoder(fake.decode, fake.token, vocab_size=1000, limit_chars=limit_chars)


def test_an_answer_at_the_limit_is_decoded_and_one_character_more_is_refused_before_the_joint_decode() -> None:
    fake = Decoder()
    assert decoder_of(fake).texts().decode([40, 60]) == "x" * 100
    fake.calls.clear()
    with pytest.raises(AnswerTextError, match="decodes this answer's tokens to more than 100 characters"):
        decoder_of(fake).texts().decode([40, 61])
    assert [40, 61] not in fake.calls  # refused from the tokens' own lengths: the joint text never built


def test_each_tokens_length_is_decoded_once() -> None:
    fake = Decoder()
    decoder = decoder_of(fake)
    for _ in range(3):
        decoder.texts().decode([5, 6, 5])
    assert fake.calls.count(5) == 1 and fake.calls.count(6) == 1


def test_an_answers_texts_share_one_budget_and_the_next_answer_has_its_own() -> None:
    decoder = decoder_of(Decoder())
    texts = decoder.texts()
    texts.decode([50])
    texts.token(50)
    with pytest.raises(AnswerTextError):
        texts.token(1)  # a logprob's token text past what the answer's text left
    assert decoder.texts().decode([100]) == "x" * 100


def test_a_decoder_that_expands_tokens_once_joined_is_refused_after_it() -> None:
    with pytest.raises(AnswerTextError, match="more than 100 characters"):
        decoder_of(Decoder(joined=10)).texts().decode([45, 46])


@pytest.mark.parametrize("failure", [PanicException("called `Result::unwrap()` on an `Err` value: RetryLimit"),
                                     RuntimeError("bad\nmultiline"), MemoryError(), OverflowError("int too big")])
def test_a_decoder_failure_is_the_answers_error(failure: BaseException) -> None:
    with pytest.raises(AnswerTextError, match=f"failed to decode this answer's tokens: {type(failure).__name__}"):
        decoder_of(Decoder(failure=failure)).texts().decode([1, 2])
    with pytest.raises(AnswerTextError) as caught:
        decoder_of(Decoder(failure=failure)).texts().token(3)
    assert "\n" not in str(caught.value)


def test_an_interrupt_is_not_the_answers_failure() -> None:
    with pytest.raises(KeyboardInterrupt):
        decoder_of(Decoder(failure=KeyboardInterrupt())).texts().decode([1])


@pytest.mark.parametrize("ids", ["x", [1, "2"], [1.5], None, [True]])
def test_a_row_whose_output_is_not_token_ids_is_not_a_row(ids: object) -> None:
    with pytest.raises(BatchOutputError) as caught:
        decoder_of(Decoder()).texts().decode(ids)  # type: ignore[arg-type]
    assert not isinstance(caught.value, AnswerTextError)


def test_the_default_limit_takes_a_real_answer_at_the_token_limit() -> None:
    from pipeline.batchjob.sampling import MAX_ANSWER_TOKENS

    assert MAX_ANSWER_TEXT_CHARS >= 8 * MAX_ANSWER_TOKENS  # a real answer at the token limit (under 8 a token)
