"""`pipeline tools` over a real store: dump-segment, dump-tombstones, verify (and its exit code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from click.testing import CliRunner

from pipeline.broker.storage.paths import make_dirs, segment_path
from pipeline.broker.storage.segment import Durability, SegmentFile, SegmentKeys, encode_entries, scan_segment
from pipeline.cli import main
from tests.broker.test_segment import make_items

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")


def build_store(data_dir: str) -> list[str]:
    """Two shapes, three segments; a few entries tombstoned in one of them."""
    paths = []
    for n, (signature, lane, seq) in enumerate([(0xAAA, 0, 0), (0xAAA, 1, 0), (0xBBB, 0, 4)]):
        path = segment_path(data_dir, 0, signature, lane, seq)
        make_dirs(os.path.dirname(path))
        frame = make_items(20, seed=n)
        frame[0]["item_id"] += 100 * n  # distinct item ids across segments
        segment = SegmentFile.create(path, SegmentKeys(0, signature, lane, seq), Durability.PROCESS)
        segment.append(encode_entries(*frame, indices=np.arange(20), producer_id=1))
        if n == 1:
            for offset in scan_segment(path).offsets[:5]:
                segment.tombstone(int(offset))
        segment.close()
        paths.append(path)
    return paths


def test_verify_passes_on_a_clean_store(tmp_path):
    build_store(str(tmp_path))
    result = CliRunner().invoke(main, ["tools", "verify", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] and report["segments"] == 3 and report["entries"] == 60
    assert report["tombstones"] == 5 and report["live"] == 55


def test_verify_fails_on_damage_and_names_path_and_offset(tmp_path):
    paths = build_store(str(tmp_path))
    victim = scan_segment(paths[2]).offsets[10]
    data = np.fromfile(paths[2], dtype=np.uint8)
    data[int(victim) + 70] ^= 0xFF
    data.tofile(paths[2])
    (tmp_path / "segments" / "m00000" / "stray.txt").write_text("x")
    result = CliRunner().invoke(main, ["tools", "verify", str(tmp_path)])
    assert result.exit_code == 1
    assert f"{paths[2]}: corrupt at offset {int(victim)}" in result.output
    assert "stray.txt: not a segment name" in result.output


def test_verify_reports_counts_that_disagree(tmp_path):
    paths = build_store(str(tmp_path))
    with open(paths[0], "r+b") as file:
        file.seek(88)
        file.write((3).to_bytes(8, "little"))  # deleted count says 3, no entry is tombstoned
    result = CliRunner().invoke(main, ["tools", "verify", str(tmp_path), "--json"])
    assert result.exit_code == 1
    assert any("deleted" in p for p in json.loads(result.output)["problems"])


def test_dump_segment_and_tombstones(tmp_path):
    paths = build_store(str(tmp_path))
    result = CliRunner().invoke(main, ["tools", "dump-segment", paths[1], "--json"])
    assert result.exit_code == 0
    dump = json.loads(result.output)
    assert dump["header"]["lane"] == 1 and dump["scanned"]["tombstones"] == 5
    assert [e["state"] for e in dump["entries"][:6]] == ["tombstone"] * 5 + ["live"]
    text = CliRunner().invoke(main, ["tools", "dump-segment", paths[1]]).output
    assert "signature: 0xaaa" in text and "tombstone" in text
    rows = json.loads(CliRunner().invoke(main, ["tools", "dump-tombstones", str(tmp_path), "--json"]).output)
    assert [(r["live"], r["tombstones"], r["agree"]) for r in rows] == [(20, 0, True), (15, 5, True), (20, 0, True)]


def test_dump_segment_of_a_non_segment_is_a_clear_error(tmp_path):
    bogus = tmp_path / "bogus.seg"
    bogus.write_bytes(b"\0" * 5000)
    result = CliRunner().invoke(main, ["tools", "dump-segment", str(bogus)])
    assert result.exit_code != 0 and "magic" in result.output


def test_thin_script_runs_the_same_command(tmp_path):
    build_store(str(tmp_path))
    done = subprocess.run([sys.executable, os.path.join(TOOLS, "verify.py"), str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("OK")


def test_live_item_ids_are_the_stored_entries_not_yet_completed(tmp_path):
    from pipeline.broker.storage.inspect import live_item_ids

    paths = build_store(str(tmp_path))
    # Segment n holds items 1000 + 100 n .. + 19; the first 5 of segment 1 are tombstoned.
    assert live_item_ids(paths[1:2]) == {1100 + k for k in range(5, 20)}
    assert live_item_ids(paths) == {1000 + 100 * n + k for n in range(3) for k in range(20)} - {1100 + k for k in range(5)}
    assert live_item_ids([str(tmp_path / "gone.seg")]) == set()  # completed and deleted since
