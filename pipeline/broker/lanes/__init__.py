"""Rolling lanes for one shape: which lane (padding class) each item joins (SPEC §2).

A lane is a queue of items of similar length with a target length; the broker pads a lane's
batches to (about) its target. `ShapeLanes` decides, for every item of one (model, signature)
shape, which lane it joins, opens and retires lanes, and keeps the per-lane counts the
dispatcher orders lanes by. It is pure policy: no I/O, no clock (callers pass `now_s`), no
processes; the storage tier holds the items themselves.

Who calls what, in one broker loop:

    lanes = ShapeLanes()                       # one per shape
    lane = lanes.assign(length, now_s)         # or lanes.assign_many(lengths, now_s)
    lanes.on_dispatched(lane, batch_lengths)   # a batch of the lane's front items was committed
    lanes.on_completed(lane, count)            # its items were completed (tombstoned)
    lanes.on_returned(lane, lengths)           # a lost consumer's pending items came back
    changed = lanes.tick(now_s)                # maintenance, e.g. once per loop turn

The modules, each importing only those above it:

    config.py   the policy's constants (assign_many's tuning settings among them),
                LaneConfig, LaneCounters, TickResult, LaneView, length checks
    queues.py   LaneTable: every per-lane field, the queue events, the min/max windows
    bulk.py     assign_many's vectorised placement, through ShapeLanes' public view
    policy.py   ShapeLanes: place, tick, the queue events' entry points, restore_lane

Lane ids are `pipeline.broker.ids.LaneId`.
"""

from pipeline.broker.lanes.config import MAX_LENGTH_TOKENS, LaneConfig, LaneCounters, LaneView, TickResult, WasteMeasure
from pipeline.broker.lanes.policy import ShapeLanes

__all__ = ["MAX_LENGTH_TOKENS", "LaneConfig", "LaneCounters", "LaneView", "ShapeLanes", "TickResult", "WasteMeasure"]
