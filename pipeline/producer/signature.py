"""Shape signatures: one 64-bit value naming a prompt's cacheable prefix components (SPEC §1).

The producer knows its template, so it declares the shape. Each cacheable component (the
system prompt, the few-shot block, the tool schema...) is hashed with xxh3-64, in order, into
a vector of 64-bit values; the vector is reduced to one signature by hashing it again.

    signature([system_ids, fewshot_ids])  !=  signature([fewshot_ids, system_ids])

Components are `bytes` (template text, already encoded) or integer arrays (token ids).
Token ids are hashed as little-endian int32, the dtype every record carries, so the same ids
given as int64 or as a list give the same signature. Length is deliberately not part of a
signature: one shape spans many lengths.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import NewType, Union

import numpy as np
import xxhash

from pipeline.wire.errors import SignatureError, TokenArrayError
from pipeline.wire.shapes import EMPTY_SHAPE_SIGNATURE, POOL_SIGNATURE

Signature = NewType("Signature", int)

# Seed of the reduction hash, distinct from the per-component seed (0), so a one-component
# signature is not simply that component's hash (a shape is not a component).
SIGNATURE_SEED = 0x5348_4150_455F_5349  # "SHAPE_SI"
INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1
UINT64_MAX = (1 << 64) - 1
# What token ids are hashed as (little-endian int32, the records' dtype).
_TOKEN_BYTES_DTYPE = np.dtype("<i4")

Component = Union[bytes, bytearray, memoryview, np.ndarray, Sequence[int]]


def component_hash(component: Component) -> int:
    """xxh3-64 of one component: its bytes, or its token ids as little-endian int32."""
    if isinstance(component, (bytes, bytearray, memoryview)):
        return xxhash.xxh3_64_intdigest(component)
    return xxhash.xxh3_64_intdigest(as_token_bytes(component))


def as_token_bytes(tokens: np.ndarray | Sequence[int]) -> bytes:
    """Token ids as the little-endian int32 bytes that are hashed (validated, typed errors)."""
    array = np.asarray(tokens)
    if array.dtype == _TOKEN_BYTES_DTYPE and array.ndim == 1:  # a prompt's own ids: int32 holds no other value
        return array.tobytes()
    if array.ndim != 1:
        raise TokenArrayError(f"token component must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise TokenArrayError(f"token component must hold integers, got dtype {array.dtype}")
    if array.size and (int(array.min()) < INT32_MIN or int(array.max()) > INT32_MAX):
        raise TokenArrayError(
            f"token ids must fit int32, got range [{int(array.min())}, {int(array.max())}]"
        )
    return array.astype(_TOKEN_BYTES_DTYPE, copy=False).tobytes()


def reduce_hashes(hashes: Sequence[int]) -> Signature:
    """Reduce an ordered vector of component hashes to one signature (order-sensitive)."""
    for h in hashes:
        if not 0 <= h <= UINT64_MAX:
            raise SignatureError(f"component hash {h} is not an unsigned 64-bit value")
    packed = struct.pack(f"<{len(hashes)}Q", *hashes)
    return Signature(xxhash.xxh3_64_intdigest(packed, seed=SIGNATURE_SEED))


# The broker knows the empty shape by this shared constant (pipeline/wire/shapes.py; it hashes nothing).
assert reduce_hashes([]) == EMPTY_SHAPE_SIGNATURE, hex(reduce_hashes([]))


def signature(components: Iterable[Component]) -> Signature:
    """The shape signature of a prompt's cacheable components, in order.

    An empty list is a valid shape: prompts that share no prefix at all.
    """
    if isinstance(components, (bytes, bytearray, memoryview, np.ndarray)):
        raise TypeError("signature() takes a list of components, not one component")
    return reduce_hashes([component_hash(c) for c in components])


def chain(components: Sequence[Component]) -> tuple[Signature, ...]:
    """A shape's chain of prefix signatures (SPEC §4b): the signature of components[:1],
    components[:2], ..., the last one `signature(components)`; for no components, the one
    signature of the empty shape. Shapes whose chains share a prefix share those leading
    components: the broker orders them by it without seeing a token.

    Example: chain([system, fewshot]) == (signature([system]), signature([system, fewshot]))."""
    hashes = [component_hash(c) for c in components]
    if not hashes:
        return (reduce_hashes([]),)
    return tuple(reduce_hashes(hashes[:k]) for k in range(1, len(hashes) + 1))


def check_signature(value: object) -> int:
    """An unsigned 64-bit signature as a Python int, or SignatureError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise SignatureError(f"signature must be an integer, got {type(value).__name__} {value!r}")
    as_int = int(value)
    if not 0 <= as_int <= UINT64_MAX:
        raise SignatureError(f"signature {as_int} is not an unsigned 64-bit value")
    if as_int == POOL_SIGNATURE:
        raise SignatureError(f"signature {as_int:#018x} is reserved: it names the broker's solitary pool")
    return as_int
