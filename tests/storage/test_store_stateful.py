"""The whole store (Dispatcher over a DiskTier on real files) against a simple model, under
random sequences of submit, dispatch, complete, consumer loss, broker crash and restart,
torn tails and segment damage (hypothesis's rule-based state machine), checked after every
step.

The model: every acknowledged item (ingested and flushed) is queued, held by one consumer's
batch, or completed. A crash abandons the Dispatcher and DiskTier without closing them (what
a kill -9 leaves: whatever reached the files; nothing in the objects' memory) and reopens
the data directory. Then every queued or held item must be queued again (held ones come
back: their consumer's batch was never completed), a completed item may come back (its
tombstone had not reached the file: a redelivery, at-least-once) but is never lost, and an
item the test damaged (a flipped byte in its token ids) is either dropped by recovery
(counted in the RecoveryReport's damage) or never dispatched with the wrong tokens. A torn
tail (bytes appended past a segment's last entry, as a write cut by a crash leaves) changes
nothing. Dispatched entries carry exactly the tokens their producer sent.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from tests.support.frames import make_frame, token_ids
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pipeline.broker.dispatch import Batch, Dispatcher
from pipeline.broker.ids import ConsumerId
from pipeline.broker.packing import Contract
from pipeline.storage import DiskTier, Durability
from pipeline.storage.paths import iter_segments
from pipeline.storage.segment import scan_segment
from pipeline.storage.storelog import read_store_log
from pipeline.wire.layouts.frames import TOKEN_SIZE_BYTES
from pipeline.wire.layouts.segments import ENTRY_HEADER_SIZE_BYTES, ENTRY_LIVE

SHAPES = [(0, 0x71), (0, 0x72), (1, 0x73)]
CONTRACTS = {1: Contract(0, 8, 4096, 1024), 2: Contract(1, 8, 4096, 1024), 3: Contract(0, 4, 4096, 1024)}
# Small segments, so they seal, rotate and are deleted within a run of a few dozen steps.
SEGMENT_BYTES = 8 << 10


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="store-stateful-")
        self.durability = Durability.PROCESS
        self.next_seq = 0
        self.now_s = 0.0
        self.lengths: dict[int, int] = {}  # acknowledged item -> length
        self.queued: set[int] = set()
        self.held: dict[int, list[tuple[Batch, list[int]]]] = {c: [] for c in CONTRACTS}
        self.completed: set[int] = set()
        self.may_return: set[int] = set()  # completed, tombstone maybe not on file at a crash
        self.damaged: set[int] = set()
        self.consumer_ids = {c: c for c in CONTRACTS}
        self._open()

    def _open(self) -> None:
        self.tier = DiskTier.open(self.root, self.durability, segment_max_bytes=SEGMENT_BYTES)
        self.dispatcher = Dispatcher(self.tier)
        self.recovered = self.dispatcher.recover(self.now_s)

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(sizes=st.lists(st.integers(1, 180), min_size=1, max_size=6), shape=st.integers(0, len(SHAPES) - 1))
    def submit(self, sizes: list[int], shape: int) -> None:
        frame = make_frame(1, self.next_seq, [SHAPES[shape]] * len(sizes), sizes, submit_ns=self.next_seq)
        self.dispatcher.ingest(frame, self.now_s)
        self.dispatcher.flush()  # acknowledged from here on
        for item_id, length in zip(frame.items["item_id"].tolist(), sizes):
            self.lengths[item_id] = length
            self.queued.add(item_id)
        self.next_seq += len(sizes)

    @rule(slot=st.sampled_from(sorted(CONTRACTS)))
    def dispatch(self, slot: int) -> None:
        self.now_s += 0.01
        batch = self.dispatcher.next_batch(ConsumerId(self.consumer_ids[slot]), CONTRACTS[slot], self.now_s)
        if batch is None:
            return
        ids = []
        for entry in batch.entries:
            item = entry.item_id
            assert item in self.queued, f"item {item} dispatched but not queued (held or completed: lost track)"
            tokens = self.tier.read_tokens(entry.ref)
            if not np.array_equal(tokens, token_ids(item, self.lengths[item])):
                assert item in self.damaged, f"item {item} dispatched with other tokens than it was sent with"
                raise AssertionError(f"damaged item {item} dispatched: recovery kept an entry that fails its checksum")
            ids.append(item)
        self.dispatcher.commit(batch)
        self.queued -= set(ids)
        self.held[slot].append((batch, ids))

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def complete(self, data) -> None:
        slot = data.draw(st.sampled_from([c for c, held in self.held.items() if held]))
        batch, ids = self.held[slot].pop(0)
        self.dispatcher.complete_batch(ConsumerId(self.consumer_ids[slot]), batch)
        self.completed.update(ids)
        self.may_return.update(ids)

    @rule(slot=st.sampled_from(sorted(CONTRACTS)))
    def lose_consumer(self, slot: int) -> None:
        self.dispatcher.consumer_lost(ConsumerId(self.consumer_ids[slot]))
        for _, ids in self.held[slot]:
            self.queued.update(ids)
        self.held[slot] = []
        self.consumer_ids[slot] += 10  # it comes back under a new id

    @rule()
    def tick(self) -> None:
        self.now_s += 10.0
        self.dispatcher.tick(self.now_s)

    @rule(tail=st.binary(min_size=1, max_size=300), which=st.integers(0, 50))
    def crash_with_torn_tail(self, tail: bytes, which: int) -> None:
        segments = sorted(s.path for s in iter_segments(self.root))
        if segments:
            with open(segments[which % len(segments)], "r+b") as file:
                end = scan_segment(file.name).data_end
                file.seek(end)
                file.write(tail)  # past the commit boundary: an unacknowledged write cut short
        self._crash()

    @rule(which=st.integers(0, 1000), bit=st.integers(0, 7))
    def crash_with_damage(self, which: int, bit: int) -> None:
        live = []
        log = read_store_log(self.root)  # once for every segment
        for seg in iter_segments(self.root):
            scan = scan_segment(seg.path, records=log.of(seg.keys))
            live += [(seg.path, int(off), int(h["item_id"]), int(h["length"]))
                     for off, h in zip(scan.offsets.tolist(), scan.headers) if h["state"] == ENTRY_LIVE]
        if live:
            path, offset, item, length = live[which % len(live)]
            at = offset + ENTRY_HEADER_SIZE_BYTES + (which % length) * TOKEN_SIZE_BYTES
            with open(path, "r+b") as file:
                file.seek(at)
                byte = file.read(1)[0]
                file.seek(at)
                file.write(bytes([byte ^ (1 << bit)]))
            self.damaged.add(item)
        self._crash()

    @rule()
    def crash(self) -> None:
        self._crash()

    def _crash(self) -> None:
        """Abandon the broker's objects as a kill -9 does and reopen the directory."""
        back = set(self.queued) | {i for held in self.held.values() for _, ids in held for i in ids}
        self.tier.abandon()  # descriptors closed, nothing synced or written: a kill -9
        self._open()
        found = self._live_items()
        lost = back - found - self.damaged
        assert not lost, f"acknowledged items lost by a crash: {sorted(lost)[:10]}"
        returned = found - back
        assert returned <= self.may_return, f"items back that were never acknowledged: {sorted(returned - self.may_return)[:10]}"
        dropped = (back & self.damaged) - found
        if dropped:
            report = self.tier.recovery
            assert report.damaged or report.quarantined or report.lost, (
                f"damaged items {sorted(dropped)} dropped without a word in the recovery report")
        self.queued = found
        self.completed -= returned
        self.held = {c: [] for c in CONTRACTS}
        self.consumer_ids = {c: i + 100 for c, i in self.consumer_ids.items()}
        self.may_return = set()

    def _live_items(self) -> set[int]:
        log = read_store_log(self.root)  # once for every segment
        return {int(h["item_id"]) for seg in iter_segments(self.root)
                for h in scan_segment(seg.path, records=log.of(seg.keys)).headers if h["state"] == ENTRY_LIVE}

    @invariant()
    def counts_agree(self) -> None:
        self.dispatcher.check_invariants()
        held = sum(len(ids) for held in self.held.values() for _, ids in held)
        assert self.tier.queued_items() == len(self.queued), (self.tier.queued_items(), len(self.queued))
        assert self.tier.pending_items() == held


class PowerStoreMachine(StoreMachine):
    """The same at durability `power` (fdatasync at each flush; the crashes are still of the
    process: power loss is the fault layer's campaign)."""

    def __init__(self) -> None:
        super().__init__()
        self.tier.close()
        self.durability = Durability.POWER
        self._open()


_FAST = settings(max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_SLOW = settings(_FAST, max_examples=2000, stateful_step_count=80)
StoreMachine.TestCase.settings = _FAST
PowerStoreMachine.TestCase.settings = settings(_FAST, max_examples=15)  # an fdatasync per flush
test_store_against_a_model = StoreMachine.TestCase
test_store_at_power_durability_against_a_model = PowerStoreMachine.TestCase


@pytest.mark.campaign
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_store_against_a_model_long():
    """2,000 sequences of 80 steps (--run-slow; about 10 minutes on 2 cores)."""
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(StoreMachine, settings=_SLOW)


def test_the_machine_cleans_up_its_directories():
    machine = StoreMachine()
    root = machine.root
    machine.teardown()
    assert not os.path.exists(root)
