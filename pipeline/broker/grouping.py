"""How a frame's items, and a reopened store's lanes, split by shape and lane: the pure column
work of the dispatcher's ingest and recovery (`dispatch.py`), which owns the state they read."""

from __future__ import annotations

import numpy as np

from pipeline.broker.ids import LaneId, LaneKey, ShapeKey
from pipeline.broker.lanes import MAX_LENGTH_TOKENS, ShapeLanes
from pipeline.broker.pool import is_pool
from pipeline.storage.base import AppendGroup, RecoveredLane
from pipeline.wire.errors import ItemTooLongError, ModelIdError, StorageError
from pipeline.wire.layouts.frames import Frame


def check_frame_limits(frame: Frame, max_models: int) -> None:
    """ItemTooLongError or ModelIdError naming the first item of `frame` past the broker's
    limits: the frame is refused whole, never stored (and so skipped at restart)."""
    items = frame.items
    too_long = np.flatnonzero(items["length"] > MAX_LENGTH_TOKENS)
    if too_long.size:
        index = int(too_long[0])
        raise ItemTooLongError(
            f"producer {frame.producer_id}: item {index} has {int(items['length'][index])} "
            f"tokens, above the broker's limit of {MAX_LENGTH_TOKENS}"
        )
    if int(items["model"].max()) >= max_models:
        index = int(np.flatnonzero(items["model"] >= max_models)[0])
        raise ModelIdError(f"producer {frame.producer_id}: item {index} is for model "
                           f"{int(items['model'][index])}; this broker serves models 0..{max_models - 1}")


def group_by_shape(items: np.ndarray, rows: np.ndarray) -> list[tuple[ShapeKey, np.ndarray]]:
    """Rows per (model, signature), each in arrival order; shapes in (model, sig) order."""
    if not rows.size:
        return []
    models = items["model"][rows]
    signatures = items["signature"][rows]
    if (models == models[0]).all() and (signatures == signatures[0]).all():
        return [(ShapeKey(int(models[0]), int(signatures[0])), rows)]  # the common case
    order = np.lexsort((signatures, models))  # stable: arrival order within a shape
    models, signatures, rows = models[order], signatures[order], rows[order]
    cuts = np.flatnonzero((np.diff(models) != 0) | (np.diff(signatures) != 0)) + 1
    starts = [0, *cuts.tolist()]
    return [
        (ShapeKey(int(models[start]), int(signatures[start])), part)
        for start, part in zip(starts, np.split(rows, cuts))
    ]


def lane_groups(lanes: ShapeLanes, shape: ShapeKey, frame: Frame, rows: np.ndarray,
                now_s: float) -> list[tuple[AppendGroup, int]]:
    """Assign `lanes` (the shape's) to the shape's rows of `frame`; return each lane's group
    (arrival order within it) and its tokens, in lane order."""
    lengths = frame.items["length"][rows].astype(np.int64)
    lane_ids = lanes.assign_many(lengths, now_s)
    order = np.argsort(lane_ids, kind="stable")  # each lane's rows stay in arrival order
    sorted_lanes = lane_ids[order]
    cuts = np.flatnonzero(np.diff(sorted_lanes)) + 1
    starts = [0, *cuts.tolist()]
    group_tokens = np.add.reduceat(lengths[order], starts).tolist()
    groups = []
    for lane_rows, first, tokens in zip(np.split(rows[order], cuts), starts, group_tokens):
        key = LaneKey(shape.model, shape.signature, LaneId(int(sorted_lanes[first])))
        groups.append((AppendGroup(key, frame, lane_rows), int(tokens)))
    return groups


def recovered_shapes(found_lanes: list[RecoveredLane]) -> tuple[dict[ShapeKey, int], set[ShapeKey]]:
    """The shapes a reopened store holds: each pooled shape's items (by each pool entry's own
    shape), and the shapes with lanes of their own."""
    pooled: dict[ShapeKey, int] = {}
    own: set[ShapeKey] = set()
    for found in found_lanes:
        if is_pool(found.lane.shape):
            signatures, counts = np.unique(found.signatures, return_counts=True)
            for signature, count in zip(signatures.tolist(), counts.tolist()):
                shape = ShapeKey(found.lane.model, signature)
                pooled[shape] = pooled.get(shape, 0) + count
        else:
            own.add(found.lane.shape)
    return pooled, own


def check_recovered_lane(found: RecoveredLane, max_lanes: int) -> None:
    """StorageError for a recovered lane whose id (a file name's, from outside) is beyond the
    broker's lane budget."""
    if found.lane.lane >= max_lanes:
        raise StorageError(
            f"recovered lane {tuple(found.lane)} ({found.lengths.size} items): lane id {found.lane.lane} is "
            f"beyond this broker's lane budget of {max_lanes} (a store written with a "
            f"larger max_lanes, or a segment named by hand): the broker cannot serve it")


def first_unheld_lane(shape: ShapeKey, lanes: ShapeLanes, held: dict[LaneKey, int]) -> LaneId | None:
    """While a full disk holds part of a frame back (`held`: its items per lane): the first
    lane, in descending queued-token order, with stored items before the unstored ones at
    its back (the pad-to still counts those)."""
    for lane in lanes.lanes_by_queued_tokens():
        if lanes.queued_items(lane) > held.get(LaneKey(shape.model, shape.signature, lane), 0):
            return lane
    return None
