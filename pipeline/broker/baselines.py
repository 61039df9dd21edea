"""Baseline dispatch policies, for comparison only (the evaluation suite's): what a
plain queue would hand a consumer, on the same DispatchPolicy interface as the product's
ShapeSelector, the same lanes and packing. Not recommendations: they leave the prefix
cache cold, which is what they are there to show.

    fifo          the shape whose oldest dispatchable item is oldest, every batch (arrival
                  order across shapes; lanes still pack each batch)
    round-robin   the next shape with work after the one last handed out, every batch

Each batch's shape is the consumer's current shape for the signature guard, as with any
policy; a change of shape is a switch counted with reason `order`.

Pure, like selection.py. Owner: the Dispatcher, in the broker's dispatch loop; not
thread-safe.
"""

from __future__ import annotations

from sortedcontainers import SortedList

from pipeline.broker.ids import ConsumerId, ShapeKey
from pipeline.broker.selection import ShapeSelector, SwitchReason

# FIFO's arrival order, to the millisecond: the selector's 100 ms buckets would make a burst
# of submits one tie, broken by signature (shape by shape: not arrival order at all); a
# millisecond holds about 200 items at the broker's ingest rate, a few buckets per shape.
FIFO_RESOLUTION_NS = 1_000_000


class FifoPolicy(ShapeSelector):
    """Oldest item first across shapes (by each shape's oldest arrival bucket, ties by the
    lower signature)."""

    KEEPS_AGES = True

    def __init__(self, max_age_s: float | None = None, age_resolution_ns: int = FIFO_RESOLUTION_NS,
                 **options) -> None:
        super().__init__(max_age_s, age_resolution_ns, **options)

    def choose(self, model: int, now_s: float, *, consumer: ConsumerId,
               batch_tokens: int = 0) -> tuple[ShapeKey, SwitchReason | None] | None:
        state = self._models.get(model)
        if state is None or not state.by_age:
            return None
        state.consumers.add(consumer)
        oldest = state.by_age[0][1]
        return ShapeKey(model, oldest), _switch_reason(state.current.get(consumer), oldest)


class RoundRobinPolicy(ShapeSelector):
    """Each batch from the next shape with work, in signature order, after the one the model
    handed out last (shared by the model's consumers, so they take turns over the shapes)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._last: dict[int, int] = {}  # model -> the signature handed out last

    def choose(self, model: int, now_s: float, *, consumer: ConsumerId,
               batch_tokens: int = 0) -> tuple[ShapeKey, SwitchReason | None] | None:
        state = self._models.get(model)
        if state is None or not state.by_tokens:
            return None
        state.consumers.add(consumer)
        ring = SortedList(signature for _tokens, signature in state.by_tokens)
        last = self._last.get(model)
        at = 0 if last is None else ring.bisect_right(last)
        chosen = ring[at % len(ring)]
        return ShapeKey(model, chosen), _switch_reason(state.current.get(consumer), chosen)

    def on_dispatched(self, shape: ShapeKey, tokens: int, arrivals_ns) -> None:
        super().on_dispatched(shape, tokens, arrivals_ns)
        self._last[shape.model] = shape.signature  # the turn passes once a batch was handed out


def _switch_reason(mine: int | None, signature: int) -> SwitchReason | None:
    """Why a consumer on shape `mine` moves to `signature` (None: it stays)."""
    if mine == signature:
        return None
    return SwitchReason.INITIAL if mine is None else SwitchReason.ORDER


# The policies `--dispatch` names (the product's sticky one is ShapeSelector itself).
BASELINES: dict[str, type[ShapeSelector]] = {"fifo": FifoPolicy, "round-robin": RoundRobinPolicy}
