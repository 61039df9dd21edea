"""Per-item generation parameters, carried in the item's payload so the broker stays blind.

An item's payload is opaque to the broker: it stores it in the segment entry and the
consumer reads it back with the tokens. The generation parameters of an item (vLLM's
sampling parameters: max and min new tokens, temperature, top_p/top_k/min_p, penalties,
seed, n samples, stop strings and token ids, logprobs, a logit bias, a structured-output
constraint...) travel there, in an envelope in front of the producer's own payload:

    payload:  GENERATION_HEADER | stop strings (u2 length + UTF-8, each)
              | stop token ids (<u4 each) | logit bias (LOGIT_BIAS_DTYPE each)
              | structured-output spec (UTF-8) | input lengths (<u4 each)
              | the producer's payload

An item to embed (FLAG_EMBED: an engine pools it instead of generating) holds the token ids
of each input of its request back to back; the input lengths say where each ends, and the
engine embeds each input on its own (vLLM's /v1/embeddings answers a list of inputs so).

The producer writes the envelope (`encode_payload`) only for an item that has parameters,
and for one whose own payload happens to begin with GENERATION_MAGIC (so a plain payload is
never misread as an envelope); every other payload is stored as it is, at no cost. The
consumer splits it (`decode_payload`) and hands the engine the parameters and the results
file the producer's payload alone. A field the item does not give (its bit clear in
`set_mask`) takes the engine's default.

Every variable part has a limit (MAX_* below), so the largest envelope (MAX_ENVELOPE_BYTES)
and a job's own payload fit the producer's payload limit together (tests/test_generation.py).

NOTE: a new field in the item and entry headers was rejected: the broker would copy, store
and checksum parameters it never reads, both on-disk and in-ring formats would change
version, and items without parameters (the sim workloads, token-id jobs) would pay bytes
for them. In the payload they cost nothing where absent and the broker cannot depend on them.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from pipeline.wire.errors import GenerationParamsError
from shm.layout import checked_dtype, struct_for

GENERATION_MAGIC = b"SBGP"
# Bump when a field below moves or changes meaning; envelopes of another version are refused.
GENERATION_VERSION = 3

# Generation envelope header, at the start of a payload.
#   off  size  field               meaning
#     0     4  magic               b"SBGP"
#     4     2  version             GENERATION_VERSION
#     6     2  header_size         GENERATION_HEADER_DTYPE.itemsize, so a reader can check it
#     8     4  set_mask            bit per parameter the item gives (SET_* below); others: defaults
#    12     4  max_tokens          new tokens at most, >= 1
#    16     8  temperature         float64, >= 0 (0: greedy)
#    24     8  top_p               float64, in (0, 1]
#    32     8  seed                int64, the sampler's seed
#    40     2  stop_count          stop strings after the header
#    42     2  flags               FLAG_* below (booleans; clear: vLLM's default)
#    44     4  stop_bytes          bytes the stop strings take (each: u2 length, then UTF-8)
#    48     4  n                   samples of the prompt, >= 1
#    52     4  top_k               int32, -1 or 0: off
#    56     8  min_p               float64, in [0, 1]
#    64     8  presence_penalty    float64, in [-2, 2]
#    72     8  frequency_penalty   float64, in [-2, 2]
#    80     8  repetition_penalty  float64, > 0
#    88     4  min_tokens          new tokens at least, before an end-of-sequence or stop token
#    92     4  logprobs            top log probabilities per token, besides the sampled one's
#    96     2  stop_token_count    stop token ids after the stop strings
#    98     1  structured_kind     STRUCTURED_KINDS' index + 1 (0: no constraint)
#    99     1  reserved            zero
#   100     2  logit_bias_count    logit bias entries after the stop token ids
#   102     2  input_count         input lengths after the structured-output spec (embed)
#   104     4  structured_bytes    UTF-8 bytes of the structured-output spec
#   108     4  dimensions          an embedding's dimensions (vLLM's Matryoshka cut; 0: the model's)
GENERATION_HEADER_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S4", "b'SBGP'"),
        ("version", 4, "<u2", "GENERATION_VERSION"),
        ("header_size", 6, "<u2", "header bytes"),
        ("set_mask", 8, "<u4", "parameters given"),
        ("max_tokens", 12, "<u4", "new tokens at most"),
        ("temperature", 16, "<f8", "sampling temperature"),
        ("top_p", 24, "<f8", "nucleus mass"),
        ("seed", 32, "<i8", "sampler seed"),
        ("stop_count", 40, "<u2", "stop strings"),
        ("flags", 42, "<u2", "FLAG_* booleans"),
        ("stop_bytes", 44, "<u4", "bytes of stop strings"),
        ("n", 48, "<u4", "samples"),
        ("top_k", 52, "<i4", "top-k cut"),
        ("min_p", 56, "<f8", "min-p cut"),
        ("presence_penalty", 64, "<f8", "presence penalty"),
        ("frequency_penalty", 72, "<f8", "frequency penalty"),
        ("repetition_penalty", 80, "<f8", "repetition penalty"),
        ("min_tokens", 88, "<u4", "new tokens at least"),
        ("logprobs", 92, "<u4", "top logprobs per token"),
        ("stop_token_count", 96, "<u2", "stop token ids"),
        ("structured_kind", 98, "|u1", "structured-output kind"),
        ("logit_bias_count", 100, "<u2", "logit bias entries"),
        ("input_count", 102, "<u2", "input lengths (embed)"),
        ("structured_bytes", 104, "<u4", "bytes of the structured spec"),
        ("dimensions", 108, "<u4", "embedding dimensions"),
    ],
    itemsize=112,
)
GENERATION_HEADER_SIZE_BYTES = GENERATION_HEADER_DTYPE.itemsize
_HEADER = struct_for(GENERATION_HEADER_DTYPE)
# One logit bias entry, after the stop token ids.
#   off  size  field  meaning
#     0     4  token  the token id biased
#     4     8  bias   float64, added to its logit, in [-100, 100]
LOGIT_BIAS_DTYPE = checked_dtype([("token", 0, "<u4", "token id"), ("bias", 4, "<f8", "bias")], itemsize=12)
STOP_TOKEN_DTYPE = np.dtype("<u4")
INPUT_LENGTH_DTYPE = np.dtype("<u4")
_STOP_LEN = struct.Struct("<H")

(SET_MAX_TOKENS, SET_TEMPERATURE, SET_TOP_P, SET_SEED, SET_STOP, SET_N, SET_TOP_K, SET_MIN_P, SET_PRESENCE,
 SET_FREQUENCY, SET_REPETITION, SET_MIN_TOKENS, SET_LOGPROBS) = (1 << k for k in range(13))
_KNOWN_MASK = (1 << 13) - 1
# The header's booleans: set where the item asks the opposite of vLLM's default.
FLAG_IGNORE_EOS, FLAG_KEEP_SPECIAL_TOKENS, FLAG_INCLUDE_STOP_STR = 1, 2, 4
# The structured-output constraint's options (vLLM's StructuredOutputsParams names them).
FLAG_NO_ANY_WHITESPACE, FLAG_NO_ADDITIONAL_PROPERTIES = 8, 16
# The item is pooled into one embedding per input (vLLM's "embed" pooling task), not generated.
FLAG_EMBED = 32
_KNOWN_FLAGS = 63
# Scalar parameters: (field, set bit). Their order is the header's.
_SCALARS = (("max_tokens", SET_MAX_TOKENS), ("temperature", SET_TEMPERATURE), ("top_p", SET_TOP_P),
            ("seed", SET_SEED), ("n", SET_N), ("top_k", SET_TOP_K), ("min_p", SET_MIN_P),
            ("presence_penalty", SET_PRESENCE), ("frequency_penalty", SET_FREQUENCY),
            ("repetition_penalty", SET_REPETITION), ("min_tokens", SET_MIN_TOKENS), ("logprobs", SET_LOGPROBS))
# A structured-output constraint's kinds, as vLLM's StructuredOutputsParams names them: a
# JSON schema (its JSON text), a regular expression, a choice of strings (a JSON array of
# them), an EBNF or Lark grammar, or any JSON object (an empty spec).
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")

# A million new tokens: more than any model's context, so no real request is refused here
# (the job refuses max tokens past the model's context where the request enters).
MAX_NEW_TOKENS = 1 << 20
# The most characters of text one answer may hold (its samples' texts and their logprob
# tokens' together), whoever decodes it (an engine into its results row, the job into its
# output line): eight a token at MAX_NEW_TOKENS, where a real vocabulary's tokens average
# under five; at six bytes a character (JSON's \u escapes, the files are ASCII) a row stays
# within the job's 64 MiB row limit. Past it a decoder expands tokens (a Replace decoder
# of a megabyte's content), and the item is failed, never truncated: cut text would not be
# the tokens its usage counts.
MAX_ANSWER_TEXT_CHARS = 8 << 20
# vLLM's default limit of stop strings (VLLM_MAX_STOP_STRINGS) and OpenAI's: a request with
# more is refused by both.
MAX_STOP_STRINGS = 4
# A stop sequence is a few tokens of text; 256 bytes of UTF-8 is far beyond any real one.
MAX_STOP_STRING_BYTES = 256
# Stop token ids: a model's end-of-turn markers and a user's own; 64 bounds the envelope
# (256 bytes) far above any real list.
MAX_STOP_TOKEN_IDS = 64
# Samples of one prompt: OpenAI's limit of n (vLLM's VLLM_MAX_N_SEQUENCES is 16,384); every
# sample's output rides in the prompt's one results row.
MAX_SAMPLES = 128
# vLLM's default max_logprobs and OpenAI's limit of top_logprobs.
MAX_LOGPROBS = 20
# Biased tokens: a classifier's label set or a list of banned words is tens to hundreds of
# tokens; 1,024 entries (12 KiB) bound the envelope.
MAX_LOGIT_BIAS_ENTRIES = 1024
# OpenAI's (and vLLM's) range of a bias: -100 bans a token, 100 forces it.
MAX_LOGIT_BIAS = 100.0
# A structured-output spec (a JSON schema, a grammar): an extraction task's schema is 1-10
# KB; 32 KiB keeps the largest envelope with every other part at its limit inside the
# producer's 64 KiB payload limit.
MAX_STRUCTURED_OUTPUT_BYTES = 32 << 10
# vLLM's range of the penalties.
MAX_PENALTY = 2.0
# Inputs of one embeddings request: OpenAI's limit of an input array (vLLM sets none); their
# lengths take 8 KiB of the envelope at most.
MAX_EMBEDDING_INPUTS = 2048
# LoRA adapters (an engine's option `lora_modules`, [{"name", "path"}]): adapter k is model
# id LORA_FIRST_MODEL + k to the broker, the base model 0, so shapes never mix adapters and
# an item's adapter is its model's (nothing in the envelope).
LORA_FIRST_MODEL = 1
# Adapters of one run: each is a model of its own, served by a consumer of its own (the
# launcher's one model per consumer), so more than a node's engines is past any use.
MAX_LORA_MODULES = 64
# An embedding's dimensions at most: past any model's hidden size (the largest are 16,384).
MAX_EMBEDDING_DIMENSIONS = 1 << 20
MAX_ENVELOPE_BYTES = (GENERATION_HEADER_SIZE_BYTES + MAX_STOP_STRINGS * (_STOP_LEN.size + MAX_STOP_STRING_BYTES)
                      + MAX_STOP_TOKEN_IDS * STOP_TOKEN_DTYPE.itemsize
                      + MAX_LOGIT_BIAS_ENTRIES * LOGIT_BIAS_DTYPE.itemsize + MAX_STRUCTURED_OUTPUT_BYTES
                      + MAX_EMBEDDING_INPUTS * INPUT_LENGTH_DTYPE.itemsize)
_INT64 = 1 << 63
_INT32 = 1 << 31
_UINT32 = 1 << 32


@dataclass(slots=True, frozen=True)
class GenerationParams:
    """How one item is generated, in vLLM's SamplingParams' names and ranges; None (or an
    empty tuple, or a boolean at vLLM's default): the engine's default. `structured`: a
    structured-output constraint, (kind of STRUCTURED_KINDS, spec text), or None, with its
    options disable_any_whitespace and disable_additional_properties. `embed`: the item is
    pooled, one embedding per input (`input_lengths`: each input's tokens, back to back in
    the prompt), of `dimensions` (None: the model's own)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: tuple[str, str] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    embed: bool = False
    input_lengths: tuple[int, ...] = ()
    dimensions: int | None = None

    def __post_init__(self) -> None:
        wrong = self.problems()
        if wrong:
            raise GenerationParamsError("generation parameters: " + "; ".join(wrong))

    def problems(self) -> list[str]:
        """What is out of range (empty when nothing is)."""
        wrong = []
        for name, _bit in _SCALARS:
            value = getattr(self, name)
            if value is not None and (why := _scalar_problem(name, value)):
                wrong.append(why)
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            wrong.append(f"min_tokens {self.min_tokens} must be at most max_tokens {self.max_tokens}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "disable_any_whitespace",
                     "disable_additional_properties", "embed"):
            if not isinstance(getattr(self, name), bool):
                wrong.append(f"{name} {getattr(self, name)!r} must be true or false")
        wrong.extend(_stop_problems(self.stop))
        wrong.extend(_id_list_problems(self.stop_token_ids, self.logit_bias))
        if self.structured is not None:
            wrong.extend(_structured_problems(self.structured))
        wrong.extend(_embed_problems(self.embed, self.input_lengths, self.dimensions))
        return wrong

    def overrides(self) -> dict[str, object]:
        """The parameters this item gives, by vLLM's SamplingParams names (what it changes
        from the defaults); `structured` and its options are left to the engine (vLLM's
        StructuredOutputsParams)."""
        out: dict[str, object] = {name: getattr(self, name) for name, _bit in _SCALARS
                                  if getattr(self, name) is not None}
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias:
            out["logit_bias"] = dict(self.logit_bias)
        for name, default in (("ignore_eos", False), ("skip_special_tokens", True),
                              ("include_stop_str_in_output", False)):
            if getattr(self, name) != default:
                out[name] = getattr(self, name)
        return out

    @property
    def samples(self) -> int:
        """How many outputs the item asks for (n, 1 by default)."""
        return self.n if self.n is not None else 1


_INT_RANGES = {"max_tokens": (1, MAX_NEW_TOKENS), "seed": (-_INT64, _INT64 - 1), "n": (1, MAX_SAMPLES),
               "top_k": (-1, _INT32 - 1), "min_tokens": (0, MAX_NEW_TOKENS), "logprobs": (0, MAX_LOGPROBS)}
# (low, high, low included, high included)
_REAL_RANGES = {"temperature": (0.0, math.inf, True, False), "top_p": (0.0, 1.0, False, True),
                "min_p": (0.0, 1.0, True, True), "presence_penalty": (-MAX_PENALTY, MAX_PENALTY, True, True),
                "frequency_penalty": (-MAX_PENALTY, MAX_PENALTY, True, True),
                "repetition_penalty": (0.0, math.inf, False, False)}


def _scalar_problem(name: str, value: object) -> str | None:
    if value is None:
        return None
    if name in _INT_RANGES:
        low, high = _INT_RANGES[name]
        if not (_is_int(value) and low <= value <= high):  # type: ignore[operator]
            return f"{name} {value!r} must be an integer from {low} to {high}"
        return None
    low, high, low_in, high_in = _REAL_RANGES[name]
    ok = _is_real(value) and (value >= low if low_in else value > low) and (  # type: ignore[operator]
        value <= high if high_in else value < high)  # type: ignore[operator]
    if not ok:
        return (f"{name} {value!r} must be a finite number in {'[' if low_in else '('}{low:g}, "
                f"{high:g}{']' if high_in else ')'}")
    return None


def _stop_problems(stop: object) -> list[str]:
    if not isinstance(stop, tuple) or not all(isinstance(s, str) and s for s in stop):
        return [f"stop {stop!r} must be a tuple of non-empty strings"]
    if len(stop) > MAX_STOP_STRINGS:
        return [f"{len(stop)} stop strings, limit {MAX_STOP_STRINGS}"]
    for one in stop:
        try:
            size = len(one.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: no UTF-8 for it
            return [f"stop string {one[:40]!r} is not valid Unicode text"]
        if size > MAX_STOP_STRING_BYTES:
            return [f"stop string {one[:40]!r}... is over {MAX_STOP_STRING_BYTES} bytes of UTF-8"]
    return []


def _id_list_problems(stop_token_ids: object, logit_bias: object) -> list[str]:
    wrong = []
    if not isinstance(stop_token_ids, tuple) or not all(_is_int(t) and 0 <= t < _UINT32 for t in stop_token_ids):
        wrong.append(f"stop_token_ids {stop_token_ids!r} must be a tuple of token ids")
    elif len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        wrong.append(f"{len(stop_token_ids)} stop token ids, limit {MAX_STOP_TOKEN_IDS}")
    if not isinstance(logit_bias, tuple) or not all(
            isinstance(e, tuple) and len(e) == 2 and _is_int(e[0]) and 0 <= e[0] < _UINT32 and _is_real(e[1])
            and -MAX_LOGIT_BIAS <= e[1] <= MAX_LOGIT_BIAS for e in logit_bias):
        wrong.append(f"logit_bias must be a tuple of (token id, bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]) "
                     f"pairs, got {str(logit_bias)[:60]}")
    elif len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        wrong.append(f"{len(logit_bias)} logit bias entries, limit {MAX_LOGIT_BIAS_ENTRIES}")
    elif len({token for token, _bias in logit_bias}) != len(logit_bias):
        wrong.append("logit_bias names a token twice")
    return wrong


def _structured_problems(structured: object) -> list[str]:
    if not (isinstance(structured, tuple) and len(structured) == 2 and structured[0] in STRUCTURED_KINDS
            and isinstance(structured[1], str)):
        return [f"structured {str(structured)[:60]} must be (one of {', '.join(STRUCTURED_KINDS)}, text)"]
    try:
        size = len(structured[1].encode("utf-8"))
    except UnicodeEncodeError:
        return ["the structured-output spec is not valid Unicode text"]
    if size > MAX_STRUCTURED_OUTPUT_BYTES:
        return [f"the structured-output spec is {size:,} bytes, limit {MAX_STRUCTURED_OUTPUT_BYTES:,}"]
    return []


def _embed_problems(embed: object, lengths: object, dimensions: object) -> list[str]:
    if embed is not True:
        return [] if lengths == () and dimensions is None else ["input_lengths and dimensions are an embedding's"]
    if not isinstance(lengths, tuple) or not lengths or not all(_is_int(n) and 0 < n < _UINT32 for n in lengths):
        return [f"input_lengths {str(lengths)[:60]} must be a non-empty tuple of positive token counts"]
    if len(lengths) > MAX_EMBEDDING_INPUTS:
        return [f"{len(lengths)} inputs to embed, limit {MAX_EMBEDDING_INPUTS}"]
    if dimensions is not None and not (_is_int(dimensions) and 1 <= dimensions <= MAX_EMBEDDING_DIMENSIONS):
        return [f"dimensions {dimensions!r} must be an integer from 1 to {MAX_EMBEDDING_DIMENSIONS}"]
    return []


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past a float's range (10**400, from a JSON file)
        return False


def encode_payload(params: GenerationParams | None, payload: bytes = b"") -> bytes:
    """The payload the producer submits: `payload` itself for an item without parameters
    (unless it begins with GENERATION_MAGIC), else the envelope in front of it."""
    if params is None:
        if not payload.startswith(GENERATION_MAGIC):
            return payload
        params = GenerationParams()
    p = params
    mask = 0
    for name, bit in _SCALARS:
        if getattr(p, name) is not None:
            mask |= bit
    mask |= SET_STOP if p.stop else 0
    flags = ((FLAG_IGNORE_EOS if p.ignore_eos else 0) | (0 if p.skip_special_tokens else FLAG_KEEP_SPECIAL_TOKENS)
             | (FLAG_INCLUDE_STOP_STR if p.include_stop_str_in_output else 0)
             | (FLAG_NO_ANY_WHITESPACE if p.disable_any_whitespace else 0)
             | (FLAG_NO_ADDITIONAL_PROPERTIES if p.disable_additional_properties else 0)
             | (FLAG_EMBED if p.embed else 0))
    stops = b"".join(_STOP_LEN.pack(len(raw)) + raw for raw in (s.encode("utf-8") for s in p.stop))
    stop_ids = np.array(p.stop_token_ids, dtype=STOP_TOKEN_DTYPE).tobytes()
    bias = np.array(list(p.logit_bias), dtype=LOGIT_BIAS_DTYPE).tobytes() if p.logit_bias else b""
    lengths = np.array(p.input_lengths, dtype=INPUT_LENGTH_DTYPE).tobytes()
    kind, spec = (STRUCTURED_KINDS.index(p.structured[0]) + 1, p.structured[1].encode("utf-8")) \
        if p.structured is not None else (0, b"")
    header = _HEADER.pack(
        GENERATION_MAGIC, GENERATION_VERSION, GENERATION_HEADER_SIZE_BYTES, mask, p.max_tokens or 0,
        float(p.temperature or 0.0), float(p.top_p or 0.0), p.seed or 0, len(p.stop), flags, len(stops), p.n or 0,
        p.top_k or 0, float(p.min_p or 0.0), float(p.presence_penalty or 0.0), float(p.frequency_penalty or 0.0),
        float(p.repetition_penalty or 0.0), p.min_tokens or 0, p.logprobs or 0, len(p.stop_token_ids), kind,
        len(p.logit_bias), len(p.input_lengths), len(spec), p.dimensions or 0)
    return b"".join((header, stops, stop_ids, bias, spec, lengths, payload))


def decode_payload(data: bytes) -> tuple[GenerationParams | None, bytes]:
    """(the item's parameters, the producer's own payload) from a stored payload; (None,
    data) for a payload without an envelope. GenerationParamsError, naming the byte offset,
    for an envelope that is cut short, of another version, or out of range."""
    if not data.startswith(GENERATION_MAGIC):
        return None, data
    if len(data) < GENERATION_HEADER_SIZE_BYTES:
        raise GenerationParamsError(f"generation envelope of {len(data)} bytes is shorter than its "
                                    f"{GENERATION_HEADER_SIZE_BYTES}-byte header")
    h = dict(zip(GENERATION_HEADER_DTYPE.names, _HEADER.unpack_from(data)))
    version, size, mask, flags = h["version"], h["header_size"], h["set_mask"], h["flags"]
    if version != GENERATION_VERSION or size != GENERATION_HEADER_SIZE_BYTES or mask & ~_KNOWN_MASK \
            or flags & ~_KNOWN_FLAGS or h["structured_kind"] > len(STRUCTURED_KINDS):
        raise GenerationParamsError(f"generation envelope version {version}, header size {size}, mask {mask:#x}, "
                                    f"flags {flags:#x}, structured kind {h['structured_kind']} at byte 4: this "
                                    f"consumer reads version {GENERATION_VERSION}, size {GENERATION_HEADER_SIZE_BYTES}"
                                    f", mask within {_KNOWN_MASK:#x}, flags within {_KNOWN_FLAGS:#x}")
    at = GENERATION_HEADER_SIZE_BYTES
    sections = (("stop strings", h["stop_bytes"]), ("stop token ids", h["stop_token_count"] * STOP_TOKEN_DTYPE.itemsize),
                ("logit bias", h["logit_bias_count"] * LOGIT_BIAS_DTYPE.itemsize),
                ("structured-output spec", h["structured_bytes"]),
                ("input lengths", h["input_count"] * INPUT_LENGTH_DTYPE.itemsize))
    bounds = []
    for what, length in sections:
        if at + length > len(data):
            raise GenerationParamsError(f"generation envelope: {what} end at byte {at + length}, past the payload's "
                                        f"{len(data)} bytes")
        bounds.append((at, at + length))
        at += length
    stops = _read_stops(data, *bounds[0], h["stop_count"])
    stop_ids = tuple(np.frombuffer(data, STOP_TOKEN_DTYPE, h["stop_token_count"], bounds[1][0]).tolist())
    bias = np.frombuffer(data, LOGIT_BIAS_DTYPE, h["logit_bias_count"], bounds[2][0])
    structured = None
    if h["structured_kind"]:
        try:
            spec = data[bounds[3][0]:bounds[3][1]].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GenerationParamsError(f"generation envelope: the structured-output spec at byte {bounds[3][0]} is "
                                        f"not UTF-8 ({exc.reason})") from None
        structured = (STRUCTURED_KINDS[h["structured_kind"] - 1], spec)
    given = {name: h[name] if mask & bit else None for name, bit in _SCALARS}
    params = GenerationParams(
        **given, stop=stops, stop_token_ids=stop_ids,
        logit_bias=tuple(zip(bias["token"].tolist(), bias["bias"].tolist())), structured=structured,
        ignore_eos=bool(flags & FLAG_IGNORE_EOS), skip_special_tokens=not flags & FLAG_KEEP_SPECIAL_TOKENS,
        include_stop_str_in_output=bool(flags & FLAG_INCLUDE_STOP_STR),
        disable_any_whitespace=bool(flags & FLAG_NO_ANY_WHITESPACE),
        disable_additional_properties=bool(flags & FLAG_NO_ADDITIONAL_PROPERTIES), embed=bool(flags & FLAG_EMBED),
        input_lengths=tuple(np.frombuffer(data, INPUT_LENGTH_DTYPE, h["input_count"], bounds[4][0]).tolist()),
        dimensions=h["dimensions"] or None)
    return params, data[at:]


def _read_stops(data: bytes, start: int, end: int, count: int) -> tuple[str, ...]:
    """`count` length-prefixed UTF-8 strings filling data[start:end] exactly."""
    stops = []
    at = start
    for _ in range(count):
        if at + _STOP_LEN.size > end:
            raise GenerationParamsError(f"generation envelope: stop string {len(stops)} at byte {at} runs past "
                                        f"the stop strings' end at byte {end}")
        (length,) = _STOP_LEN.unpack_from(data, at)
        at += _STOP_LEN.size
        if at + length > end:
            raise GenerationParamsError(f"generation envelope: stop string {len(stops)} of {length} bytes at byte "
                                        f"{at} runs past byte {end}")
        try:
            stops.append(data[at:at + length].decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise GenerationParamsError(f"generation envelope: stop string {len(stops)} at byte {at} is not "
                                        f"UTF-8 ({exc.reason})") from None
        at += length
    if at != end:
        raise GenerationParamsError(f"generation envelope: {end - at} bytes after the last stop string at byte {at}")
    return tuple(stops)


# The envelopes a PayloadDecoder keeps decoded, in bytes: a job's items mostly share a few
# parameter sets, and the largest envelope (MAX_ENVELOPE_BYTES) still leaves room for dozens.
DECODED_ENVELOPES_MAX_BYTES = 4 << 20
# (header field, bytes per count) of the sections after the header, in their order.
_SECTION_SIZES = tuple((GENERATION_HEADER_DTYPE.names.index(name), width) for name, width in (
    ("stop_bytes", 1), ("stop_token_count", STOP_TOKEN_DTYPE.itemsize),
    ("logit_bias_count", LOGIT_BIAS_DTYPE.itemsize), ("structured_bytes", 1),
    ("input_count", INPUT_LENGTH_DTYPE.itemsize)))


class PayloadDecoder:
    """`decode_payload` that decodes each distinct envelope once: the parameters (frozen)
    of an envelope seen before are given again, so a batch of items sharing their
    parameters costs a header read each. Holds at most DECODED_ENVELOPES_MAX_BYTES of
    envelopes, forgetting them all when full. NOTE: decoding and checking every item's
    envelope was a quarter of a sim consumer's CPU on a 200,000-request job."""

    def __init__(self, max_bytes: int = DECODED_ENVELOPES_MAX_BYTES) -> None:
        self._known: dict[bytes, GenerationParams] = {}
        self._bytes = 0
        self._max_bytes = max_bytes

    def decode(self, data: bytes) -> tuple[GenerationParams | None, bytes]:
        """As decode_payload(data), errors included."""
        if not data.startswith(GENERATION_MAGIC) or len(data) < GENERATION_HEADER_SIZE_BYTES:
            return decode_payload(data)
        fields = _HEADER.unpack_from(data)
        end = GENERATION_HEADER_SIZE_BYTES + sum(fields[index] * width for index, width in _SECTION_SIZES)
        envelope = data[:end]
        params = self._known.get(envelope)
        if params is None:
            params, _rest = decode_payload(envelope)  # past the data's end: decode_payload(data)'s own error
            assert params is not None
            if self._bytes + len(envelope) > self._max_bytes:
                self._known.clear()
                self._bytes = 0
            self._known[envelope] = params
            self._bytes += len(envelope)
        return params, data[end:]

    def check_invariants(self) -> None:
        assert self._bytes == sum(map(len, self._known))
        assert self._bytes <= self._max_bytes or len(self._known) == 1  # one envelope larger than the bound
