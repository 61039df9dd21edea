"""`pipeline tools` over a real store: dump-segment, dump-tombstones, verify (and its exit code),
on real byte flips, truncations, deletions, strays and quarantined files, before and after a
real recovery; and unreadable stores as one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.storage import DiskTier
from pipeline.storage.diskio import Durability
from pipeline.storage.inspect import verify
from pipeline.storage.paths import make_dirs, segment_path
from pipeline.storage.segment import SegmentFile, SegmentKeys, encode_entries, scan_segment
from pipeline.storage.segments import SegmentStore
from pipeline.storage.storelog import StoreLog, log_key
from pipeline.cli import main
from pipeline.wire.errors import StoreReadError
from pipeline.wire.layouts.storelog import LOG_LINEAGE, STORE_LOG_FILE
from tests.support.repo import ROOT
from tests.support.segments import data_dir_of, make_items, shared_log
from tests.support.users import python_for


def build_store(data_dir: str) -> list[str]:
    """Two shapes, three segments; a few entries tombstoned in one of them. Then a store
    recovery, as a broker start would, writes the store log (and seals them)."""
    paths = []
    for n, (signature, lane, seq) in enumerate([(0xAAA, 0, 0), (0xAAA, 1, 0), (0xBBB, 0, 4)]):
        path = segment_path(data_dir, 0, signature, lane, seq)
        make_dirs(os.path.dirname(path))
        frame = make_items(20, seed=n)
        frame[0]["item_id"] += 100 * n  # distinct item ids across segments
        segment = SegmentFile.create(path, SegmentKeys(0, signature, lane, seq), Durability.PROCESS,
                                     shared_log(data_dir_of(path)))
        segment.append(encode_entries(*frame, indices=np.arange(20), producer_id=1))
        if n == 1:
            segment.tombstone_many(scan_segment(path).offsets[:5].tolist())
        segment.close()
        paths.append(path)
    store = SegmentStore(data_dir)
    store.recover()
    store.close()
    return paths


def run_verify(data_dir: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["tools", "verify", data_dir, "--json"])
    return result.exit_code, json.loads(result.output)


def flip(path: str, offset: int, mask: int = 0xFF) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ mask]))


def recover(data_dir: str):
    tier = DiskTier.open(data_dir)
    report = tier.recovery
    tier.close()
    return report


def test_verify_passes_on_a_clean_store(tmp_path):
    build_store(str(tmp_path))
    code, report = run_verify(str(tmp_path))
    assert code == 0, report
    assert report["ok"] and report["segments"] == 3 and report["entries"] == 60
    assert report["tombstones"] == 5 and report["live"] == 55 and report["quarantined_files"] == 0


def test_verify_fails_on_damage_and_names_path_offset_and_item(tmp_path):
    paths = build_store(str(tmp_path))
    whole = scan_segment(paths[2])
    victim, victim_id = int(whole.offsets[10]), int(whole.headers["item_id"][10])
    flip(paths[2], victim + 70)
    (tmp_path / "segments" / "m00000" / "stray.txt").write_text("x")
    result = CliRunner().invoke(main, ["tools", "verify", str(tmp_path)])
    assert result.exit_code == 1
    assert f"{paths[2]}: bytes {victim}..{int(whole.offsets[11])}: 1 entry damaged" in result.output
    assert f"item {victim_id} (unverified)" in result.output
    assert "stray.txt: stray: a file" in result.output and result.output.strip().endswith("problems")


def test_verify_fails_after_recovery_for_every_kind_of_loss(tmp_path):
    """After recovery `verify` once said OK because it did not look in quarantine/.
    Each loss stays visible until an operator removes the evidence."""
    cases = {}
    for case in ("flip-last", "truncate", "delete", "identity", "stray-model"):
        data_dir = str(tmp_path / case)
        paths = build_store(data_dir)
        whole = scan_segment(paths[0])
        if case == "flip-last":
            flip(paths[0], int(whole.offsets[-1]) + 80)
        elif case == "truncate":
            os.truncate(paths[0], int(whole.offsets[12]) + 8)
        elif case == "delete":
            os.unlink(paths[0])
        elif case == "identity":
            flip(paths[0], 16, 0x01)  # the model id in the header: not the file name's
        else:
            shutil.copytree(os.path.dirname(os.path.dirname(paths[0])),
                            os.path.join(data_dir, "segments", "m123456"))
        before = run_verify(data_dir)
        report = recover(data_dir)
        after = run_verify(data_dir)
        cases[case] = (before, report, after)
        assert before[0] == 1 and after[0] == 1, (case, before, after)
    assert cases["flip-last"][1].damage_counts()["entries_damaged"] == 1  # corruption, not torn
    assert not cases["flip-last"][1].torn_tails
    assert cases["truncate"][1].damage_counts()["entries_missing"] == 8  # 20 written, 12 whole
    assert cases["delete"][1].damage_counts()["segments_missing"] == 1
    assert cases["delete"][1].missing[0].entry_count == 20  # recovery sealed it: its count is known
    assert any("MISSING" in p and "20 entries" in p for p in cases["delete"][2][1]["problems"])
    # The header's model field disagrees with the file name, but the store log recorded a
    # segment of the name's keys: salvaged under them (its 20 entries delivered), named.
    assert cases["identity"][1].damage_counts()["entries_quarantined"] == 0
    assert cases["identity"][1].live_entries == 55 and cases["identity"][1].damaged_identities  # as a clean store
    assert any("identity" in p for p in cases["identity"][2][1]["problems"])
    assert cases["stray-model"][1].damage_counts()["strays"] == 1
    assert any("m123456" in p for p in cases["stray-model"][2][1]["problems"])


def test_torn_tail_is_a_note_not_a_failure(tmp_path):
    paths = build_store(str(tmp_path))
    whole = scan_segment(paths[0])
    with open(paths[0], "r+b") as file:  # garbage of a write past the commit boundary
        file.seek(whole.data_end)
        file.write(b"\x4c\x49\x56\x45partial write, never acknowledged")
    code, report = run_verify(str(tmp_path))
    assert code == 0 and report["counts"]["torn_tails"] == 1
    assert any("torn tail of an unacknowledged write" in note for note in report["notes"])


def test_verify_reports_counts_that_disagree(tmp_path):
    paths = build_store(str(tmp_path))
    log = StoreLog.open(str(tmp_path), durable=False)
    log.completed(log_key(scan_segment(paths[0]).keys), np.array([4096 + 16]))  # no entry starts there
    log.close()
    code, report = run_verify(str(tmp_path))
    assert code == 1 and any("deleted" in p for p in report["problems"])


def test_verify_fails_without_a_store_log(tmp_path):
    build_store(str(tmp_path))
    os.unlink(tmp_path / STORE_LOG_FILE)
    code, report = run_verify(str(tmp_path))
    assert code == 1 and any("no store log" in p for p in report["problems"])
    assert recover(str(tmp_path)).damage_counts()["catalog_problems"] == 1  # reported, rebuilt
    assert run_verify(str(tmp_path))[0] == 0


def test_verify_of_a_directory_that_is_not_a_data_directory_is_refused(tmp_path):
    # A typo'd path must not pass as an empty, healthy store.
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(StoreReadError, match="not a data directory"):
        verify(str(tmp_path))
    build_store(str(tmp_path / "data"))
    assert run_verify(str(tmp_path / "data"))[0] == 0


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


def test_dump_segment_shows_damaged_ranges(tmp_path):
    paths = build_store(str(tmp_path))
    whole = scan_segment(paths[0])
    flip(paths[0], int(whole.offsets[7]) + 90)
    dump = json.loads(CliRunner().invoke(main, ["tools", "dump-segment", paths[0], "--json"]).output)
    (damaged,) = dump["scanned"]["damaged"]
    assert damaged["offset"] == int(whole.offsets[7]) and damaged["item_ids"] == [int(whole.headers["item_id"][7])]
    assert len(dump["entries"]) == 19
    text = CliRunner().invoke(main, ["tools", "dump-segment", paths[0]]).output
    assert f"DAMAGE: DAMAGED: {paths[0]}: bytes {int(whole.offsets[7])}" in text


def test_dump_segment_of_a_non_segment_is_a_clear_error(tmp_path):
    bogus = tmp_path / "bogus.seg"
    bogus.write_bytes(b"\0" * 5000)
    result = CliRunner().invoke(main, ["tools", "dump-segment", str(bogus)])
    assert result.exit_code != 0 and "magic" in result.output


@pytest.mark.integration
def test_an_unreadable_store_is_a_one_line_error(tmp_path):
    build_store(str(tmp_path))
    shutil.rmtree(tmp_path / "segments")
    (tmp_path / "segments").write_text("not a directory")
    with pytest.raises(StoreReadError, match="segments: cannot read the store"):
        verify(str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "pipeline", "tools", "verify", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "cannot read the store" in done.stderr


@pytest.mark.integration
@pytest.mark.parametrize("locked", ["segments", "segment file", "store log"])
def test_what_another_user_cannot_read_is_a_one_line_error(locked):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run verify as another user")
    python = python_for(65534, 65534, "pipeline.cli", cwd=str(ROOT))
    top = tempfile.mkdtemp(prefix="verify-other-user-", dir="/tmp")  # a path user nobody can reach
    try:
        data_dir = os.path.join(top, "data")
        paths = build_store(data_dir)
        for root, dirs, _files in os.walk(top):
            for name in [".", *dirs]:
                os.chmod(os.path.join(root, name), 0o755)
        log = os.path.join(data_dir, STORE_LOG_FILE)
        for path in [*paths, log]:
            os.chmod(path, 0o644)
        # Owned by root, owner-only: user nobody can neither list the one nor read the others.
        os.chmod({"segments": os.path.join(data_dir, "segments"), "segment file": paths[1],
                  "store log": log}[locked], 0o700)
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python,
                               "-m", "pipeline", "tools", "verify", data_dir],
                              capture_output=True, text=True, cwd=str(ROOT),
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    finally:
        shutil.rmtree(top)
    if "No module named" in done.stderr or "can't open file" in done.stderr:
        pytest.skip(f"user nobody cannot run this checkout's python: {done.stderr.strip()}")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Permission denied" in done.stderr, done.stderr
    expected = {"segments": "segments: cannot read the store", "segment file": f"{paths[1]}: cannot read the segment",
                "store log": f"{log}: cannot read the store log"}[locked]
    assert expected in done.stderr, done.stderr


def test_live_items_are_the_stored_entries_not_yet_completed(tmp_path):
    from pipeline.storage.inspect import live_items

    paths = build_store(str(tmp_path))
    # Segment n holds items 1000 + 100 n .. + 19; the first 5 of segment 1 are tombstoned.
    models = {scan_segment(path).keys.model for path in paths}
    assert live_items(paths[1:2])[0] == {1100 + k for k in range(5, 20)}
    assert live_items(paths) == ({1000 + 100 * n + k for n in range(3) for k in range(20)} - {1100 + k for k in range(5)},
                                 models)
    assert live_items([str(tmp_path / "gone.seg")]) == (set(), set())  # completed and deleted since


@pytest.mark.parametrize("size", [1, 7, 29])
def test_live_payload_tails_are_the_live_payloads_ends_gathered_as_columns(tmp_path, size):
    from pipeline.storage.inspect import live_payload_tails, live_payloads

    paths = build_store(str(tmp_path))  # payloads of 0 to 29 bytes: some shorter than `size`, some exactly it
    expected = [(item, payload[-size:]) for item, payload in live_payloads(paths) if len(payload) >= size]
    got = [(int(item), bytes(row)) for ids, tails in live_payload_tails(paths + [str(tmp_path / "gone.seg")], size)
           for item, row in zip(ids.tolist(), tails)]
    assert got == expected and expected
    assert all(tails.shape[1] == size for _ids, tails in live_payload_tails(paths, size))


def test_verify_names_a_damaged_chain_record(tmp_path):
    build_store(str(tmp_path))
    tier = DiskTier.open(str(tmp_path))
    for chain in ((1, 2), (1, 3)):  # two sync groups: the first one's records are synced
        tier.record_chains([(0, chain)])
        tier.flush()
    tier.close()
    code, report = run_verify(str(tmp_path))
    assert code == 0, report
    path = os.path.join(str(tmp_path), STORE_LOG_FILE)
    data = open(path, "rb").read()
    kinds = np.frombuffer(data[:len(data) // 64 * 64], dtype="<u8").reshape(-1, 8)[:, 0] >> np.uint64(48)
    first = int(np.flatnonzero(kinds == np.uint64(LOG_LINEAGE))[0]) * 64
    flip(path, first + 40)
    result = CliRunner().invoke(main, ["tools", "verify", str(tmp_path)])
    assert result.exit_code == 1
    assert f"STORE LOG: {path}: offset {first}: store log record fails its checks" in result.output
