"""Freeing what every job read of a node's results (`batchjob/reclaim.py`): the rule against
a reference on seeded random readers and at its edges (a reader without positions holds all,
a file a reader does not name is read from its start, whole units only: at one and one short
of it; a job not yet made starts at the ends and holds nothing), then real holes in real
files: the blocks go, the size and the unread rows stay, and a collector that lost its
positions reads on past a hole instead of reading zeros; a stopped node's files go once read
whole and quiet, never the live node's."""

from __future__ import annotations

import json
import os
import random

from pipeline.batchjob.collect import COLLECTED_NAME, _read_rows, read_positions
from pipeline.batchjob.manifest import JOB_DIR, MANIFEST_NAME
from pipeline.batchjob.reclaim import (
    HOLE_ALIGN_BYTES,
    RESULTS_QUIET_S,
    read_by_all,
    reclaim_results,
    reclaimable,
    removable,
)
from pipeline.runtime.madefiles import RESULTS_DIR

UNIT = HOLE_ALIGN_BYTES


def reference(sizes: dict[str, int], readers: list[dict[str, int] | None]) -> dict[str, int]:
    if any(r is None for r in readers):
        return {}
    out = {}
    for name, size in sizes.items():
        read = size
        for positions in readers:
            read = min(read, positions[name] if name in positions else 0)
        units = read // UNIT
        if units:
            out[name] = units * UNIT
    return out


def reference_removable(sizes: dict[str, int], readers: list[dict[str, int] | None], quiet: list[str]) -> list[str]:
    if any(r is None for r in readers):
        return []
    return sorted(n for n in quiet if all(positions.get(n, 0) >= sizes[n] for positions in readers))


def test_the_rule_matches_its_reference_on_random_readers() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        names = [f"f{k}" for k in range(rng.randint(0, 4))]
        sizes = {n: rng.choice([0, UNIT, rng.randint(0, 5 * UNIT)]) for n in names}
        readers: list[dict[str, int] | None] = []
        for _r in range(rng.randint(0, 4)):
            if rng.random() < 0.05:
                readers.append(None)
                continue
            readers.append({n: rng.choice([sizes[n], rng.randint(0, sizes[n])]) for n in names if rng.random() < 0.8})
        quiet = [n for n in names if rng.random() < 0.5]
        assert reclaimable(sizes, readers) == reference(sizes, readers)
        assert removable(sizes, read_by_all(sizes, readers), quiet) == reference_removable(sizes, readers, quiet)


def test_the_rule_at_its_edges() -> None:
    sizes = {"a": 3 * UNIT, "b": 3 * UNIT}
    assert reclaimable(sizes, []) == sizes  # nobody reads: all but the tail unit's rest
    assert reclaimable(sizes, [{"a": UNIT, "b": UNIT - 1}]) == {"a": UNIT}  # a unit, one short of it
    assert reclaimable(sizes, [{"a": 2 * UNIT}]) == {"a": 2 * UNIT}  # b: read from its start
    assert reclaimable(sizes, [{"a": 2 * UNIT, "b": 2 * UNIT}, None]) == {}  # saved none yet: holds all
    assert reclaimable({"a": UNIT + 5}, [{"a": UNIT + 5}]) == {"a": UNIT}  # never past what is read


def _row(k: int) -> bytes:
    return json.dumps({"item_id": k, "pad": "x" * 200}).encode() + b"\n"


def _node_with_results(tmp_path, rows: int) -> tuple[str, str, bytes]:
    node = tmp_path / "node"
    folder = node / RESULTS_DIR / "run-1"
    folder.mkdir(parents=True)
    data = b"".join(_row(k) for k in range(rows))
    (folder / "c0.jsonl").write_bytes(data)
    return str(node), os.path.join(RESULTS_DIR, "run-1", "c0.jsonl"), data


def _job(tmp_path, name: str, positions: dict[str, int] | None, made: bool = True) -> str:
    job = tmp_path / name
    (job / JOB_DIR).mkdir(parents=True)
    if made:
        (job / JOB_DIR / MANIFEST_NAME).write_text("{}")  # its content is not read here
    if positions is not None:
        (job / JOB_DIR / COLLECTED_NAME).write_text(json.dumps(positions))
    return str(job)


def _allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_holes_free_what_every_job_read_and_keep_the_rest(tmp_path) -> None:
    node, relative, data = _node_with_results(tmp_path, 16_000)  # about 3.4 MiB
    path = os.path.join(node, relative)
    ahead = _job(tmp_path, "ahead", {relative: len(data)})
    behind = _job(tmp_path, "behind", {relative: 2 * UNIT + 100})
    assert read_positions(behind) == {relative: 2 * UNIT + 100}
    before = _allocated(path)
    assert reclaim_results(node, [ahead, behind]) == 2 * UNIT
    assert before - _allocated(path) >= 2 * UNIT
    assert os.path.getsize(path) == len(data)
    with open(path, "rb") as f:
        assert f.read(2 * UNIT) == bytes(2 * UNIT)
        assert f.read() == data[2 * UNIT:]  # every byte not yet read by both, as written
    assert reclaim_results(node, [ahead, behind]) == 0  # freed already


def test_a_job_without_positions_or_that_never_read_a_file_holds_it_and_one_not_made_does_not(tmp_path) -> None:
    node, relative, data = _node_with_results(tmp_path, 16_000)
    ahead = _job(tmp_path, "ahead", {relative: len(data)})
    assert reclaim_results(node, [ahead, _job(tmp_path, "new", None)]) == 0
    assert reclaim_results(node, [ahead, _job(tmp_path, "other", {"results/run-0/c0.jsonl": 10})]) == 0
    assert reclaim_results(node, [ahead, _job(tmp_path, "unmade", None, made=False)]) == 3 * UNIT


def test_a_reader_that_lost_its_positions_reads_on_past_the_hole(tmp_path) -> None:
    node, relative, data = _node_with_results(tmp_path, 16_000)
    reclaim_results(node, [_job(tmp_path, "ahead", {relative: len(data)})])
    with open(os.path.join(node, relative), "rb") as f:
        assert _read_rows(f, 0) == (3 * UNIT, data[3 * UNIT:])
        assert _read_rows(f, 3 * UNIT + 7) == (3 * UNIT + 7, data[3 * UNIT + 7:])
        assert _read_rows(f, len(data)) == (len(data), b"")  # at the end: nothing new


def test_a_hole_to_the_end_reads_as_nothing_until_rows_follow(tmp_path) -> None:
    node, relative, _ = _node_with_results(tmp_path, 0)
    path = os.path.join(node, relative)
    with open(path, "wb") as f:
        f.write(b"x" * (UNIT - 1) + b"\n")
    reclaim_results(node, [_job(tmp_path, "ahead", {relative: UNIT})])
    with open(path, "rb") as f:
        assert _read_rows(f, 0) == (0, b"")
    with open(path, "ab") as f:
        f.write(_row(1))
    with open(path, "rb") as f:
        assert _read_rows(f, 0) == (UNIT, _row(1))


def test_a_stopped_node_runs_files_go_once_every_job_read_them_whole_and_none_wrote_them_lately(tmp_path) -> None:
    node = tmp_path / "node"
    old_run, live_run = node / RESULTS_DIR / "run-1", node / RESULTS_DIR / "run-2"
    for folder in (old_run, live_run):
        folder.mkdir(parents=True)
    rows = b"".join(_row(k) for k in range(10))
    for path in (old_run / "c0.jsonl", old_run / "c1.jsonl", live_run / "c0.jsonl"):
        path.write_bytes(rows)
    long_ago = os.stat(old_run / "c0.jsonl").st_mtime - RESULTS_QUIET_S - 1
    for path in (old_run / "c0.jsonl", old_run / "c1.jsonl", live_run / "c0.jsonl"):
        os.utime(path, (long_ago, long_ago))
    names = {p: os.path.join(RESULTS_DIR, p.parent.name, p.name)
             for p in (old_run / "c0.jsonl", old_run / "c1.jsonl", live_run / "c0.jsonl")}
    whole = _job(tmp_path, "whole", {name: len(rows) for name in names.values()})
    short = _job(tmp_path, "short", {**{name: len(rows) for name in names.values()},
                                     names[old_run / "c1.jsonl"]: len(rows) - 1})
    reclaim_results(str(node), [whole, short], None)
    assert sorted(p.name for p in old_run.iterdir()) == ["c0.jsonl", "c1.jsonl"]  # no live folder known: none goes
    unsaved = _job(tmp_path, "unsaved", None)  # made, no positions saved yet
    unnamed = _job(tmp_path, "unnamed", {names[old_run / "c1.jsonl"]: len(rows)})  # reads c0 from its start
    for holder in (unsaved, unnamed):
        reclaim_results(str(node), [whole, short, holder], str(live_run))
        assert (old_run / "c0.jsonl").exists()
    reclaim_results(str(node), [whole, short], str(live_run))
    assert sorted(p.name for p in old_run.iterdir()) == ["c1.jsonl"]  # read whole by both: gone
    assert (live_run / "c0.jsonl").exists()  # the live node's: never removed
    os.utime(old_run / "c1.jsonl")  # written just now
    reclaim_results(str(node), [whole], str(live_run))
    assert (old_run / "c1.jsonl").exists()
    os.utime(old_run / "c1.jsonl", (long_ago, long_ago))
    reclaim_results(str(node), [whole], str(live_run))
    assert not old_run.exists()  # its last file gone, the folder with it


def test_a_stopped_node_runs_file_cut_short_by_a_kill_goes_once_its_whole_lines_are_read(tmp_path) -> None:
    node = tmp_path / "node"
    old_run, live_run = node / RESULTS_DIR / "run-1", node / RESULTS_DIR / "run-2"
    old_run.mkdir(parents=True)
    live_run.mkdir(parents=True)
    rows = b"".join(_row(k) for k in range(10))
    (old_run / "c0.jsonl").write_bytes(rows + _row(10)[:40])  # the consumer killed mid-write
    os.utime(old_run / "c0.jsonl", (0, 0))
    name = os.path.join(RESULTS_DIR, "run-1", "c0.jsonl")
    reclaim_results(str(node), [_job(tmp_path, "short", {name: len(rows) - 1})], str(live_run))
    assert (old_run / "c0.jsonl").exists()  # a whole line not read yet
    reclaim_results(str(node), [_job(tmp_path, "whole", {name: len(rows)})], str(live_run))
    assert not old_run.exists()  # every whole line read: the torn tail is nobody's
