"""How many distinct shapes a run gave items, in memory that does not grow with the run.

Exact while the run has seen at most `exact_limit` shapes (a set of their 64-bit keys),
then a HyperLogLog estimate (Flajolet et al. 2007) over 2**REGISTER_BITS one-byte registers:
a standard error of 1.04 / sqrt(2**14) = 0.81%, in 16 KiB, however many shapes come. The
registers take every key from the first, so the switch loses nothing.

NOTE: an exact set of every shape was rejected: ~100 bytes a shape in Python (ShapeKey plus
its slot), 1 GB for a job of ten million requests that each have their own system prompt,
for a figure of the run's report.

A key is (model, signature) mixed by splitmix64's finaliser; a signature is already a 64-bit
hash of the shape's components, so two shapes share a key with odds ~n**2 / 2**65.

Pure: no I/O, no clock. Owner: the Dispatcher, in the broker's single loop.
"""

from __future__ import annotations

import math

import numpy as np

# 2**14 registers: 0.81% standard error in 16 KiB (Redis's PFCOUNT uses the same).
REGISTER_BITS = 14
_REGISTERS = 1 << REGISTER_BITS
_RANK_BITS = 64 - REGISTER_BITS  # the bits past a key's register index
# Shapes counted exactly: their keys as Python ints in a set, ~70 bytes each, so ~1 MiB here.
DISTINCT_EXACT_LIMIT = 16_384
# The bias correction of the raw estimate for 2**14 registers (the paper's alpha_m).
_ALPHA = 0.7213 / (1 + 1.079 / _REGISTERS)
# 2**64 / golden ratio (Fibonacci hashing) spreads the model id over every bit before the mix.
_MODEL_MIX = np.uint64(0x9E3779B97F4A7C15)


def shape_keys(models: np.ndarray, signatures: np.ndarray) -> np.ndarray:
    """Each (model, signature)'s 64-bit key: splitmix64's finaliser (Steele et al., its
    published shift and multiplier constants) of the two mixed."""
    with np.errstate(over="ignore"):
        z = signatures.astype(np.uint64) ^ (models.astype(np.uint64) * _MODEL_MIX)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class DistinctCount:
    """Distinct (model, signature) pairs added: exact up to `exact_limit`, then estimated."""

    def __init__(self, exact_limit: int = DISTINCT_EXACT_LIMIT) -> None:
        assert exact_limit >= 0, exact_limit
        self.exact_limit = exact_limit
        self._exact: set[int] | None = set()  # None once past exact_limit
        self._registers = np.zeros(_REGISTERS, dtype=np.uint8)
        # The count never falls (it is exported as a counter): the estimate at or above the
        # last count reported, and past exact_limit at the switch.
        self._floor = 0

    def add_many(self, models: np.ndarray, signatures: np.ndarray) -> None:
        """Add the pairs (models[k], signatures[k]); a pair added before changes nothing."""
        keys = shape_keys(np.asarray(models), np.asarray(signatures))
        if keys.size == 0:
            return
        index = (keys >> np.uint64(_RANK_BITS)).astype(np.intp)
        rest = keys & np.uint64((1 << _RANK_BITS) - 1)
        # The rank is the position of the first 1 bit of the rest, from its top: frexp gives
        # the bit length exactly (every rest is below 2**53), and a rest of 0 ranks past all.
        _mantissa, bit_length = np.frexp(rest.astype(np.float64))
        rank = (_RANK_BITS + 1 - bit_length).astype(np.uint8)
        np.maximum.at(self._registers, index, rank)
        if self._exact is not None:
            self._exact.update(keys.tolist())
            if len(self._exact) > self.exact_limit:
                self._exact = None
                self._floor = self.exact_limit + 1
        if self._exact is None:
            self._floor = max(self._floor, round(self.estimate()))

    @property
    def exact(self) -> bool:
        """Whether `count` is exact (at most `exact_limit` shapes so far)."""
        return self._exact is not None

    @property
    def count(self) -> int:
        """The distinct pairs added: exact, or once past the limit the estimate rounded (never
        less than a count reported before)."""
        if self._exact is not None:
            return len(self._exact)
        return self._floor

    def estimate(self) -> float:
        """HyperLogLog's estimate, with linear counting where few registers are set."""
        raw = _ALPHA * _REGISTERS ** 2 / float(np.ldexp(1.0, -self._registers.astype(np.int32)).sum())
        zeros = int(np.count_nonzero(self._registers == 0))
        if raw <= 2.5 * _REGISTERS and zeros:
            return _REGISTERS * math.log(_REGISTERS / zeros)
        return raw

    def check_invariants(self) -> None:
        """Ranks within their range; an exact set within its limit."""
        assert int(self._registers.max(initial=0)) <= _RANK_BITS + 1
        assert self._exact is None or len(self._exact) <= self.exact_limit
        assert self._exact is None or (not self._exact) == (not self._registers.any())
        assert self._exact is not None or self._floor > self.exact_limit
