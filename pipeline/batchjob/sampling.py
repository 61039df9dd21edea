"""The sampling defaults of a job's requests, as vLLM's OpenAI server fills them in.

    defaults = SamplingDefaults.load(model_dir)          # the model's generation_config.json
    params = defaults.resolve(request.params, prompt_tokens=812, context_tokens=2048)

What a request does not give is filled in at the producer, where its prompt's length is
known, so every engine answers the same request the same way (the engines' own defaults
never apply to a job's items):
- max_tokens: the rest of the context (context less the prompt), or less where the model's
  generation config sets max_new_tokens (vLLM's get_max_tokens); a completion's own default
  of 16 is `params.py`'s, as vLLM's CompletionRequest has it. At most MAX_NEW_TOKENS (a
  context of ten million tokens gets a million new ones at most).
- temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty and
  frequency_penalty: the model's generation_config.json where it sets them (vLLM's
  `--generation-config auto`, its default), else vLLM's neutral values (VLLM_NEUTRAL: a
  temperature of 1, OpenAI's default).
NOTE: vLLM reads generation_config.json through transformers' GenerationConfig, whose
to_diff_dict keeps every value the file sets (transformers 5's defaults are all None); a
model directory without the file gets no defaults of it here, as there.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.batchjob.modelfiles import read_model_text
from pipeline.wire.errors import GenerationParamsError, ModelDirError
from pipeline.wire.generation import MAX_NEW_TOKENS, GenerationParams

GENERATION_CONFIG_FILE = "generation_config.json"
# A generation config is a few hundred bytes; anything past this is not one.
MAX_GENERATION_CONFIG_BYTES = 1 << 20
# vLLM's values where neither the request nor the model says (its OpenAI protocol's
# _DEFAULT_SAMPLING_PARAMS, the same for chat and completions).
VLLM_NEUTRAL: dict[str, float | int] = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# generation_config.json's name for the default of max_tokens.
MAX_NEW_TOKENS_KEY = "max_new_tokens"


# Parameter sets `resolve` keeps (each a request's GenerationParams and its resolved one): a
# job's requests ask a handful of sets; a file of as many sets as requests clears it now and then.
RESOLVED_MEMO_ENTRIES = 4096


@dataclass(slots=True, frozen=True)
class SamplingDefaults:
    """The model's sampling defaults (`values`, by VLLM_NEUTRAL's names) and its default of
    new tokens (`max_tokens`, None: the rest of the context)."""

    values: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    # Parameters already resolved, by (asked, max_tokens filled in): `resolve`'s memo.
    _resolved: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, model_dir: str) -> SamplingDefaults:
        """MODEL_DIR/generation_config.json's defaults (none without the file);
        ModelDirError naming the file for one that is not a generation config."""
        path = Path(model_dir) / GENERATION_CONFIG_FILE
        if not path.exists():
            return cls()
        text = read_model_text(path, MAX_GENERATION_CONFIG_BYTES, "a generation config is optional")
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise ModelDirError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(config, dict):
            raise ModelDirError(f"{path}: not a generation config (a JSON object)")
        values = {name: config[name] for name in VLLM_NEUTRAL if config.get(name) is not None}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ModelDirError(f"{path}: {name} must be a number, got {value!r}")
        max_new = config.get(MAX_NEW_TOKENS_KEY)
        if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
            raise ModelDirError(f"{path}: {MAX_NEW_TOKENS_KEY} must be a positive integer, got {max_new!r}")
        return cls(values, max_new)

    def resolve(self, params: GenerationParams, prompt_tokens: int, context_tokens: int | None) -> GenerationParams:
        """The request's parameters with every default filled in. The caller has refused a
        max_tokens past the context (`prompt_tokens + max_tokens > context_tokens`)."""
        bounds = [b for b in (params.max_tokens if params.max_tokens is not None else self.max_tokens,
                              context_tokens - prompt_tokens if context_tokens is not None else None) if b is not None]
        max_tokens = min(*bounds, MAX_NEW_TOKENS) if bounds else None  # a context past a million: the envelope's cap
        # By the parameters object (kept alive here, so its id is not reused): a job's requests
        # share a few (`requests.py` keeps them), and hashing one costs more than resolving.
        key = (id(params), max_tokens)
        found = self._resolved.get(key)
        if found is not None and found[0] is params:
            return found[1]
        filled: dict[str, Any] = {name: self.values.get(name, neutral) for name, neutral in VLLM_NEUTRAL.items()
                                  if getattr(params, name) is None}
        if max_tokens is not None and max_tokens != params.max_tokens:
            filled["max_tokens"] = max(max_tokens, 1)
        resolved = replace(params, **filled) if filled else params
        if len(self._resolved) >= RESOLVED_MEMO_ENTRIES:
            self._resolved.clear()
        self._resolved[key] = (params, resolved)
        return resolved


# Every sample's tokens of one request (n times max_tokens): its results row holds each
# sample's token ids and text, at most ~30 bytes a token with JSON escapes, so a million
# tokens keep a row near 32 MiB (the collector takes rows up to collect.MAX_ROW_BYTES).
MAX_ANSWER_TOKENS = 1 << 20
# Log probabilities of one request (n x max_tokens x (logprobs + 1) entries, ~40 bytes each
# in its row): half a million keep the row within collect.MAX_ROW_BYTES with its tokens.
MAX_ANSWER_LOGPROBS = 1 << 19
# vLLM samples greedily below this temperature (_SAMPLING_EPS), and then refuses n > 1.
GREEDY_BELOW = 1e-5
CONFIG_FILE = "config.json"
# A config.json is kilobytes (its tables of added tokens live elsewhere); past this, not one.
MAX_CONFIG_BYTES = 16 << 20


@dataclass(slots=True, frozen=True)
class ModelFacts:
    """What a request's parameters are checked against and filled in from: the model's
    sampling defaults and its vocabulary (config.json's vocab_size, as vLLM checks token ids
    against it; else the tokenizer's)."""

    defaults: SamplingDefaults
    vocab_size: int

    @classmethod
    def load(cls, model_dir: str, tokenizer_vocab_size: int) -> ModelFacts:
        vocab = None
        try:
            config = json.loads(read_model_text(Path(model_dir) / CONFIG_FILE, MAX_CONFIG_BYTES, CONFIG_FILE))
            vocab = config.get("vocab_size") if isinstance(config, dict) else None
        except (ModelDirError, ValueError):  # the tokenizer's vocabulary then
            pass
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            vocab = tokenizer_vocab_size
        return cls(SamplingDefaults.load(model_dir), vocab)

    def params_for(self, params: GenerationParams, prompt_tokens: int, context_tokens: int | None) -> GenerationParams:
        """The item's parameters: token ids checked against the vocabulary, every default
        filled in, the answer's size within its limits; Refused (vLLM's reason) otherwise."""
        from pipeline.batchjob.params import Refused

        for name, ids in (("logit_bias", [t for t, _b in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise Refused(f"token_id(s) {bad[:10]} in {name} contain out-of-vocab token ids. Vocabulary size: "
                              f"{self.vocab_size}", name)
        try:
            resolved = self.defaults.resolve(params, prompt_tokens, context_tokens)
        except GenerationParamsError:
            bound = params.max_tokens if params.max_tokens is not None else "the rest of the context"
            raise Refused(f"min_tokens must be less than or equal to max_tokens={bound}, got {params.min_tokens}.",
                          "min_tokens") from None
        if resolved.samples > 1 and resolved.temperature is not None and resolved.temperature < GREEDY_BELOW:
            raise Refused(f"n must be 1 when using greedy sampling, got {resolved.samples}.", "n")
        tokens = resolved.samples * (resolved.max_tokens or 0)
        if tokens > MAX_ANSWER_TOKENS:
            raise Refused(f"n={resolved.samples} samples of up to {resolved.max_tokens:,} tokens are {tokens:,} tokens, "
                          f"more than the {MAX_ANSWER_TOKENS:,} one answer of this job holds: give a smaller n or "
                          f"max_tokens", "n")
        if resolved.logprobs is not None and tokens * (resolved.logprobs + 1) > MAX_ANSWER_LOGPROBS:
            raise Refused(f"logprobs for {tokens:,} tokens with {resolved.logprobs} alternatives each are more than the "
                          f"{MAX_ANSWER_LOGPROBS:,} log probabilities one answer of this job holds: give a smaller n, "
                          f"max_tokens or top_logprobs", "logprobs")
        return resolved


def sim_answer_options(model_dir: str, tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """The sim engine's options that give a job's answers their shape: the model directory
    whose tokenizer decodes its text, and the model's end-of-sequence token (where it falls
    within the sim's vocabulary)."""
    eos = tokenizer.eos_token_id
    return {"tokenizer": model_dir, **({"eos_token_id": eos} if eos is not None and eos < vocab_size else {})}
