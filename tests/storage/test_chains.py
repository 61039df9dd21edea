"""The shapes' chains in the store log (pipeline/storage/chains.py): chains declared by
producers survive a reopen of the disk tier and drive the prefix order of the recovered
backlog, with no producer declaring them again; a damaged record is named and loses the
chains through it; recovery compacts them to the live shapes; their limit, at and past."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.broker.dispatch import Dispatcher
from pipeline.broker.ids import ConsumerId, ShapeKey
from pipeline.broker.lineage import MAX_TRIE_NODES
from pipeline.broker.packing import Contract
from pipeline.storage import DiskTier, Durability
from pipeline.storage import chains as chains_module
from pipeline.storage.chains import MAX_LINEAGE_RECORDS, LineageReading, lineage_bodies, read_lineage
from pipeline.storage.storelog import StoreLog, log_path, read_store_log
from pipeline.wire.layouts.frames import MAX_CHAIN_DEPTH
from pipeline.wire.layouts.storelog import LOG_LINEAGE, LOG_RECORD_SIZE_BYTES
from tests.support.frames import make_frame

CONTRACT = Contract(model=0, max_batch_items=8, max_batch_tokens=1 << 20, max_input_len=1 << 16)
# Shape chains: SYSTEM (level 1) <- FEWSHOT <- DEEP; OTHER a stranger with more tokens than
# FEWSHOT and DEEP, fewer than SYSTEM.
SYSTEM, FEWSHOT, DEEP, OTHER = 0x51, 0x52, 0x53, 0x99
CHAINS = [(0, (SYSTEM,)), (0, (SYSTEM, FEWSHOT)), (0, (SYSTEM, FEWSHOT, DEEP)), (0, (OTHER,))]
ITEMS = {SYSTEM: (8, 1000), FEWSHOT: (8, 100), DEEP: (8, 90), OTHER: (8, 600)}  # items, tokens each


def ingest_all(data_dir: str, chains=CHAINS, durability: Durability = Durability.PROCESS) -> None:
    shapes, lengths = [], []
    for signature, (count, tokens) in ITEMS.items():
        shapes += [(0, signature)] * count
        lengths += [tokens] * count
    tier = DiskTier.open(data_dir, durability)
    try:
        dispatcher = Dispatcher(tier, shape_order="prefix")
        dispatcher.recover(0.0)
        dispatcher.ingest(make_frame(1, 0, shapes, lengths, chains=chains), 0.0)
        dispatcher.flush()
        dispatcher.check_invariants()
    finally:
        tier.close()


def served_after_reopen(data_dir: str) -> tuple[list[int], DiskTier, Dispatcher]:
    tier = DiskTier.open(data_dir)
    dispatcher = Dispatcher(tier, shape_order="prefix")
    dispatcher.recover(0.0)
    served: list[int] = []
    while (batch := dispatcher.next_batch(ConsumerId(0), CONTRACT, 0.0)) is not None:
        dispatcher.commit(batch)
        if not served or served[-1] != batch.lane.signature:
            served.append(batch.lane.signature)
    dispatcher.check_invariants()
    return served, tier, dispatcher


def test_the_recovered_backlog_is_served_in_prefix_order_without_any_declaration(tmp_path):
    ingest_all(str(tmp_path))
    served, tier, _ = served_after_reopen(str(tmp_path))
    try:
        assert served == [SYSTEM, FEWSHOT, DEEP, OTHER]
        assert tier.recovery.lineage_chains == 2 and tier.recovery.ok  # FEWSHOT's and DEEP's
        assert "2 shapes' chains restored" in tier.recovery.summary()
    finally:
        tier.close()


def lineage_of(data_dir: str) -> LineageReading:
    return read_lineage(read_store_log(data_dir))


def records_of(data_dir: str) -> int:
    return int(read_store_log(data_dir).lineage.shape[0])


def test_without_the_chains_the_recovered_shapes_are_chains_of_one(tmp_path):
    ingest_all(str(tmp_path))
    reading = read_store_log(str(tmp_path))  # rewritten with every record but the chains'
    StoreLog.write_fresh(str(tmp_path), reading, None, False, np.zeros((0, 4), dtype=np.uint64)).close()
    served, tier, _ = served_after_reopen(str(tmp_path))
    tier.close()
    assert served == [SYSTEM, OTHER, FEWSHOT, DEEP]  # most tokens first: the order is lost


def test_a_chain_declared_again_writes_nothing_and_each_node_is_one_record(tmp_path):
    ingest_all(str(tmp_path))
    assert records_of(str(tmp_path)) == 4  # SYSTEM, FEWSHOT, DEEP, OTHER: one record each
    tier = DiskTier.open(str(tmp_path))  # compacted to the nodes of chains deeper than one
    try:
        assert records_of(str(tmp_path)) == 3
        for model, chain in CHAINS:  # a producer that reconnects declares its shapes again
            tier.record_chains([(model, chain)])
        tier.flush()
        assert records_of(str(tmp_path)) == 4  # OTHER's own node only: a chain of one, dropped at compaction
    finally:
        tier.close()


def test_compaction_keeps_only_the_chains_of_live_shapes(tmp_path):
    ingest_all(str(tmp_path))
    tier = DiskTier.open(str(tmp_path))
    try:
        tier.record_chains([(0, (0x70, 0x71))])  # a shape declared whose items never came
        tier.flush()
        assert (0, 0x71) in lineage_of(str(tmp_path)).nodes
    finally:
        tier.close()
    DiskTier.open(str(tmp_path)).close()
    assert set(lineage_of(str(tmp_path)).nodes) == {(0, SYSTEM), (0, FEWSHOT), (0, DEEP)}


def lineage_offsets(data_dir: str) -> list[int]:
    """The byte offsets of the log's LINEAGE records, in file order."""
    data = open(log_path(data_dir), "rb").read()
    words = np.frombuffer(data[:len(data) // 64 * 64], dtype="<u8").reshape(-1, 8)
    return (np.flatnonzero((words[:, 0] >> np.uint64(48)) == np.uint64(LOG_LINEAGE)) * 64).tolist()


def test_a_damaged_record_is_named_and_loses_the_chains_through_it(tmp_path):
    ingest_all(str(tmp_path))
    DiskTier.open(str(tmp_path)).close()  # compacted: SYSTEM, FEWSHOT, DEEP, synced whole
    offset = lineage_offsets(str(tmp_path))[1]  # parents first: FEWSHOT's
    with open(log_path(str(tmp_path)), "r+b") as file:
        file.seek(offset + 40)
        value = file.read(1)[0]
        file.seek(offset + 40)
        file.write(bytes([value ^ 0xFF]))
    tier = DiskTier.open(str(tmp_path))
    try:
        problems = tier.recovery.catalog_problems
        assert any(f"offset {offset}" in line for line in problems), problems
        assert not tier.recovery.ok and "STORE LOG:" in tier.recovery.summary()
        # FEWSHOT's level is gone: DEEP's walk up stops there, so both are chains of one
        assert tier.take_recovered_chains() == []
    finally:
        tier.close()
    assert not read_store_log(str(tmp_path)).damaged  # the compacted log holds no damage


def test_a_record_of_a_depth_no_chain_has_is_named(tmp_path):
    ingest_all(str(tmp_path))
    tier = DiskTier.open(str(tmp_path))
    try:
        bodies = lineage_bodies([((0, 0x77), 0, MAX_CHAIN_DEPTH + 1), ((0, 0x78), 0, MAX_CHAIN_DEPTH)])
        tier._store.log.lineage(bodies)  # checksummed: what a bug or a forger writes
        tier.flush()
    finally:
        tier.close()
    reading = lineage_of(str(tmp_path))
    assert (0, 0x78) in reading.nodes and (0, 0x77) not in reading.nodes
    assert reading.damaged and f"depth no chain has (first: {MAX_CHAIN_DEPTH + 1}" in reading.damaged[0]
    tier = DiskTier.open(str(tmp_path))
    try:
        assert any("depth no chain has" in line for line in tier.recovery.catalog_problems)
        assert tier.recovery.lineage_chains == 2  # FEWSHOT's and DEEP's, whole
    finally:
        tier.close()


@pytest.mark.parametrize("extra", [0, 1])
def test_the_record_limit_at_and_past(tmp_path, monkeypatch, extra):
    """A chain whose new levels reach the limit is kept; one whose levels would pass it is
    not recorded at all (counted), and after a restart that shape is a chain of one while
    the others keep theirs."""
    monkeypatch.setattr(chains_module, "MAX_LINEAGE_RECORDS", 4)
    chains = CHAINS[:3] + [(0, (0x61, OTHER))] if extra else CHAINS  # 4 records, or 5
    ingest_all(str(tmp_path), chains=chains)
    assert records_of(str(tmp_path)) == (3 if extra else 4)
    tier = DiskTier.open(str(tmp_path))
    try:
        dispatcher = Dispatcher(tier, shape_order="prefix")
        dispatcher.recover(0.0)
        assert dispatcher.selector.lineage_overflows == 0
        trie = dispatcher.selector._trie
        assert trie.depth(ShapeKey(0, DEEP)) == 3 and trie.depth(ShapeKey(0, OTHER)) == 1
        tier.record_chains([(0, (0x62,))])  # compacted to 3 records: the fourth is at the limit
        assert tier.chains_unrecorded == 0
        tier.record_chains([(0, (0x63,))])  # past it
        tier.record_chains([(0, (0x62,))])  # known already: nothing to record, nothing counted
        assert tier.chains_unrecorded == 1
        tier.flush()
    finally:
        tier.close()
    assert set(lineage_of(str(tmp_path)).nodes) >= {(0, 0x62)}
    assert (0, 0x63) not in lineage_of(str(tmp_path)).nodes
    assert MAX_LINEAGE_RECORDS == MAX_TRIE_NODES  # one record per node the trie can hold


def test_a_chain_at_the_deepest_level_comes_back_whole(tmp_path):
    deep = tuple(range(1000, 1000 + MAX_CHAIN_DEPTH))
    tier = DiskTier.open(str(tmp_path), Durability.POWER)
    try:
        tier.record_chains([(0, deep)])
        tier.flush()
    finally:
        tier.close()
    assert lineage_of(str(tmp_path)).chain(ShapeKey(0, deep[-1])) == deep


def test_a_disk_too_full_to_append_counts_the_chains_unrecorded(tmp_path, monkeypatch):
    ingest_all(str(tmp_path))
    tier = DiskTier.open(str(tmp_path))
    try:
        def full(self, bodies):
            raise chains_module.DiskFullError(f"{self.path}: disk full (injected)")

        monkeypatch.setattr(StoreLog, "lineage", full)
        tier.record_chains([(0, (0x70, 0x71)), (0, (0x70, 0x72))])
        assert tier.chains_unrecorded == 2
        monkeypatch.undo()
        tier.record_chains([(0, (0x70, 0x71))])  # not known: recorded once space is back
        tier.flush()
        assert tier.chains_unrecorded == 2 and (0, 0x71) in lineage_of(str(tmp_path)).nodes
    finally:
        tier.close()


def test_a_frames_chains_in_one_call_share_their_nodes_and_the_limit(tmp_path, monkeypatch):
    """Chains recorded together write a node they share once; the one that would pass the
    limit is counted, and those before and after it that fit are kept."""
    monkeypatch.setattr(chains_module, "MAX_LINEAGE_RECORDS", 5)
    tier = DiskTier.open(str(tmp_path), Durability.POWER)
    try:
        tier.record_chains([(0, (0x10, 0x11)), (0, (0x10, 0x12)), (0, (0x20, 0x21, 0x22)), (0, (0x10, 0x13))])
        tier.flush()
        assert tier.chains_unrecorded == 1  # (0x20, 0x21, 0x22): 3 new records after 3, past 5
    finally:
        tier.close()
    assert records_of(str(tmp_path)) == 4
    reading = lineage_of(str(tmp_path))
    assert set(reading.nodes) == {(0, 0x10), (0, 0x11), (0, 0x12), (0, 0x13)}
    assert reading.chain(ShapeKey(0, 0x13)) == (0x10, 0x13)


def test_a_compaction_while_running_keeps_every_chain(tmp_path, monkeypatch):
    """The log is compacted as segments come and go; the chains recorded before it (of
    shapes whose items are all done by then) are in the file after it, and a reopen after a
    crash gives back those of the shapes still live."""
    monkeypatch.setattr("pipeline.storage.storelog.LOG_COMPACT_MIN_BYTES", 16 << 10)
    tier = DiskTier.open(str(tmp_path), Durability.POWER)
    dispatcher = Dispatcher(tier, shape_order="prefix")
    dispatcher.recover(0.0)
    dispatcher.ingest(make_frame(1, 0, [(0, DEEP)] * 8, [90] * 8, chains=CHAINS), 0.0)
    dispatcher.flush()
    compactions = tier._store.log.compactions
    for turn in range(1, 40):  # another shape's items stored and done, turn after turn
        dispatcher.ingest(make_frame(1, turn * 8, [(0, 0x200 + turn)] * 8, [50] * 8), 0.0)
        dispatcher.flush()
        while (batch := dispatcher.next_batch(ConsumerId(0), CONTRACT, 0.0)) is not None:
            if batch.lane.signature == DEEP:  # kept live: its chain must come back
                dispatcher.abandon(batch)
                break
            dispatcher.commit(batch)
            dispatcher.complete_batch(ConsumerId(0), batch)
        dispatcher.flush()
        tier._store.seal_aged(float(10**6))  # sealed: done segments are deleted, the log churns
    assert tier._store.log.compactions > compactions
    assert {(0, SYSTEM), (0, FEWSHOT), (0, DEEP), (0, OTHER)} <= set(lineage_of(str(tmp_path)).nodes)
    tier.abandon()
    tier = DiskTier.open(str(tmp_path), Durability.POWER)
    try:
        assert tier.take_recovered_chains() == [(0, (SYSTEM, FEWSHOT, DEEP))]
    finally:
        tier.close()
