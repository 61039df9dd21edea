"""The producer API: submit work items, one at a time or many per call, into a shared ring.

    producer = Producer.create("/sbrk-run1-producer-0", producer_id=0)
    sig = signature([system_prompt_ids, fewshot_ids])
    item_id = producer.submit(model=0, signature=sig, tokens=prompt_ids, prefix_len=1800)
    ids = producer.submit_many(model=0, signature=sig, tokens=flat_ids, lengths=lengths)

Every item gets a unique item id ((producer_id << 40) | seq) and a per-producer sequence
number, and lands in a frame (see `pipeline.wire.layouts`). Bad input raises a typed error from
`pipeline.wire.errors` and writes nothing: everything is validated before the first byte goes
into the ring.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.producer.signature import INT32_MAX, INT32_MIN, UINT64_MAX, check_signature
from pipeline.wire.errors import (
    BadInputError,
    ItemTooLongError,
    ModelIdError,
    PayloadTooLargeError,
    RingTimeoutError,
    SignatureError,
    TokenArrayError,
)
from pipeline.wire.generation import GENERATION_MAGIC, GenerationParams, encode_payload
from pipeline.wire.layouts.frames import (
    FRAME_HEADER_SIZE_BYTES,
    FRAME_HEADER_STRUCT,
    FRAME_MAGIC,
    FRAME_VERSION,
    ITEM_HEADER_DTYPE,
    ITEM_HEADER_SIZE_BYTES,
    MAX_CHAIN_DEPTH,
    MAX_PRODUCER_ID,
    MAX_SEQ,
    SINGLE_ITEM_FRAME_STRUCT,
    TOKEN_SIZE_BYTES,
    ItemId,
    encode_chains,
    frame_size_bytes,
    make_item_id,
)
from pipeline.wire.layouts.names import DEFAULT_MAX_MODELS, MODEL_ID_LIMIT
from shm.ring import RingWriter

# 256 Ki tokens: above the longest prompt in the Mooncake trace (191,378 tokens) and the
# context window of today's long-context models.
DEFAULT_MAX_ITEM_TOKENS = 262_144
# 64 KiB: a payload is routing metadata returned with the result (ids, a reply address),
# not a document; anything bigger belongs in the prompt or in the caller's own store.
DEFAULT_MAX_PAYLOAD_BYTES = 65_536
# Items per frame in submit_many: 4,096 items of 256 tokens make a 4 MiB frame, large
# enough that per-frame costs vanish, small enough that a 64 MiB ring holds 16 in flight.
DEFAULT_FRAME_ITEMS = 4096
# Bytes per frame in submit_many: with 2,048-token items, 4,096 items would make a 32 MiB
# frame, and a ring that holds two frames makes writer and reader take turns. 4 MiB keeps
# 16 frames in flight in the default ring; an item bigger than this still gets its own frame.
DEFAULT_FRAME_BYTES = 4 << 20
# 64 MiB ring: 16 frames of the size above, and room (half the ring) for the largest item.
DEFAULT_RING_CAPACITY_BYTES = 64 << 20
# Shapes a producer remembers having declared, per generation (two are kept): ~100 bytes
# each, so ~13 MiB at most, where a set of every shape grew with a job whose requests each
# have their own system prompt. A shape forgotten and seen again is declared again: a chain
# more on the wire, which the broker takes as the same declaration.
MAX_DECLARED_SHAPES = 65_536

_I4 = np.dtype("<i4")
_monotonic_ns = time.monotonic_ns
_SINGLE_BODY_BASE = FRAME_HEADER_SIZE_BYTES + ITEM_HEADER_SIZE_BYTES
_NO_TIMEOUT = object()


@dataclass(frozen=True, slots=True)
class ProducerLimits:
    """What a producer accepts. The broker checks the same limits again on ingest. Each is
    checked on construction: `max_models` is at most MODEL_ID_LIMIT (what a segment
    directory name holds), the others at least 1."""

    max_item_tokens: int = DEFAULT_MAX_ITEM_TOKENS
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_models: int = DEFAULT_MAX_MODELS
    frame_items: int = DEFAULT_FRAME_ITEMS
    frame_bytes: int = DEFAULT_FRAME_BYTES

    def __post_init__(self) -> None:
        if not 1 <= self.max_models <= MODEL_ID_LIMIT:
            raise ModelIdError(f"max_models {self.max_models} must be in [1, {MODEL_ID_LIMIT}] (a segment "
                               f"directory name holds model ids below {MODEL_ID_LIMIT})")
        for name in ("max_item_tokens", "frame_items", "frame_bytes"):
            if getattr(self, name) < 1:
                raise BadInputError(f"producer limit {name} {getattr(self, name)} must be at least 1")
        if self.max_payload_bytes < 0:
            raise BadInputError(f"producer limit max_payload_bytes {self.max_payload_bytes} must be >= 0")


def coerce_tokens(tokens: object, where: str = "tokens") -> np.ndarray:
    """Any integer array-like as a contiguous little-endian int32 array, or TokenArrayError."""
    try:
        array = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise TokenArrayError(f"{where}: not an array of token ids ({exc})") from exc
    if array.ndim != 1:
        raise TokenArrayError(f"{where}: must be one-dimensional, got shape {array.shape}")
    if array.shape[0] == 0:
        raise TokenArrayError(f"{where}: empty (an item needs at least one token)")
    if array.dtype.kind not in "iu":
        raise TokenArrayError(f"{where}: must hold integers, got dtype {array.dtype}")
    if array.dtype != _I4:
        lo, hi = int(array.min()), int(array.max())
        if lo < INT32_MIN or hi > INT32_MAX:
            bad = int(np.flatnonzero((array < INT32_MIN) | (array > INT32_MAX))[0])
            raise TokenArrayError(
                f"{where}: token id {int(array[bad])} at index {bad} is outside int32 "
                f"[{INT32_MIN}, {INT32_MAX}]"
            )
    return np.ascontiguousarray(array, dtype=_I4)


class Producer:
    """Writes work items into one ring as frames.

    Owner: one producer process, which normally creates the ring (`Producer.create`) and
    unlinks it at the end (`unlink`); `close` detaches. Not thread-safe: one thread submits.
    """

    def __init__(
        self,
        ring: RingWriter,
        producer_id: int,
        *,
        limits: ProducerLimits = ProducerLimits(),
        next_seq: int = 0,
        timeout_s: float | None = None,
    ) -> None:
        if not 0 <= producer_id <= MAX_PRODUCER_ID:
            raise ValueError(f"producer id {producer_id} outside [0, {MAX_PRODUCER_ID}]")
        largest = frame_size_bytes(1, limits.max_item_tokens, limits.max_payload_bytes)
        if largest > ring.max_body_bytes:
            raise ValueError(
                f"ring {ring.name} of {ring.capacity_bytes} bytes cannot hold the largest item "
                f"({largest} bytes; a record may take half the ring): raise the capacity or "
                f"lower max_item_tokens / max_payload_bytes"
            )
        self.ring = ring
        self.producer_id = producer_id
        self.limits = limits
        self.timeout_s = timeout_s
        self._seq = next_seq
        self._buf = ring.buf
        self._tokens_view = ring.buf.cast("i")  # int32 view of the data region for token copies
        self._id_base = make_item_id(producer_id, 0)
        # Bound methods and limits as plain attributes: the single-item path uses them on
        # every call, and each saved lookup is a few percent of a ~1.3 us submit.
        self._reserve = ring.reserve
        self._commit = ring.commit
        self._pack_single = SINGLE_ITEM_FRAME_STRUCT.pack_into
        self._max_item_tokens = limits.max_item_tokens
        self._max_payload_bytes = limits.max_payload_bytes
        self._max_models = limits.max_models
        # Shape lineage (SPEC §4b): the shapes declared on this connection lately (two
        # generations of at most MAX_DECLARED_SHAPES each), and the chains still to go out
        # with the next frame written.
        self._declared: set[tuple[int, int]] = set()
        self._declared_before: set[tuple[int, int]] = set()
        self._pending_chains: list[tuple[int, tuple[int, ...]]] = []
        # Called with `next_seq` after each frame `submit_many` publishes (a call of many
        # items may be several frames): a process that counts what it published (the launch
        # and produce ledger) is then never short by the frames of a call cut by a kill.
        self.on_frame: Callable[[int], None] | None = None

    @classmethod
    def create(
        cls,
        name: str,
        producer_id: int,
        *,
        capacity_bytes: int = DEFAULT_RING_CAPACITY_BYTES,
        doorbell: str | None = None,
        reattach: bool = False,
        **kwargs,
    ) -> Producer:
        """Create the producer's ring (owner-only) and a producer writing into it."""
        ring = RingWriter.create(name, capacity_bytes, doorbell=doorbell, reattach=reattach)
        try:
            return cls(ring, producer_id, **kwargs)
        except BaseException:
            ring.close()
            ring.unlink()
            raise

    @property
    def next_seq(self) -> int:
        """Sequence number the next item will get."""
        return self._seq

    def _timeout(self, timeout_s: object) -> float | None:
        return self.timeout_s if timeout_s is _NO_TIMEOUT else timeout_s  # type: ignore[return-value]

    def declare_shape(self, model: int, chain: Sequence[int]) -> None:
        """Declare a shape's chain of prefix signatures: the signature of its components[:1],
        [:2], ..., the last one the shape's own (`signature.chain`). Once per shape while it
        is among the last MAX_DECLARED_SHAPES to 2x that declared: a shape declared before
        costs a set lookup. The chain goes to the broker with the next frame
        written, so it arrives before any item submitted after this call. A shape never
        declared is a chain of one. A chain deeper than MAX_CHAIN_DEPTH keeps its first
        levels and its own signature (layouts.py)."""
        if type(model) is not int or not 0 <= model < self._max_models:
            model = self._check_model(model)
        if not chain:
            raise BadInputError("declare_shape: a chain holds at least the shape's own signature")
        key = (model, chain[-1])
        if key in self._declared:
            return
        if key in self._declared_before:  # declared a generation ago: kept as a recent one
            self._remember(key)
            return
        values = tuple(check_signature(v) for v in chain)
        if len(values) > MAX_CHAIN_DEPTH:
            values = values[:MAX_CHAIN_DEPTH - 1] + values[-1:]
        self._remember(key)
        self._pending_chains.append((model, values))

    def _remember(self, key: tuple[int, int]) -> None:
        """A declared shape joins the current generation; a full generation becomes the one
        before (the oldest is forgotten: its shape is declared again if it comes back)."""
        self._declared.add(key)
        if len(self._declared) >= MAX_DECLARED_SHAPES:
            self._declared_before, self._declared = self._declared, set()

    def forget_declared_shapes(self) -> None:
        """A new broker connection: every shape is declared again as its items come."""
        self._declared.clear()
        self._declared_before.clear()

    def submit(
        self,
        model: int,
        signature: int,
        tokens: np.ndarray,
        prefix_len: int = 0,
        payload: bytes = b"",
        timeout_s: float | None | object = _NO_TIMEOUT,
        params: GenerationParams | None = None,
    ) -> ItemId:
        """Submit one item; returns its item id. Blocks while the ring is full. `params`:
        how the engine generates for it (pipeline/wire/generation.py; None: its defaults),
        carried in the payload, which the results file gives back without them."""
        if params is not None or (payload and payload[:4] == GENERATION_MAGIC):
            payload = encode_payload(params, payload if type(payload) is bytes else _check_payload(payload))
        if self._pending_chains:  # the chains go in this item's frame: the general path
            tokens = coerce_tokens(tokens)
            ids = self.submit_many(model, signature, tokens, [len(tokens)], prefix_len,
                                   payloads=[payload if type(payload) is bytes else _check_payload(payload)],
                                   timeout_s=timeout_s)
            return ItemId(int(ids[0]))
        if type(tokens) is not np.ndarray or tokens.dtype != _I4 or tokens.ndim != 1:
            tokens = coerce_tokens(tokens)
        length = len(tokens)  # one-dimensional here; len() is cheaper than shape[0]
        payload_len = len(payload)
        if not 0 < length <= self._max_item_tokens or payload_len > self._max_payload_bytes:
            self._reject_sizes(length, payload_len)
        if type(model) is not int or not 0 <= model < self._max_models:
            model = self._check_model(model)
        if type(signature) is not int or not 0 <= signature <= UINT64_MAX:
            signature = check_signature(signature)
        if type(prefix_len) is not int or not 0 <= prefix_len <= length:
            prefix_len = self._check_prefix(prefix_len, length)
        if type(payload) is not bytes:
            payload = _check_payload(payload)
        seq = self._seq
        if seq > MAX_SEQ:
            raise BadInputError(f"producer {self.producer_id} used every sequence number")
        token_bytes = length * TOKEN_SIZE_BYTES
        if timeout_s is _NO_TIMEOUT:
            timeout_s = self.timeout_s
        offset = self._reserve(_SINGLE_BODY_BASE + token_bytes + payload_len, timeout_s)  # type: ignore[arg-type]
        item_id = self._id_base | seq
        try:
            self._pack_single(
                self._buf, offset, FRAME_MAGIC, FRAME_VERSION, FRAME_HEADER_SIZE_BYTES, self.producer_id,
                1, length, payload_len, 0,
                item_id, seq, signature, _monotonic_ns(), model, length, prefix_len, payload_len,
            )
            start = offset + _SINGLE_BODY_BASE
            self._tokens_view[start >> 2:(start >> 2) + length] = tokens
            if payload_len:
                self._buf[start + token_bytes:start + token_bytes + payload_len] = payload
        except BaseException:
            self.ring.abort()  # nothing was published; the space is simply reused
            raise
        self._commit()
        self._seq = seq + 1
        return item_id  # an ItemId; NewType's call is skipped on this path (it costs a call)

    def _reject_sizes(self, length: int, payload_len: int) -> None:
        if length == 0:
            raise TokenArrayError("tokens: empty (an item needs at least one token)")
        if length > self.limits.max_item_tokens:
            raise ItemTooLongError(f"item of {length} tokens, limit {self.limits.max_item_tokens}")
        raise PayloadTooLargeError(f"payload of {payload_len} bytes, limit {self.limits.max_payload_bytes}")

    def _check_model(self, model: object) -> int:
        if isinstance(model, (bool, np.bool_)) or not isinstance(model, (int, np.integer)):
            raise ModelIdError(f"model id must be an integer, got {type(model).__name__} {model!r}")
        if not 0 <= int(model) < self.limits.max_models:
            raise ModelIdError(f"model id {int(model)} outside [0, {self.limits.max_models})")
        return int(model)

    def _check_prefix(self, prefix_len: object, length: int) -> int:
        if isinstance(prefix_len, (bool, np.bool_)) or not isinstance(prefix_len, (int, np.integer)):
            raise BadInputError(f"prefix_len must be an integer, got {prefix_len!r}")
        if not 0 <= int(prefix_len) <= length:
            raise BadInputError(f"prefix_len {int(prefix_len)} outside [0, {length}] (the item's length)")
        return int(prefix_len)

    def submit_many(
        self,
        model: int | np.ndarray,
        signature: int | np.ndarray,
        tokens: np.ndarray,
        lengths: np.ndarray | Sequence[int],
        prefix_len: int | np.ndarray = 0,
        payloads: Sequence[bytes] | None = None,
        timeout_s: float | None | object = _NO_TIMEOUT,
        params: Sequence[GenerationParams | None] | None = None,
    ) -> np.ndarray:
        """Submit many items in one call: `tokens` holds every item's token ids back to back,
        `lengths[i]` how many belong to item i. `model`, `signature` and `prefix_len` are one
        value for all items or one per item. Returns the item ids (uint64), in order.

        Everything is validated before anything is written. If the ring stays full past the
        timeout after some frames went in, RingTimeoutError says how many items were
        accepted (`accepted_items` attribute): those keep their ids, the rest were not sent.
        `params`: one GenerationParams (or None) per item, as `submit` takes it.
        """
        if params is not None:
            payloads = _with_params(params, payloads, len(lengths))
        batch = _Batch.validate(self.limits, model, signature, tokens, lengths, prefix_len, payloads,
                                enveloped=params is not None)
        first_seq = self._seq
        if first_seq + batch.count - 1 > MAX_SEQ:
            raise BadInputError(f"producer {self.producer_id} would run out of sequence numbers")
        timeout = self._timeout(timeout_s)
        chains = encode_chains(self._pending_chains) if self._pending_chains else b""
        start = 0
        for end in self._frame_bounds(batch, len(chains)):
            try:
                self._write_frame(batch, start, end, first_seq, timeout, chains if start == 0 else b"")
            except RingTimeoutError as exc:
                exc.accepted_items = start  # type: ignore[attr-defined]
                raise
            if self.on_frame is not None:
                self.on_frame(self._seq)
            start = end
        ids = np.arange(first_seq, first_seq + batch.count, dtype=np.uint64)
        ids |= np.uint64(self._id_base)
        return ids

    def _frame_bounds(self, batch: _Batch, first_extra_bytes: int = 0) -> list[int]:
        """Item index where each frame ends: at most `frame_items` items and `frame_bytes`
        bytes (one ring record), but always at least one item.

        Example: frame_items 4096, 10,000 items of 16 tokens -> [4096, 8192, 10000];
        10 items of 2 Mi tokens (8 MiB each, above frame_bytes) -> one frame per item.
        """
        per_item = ITEM_HEADER_SIZE_BYTES + batch.lengths * TOKEN_SIZE_BYTES + batch.payload_lens
        cumulative = np.cumsum(per_item)
        budget = min(self.ring.max_body_bytes, self.limits.frame_bytes) - FRAME_HEADER_SIZE_BYTES
        bounds = []
        start, used = 0, 0
        while start < batch.count:
            room = budget - (first_extra_bytes if start == 0 else 0)  # the first frame carries the chains
            end = int(np.searchsorted(cumulative, used + room, side="right"))
            end = max(start + 1, min(end, start + self.limits.frame_items))  # one max item always fits
            bounds.append(end)
            used = int(cumulative[end - 1])
            start = end
        return bounds

    def _write_frame(self, batch: _Batch, start: int, end: int, first_seq: int, timeout: float | None,
                     chains: bytes = b"") -> None:
        count = end - start
        tok_lo, tok_hi = int(batch.token_starts[start]), int(batch.token_starts[end])
        pay_lo, pay_hi = int(batch.payload_starts[start]), int(batch.payload_starts[end])
        body = frame_size_bytes(count, tok_hi - tok_lo, pay_hi - pay_lo, len(chains))
        offset = self.ring.reserve(body, timeout)
        try:
            self._fill_frame(batch, start, end, first_seq, offset, chains)
        except BaseException:
            self.ring.abort()
            raise
        self.ring.commit()
        self._seq = first_seq + end
        if chains:
            self._pending_chains.clear()

    def _fill_frame(self, batch: _Batch, start: int, end: int, first_seq: int, offset: int,
                    chains: bytes = b"") -> None:
        count = end - start
        tok_lo, tok_hi = int(batch.token_starts[start]), int(batch.token_starts[end])
        pay_lo, pay_hi = int(batch.payload_starts[start]), int(batch.payload_starts[end])
        FRAME_HEADER_STRUCT.pack_into(
            self._buf, offset, FRAME_MAGIC, FRAME_VERSION, FRAME_HEADER_SIZE_BYTES,
            self.producer_id, count, tok_hi - tok_lo, pay_hi - pay_lo, len(chains),
        )
        items_at = offset + FRAME_HEADER_SIZE_BYTES
        items = self.ring.data[items_at:items_at + count * ITEM_HEADER_SIZE_BYTES].view(ITEM_HEADER_DTYPE)
        seq = np.arange(first_seq + start, first_seq + end, dtype=np.uint64)
        items["seq"] = seq
        items["item_id"] = seq | np.uint64(self._id_base)
        items["signature"] = batch.signatures[start:end] if batch.signatures.ndim else batch.signatures
        items["submit_ns"] = time.monotonic_ns()
        items["model"] = batch.models[start:end] if batch.models.ndim else batch.models
        items["length"] = batch.lengths[start:end]
        items["prefix_len"] = batch.prefix_lens[start:end] if batch.prefix_lens.ndim else batch.prefix_lens
        items["payload_len"] = batch.payload_lens[start:end]
        tokens_at = (items_at + count * ITEM_HEADER_SIZE_BYTES) >> 2
        self._tokens_view[tokens_at:tokens_at + tok_hi - tok_lo] = batch.tokens[tok_lo:tok_hi]
        payload_at = (tokens_at + tok_hi - tok_lo) << 2
        if pay_hi > pay_lo:
            self._buf[payload_at:payload_at + pay_hi - pay_lo] = batch.payload_blob[pay_lo:pay_hi]
        if chains:
            chains_at = payload_at + pay_hi - pay_lo
            self._buf[chains_at:chains_at + len(chains)] = chains

    def close(self) -> None:
        """Detach from the ring, marking the writing side closed."""
        del self._tokens_view
        self._buf = None  # type: ignore[assignment]
        self.ring.close()

    def unlink(self) -> None:
        """Remove the ring from the system (the creator does this once, after close)."""
        self.ring.unlink()


@dataclass(slots=True)
class _Batch:
    """A validated submit_many call: arrays ready to be copied into frames."""

    count: int
    models: np.ndarray
    signatures: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray
    token_starts: np.ndarray
    prefix_lens: np.ndarray
    payload_lens: np.ndarray
    payload_starts: np.ndarray
    payload_blob: bytes

    @classmethod
    def validate(cls, limits: ProducerLimits, model, signature, tokens, lengths, prefix_len, payloads,
                 enveloped: bool = False) -> _Batch:
        lengths = _int_array(lengths, "lengths")
        count = lengths.shape[0]
        if count == 0:
            raise BadInputError("submit_many: no items (lengths is empty)")
        if lengths.min() <= 0 or lengths.max() > limits.max_item_tokens:
            bad = int(np.flatnonzero((lengths <= 0) | (lengths > limits.max_item_tokens))[0])
            kind = ItemTooLongError if lengths[bad] > 0 else TokenArrayError
            raise kind(f"item {bad}: length {int(lengths[bad])}, must be in [1, {limits.max_item_tokens}]")
        tokens = coerce_tokens(tokens)
        token_starts = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(lengths, out=token_starts[1:])
        if token_starts[-1] != tokens.shape[0]:
            raise TokenArrayError(f"lengths sum to {int(token_starts[-1])} but tokens holds {tokens.shape[0]}")
        models = _per_item(model, count, "model", np.uint32)
        if models.size and (models.min() < 0 or models.max() >= limits.max_models):
            raise ModelIdError(f"model id outside [0, {limits.max_models}): range {models.min()}..{models.max()}")
        signatures = _signatures(signature, count)
        prefix_lens = _per_item(prefix_len, count, "prefix_len", np.uint32)
        if prefix_lens.size and (prefix_lens.min() < 0 or np.any(prefix_lens > lengths)):
            raise BadInputError("prefix_len must be in [0, length] for every item")
        payload_lens, payload_blob = _payloads(payloads, count, limits.max_payload_bytes, enveloped)
        payload_starts = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(payload_lens, out=payload_starts[1:])
        return cls(
            count, models.astype(np.uint32), signatures, tokens, lengths.astype(np.uint32), token_starts,
            prefix_lens.astype(np.uint32), payload_lens, payload_starts, payload_blob,
        )


def _int_array(values: object, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise BadInputError(f"{what} must be a one-dimensional integer array, got {array.dtype} {array.shape}")
    return array.astype(np.int64, copy=False)


def _per_item(value: object, count: int, what: str, dtype: type) -> np.ndarray:
    """One value for every item (a 0-d array) or one per item; always checked as int64."""
    array = np.asarray(value)
    if array.dtype.kind not in "iu" or array.dtype == np.bool_:
        raise (ModelIdError if what == "model" else BadInputError)(
            f"{what} must be integers, got {array.dtype} {value!r:.60}"
        )
    if array.ndim == 1 and array.shape[0] != count:
        raise BadInputError(f"{what}: {array.shape[0]} values for {count} items")
    if array.ndim > 1:
        raise BadInputError(f"{what} must be a scalar or one-dimensional, got shape {array.shape}")
    return array.astype(np.int64)


def _signatures(value: object, count: int) -> np.ndarray:
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return np.asarray(check_signature(value), dtype=np.uint64)
    array = np.asarray(value)
    if array.ndim != 1 or array.shape[0] != count or (array.dtype.kind not in "iu"):
        raise SignatureError(f"signature must be one integer or {count} integers, got {array.dtype} {array.shape}")
    if array.dtype.kind == "i" and array.min() < 0:
        raise SignatureError(f"signature {int(array.min())} is negative")
    return array.astype(np.uint64)


def _check_payload(payload: object) -> bytes:
    if isinstance(payload, (bytearray, memoryview)):
        return bytes(payload)
    raise BadInputError(f"payload must be bytes, got {type(payload).__name__}")


def _with_params(params: Sequence[GenerationParams | None], payloads: Sequence[bytes] | None,
                 count: int) -> list[bytes]:
    """Each item's payload with its parameters' envelope in front (generation.py)."""
    if len(params) != count or (payloads is not None and len(payloads) != count):
        raise BadInputError(f"{len(params)} generation parameters and "
                            f"{count if payloads is None else len(payloads)} payloads for {count} items")
    if any(p is not None and not isinstance(p, GenerationParams) for p in params):
        raise BadInputError("params must be GenerationParams or None, one per item")
    plain = payloads or [b""] * count
    envelopes: dict[int, bytes] = {}  # by parameters object (alive in `params`): items share a few
    out = []
    for p, q in zip(params, plain):
        q = q if type(q) is bytes else _check_payload(q)
        if p is None:
            out.append(encode_payload(None, q))
            continue
        envelope = envelopes.get(id(p))
        if envelope is None:
            envelope = envelopes[id(p)] = encode_payload(p)
        out.append(envelope + q)
    return out


def _payloads(payloads: Sequence[bytes] | None, count: int, limit: int,
              enveloped: bool) -> tuple[np.ndarray, bytes]:
    """Payload sizes and bytes; a payload that begins like a generation envelope gets one
    (unless `enveloped`: `_with_params` made them all)."""
    if payloads is None:
        return np.zeros(count, dtype=np.uint32), b""
    if len(payloads) != count:
        raise BadInputError(f"{len(payloads)} payloads for {count} items")
    payloads = [p if type(p) is bytes else _check_payload(p) for p in payloads]
    if any(p[:4] == GENERATION_MAGIC for p in payloads) and not enveloped:  # never misread as one
        payloads = [encode_payload(None, p) for p in payloads]
    lens = np.fromiter((len(p) for p in payloads), dtype=np.int64, count=count)
    if lens.size and lens.max() > limit:
        bad = int(np.argmax(lens))
        raise PayloadTooLargeError(f"item {bad}: payload of {int(lens[bad])} bytes, limit {limit}")
    return lens.astype(np.uint32), b"".join(payloads)
