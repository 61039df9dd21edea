"""Random damage on a real multi-segment store: nothing lost, nothing hidden.

Seeded: each trial writes a store through the disk tier (three lanes over two models, small
segments that rotate), restarts it once (so every segment is sealed with its count in the
store log), then flips bytes, zeroes ranges, truncates and deletes files at random offsets,
restarts it again and drains everything it delivers, each item checked against its tokens.
Against what was written, per segment:

- every entry whose bytes are intact is delivered;
- every entry that is not delivered is counted: in a damaged range, a truncation loss or a
  torn tail of that segment, in the missing segment's count, or in the quarantined file's;
- nothing is delivered that was not written, nothing twice;
- when anything was not delivered, neither the recovery report nor `verify` says OK.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
from tests.support.frames import make_frame, token_ids

from pipeline.broker.ids import BatchId, ConsumerId, LaneId, LaneKey
from pipeline.storage import AppendGroup, DiskTier
from pipeline.storage.inspect import verify
from pipeline.storage.paths import iter_segments
from pipeline.storage.segment import scan_segment
from pipeline.wire.layouts.segments import SEGMENT_HEADER_SIZE_BYTES, entry_size_bytes

LANES = [LaneKey(0, 0x71, LaneId(0)), LaneKey(0, 0x71, LaneId(1)), LaneKey(1, 0x72, LaneId(0))]
SEGMENT_BYTES = 12 << 10
TRIALS = 40


def build(data_dir: str, rng: np.random.Generator) -> dict[int, tuple[str, int, int]]:
    """Write the store; return {item id: (segment path, offset, end)} of every entry."""
    tier = DiskTier.open(data_dir, segment_max_bytes=SEGMENT_BYTES)
    seq = 0
    for _ in range(int(rng.integers(25, 45))):
        lane = LANES[int(rng.integers(len(LANES)))]
        lengths = rng.integers(1, 200, int(rng.integers(1, 6))).tolist()
        frame = make_frame(3, seq, [(lane.model, lane.signature)] * len(lengths), lengths,
                           payloads=[bytes([n % 251]) * (n % 7) for n in range(seq, seq + len(lengths))])
        tier.append(AppendGroup(lane, frame, np.arange(len(lengths))))
        tier.flush()
        seq += len(lengths)
    tier.close()
    DiskTier.open(data_dir, segment_max_bytes=SEGMENT_BYTES).close()  # a restart seals them all
    written = {}
    for seg in iter_segments(data_dir):
        scan = scan_segment(seg.path)
        for offset, header in zip(scan.offsets.tolist(), scan.headers):
            end = offset + entry_size_bytes(int(header["length"]), int(header["payload_len"]))
            written[int(header["item_id"])] = (seg.path, offset, end)
    assert len(written) == seq
    return written


def damage(paths: list[str], rng: np.random.Generator) -> list[str]:
    """One to four random acts of damage; what was done, for the failure message."""
    done = []
    for _ in range(int(rng.integers(1, 5))):
        alive = [p for p in paths if os.path.exists(p)]
        if not alive:
            break
        path = alive[int(rng.integers(len(alive)))]
        size = os.path.getsize(path)
        kind = rng.choice(["flip", "flip", "flip", "flip-anywhere", "zero", "truncate", "delete"])
        if kind == "delete":
            os.unlink(path)
        elif kind == "truncate":
            size = int(rng.integers(0, size))
            os.truncate(path, size)
        else:
            lowest = 0 if kind == "flip-anywhere" else min(SEGMENT_HEADER_SIZE_BYTES, size - 1)
            at = int(rng.integers(lowest, size))
            count = int(rng.integers(1, 200)) if kind == "zero" else 1
            with open(path, "r+b") as file:
                file.seek(at)
                old = file.read(count)
                file.seek(at)
                file.write(bytes(len(old)) if kind == "zero" else bytes([old[0] ^ (1 << int(rng.integers(8)))]))
            size = at
        done.append(f"{kind} {os.path.basename(path)} at {size}")
    return done


def intact(path: str, offset: int, end: int, originals: dict[str, bytes]) -> bool:
    if not os.path.exists(path):
        return False
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(end - offset) == originals[path][offset:end]


def drain(tier: DiskTier) -> list[int]:
    delivered, batch = [], 0
    for lane in tier.lane_keys():
        while front := tier.peek_many(lane, 32):
            for entry in front:
                assert np.array_equal(tier.read_tokens(entry.ref), token_ids(entry.item_id, entry.length))
                delivered.append(entry.item_id)
            tier.commit(lane, front, ConsumerId(1), BatchId(batch))
            tier.complete_batch(ConsumerId(1), BatchId(batch))
            batch += 1
    return delivered


@pytest.mark.parametrize("seed", range(TRIALS))
def test_random_damage_loses_nothing_silently(tmp_path, seed):
    rng = np.random.default_rng(seed)
    data_dir = str(tmp_path / "data")
    written = build(data_dir, rng)
    paths = sorted({path for path, _, _ in written.values()})
    originals = {path: open(path, "rb").read() for path in paths}
    acts = damage(paths, rng)
    before = verify(data_dir)
    tier = DiskTier.open(data_dir, segment_max_bytes=SEGMENT_BYTES)
    report = tier.recovery
    delivered = drain(tier)
    tier.close()
    why = f"seed {seed}: {acts}\n{report.summary()}"
    assert not [item for item, n in Counter(delivered).items() if n > 1], why
    assert set(delivered) <= set(written), why
    missing = {m.path: m for m in report.missing}
    quarantined = {q.path: q for q in report.quarantined if q.identity_refused}
    for path in paths:
        mine = {item for item, (p, _, _) in written.items() if p == path}
        lost = mine - set(delivered)
        if path in missing:
            assert missing[path].entry_count == len(mine) and not mine & set(delivered), why
            continue
        if path in quarantined:
            assert quarantined[path].entries >= len(mine) and not mine & set(delivered), why
            continue
        unharmed = {item for item in mine if intact(*written[item], originals)}
        assert unharmed <= set(delivered), f"{why}\nintact, not delivered: {sorted(unharmed - set(delivered))}"
        counted = (sum(r.entries for r in report.damaged if r.path == path)
                   + sum(r.entries for r in report.lost if r.path == path)
                   + sum(t.entries for t in report.torn_tails if t.path == path))
        assert len(lost) <= counted, f"{why}\n{path}: {len(lost)} not delivered, {counted} counted"
    if set(written) - set(delivered):
        assert not report.ok and not before.ok, why
        assert not verify(data_dir).ok, why
    again = DiskTier.open(data_dir, segment_max_bytes=SEGMENT_BYTES)
    assert again.recovery.live_entries == 0 and not again.recovery.missing, why  # once, not again
    again.close()
