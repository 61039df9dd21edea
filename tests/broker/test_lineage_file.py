"""The lineage file (pipeline/broker/storage/chains.py): chains declared by producers survive
a reopen of the disk tier and drive the prefix order of the recovered backlog, with no
producer declaring them again; a torn last record is ignored, a damaged one before it is
named by path and offset, a damaged header loses the file (rewritten); the file is compacted
to the live shapes; its record limit, at and past."""

from __future__ import annotations

import os

import pytest

from pipeline.broker.dispatch import Dispatcher
from pipeline.broker.ids import ConsumerId, ShapeKey
from pipeline.broker.lineage import MAX_TRIE_NODES
from pipeline.broker.packing import Contract
from pipeline.broker.storage import DiskTier, Durability
from pipeline.broker.storage import chains as chains_module
from pipeline.broker.storage.chains import MAX_LINEAGE_RECORDS, lineage_path, read_lineage
from pipeline.wire.layouts.frames import MAX_CHAIN_DEPTH
from pipeline.wire.layouts.lineage import LINEAGE_RECORD_SIZE_BYTES
from tests.broker.broker_frames import make_frame

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


def test_without_the_file_the_recovered_shapes_are_chains_of_one(tmp_path):
    ingest_all(str(tmp_path))
    os.unlink(lineage_path(str(tmp_path)))
    served, tier, _ = served_after_reopen(str(tmp_path))
    tier.close()
    assert served == [SYSTEM, OTHER, FEWSHOT, DEEP]  # most tokens first: the order is lost


def test_a_chain_declared_again_writes_nothing_and_each_node_is_one_record(tmp_path):
    ingest_all(str(tmp_path))
    path = lineage_path(str(tmp_path))
    assert read_lineage(path).used == 4  # SYSTEM, FEWSHOT, DEEP, OTHER: one record each
    tier = DiskTier.open(str(tmp_path))  # compacted to the nodes of chains deeper than one
    try:
        assert read_lineage(path).used == 3
        for model, chain in CHAINS:  # a producer that reconnects declares its shapes again
            tier.record_chains([(model, chain)])
        tier.flush()
        assert read_lineage(path).used == 4  # OTHER's own node only: a chain of one, dropped at compaction
    finally:
        tier.close()


def test_compaction_keeps_only_the_chains_of_live_shapes(tmp_path):
    ingest_all(str(tmp_path))
    path = lineage_path(str(tmp_path))
    tier = DiskTier.open(str(tmp_path))
    try:
        tier.record_chains([(0, (0x70, 0x71))])  # a shape declared whose items never came
        tier.flush()
        assert (0, 0x71) in read_lineage(path).nodes
    finally:
        tier.close()
    DiskTier.open(str(tmp_path)).close()
    assert set(read_lineage(path).nodes) == {(0, SYSTEM), (0, FEWSHOT), (0, DEEP)}


def corrupt(path: str, slot: int, byte: int = 20) -> int:
    """Flip one byte of record `slot` (0: the first after the header); its byte offset."""
    offset = (slot + 1) * LINEAGE_RECORD_SIZE_BYTES
    with open(path, "r+b") as file:
        file.seek(offset + byte)
        value = file.read(1)[0]
        file.seek(offset + byte)
        file.write(bytes([value ^ 0xFF]))
    return offset


def test_a_torn_last_record_is_ignored(tmp_path):
    ingest_all(str(tmp_path))
    path = lineage_path(str(tmp_path))
    last = read_lineage(path).used - 1
    corrupt(path, last)
    reading = read_lineage(path)
    assert "torn append" in reading.torn_last and not reading.damaged
    tier = DiskTier.open(str(tmp_path))
    try:
        assert tier.recovery.ok and not tier.recovery.lineage_problems
        assert any("torn append" in note for note in tier.recovery.lineage_notes)
    finally:
        tier.close()


def test_a_partial_last_record_is_ignored(tmp_path):
    ingest_all(str(tmp_path))
    path = lineage_path(str(tmp_path))
    used = read_lineage(path).used
    with open(path, "r+b") as file:
        file.truncate((used + 1) * LINEAGE_RECORD_SIZE_BYTES + 24)
        file.seek((used + 1) * LINEAGE_RECORD_SIZE_BYTES)
        file.write(b"\x01" * 24)
    reading = read_lineage(path)
    assert "partial last record" in reading.torn_last and len(reading.nodes) == 4


def test_a_damaged_record_before_the_last_is_named_and_loses_the_chains_through_it(tmp_path):
    ingest_all(str(tmp_path))
    path = lineage_path(str(tmp_path))
    offset = corrupt(path, 1)  # records go in chain order: SYSTEM, FEWSHOT, DEEP, OTHER
    assert read_lineage(path).damaged
    tier = DiskTier.open(str(tmp_path))
    try:
        problems = tier.recovery.lineage_problems
        assert len(problems) == 1 and f"{path}: offset {offset}" in problems[0]
        assert not tier.recovery.ok and tier.recovery.damage_counts()["lineage_problems"] == 1
        assert "LINEAGE:" in tier.recovery.summary()
        # FEWSHOT's level is gone: DEEP's walk up stops there, so both are chains of one
        assert tier.take_recovered_chains() == []
    finally:
        tier.close()
    assert not read_lineage(path).damaged  # the compacted file holds no damage


def test_a_damaged_header_loses_the_file_and_it_is_rewritten(tmp_path):
    ingest_all(str(tmp_path))
    path = lineage_path(str(tmp_path))
    with open(path, "r+b") as file:
        file.write(b"XX")
    tier = DiskTier.open(str(tmp_path))
    try:
        assert any("offset 0: not a lineage header" in p for p in tier.recovery.lineage_problems)
        assert tier.take_recovered_chains() == []
    finally:
        tier.close()
    reading = read_lineage(path)
    assert not reading.header_problem and reading.used == 0


@pytest.mark.parametrize("extra", [0, 1])
def test_the_record_limit_at_and_past(tmp_path, monkeypatch, extra):
    """A chain whose new levels reach the limit is kept; one whose levels would pass it is
    not recorded at all (counted), and after a restart that shape is a chain of one while
    the others keep theirs."""
    monkeypatch.setattr(chains_module, "MAX_LINEAGE_RECORDS", 4)
    chains = CHAINS[:3] + [(0, (0x61, OTHER))] if extra else CHAINS  # 4 records, or 5
    ingest_all(str(tmp_path), chains=chains)
    assert read_lineage(lineage_path(str(tmp_path))).used == (3 if extra else 4)
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
    assert set(read_lineage(lineage_path(str(tmp_path))).nodes) >= {(0, 0x62)}
    assert (0, 0x63) not in read_lineage(lineage_path(str(tmp_path))).nodes
    assert MAX_LINEAGE_RECORDS == MAX_TRIE_NODES  # one record per node the trie can hold


def test_a_chain_at_the_deepest_level_comes_back_whole(tmp_path):
    deep = tuple(range(1000, 1000 + MAX_CHAIN_DEPTH))
    tier = DiskTier.open(str(tmp_path), Durability.POWER)
    try:
        tier.record_chains([(0, deep)])
        tier.flush()
    finally:
        tier.close()
    reading = read_lineage(lineage_path(str(tmp_path)))
    assert reading.chain(ShapeKey(0, deep[-1])) == deep


def test_a_disk_too_full_to_rewrite_the_file_keeps_the_old_one_or_runs_without(tmp_path, monkeypatch):
    ingest_all(str(tmp_path))

    def full(*_args):
        raise chains_module.DiskFullError("disk full (test)")

    monkeypatch.setattr(chains_module, "_allocate", full)  # growing the file
    monkeypatch.setattr(chains_module, "write_replacement", full)  # rewriting it whole
    tier = DiskTier.open(str(tmp_path))  # the old file is used as it is: its chains come back
    try:
        assert tier.recovery.lineage_chains == 2 and any("kept as it is" in n for n in tier.recovery.lineage_notes)
    finally:
        tier.close()
    os.unlink(lineage_path(str(tmp_path)))
    tier = DiskTier.open(str(tmp_path))  # no file and no room for one: the broker still starts
    try:
        tier.record_chains([(0, (0x70, 0x71))])
        tier.flush()
        assert tier.chains_unrecorded == 1 and not os.path.exists(lineage_path(str(tmp_path)))
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
    reading = read_lineage(lineage_path(str(tmp_path)))
    assert reading.used == 4
    assert set(reading.nodes) == {(0, 0x10), (0, 0x11), (0, 0x12), (0, 0x13)}
    assert reading.chain(ShapeKey(0, 0x13)) == (0x10, 0x13)
