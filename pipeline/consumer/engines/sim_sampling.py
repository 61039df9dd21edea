"""The sim engine's made-up generation for items with parameters: the shape of a real answer.

    sampler = MadeUpSampler(natural_tokens=4, vocab_size=4096, eos_token_id=1, decode=decode)
    samples = sampler.samples(prompt_seed, params)      # [Sample] x n, or SimRefusal

Nothing here is a model: token ids are a hash of the prompt, the sample and the position.
What it honours is what changes the shape of an answer, as vLLM would:
- n samples (all the same where the temperature is 0: greedy; else each its own);
- an end of sequence after `natural_tokens` made-up tokens (the model "finishes"; its eos
  comes nowhere else), with the eos token in the ids and finish reason "stop"; ignore_eos
  runs on to max_tokens;
  without an eos token known, the natural end is finish reason "length" (the sim's old way);
- max_tokens (finish "length") and min_tokens (no eos or stop token before it: vLLM masks
  them);
- stop_token_ids (stop there, finish "stop");
- stop strings, found in the decoded text: the tokens up to the one that completes the
  string, the text cut before it (or after it with include_stop_str_in_output);
- skip_special_tokens in the text, and the stop token's text left out of it as vLLM does;
- logprobs of the asked size: the sampled token first (rank 1), then made-up alternatives
  with falling log probabilities, deterministic.
It refuses (SimRefusal, the item's error) stop strings without a tokenizer to decode with.
Sampling parameters that only move probabilities (temperature's value, top_p, top_k, min_p,
penalties, logit_bias, a structured-output constraint) change nothing here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.consumer.engines.base import FINISH_LENGTH, FINISH_STOP, Sample, TokenLogprobs
from pipeline.wire.generation import MAX_ANSWER_TEXT_CHARS, GenerationParams

_MASK = (1 << 64) - 1
_U64 = np.uint64
_GOLDEN = 0x9E3779B97F4A7C15
# Made-up log probabilities: the sampled token's, then each alternative this much lower.
_TOP_LOGPROB = -0.25
_LOGPROB_STEP = 1.5

Decode = Callable[[list[int], bool], str]
# The texts of many answers' ids at once (skip_special_tokens as in Decode); None where some
# answer's tokens could decode past MAX_ANSWER_TEXT_CHARS (by their own lengths) or the
# decoder failed: the caller then decodes answer by answer, which refuses the right one.
DecodeRows = Callable[[list[list[int]], bool], "list[str] | None"]
# A token's decoded length (skip_special_tokens off), learned without building long texts.
TokenChars = Callable[[int], int]
# The characters one batch's answers decode to together, texts and logprob tokens: what a
# consumer holds of them until its results are written (up to 4 bytes a character). 64 Mi:
# 256 answers of 256 Ki characters each, far past a batch of real answers; past it a
# decoder expands tokens, and the answers past it are failed.
MAX_BATCH_ANSWER_CHARS = 64 << 20
# Made-up tokens `plain_many` makes at once at most (8 MiB of uint64, a few temporaries of it):
# past it the items are made one by one.
MAX_PLAIN_MANY_TOKENS = 1 << 20


class SimRefusal(Exception):
    """An item the sim cannot make up an answer for (its message is the item's error)."""


def _mix(x: int) -> int:
    """splitmix64's finaliser."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def mix_array(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise (uint64, wrapping): `_mix` of each element."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def is_plain(params: GenerationParams) -> bool:
    """Whether an item's answer is one sample that nothing but max_tokens, ignore_eos and
    the natural end shapes (no stop string or token, no min_tokens, no logprobs): what
    `MadeUpSampler.plain_many` makes for many items at once."""
    return (params.samples == 1 and not params.stop and not params.stop_token_ids and not params.min_tokens
            and params.logprobs is None and not params.embed)


@dataclass(slots=True)
class CharBudget:
    """The characters a batch's answers may still decode to (MAX_BATCH_ANSWER_CHARS at first)."""

    left: int = MAX_BATCH_ANSWER_CHARS

    def charge(self, chars: int) -> None:
        if chars > self.left:
            raise SimRefusal(f"this batch's answers decode to more than {MAX_BATCH_ANSWER_CHARS:,} characters "
                             f"together (the model's decoder expands tokens)")
        self.left -= chars


@dataclass(slots=True, frozen=True)
class MadeUpSampler:
    """Made-up answers of `natural_tokens` tokens before an end of sequence, ids below
    `vocab_size`; `decode(ids, skip_special_tokens)` and `token_chars(id)` where the sim has
    a tokenizer."""

    natural_tokens: int
    vocab_size: int
    eos_token_id: int | None = None
    decode: Decode | None = None
    token_chars: TokenChars | None = None
    decode_rows: DecodeRows | None = None

    def samples(self, prompt_seed: int, params: GenerationParams, budget: CharBudget | None = None) -> list[Sample]:
        """The `n` samples of one item; SimRefusal for one it cannot answer, and for one
        whose text and logprob tokens pass MAX_ANSWER_TEXT_CHARS or what is left of `budget`
        (charged with what each sample keeps)."""
        if params.stop and self.decode is None:
            raise SimRefusal("the sim engine finds stop strings in decoded text, and it has no tokenizer (engine "
                             "option tokenizer: a model directory)")
        budget = budget or CharBudget()  # alone: the item's samples together, as a batch of one
        return [self._one(_key(prompt_seed, params, s), params, budget) for s in range(params.samples)]

    def plain_many(self, prompt_seeds: Sequence[int], params: GenerationParams, budget: CharBudget
                   ) -> list[Sample] | None:
        """The one sample of each of items whose `params` are the same and plain (`is_plain`),
        made for all at once: each exactly what `samples` makes of it, the budget charged
        with them all. None, with nothing charged, where one of them could be refused (a
        text past its bound, the budget): `samples` item by item then refuses the right one."""
        assert is_plain(params), params
        eos = None if params.ignore_eos else self.eos_token_id
        natural = self.natural_tokens
        limit = params.max_tokens if params.max_tokens is not None else natural + (eos is not None)
        if self.vocab_size < 2 or (self.decode is not None and self.decode_rows is None) \
                or len(prompt_seeds) * limit > MAX_PLAIN_MANY_TOKENS:
            return None
        keys = np.array([_key(seed, params, 0) for seed in prompt_seeds], dtype=np.uint64)
        steps = np.arange(1, limit + 1, dtype=np.uint64) * _U64(_GOLDEN)
        tokens = mix_array(keys[:, None] + steps[None, :]) % _U64(self.vocab_size)
        if self.eos_token_id is not None:  # the made-up model says its eos where it ends, nowhere else
            tokens[tokens == self.eos_token_id] = (self.eos_token_id + 1) % self.vocab_size
        stopped = eos is not None and natural < limit
        rows = tokens[:, :natural].tolist() if stopped else tokens.tolist()
        kept = stopped and params.include_stop_str_in_output  # the eos in the ids the text is of, as `_text`
        for ids in rows if kept else ():
            ids.append(eos)
        texts: list = [None] * len(rows)
        if self.decode_rows is not None:
            texts = self.decode_rows(rows, params.skip_special_tokens)  # type: ignore[assignment]
            if texts is None:
                return None
            chars = [len(text) for text in texts]
            if max(chars, default=0) > MAX_ANSWER_TEXT_CHARS or sum(chars) > budget.left:
                return None
            budget.charge(sum(chars))
        for ids in rows if stopped and not kept else ():
            ids.append(eos)
        reason = FINISH_STOP if stopped else FINISH_LENGTH
        return [Sample(ids, reason, text, None) for ids, text in zip(rows, texts)]

    def _one(self, key: int, params: GenerationParams, budget: CharBudget) -> Sample:
        ids, reason, by_token = self._ids(key, params)
        text = None
        if self.decode is not None:
            ids, reason, text = self._text(ids, reason, by_token, params)
        ranked = None if params.logprobs is None else [self._ranked(key, k, t, params.logprobs)
                                                        for k, t in enumerate(ids)]
        chars = len(text or "")
        if ranked is not None and self.token_chars is not None:  # counted before a token string is made
            chars += sum(self.token_chars(token) for tokens in ranked for token in tokens)
        if chars > MAX_ANSWER_TEXT_CHARS:
            raise SimRefusal(f"the model's tokenizer decodes this answer and its logprob tokens to more than "
                             f"{MAX_ANSWER_TEXT_CHARS:,} characters (its decoder expands tokens)")
        budget.charge(chars)
        logprobs = None if ranked is None else [self._logprobs(tokens) for tokens in ranked]
        return Sample(ids, reason, text, logprobs)

    def _ids(self, key: int, params: GenerationParams) -> tuple[list[int], str, bool]:
        """The token ids, the finish reason, and whether a stop token (eos or a stop token
        id) ended them."""
        stops = set(params.stop_token_ids)
        eos = None if params.ignore_eos else self.eos_token_id
        if eos is not None:
            stops.add(eos)
        min_tokens = params.min_tokens or 0
        natural = max(self.natural_tokens, min_tokens)
        limit = params.max_tokens if params.max_tokens is not None else natural + (eos is not None)
        ids: list[int] = []
        vocab, own_eos = self.vocab_size, {self.eos_token_id}
        for k in range(limit):
            token = _mix(key + _GOLDEN * (k + 1)) % vocab
            held = stops if k < min_tokens else own_eos  # vLLM masks stop tokens before min_tokens;
            if token in held:  # the made-up model says its eos where it ends, nowhere else
                for _ in range(vocab):
                    token = (token + 1) % vocab
                    if token not in held:
                        break
            if k == natural and eos is not None:
                token = eos
            ids.append(token)
            if token in stops and k >= min_tokens:
                return ids, FINISH_STOP, True
            if k + 1 == natural and eos is None and params.max_tokens is None:
                break
        return ids, FINISH_LENGTH, False

    def _text(self, ids: list[int], reason: str, by_token: bool, params: GenerationParams
              ) -> tuple[list[int], str, str]:
        """The ids cut at the first stop string, the finish reason and the text."""
        decode = self.decode
        assert decode is not None
        shown = ids[:-1] if by_token and not params.include_stop_str_in_output else ids
        text = decode(shown, params.skip_special_tokens)
        found = [(text.find(s), s) for s in params.stop if s in text]
        if not found:
            return ids, reason, text
        at, stop = min(found)
        low, high = 1, len(shown)  # the fewest tokens whose text holds the stop string
        while low < high:
            mid = (low + high) // 2
            if stop in decode(shown[:mid], params.skip_special_tokens):
                high = mid
            else:
                low = mid + 1
        end = at + len(stop) if params.include_stop_str_in_output else at
        return shown[:low], FINISH_STOP, text[:end]

    def _ranked(self, key: int, position: int, token: int, count: int) -> list[int]:
        """The sampled token (rank 1) and `count - 1` made-up alternatives after it."""
        ranked, seen = [token], {token}
        for rank in range(1, count):
            other = _mix(key ^ _mix(position * _GOLDEN + rank)) % self.vocab_size
            while other in seen:
                other = (other + 1) % self.vocab_size
            seen.add(other)
            ranked.append(other)
        return ranked

    def _logprobs(self, ranked: list[int]) -> TokenLogprobs:
        """Falling made-up log probabilities of `ranked`, each token with its text."""
        return [(token, _TOP_LOGPROB - _LOGPROB_STEP * rank, self._token_text(token))
                for rank, token in enumerate(ranked)]

    def _token_text(self, token: int) -> str | None:
        return self.decode([token], False) if self.decode is not None else None


def _key(prompt_seed: int, params: GenerationParams, sample: int) -> int:
    """The key of an item's sample `sample`: every token of it is a hash of the key and its
    position (greedy: the same for every sample)."""
    if params.temperature == 0:
        return _mix(prompt_seed)
    return _mix(prompt_seed ^ _mix((params.seed or 0) + _GOLDEN * (sample + 1)))
