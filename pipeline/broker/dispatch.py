"""The dispatcher: lanes, packing and shape selection wired to a storage tier (SPEC §2-§5).

The broker's process loop (`pipeline.broker.service`) owns one Dispatcher and calls, in its
single loop:

    dispatcher.recover(now_s)                       # once, first: lanes of a reopened disk tier,
                                                    # then one catch-up turn (ingest all the rings
                                                    # hold, flush, release) before serving anyone
    report = dispatcher.ingest(frame, now_s)        # each parsed producer frame of this turn
                                                    # (max_groups=N: None while part of it is left:
                                                    # store_more(N) at the next turns, dispatching
                                                    # between, until it returns the report)
    dispatcher.flush()                              # once per turn, then release those records
    batch = dispatcher.next_batch(consumer, contract, now_s)   # None: nothing for that model
    if batch is not None:
        if channel_of(consumer).try_put(describe(batch)):
            dispatcher.commit(batch)                # only after the channel took it (SPEC §5)
        else:
            dispatcher.abandon(batch)               # nothing happened; the entries stay queued
    dispatcher.complete_batch(consumer, batch)      # NotHeldError: disconnect that consumer
    dispatcher.consumer_lost(consumer)              # its pending entries go back to the front
    dispatcher.tick(now_s, max_shapes)              # lane maintenance, e.g. every 100 ms (True:
                                                    # due shapes are left for the next call)
    except ShapeGuardError: stop the broker         # never caught to carry on
    except DurabilityError: stop the broker         # fsync failed: never carry on

A full disk (DiskFullError from ingest): the frame's lanes were assigned and some of its lane
groups may be stored; the rest wait in the dispatcher. Keep that ring record unreleased,
stop reading the rings (backpressure), keep serving consumers (completions free space), and
call `retry_pending_appends()` each turn until it returns the frame's report; then flush
and release the record, and read the rings again. Meanwhile the frame's stored groups are
dispatchable (their completions are what frees space) and its unstored ones are held (they
sit at the back of their lanes). This is the one exception to "an item is dispatched only
after its record is released" (the idempotent-ingest protocol, see
`pipeline.storage.base`): a crash while a frame is held may store some of its items
again, duplicates bounded by one frame (see `_store`).

Time is always passed in: `now_s` and the items' `submit_ns` are on the machine's monotonic
clock (time.monotonic / time.monotonic_ns). One batch is outstanding at a time: next_batch
must be followed by commit or abandon before the next next_batch, so the shape a batch was
guarded against cannot change under it.

Accounting (`counters()`): received counts items newly stored; routed counts every commit (a
redelivered item counts again) and returned every item given back by a lost consumer, so
received + recovered = queued + (routed - returned) and routed - returned = pending +
completed; when everything is done, received + recovered = completed: difference zero
(recovered: live items a reopened disk tier held at start).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from pipeline.broker.dispatch_records import (  # Batch and IngestReport: imported from here too
    Batch,
    DispatchCounters,
    IngestReport,
    ShapeSummary,
    StoringFrame,
    add_lane_counters,
    summarize_shapes,
    total_lane_counters,
)
from pipeline.broker.distinct import DistinctCount
from pipeline.broker.firstrefs import FirstReferences
from pipeline.broker.grouping import (
    check_frame_limits,
    check_recovered_lane,
    first_unheld_lane,
    group_by_shape,
    lane_groups,
    recovered_shapes,
)
from pipeline.broker.ids import BatchId, ConsumerId, LaneId, LaneKey, ShapeKey
from pipeline.broker.lanes import LaneConfig, LaneCounters, ShapeLanes
from pipeline.broker.lanes.schedule import TickSchedule
from pipeline.broker.packing import Contract, batch_items_limit, pack
from pipeline.broker.pool import SolitaryPool, is_pool, pool_shape
from pipeline.broker.pacing import PACING, BatchPacing
from pipeline.broker.selection import AGE_RESOLUTION_NS, SHAPE_ORDER_MOST_TOKENS, DispatchPolicy, ShapeSelector
from pipeline.storage.base import AppendGroup, StorageTier
from pipeline.storage.pending import Completion
from pipeline.wire.errors import DiskFullError
from pipeline.wire.layouts.frames import Frame, ProducerId, decode_chains
from pipeline.wire.layouts.names import DEFAULT_MAX_MODELS, MODEL_ID_LIMIT



class Dispatcher:
    """Ingest, batch selection, commit, completion and redelivery over one storage tier.

    Owned by the broker's single dispatch loop; it owns a ShapeLanes per (model, signature)
    (created on demand, retired when its last lane is released) and the dispatch policy
    (`policy`, a DispatchPolicy; by default the product's ShapeSelector with the given
    shape order, affinity and starvation bound). Not thread-safe.
    """

    def __init__(
        self,
        storage: StorageTier,
        *,
        lane_config: LaneConfig | None = None,
        max_age_s: float | None = None,
        age_resolution_ns: int = AGE_RESOLUTION_NS,
        max_models: int = DEFAULT_MAX_MODELS,
        shape_order: str = SHAPE_ORDER_MOST_TOKENS,
        affinity: bool = False,
        policy: DispatchPolicy | None = None,
        pool_max_items: int = 0,
        pool_min_shapes: int = 0,
        pacing: BatchPacing = PACING,
    ) -> None:
        assert 1 <= max_models <= MODEL_ID_LIMIT, max_models  # BrokerConfig checks it
        self._storage = storage
        self.pacing = pacing  # when a batch that is not full goes (pacing.py): the broker's one rule
        self._max_models = max_models
        self._lane_config = lane_config if lane_config is not None else LaneConfig()
        self._selector: DispatchPolicy = policy if policy is not None else ShapeSelector(
            max_age_s, age_resolution_ns, shape_order, affinity)
        self._shapes: dict[ShapeKey, ShapeLanes] = {}
        # Which shapes' items go to their model's solitary pool (pool.py; off at 0), and the
        # chain of every live shape.
        self._pool = SolitaryPool(pool_max_items, pool_min_shapes)
        # Every (model, signature) given items since start, retired ones included: the run's
        # shape count (`shapes` above is the live ones, near 0 once a run's lanes retire).
        self._seen = DistinctCount()
        self._retired = LaneCounters()  # counters of shapes retired by tick
        self._next_batch_id = 0
        self._outstanding: Batch | None = None
        self._waiting: StoringFrame | None = None  # a frame a full disk holds part of
        self._held: dict[LaneKey, int] = {}  # its items per lane, not to be dispatched yet
        self._c = DispatchCounters()
        # Compulsory prefix tokens per consumer and for the whole model: the consumer side
        # calls `first_refs.start` when a consumer starts a shape.
        self.first_refs = FirstReferences()
        # Lane maintenance by schedule: a shape is ticked only once ShapeLanes.next_tick_s
        # says a tick could change it (lanes/schedule.py says why).
        self._ticks = TickSchedule()

    @property
    def storage(self) -> StorageTier:
        return self._storage

    @property
    def selector(self) -> ShapeSelector:
        return self._selector

    @property
    def pool(self) -> SolitaryPool:
        return self._pool

    def lanes(self, shape: ShapeKey) -> ShapeLanes | None:
        return self._shapes.get(shape)

    def shapes(self) -> list[ShapeKey]:
        return list(self._shapes)

    # ----------------------------------------------------------------- ingest

    def ingest(self, frame: Frame, now_s: float, max_groups: int | None = None) -> IngestReport | None:
        """Store a parsed frame's items: skip those already stored (idempotent ingest), group
        the rest by (model, signature), assign lanes (ShapeLanes.assign_many, in arrival
        order), append each lane's items to storage. Call `flush()` after the turn's frames,
        then release their ring records.

        `max_groups`: append at most this many lane groups now (a frame of 200 new shapes
        costs 200 segment files, some 50 ms, which the loop would spend without serving
        anyone). Returns None while groups are left: call `store_more` (flush and dispatch
        between calls, ingest nothing else) until it returns the report. The frame's items
        become dispatchable only once all of it is stored, so no item of a record that is
        not released yet is ever dispatched (`_store`). NOTE: making each slice's groups
        dispatchable at once, as a full disk does, was rejected: after a crash the record
        is read again and an item completed (and deleted) meanwhile would be stored and run
        a second time; the earlier frames' items keep the consumers busy meanwhile.

        DiskFullError: the disk is full; the frame's lanes were assigned and the lane groups
        not yet stored wait here. Keep the record, stop reading rings, serve consumers, and
        call `retry_pending_appends()` each turn (see the module docstring).

        Example: a frame of 5 items, shapes A A B A B, lengths 500 510 90 1000 95: shape A
        assigns [500, 510, 1000] (say lanes 0, 0, 1) and appends [500, 510] to (A, 0) and
        [1000] to (A, 1); shape B appends [90, 95] to (B, 0). Ingested again after a broker
        restart, all 5 are duplicates (the storage tier finds every one stored).
        """
        assert self._waiting is None, "retry_pending_appends() must succeed before more ingest"
        assert self._c.items_recovered == self._storage.counters.recovered_items, "recover() first"
        items = frame.items
        check_frame_limits(frame, self._max_models)  # before anything is assigned or stored
        if frame.chain_section.size:  # the producer's new shapes' lineage, before their items
            chains = [(model, chain) for model, chain in
                      decode_chains(frame.chain_section, f"producer {frame.producer_id}'s frame")
                      if model < self._max_models]
            for model, chain in chains:
                self._declare(model, chain)
                self.first_refs.declare(model, chain)
            # Durable at this turn's flush, before the items are acknowledged: a restart
            # declares them again for the shapes it recovers (`recover`).
            self._storage.record_chains(chains)
        stored = self._storage.already_stored(ProducerId(frame.producer_id), items["seq"])
        rows = np.flatnonzero(~stored)
        duplicates = len(items) - rows.size
        self._c.duplicate_items += duplicates
        groups: list[tuple[AppendGroup, int]] = []
        shapes = self._route(items, rows)
        if max_groups is not None and sum(shape not in self._shapes for shape, _ in shapes) < max_groups:
            # Slices are for frames of many new shapes (a segment file each, the cost that
            # held dispatch back); a frame of known shapes is stored whole. NOTE: slicing
            # every frame cut the zero-cost demo's mean batch fill from 20% to 7% and made
            # its makespan 1.5x (`pipeline launch`: dispatch ran between slices, before a
            # frame's items could fill a batch).
            max_groups = None
        for shape, shape_rows in shapes:
            groups += self._assign_shape(shape, frame, shape_rows, now_s)
            self._schedule(shape)
        tokens = sum(group_tokens for _group, group_tokens in groups)
        report = IngestReport(items=int(rows.size), tokens=tokens, duplicates=duplicates)
        return self._store(StoringFrame(frame, groups, shapes, report), max_groups)

    def _store(self, pending: StoringFrame, max_groups: int | None = None) -> IngestReport | None:
        """Append the frame's groups not stored yet; once all are, its items become
        dispatchable (the selector learns of them). A full disk holds the rest back: the
        groups already stored become dispatchable at once (`_announce`), the others wait.
        NOTE: holding the whole frame back until every group was stored (so that no item of
        an unreleased record is ever dispatched) was rejected: it deadlocked a small disk: everything stored belonged to the held frame, nothing was dispatched, so
        nothing completed and freed space (tests/runtime/test_disk_full.py: 0 routed). The
        price: a crash while a frame is held may store again, and so run again, items of it
        that were completed and deleted meanwhile: duplicates, bounded by one frame."""
        c = self._c
        end = len(pending.groups) if max_groups is None else min(len(pending.groups), pending.stored + max_groups)
        while pending.stored < end:
            group, tokens = pending.groups[pending.stored]
            try:
                self._storage.append(group)
            except DiskFullError:
                self._waiting = pending
                self._announce(pending, pending.stored)
                self._held = pending.unannounced_by_lane()
                raise
            pending.stored += 1
            c.items_received += len(group)
            c.tokens_received += tokens
        if pending.stored < len(pending.groups):  # a slice: the rest at the next store_more
            self._waiting = pending
            self._held = pending.unannounced_by_lane()
            return None
        self._waiting, self._held = None, {}
        if pending.announced:
            self._announce(pending, len(pending.groups))
            return pending.report
        submit_ns = pending.frame.items["submit_ns"]
        for shape, rows in pending.shapes:  # the common case: one call per shape, not per group
            lengths = pending.frame.items["length"][rows]
            self._selector.on_queued(shape, int(lengths.sum()), submit_ns[rows])
        return pending.report

    def _announce(self, pending: StoringFrame, upto: int) -> None:
        """Tell the selector of the frame's stored groups it does not know of yet, one by one."""
        submit_ns = pending.frame.items["submit_ns"]
        for group, tokens in pending.groups[pending.announced:upto]:
            self._selector.on_queued(group.lane.shape, tokens, submit_ns[group.rows])
        pending.announced = max(pending.announced, upto)

    @property
    def pending_appends(self) -> int:
        """Items of a frame that a full disk kept out of storage (0 normally)."""
        waiting = self._waiting
        return 0 if waiting is None else sum(len(g) for g, _t in waiting.groups[waiting.stored:])

    def retry_pending_appends(self) -> IngestReport | None:
        """Append what a full disk held back (DiskFullError again if it still is). Returns
        the held frame's report once every item of it is stored (flush, then release its
        record), or None when nothing was waiting."""
        if self._waiting is None:
            return None
        return self._store(self._waiting)

    @property
    def storing(self) -> bool:
        """A frame is part stored (in slices, or held by a full disk): no ingest until done."""
        return self._waiting is not None

    def store_more(self, max_groups: int | None = None) -> IngestReport | None:
        """Append up to `max_groups` more lane groups of the frame `ingest` stored in part;
        its report once all of it is stored (flush, then release its record), else None.
        DiskFullError as in `ingest`."""
        assert self._waiting is not None, "nothing is being stored"
        return self._store(self._waiting, max_groups)

    def flush(self) -> None:
        """Once per loop turn, after ingesting and BEFORE releasing the turn's ring records:
        the storage tier makes its appends durable (`power`: fdatasync) and dispatchable.
        DurabilityError is fatal: stop the broker."""
        self._storage.flush()

    def recover(self, now_s: float) -> int:
        """Once, before anything else, on a reopened disk tier: declare the recovered shapes'
        chains (the store log's), then rebuild every lane the tier found live
        entries for, under its old lane id (segment files are named by it), with its items
        in dispatch order, and tell the selector. Returns the items recovered.
        Items recovered are counted apart from items received (`items_recovered`)."""
        assert not self._shapes and not self._c.items_received, "recover() comes first"
        for model, chain in self._storage.take_recovered_chains():  # before the lanes: placed once
            if model < self._max_models:
                self._pool.declare(model, chain)
                self.first_refs.declare(model, chain)
        found_lanes = sorted(self._storage.take_recovered_lanes(), key=lambda r: tuple(r.lane))
        pooled, own = recovered_shapes(found_lanes)  # to the pool before any lane is rebuilt
        shapes_found = sorted(pooled.keys() | own)
        for shape in shapes_found:
            self._pool.adopt(shape, pooled.get(shape, 0), shape in own)
        self._seen.add_many(np.array([s.model for s in shapes_found], dtype=np.uint64),
                            np.array([s.signature for s in shapes_found], dtype=np.uint64))
        recovered = 0
        for found in found_lanes:
            check_recovered_lane(found, self._lane_config.max_lanes)
            shape = found.lane.shape
            lanes = self._lanes_of(shape)
            lanes.restore_lane(found.lane.lane, int(found.lengths.max()), found.lengths, now_s)
            self._schedule(shape)
            tokens = int(found.lengths.sum())
            self._selector.on_queued(shape, tokens, found.submit_ns)
            recovered += int(found.lengths.size)
            self._c.tokens_recovered += tokens
        self._c.items_recovered += recovered
        assert self._c.items_recovered == self._storage.counters.recovered_items, "recovered twice"
        return recovered

    def _declare(self, model: int, chain) -> None:
        """A shape's chain: the pool keeps it while the shape lives; the selector's trie
        learns it when the shape gets lanes of its own (`_lanes_of`)."""
        self._pool.declare(model, chain)
        shape = ShapeKey(model, int(chain[-1]))
        if shape in self._shapes:
            self._selector.declare(model, chain)

    def _route(self, items: np.ndarray, rows: np.ndarray) -> list[tuple[ShapeKey, np.ndarray]]:
        """The frame's new rows per shape they go to (`grouping.group_by_shape`), in (model,
        signature) order, where the rows of every shape the solitary pool takes (pool.py)
        go to their model's pool as one more shape, a shape's rows together (so its items
        of one length lane ride one batch)."""
        routed: list[tuple[ShapeKey, np.ndarray]] = []
        pooled: dict[int, list[np.ndarray]] = {}
        shapes = group_by_shape(items, rows)
        to_pool = self._pool.route_many([(shape, int(shape_rows.size)) for shape, shape_rows in shapes])
        firsts = np.array([shape_rows[0] for _shape, shape_rows in shapes], dtype=np.intp)
        self._seen.add_many(items["model"][firsts], items["signature"][firsts])
        for (shape, shape_rows), pooling in zip(shapes, to_pool):
            self.first_refs.learn(shape, int(items["prefix_len"][shape_rows[0]]))
            if pooling:
                pooled.setdefault(shape.model, []).append(shape_rows)
            else:
                routed.append((shape, shape_rows))
        for model, parts in pooled.items():
            routed.append((pool_shape(model), np.concatenate(parts) if len(parts) > 1 else parts[0]))
        return routed

    def _lanes_of(self, shape: ShapeKey) -> ShapeLanes:
        """The shape's lanes, made on its first item of its own (a shape's chain goes to the
        selector's trie then: a pooled shape has no place in its order)."""
        lanes = self._shapes.get(shape)
        if lanes is None:
            lanes = self._shapes[shape] = ShapeLanes(self._lane_config)
            if not is_pool(shape):
                chain = self._pool.chain_of(shape)
                if len(chain) > 1:
                    self._selector.declare(shape.model, chain)
        return lanes

    def _assign_shape(
        self, shape: ShapeKey, frame: Frame, rows: np.ndarray, now_s: float
    ) -> list[tuple[AppendGroup, int]]:
        """Assign lanes to one shape's rows; return each lane's group (arrival order within
        it) and its tokens, in lane order."""
        return lane_groups(self._lanes_of(shape), shape, frame, rows, now_s)

    # ----------------------------------------------------------------- dispatch

    def next_batch(self, consumer: ConsumerId, contract: Contract, now_s: float,
                   full_only: bool = False) -> Batch | None:
        """The next batch for `consumer`, or None when its model has nothing dispatchable:
        the selected shape (sticky, SPEC §4) -> its lane with the most queued tokens -> peek
        the front -> pack to the contract (SPEC §3) -> the signature guard on the chunk.
        Nothing is committed: call `commit` once the consumer's channel took the batch, or
        `abandon` if it did not. `full_only`: None, without peeking and without switching
        shapes, unless that lane's batch is worth sending (`BatchPacing.worth_sending`: full
        enough of a whole batch, the contract's items or its tokens at the lane's longest
        item, or its lane idle long enough that nothing is coming to fill it).

        Example: model 0's current shape A has lanes 0 (target 512, 40 items queued, 20,000
        tokens) and 1 (target 1000, 5 items, 5,000 tokens); a contract of 64 items / 16,384
        tokens gets the first 32 items of lane 0 (its longest queued item is 510, padded to
        512, and 16,384 // 512 = 32).
        """
        assert isinstance(contract, Contract), contract
        assert self._outstanding is None, f"batch {self._outstanding} neither committed nor abandoned"
        assert not self._storage.needs_flush, "flush() after ingesting, before serving"
        assert self._c.items_recovered == self._storage.counters.recovered_items, "recover() first"
        chosen = self._selector.choose(contract.model, now_s, consumer=consumer,
                                       batch_tokens=contract.max_batch_tokens)
        if chosen is None:
            return None
        shape, switch = chosen
        lanes = self._shapes[shape]
        lane = lanes.fullest_lane()  # lanes in descending queued-token order: the first fits
        if self._held:
            lane = first_unheld_lane(shape, lanes, self._held)
        assert lane is not None, shape
        longest = lanes.queued_max(lane)
        assert longest is not None, (shape, lane)
        key = LaneKey(shape.model, shape.signature, lane)
        available = lanes.queued_items(lane) - self._held.get(key, 0)
        fits = batch_items_limit(longest, contract)
        if full_only and not self.pacing.worth_sending(available, fits, now_s - lanes.last_seen_s(lane)):
            return None
        if switch is not None:
            self._selector.switch(shape, switch, consumer=consumer)
        limit = min(fits, available)
        front = self._storage.peek_many(key, limit)
        assert len(front) == limit, (key, len(front), limit)
        packing = pack(front.lengths.tolist(), longest, contract)
        entries = front[: packing.count]
        what = f"batch for consumer {consumer}"
        self._selector.guard(entries.lane.shape, what, consumer=consumer)
        self._pool.guard(entries.lane.shape, entries.signatures, what, consumer)  # each chunk's own shape
        assert entries.lane == key, (entries.lane, key)  # right shape, wrong lane: a storage bug
        batch = Batch(BatchId(self._next_batch_id), consumer, key, packing.pad_to_tokens, entries,
                      None if switch is None else switch.value)
        self._next_batch_id += 1
        self._outstanding = batch
        return batch

    def commit(self, batch: Batch) -> None:
        """The consumer's channel took the batch: storage commits it (SPEC §5's three steps;
        StaleBatchError leaves everything as it was), then the lane and the selector learn
        that its items left the queue."""
        assert self._outstanding is batch, (self._outstanding, batch)
        self._outstanding = None
        lengths = batch.entries.lengths.tolist()
        self._storage.commit(batch.lane, batch.entries, batch.consumer, batch.batch_id)
        tokens = sum(lengths)
        self._shapes[batch.lane.shape].on_dispatched(batch.lane.lane, lengths)
        self._schedule(batch.lane.shape, batch.lane.lane)
        self._selector.on_dispatched(batch.lane.shape, tokens, batch.entries.submit_ns)
        c = self._c
        c.items_routed += len(lengths)
        c.tokens_routed += tokens
        c.batches += 1

    def abandon(self, batch: Batch) -> None:
        """The consumer's channel did not take the batch: forget it (a peek changed nothing)."""
        assert self._outstanding is batch, (self._outstanding, batch)
        self._outstanding = None

    def complete_batch(self, consumer: ConsumerId, batch: Batch) -> Completion:
        """The consumer finished every entry of a committed batch (its results are durable on
        its side): a consumer completes whole batches. NotHeldError, with nothing applied,
        when it does not hold that batch: disconnect it (SPEC §8)."""
        done = self._storage.complete_batch(consumer, batch.batch_id)
        for lane_key, lane_refs in done.by_lane.items():
            self._shapes[lane_key.shape].on_completed(lane_key.lane, len(lane_refs))
            self._schedule(lane_key.shape, lane_key.lane)
        if is_pool(batch.lane.shape):
            signatures, counts = np.unique(batch.entries.signatures, return_counts=True)
            for signature, count in zip(signatures.tolist(), counts.tolist()):
                self._pool.done(ShapeKey(batch.model, signature), count)
        c = self._c
        c.items_completed += done.items
        c.tokens_completed += done.tokens
        return done

    def consumer_lost(self, consumer: ConsumerId) -> int:
        """The consumer disconnected or missed heartbeats: every entry it holds goes back to
        the front of its lane, ahead of new work, in its original order. Returns how many."""
        if self._outstanding is not None and self._outstanding.consumer == consumer:
            self._outstanding = None  # never committed: nothing to give back
        self._selector.consumer_lost(consumer)
        returned = 0
        for run in self._storage.return_consumer(consumer):
            lengths = run.lengths
            self._shapes[run.lane.shape].on_returned(run.lane.lane, lengths)
            self._schedule(run.lane.shape, run.lane.lane)
            tokens = sum(lengths)
            self._selector.on_returned(run.lane.shape, tokens, run.entries.submit_ns)
            returned += len(lengths)
            self._c.items_returned += len(lengths)
            self._c.tokens_returned += tokens
        return returned

    def tick(self, now_s: float, max_shapes: int | None = None) -> bool:
        """Lane maintenance (SPEC §2) for every shape whose lanes are due (`_schedule`), at
        most `max_shapes` of them (the earliest due first); released lanes are dropped from
        storage, and a shape with no lane left is retired (its counters are kept). Ticking a
        shape that is not due would change nothing. Returns whether due shapes were left
        for another call (thousands of shapes go idle together once a backlog is in)."""
        due = self._ticks.pop_due(now_s, max_shapes)
        for shape in due:  # each once: one rescheduled for now waits for the next tick
            lanes = self._shapes.get(shape)
            if lanes is None:
                continue
            for lane in lanes.tick(now_s).released:
                self._storage.drop_lane(LaneKey(shape.model, shape.signature, lane))
            if not lanes.lane_count:
                add_lane_counters(self._retired, lanes.counters)
                del self._shapes[shape]
                self._selector.forget(shape)
                if not is_pool(shape):
                    self._pool.own_retired(shape)
            else:
                self._schedule(shape)
        return self._ticks.any_due(now_s)

    def _schedule(self, shape: ShapeKey, lane: LaneId | None = None) -> None:
        """After an event changed the shape's lanes (`lane`: only that one): make sure the
        shape is ticked no later than its lanes' next_tick_s. An earlier entry stays (its
        tick is harmless and schedules the shape again)."""
        self._ticks.offer(shape, self._shapes[shape].next_tick_s(lane))

    # ----------------------------------------------------------------- counters, invariants

    def _check_pool(self) -> None:
        """Every shape with lanes of its own is live in the pool with them, and the pool's
        items per model are its lanes' items, queued or pending."""
        pool = self._pool
        pool.check_invariants()
        pooled: dict[int, int] = {}
        for shape in self._shapes:
            if is_pool(shape):
                queued, _tokens, pending = self._shapes[shape].totals()
                pooled[shape.model] = queued + pending
            else:
                assert pool.owns_lanes(shape), f"{shape} has lanes the pool does not know of"
        assert pool.pooled_by_model() == {m: n for m, n in pooled.items() if n}, (pool.pooled_by_model(), pooled)
        assert pool.own_shapes() == {s for s in self._shapes if not is_pool(s)}

    def counters(self) -> DispatchCounters:
        snapshot = self._c.scalars()
        snapshot.lanes_in_use = sum(shape_lanes.lane_count for shape_lanes in self._shapes.values())
        snapshot.lanes = total_lane_counters(self._retired, self._shapes.values())
        snapshot.shapes = self.live_shapes()  # every live shape: own lanes or pooled items
        snapshot.shapes_seen = self._seen.count
        snapshot.switches = {r.value: n for r, n in self._selector.counters.switches.items()}
        return snapshot

    def live_shapes(self, models: Collection[int] | None = None) -> int:
        """Live shapes (of `models`, else all): with items queued or pending, pooled or in
        lanes of their own, or lanes not yet retired (QUIESCE_IDLE_S after their last item)."""
        return self._pool.live_shapes if models is None else self._pool.live_in(models)

    def progress(self) -> dict[str, int]:
        """The four counters of a `progress` reply, in constant time (`counters` is
        O(shapes + lanes))."""
        c = self._c
        return {"items_received": c.items_received, "items_recovered": c.items_recovered,
                "items_completed": c.items_completed, "tokens_completed": c.tokens_completed}

    def shape_summaries(self) -> list[ShapeSummary]:
        """Every shape's queue and lanes (status and metrics), largest queued tokens first."""
        return summarize_shapes(self._shapes)

    def check_invariants(self) -> None:
        """Every part's invariants, and that they agree: per lane, storage's queue length is
        the lane's queued count (less what a full disk kept out of storage); per shape, the
        selector's dispatchable tokens are the lanes' queued tokens (less a held frame's); the
        accounting identities hold. O(lanes + stored entries)."""
        storage = self._storage
        storage.check_invariants()
        self._selector.check_invariants()
        self.first_refs.check_invariants()
        self._seen.check_invariants()
        self._check_pool()
        waiting = self._waiting
        unstored = {} if waiting is None else waiting.unstored_by_lane()
        held_tokens = {} if waiting is None else waiting.unannounced_tokens_by_shape()
        assert self._held == ({} if waiting is None else waiting.unannounced_by_lane())
        pending = 0
        for shape, lanes in self._shapes.items():
            lanes.check_invariants()
            tokens = 0
            for view in lanes.lanes():
                key = LaneKey(shape.model, shape.signature, view.lane_id)
                assert storage.queued_items(key) == view.queued_items - unstored.get(key, 0), (key, view)
                tokens += view.queued_tokens
                pending += view.pending_items
            dispatchable = tokens - held_tokens.get(shape, 0)
            assert self._selector.dispatchable_tokens(shape) == dispatchable, (shape, dispatchable)
            due_s = lanes.next_tick_s()  # never ticked later than its lanes need
            scheduled = self._ticks.due_at(shape)
            assert due_s is None or (scheduled is not None and scheduled <= due_s), (shape, due_s, scheduled)
        self._ticks.check_invariants()
        assert pending == storage.pending_items(), (pending, storage.pending_items())
        c, s = self._c, storage.counters
        received = c.items_received + c.items_recovered
        assert received == c.items_completed + storage.queued_items() + pending, c
        assert c.items_recovered == s.recovered_items and c.tokens_recovered == s.recovered_tokens, c
        assert c.items_routed - c.items_returned == pending + c.items_completed, c
        assert c.items_completed == s.completed_items and c.tokens_completed == s.completed_tokens
        assert self._next_batch_id >= c.batches, c
