"""Per-item generation parameters, carried in the item's payload so the broker stays blind.

An item's payload is opaque to the broker: it stores it in the segment entry and the
consumer reads it back with the tokens. The generation parameters of an item (max new
tokens, temperature, top_p, seed, stop strings) travel there, in an envelope in front of
the producer's own payload:

    payload:  GENERATION_HEADER | stop strings (u2 length + UTF-8, each) | the producer's payload

The producer writes the envelope (`encode_payload`) only for an item that has parameters,
and for one whose own payload happens to begin with GENERATION_MAGIC (so a plain payload is
never misread as an envelope); every other payload is stored as it is, at no cost. The
consumer splits it (`decode_payload`) and hands the engine the parameters and the results
file the producer's payload alone. A field the item does not give (its bit clear in
`set_mask`) takes the engine's default (`engine_options`).

NOTE: a new field in the item and entry headers was rejected: the broker would copy, store
and checksum parameters it never reads, both on-disk and in-ring formats would change
version, and items without parameters (the sim workloads, token-id jobs) would pay bytes
for them. In the payload they cost nothing where absent and the broker cannot depend on them.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from pipeline.wire.errors import GenerationParamsError
from shm.layout import checked_dtype, struct_for

GENERATION_MAGIC = b"SBGP"
# Bump when a field below moves or changes meaning; envelopes of another version are refused.
GENERATION_VERSION = 1

# Generation envelope header, at the start of a payload.
#   off  size  field        meaning
#     0     4  magic        b"SBGP"
#     4     2  version      GENERATION_VERSION
#     6     2  header_size  GENERATION_HEADER_DTYPE.itemsize, so a reader can check it
#     8     4  set_mask     bit per parameter the item gives (SET_* below); others: defaults
#    12     4  max_tokens   new tokens at most, >= 1
#    16     8  temperature  float64, >= 0 (0: greedy)
#    24     8  top_p        float64, in (0, 1]
#    32     8  seed         int64, the sampler's seed
#    40     2  stop_count   stop strings after the header
#    42     2  reserved     zero
#    44     4  stop_bytes   bytes the stop strings take (each: u2 length, then UTF-8)
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
        ("stop_bytes", 44, "<u4", "bytes of stop strings"),
    ],
    itemsize=48,
)
GENERATION_HEADER_SIZE_BYTES = GENERATION_HEADER_DTYPE.itemsize
_HEADER = struct_for(GENERATION_HEADER_DTYPE)
_STOP_LEN = struct.Struct("<H")
SET_MAX_TOKENS, SET_TEMPERATURE, SET_TOP_P, SET_SEED, SET_STOP = (1 << k for k in range(5))
_KNOWN_MASK = SET_MAX_TOKENS | SET_TEMPERATURE | SET_TOP_P | SET_SEED | SET_STOP

# A million new tokens: more than any model's context, so no real request is refused here
# (the engine's own max_model_len is the real bound, and it answers with its error).
MAX_NEW_TOKENS = 1 << 20
# OpenAI's API takes 4 stop sequences, vLLM any number; 16 covers a chat template's end
# markers and a user's own with room to spare, and bounds the envelope.
MAX_STOP_STRINGS = 16
# A stop sequence is a few tokens of text; 256 bytes of UTF-8 is far beyond any real one.
MAX_STOP_STRING_BYTES = 256
_INT64 = 1 << 63


@dataclass(slots=True, frozen=True)
class GenerationParams:
    """How one item is generated; None (or no stop strings): the engine's default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        wrong = self.problems()
        if wrong:
            raise GenerationParamsError("generation parameters: " + "; ".join(wrong))

    def problems(self) -> list[str]:
        """What is out of range (empty when nothing is)."""
        wrong = []
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_NEW_TOKENS):
            wrong.append(f"max_tokens {self.max_tokens!r} must be an integer from 1 to {MAX_NEW_TOKENS}")
        if self.temperature is not None and not (_is_real(self.temperature) and self.temperature >= 0):
            wrong.append(f"temperature {self.temperature!r} must be a finite number >= 0")
        if self.top_p is not None and not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            wrong.append(f"top_p {self.top_p!r} must be a number in (0, 1]")
        if self.seed is not None and not (_is_int(self.seed) and -_INT64 <= self.seed < _INT64):
            wrong.append(f"seed {self.seed!r} must be a 64-bit signed integer")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            wrong.append(f"stop {self.stop!r} must be a tuple of non-empty strings")
        elif len(self.stop) > MAX_STOP_STRINGS:
            wrong.append(f"{len(self.stop)} stop strings, limit {MAX_STOP_STRINGS}")
        else:
            for stop in self.stop:
                try:
                    size = len(stop.encode("utf-8"))
                except UnicodeEncodeError:  # a lone surrogate: no UTF-8 for it
                    wrong.append(f"stop string {stop[:40]!r} is not valid Unicode text")
                    break
                if size > MAX_STOP_STRING_BYTES:
                    wrong.append(f"stop string {stop[:40]!r}... is over {MAX_STOP_STRING_BYTES} bytes of UTF-8")
                    break
        return wrong

    def overrides(self) -> dict[str, object]:
        """The parameters this item gives, by name (what it changes from the defaults)."""
        given = {name: getattr(self, name) for name in ("max_tokens", "temperature", "top_p", "seed")}
        out: dict[str, object] = {k: v for k, v in given.items() if v is not None}
        if self.stop:
            out["stop"] = list(self.stop)
        return out


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
    mask = ((SET_MAX_TOKENS if params.max_tokens is not None else 0)
            | (SET_TEMPERATURE if params.temperature is not None else 0)
            | (SET_TOP_P if params.top_p is not None else 0)
            | (SET_SEED if params.seed is not None else 0) | (SET_STOP if params.stop else 0))
    stops = b"".join(_STOP_LEN.pack(len(raw)) + raw for raw in (s.encode("utf-8") for s in params.stop))
    header = _HEADER.pack(GENERATION_MAGIC, GENERATION_VERSION, GENERATION_HEADER_SIZE_BYTES, mask,
                          params.max_tokens or 0, float(params.temperature or 0.0), float(params.top_p or 0.0),
                          params.seed or 0, len(params.stop), len(stops))
    return header + stops + payload


def decode_payload(data: bytes) -> tuple[GenerationParams | None, bytes]:
    """(the item's parameters, the producer's own payload) from a stored payload; (None,
    data) for a payload without an envelope. GenerationParamsError, naming the byte offset,
    for an envelope that is cut short, of another version, or out of range."""
    if not data.startswith(GENERATION_MAGIC):
        return None, data
    if len(data) < GENERATION_HEADER_SIZE_BYTES:
        raise GenerationParamsError(f"generation envelope of {len(data)} bytes is shorter than its "
                                    f"{GENERATION_HEADER_SIZE_BYTES}-byte header")
    _magic, version, size, mask, max_tokens, temperature, top_p, seed, count, stop_bytes = _HEADER.unpack_from(data)
    if version != GENERATION_VERSION or size != GENERATION_HEADER_SIZE_BYTES or mask & ~_KNOWN_MASK:
        raise GenerationParamsError(f"generation envelope version {version}, header size {size}, mask {mask:#x} at "
                                    f"byte 4: this consumer reads version {GENERATION_VERSION}, size "
                                    f"{GENERATION_HEADER_SIZE_BYTES}, mask within {_KNOWN_MASK:#x}")
    end = GENERATION_HEADER_SIZE_BYTES + stop_bytes
    if end > len(data):
        raise GenerationParamsError(f"generation envelope: stop strings end at byte {end}, past the payload's "
                                    f"{len(data)} bytes")
    stops = _read_stops(data, GENERATION_HEADER_SIZE_BYTES, end, count)
    params = GenerationParams(
        max_tokens=max_tokens if mask & SET_MAX_TOKENS else None,
        temperature=temperature if mask & SET_TEMPERATURE else None,
        top_p=top_p if mask & SET_TOP_P else None,
        seed=seed if mask & SET_SEED else None,
        stop=stops)
    return params, data[end:]


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
