"""A consumer's settings (`ConsumerConfig`), checked when made: what the consumer process, its
broker session and the launcher share."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.consumer.credit import DEFAULT_AHEAD_S, MAX_CREDIT, MIN_CREDIT
from pipeline.wire.protocol import MAX_CREDIT_BATCHES, check_consumer_name

# A consumer whose results disk is full waits this long before it registers again, doubling
# while the disk stays full, up to RESULTS_FULL_MAX_WAIT_S. Space comes back when someone
# frees it (seconds to minutes), and every retry costs a registration and a batch run for
# nothing; 30 s bounds how long a consumer idles once space is back. NOTE: retrying at the
# reconnect backoff (2 s at most) was rejected: that is what made 12,392 registrations in
# two minutes (tests/consumer/test_consumer_failures.py counts them).
RESULTS_FULL_FIRST_WAIT_S = 1.0
RESULTS_FULL_MAX_WAIT_S = 30.0


@dataclass(slots=True)
class ConsumerConfig:
    socket_path: str
    results_dir: str
    name: str
    model: int = 0
    max_batch_items: int = 64
    max_batch_tokens: int = 65_536
    max_input_len: int = 8192
    engine: str = "sim"
    engine_options: dict = field(default_factory=dict)
    gpu: str | None = None  # a CUDA_VISIBLE_DEVICES value: the engine's GPUs, by index or GPU-/MIG- UUID
    credit: int | None = None  # batches ahead, fixed; None: sized from batch times (credit.py)
    ahead_s: float = DEFAULT_AHEAD_S  # seconds of work kept queued when `credit` is None
    credit_min_batches: int = MIN_CREDIT  # the sized window's bounds (credit.py)
    credit_max_batches: int = MAX_CREDIT
    fsync_results: bool = False
    results_full_first_wait_s: float = RESULTS_FULL_FIRST_WAIT_S  # backoff while the results
    results_full_max_wait_s: float = RESULTS_FULL_MAX_WAIT_S  # disk is full (see above)

    def __post_init__(self) -> None:
        check_consumer_name(self.name)  # it names a results file: checked before any file is touched
        if not 0 < self.results_full_first_wait_s <= self.results_full_max_wait_s < float("inf"):
            raise ValueError(f"consumer {self.name}: results full waits {self.results_full_first_wait_s!r} s "
                             f"to {self.results_full_max_wait_s!r} s must be finite, > 0 and first <= max")
        if self.credit is not None and (isinstance(self.credit, bool) or not 1 <= self.credit <= MAX_CREDIT_BATCHES):
            raise ValueError(f"consumer {self.name}: credit {self.credit!r} must be from 1 to "
                             f"{MAX_CREDIT_BATCHES} batches")
        if not self.ahead_s >= 0:
            raise ValueError(f"consumer {self.name}: ahead_s {self.ahead_s!r} must be >= 0 seconds")
        low, high = self.credit_min_batches, self.credit_max_batches
        if any(isinstance(n, bool) or not isinstance(n, int) for n in (low, high)) \
                or not 1 <= low <= high <= MAX_CREDIT_BATCHES:
            raise ValueError(f"consumer {self.name}: credit window bounds {low!r} to {high!r} batches must be "
                             f"integers with 1 <= min <= max <= {MAX_CREDIT_BATCHES}")
