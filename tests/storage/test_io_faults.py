"""I/O-fault and power-cut campaigns over the disk tier, with the
driver and the checks of tests/support/disk_crash.py (a child process runs the broker loop
in miniature and logs what it acknowledged; the parent recovers and checks by item).

- Faults: a counting run says how many file operations (pwrite, write, msync, fsync,
  fdatasync, directory fsync, rename, ftruncate, fallocate, unlink) a run of TURNS turns
  makes; then operation k fails (EIO, ENOSPC, a one-byte short write; once, or from k on),
  for k over the run (every k with --run-slow, an even spread of SAMPLE_KS of them by
  default), at both durability levels. The child must stop with a typed PipelineError
  (or run on, where the error is one it handles), never an untyped one, and recovery must
  find every acknowledged item, nothing unexpected, nothing corrupt.
- Power cuts: at operation k every file of the data directory becomes what a power cut
  leaves (lab.reliability.faults.PowerCut: unsynced sectors dropped, kept or garbled,
  512 or 4096 bytes; name operations not yet made durable undone from a seeded point on).
  At `power` durability no acknowledged item may be lost, whatever happens to the sectors
  being written (dropped, kept, garbled, mixed; 512 or 4096 bytes): segments are written
  once (layout version 2), completions, boundaries and seals are store log records, and every
  synced group starts on a fresh sector, so no write shares a sector with synced bytes. At
  `process` the loss is counted (the campaign's figure), not failed. The store log is also
  the store's catalog, its DELETED records synced before the unlink: at `power` recovery
  names no store log problem and no MISSING segment after any cut.
"""

from __future__ import annotations

import json
import os
import shutil
import traceback

import numpy as np
import pytest

from pipeline.storage import Durability
from lab.reliability.faults import POWER_CUT_EXIT, FaultPlan, FaultyIO, PowerCut
from pipeline.wire import fileops
from pipeline.wire.errors import PipelineError
from pipeline.wire.layouts.storelog import STORE_LOG_FILE
from tests.support.disk_crash import CONTRACT_ITEMS, Driver, Log, check_after_recovery, live_items

pytestmark = pytest.mark.campaign

TURNS = 40
# The every-operation campaigns (--run-slow) run shorter runs, so that every k of both
# durability levels fits in minutes: each k is a fresh copy, a run and a recovery.
# `--io-fault-turns N` sets another length. Every kind of operation occurs from one turn on
# (the catch-up turn ingests every ring: segments are created, rotated and sealed; the turn
# completes, deletes, appends and syncs every store log record kind). Counted on layout
# version 2 (camp script in the i17camp notes): 3 turns make 817 operations at `power` and
# 571 at `process`, 15 turns 1,924 and 1,015.
SLOW_TURNS = 15
# Driver.run(0) is another run (it drains everything, no turn): not a shorter one.
MIN_SLOW_TURNS = 1
# Operations k tried per (kind, durability) in the default suite: spread evenly over the run.
SAMPLE_KS = 4
FAULT_EXIT = 4  # the child stopped on a typed error (the broker would stop or back off)
UNTYPED_EXIT = 5  # an untyped exception escaped: a bug


def _child(data_dir: str, log_path: str, seed: int, durability: Durability, turns: int, layer) -> int:
    pid = os.fork()
    if pid:
        return pid
    status = UNTYPED_EXIT
    try:
        fileops.install(layer)
        try:
            Driver(data_dir, log_path, seed, durability).run(turns)
            status = 0
        except PipelineError:
            status = FAULT_EXIT
        except BaseException:
            with open(log_path + ".err", "a") as file:
                file.write(traceback.format_exc())
        if isinstance(layer, FaultyIO | PowerCut):
            with open(log_path + ".ops", "w") as file:
                json.dump({"ops": layer.ops, "log": layer.log}, file)
    finally:
        os._exit(status)


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _seeded_store(where, durability: Durability, turns: int = TURNS) -> tuple[str, str]:
    """A data directory with history (sealed, deleted and live segments) and its log."""
    os.makedirs(where)
    data_dir, log_path = str(where / "data"), str(where / "log")
    pid = _child(data_dir, log_path, 7, durability, turns, fileops.FileIO())
    assert _wait(pid) == 0, open(log_path + ".err").read() if os.path.exists(log_path + ".err") else ""
    return data_dir, log_path


def _copy(template: tuple[str, str], where) -> tuple[str, str]:
    """A copy of a seeded store and its log, for one k (each fault starts from the same state)."""
    os.makedirs(where)
    data_dir, log_path = str(where / "data"), str(where / "log")
    shutil.copytree(template[0], data_dir)
    shutil.copyfile(template[1], log_path)
    return data_dir, log_path


def _count_ops(template: tuple[str, str], where, durability: Durability, turns: int) -> tuple[int, list[str]]:
    """The run's operations: how many, and each one's name in order."""
    data_dir, log_path = _copy(template, where)
    pid = _child(data_dir, log_path, 8, durability, turns, FaultyIO(FaultPlan(None)))
    assert _wait(pid) == 0
    with open(log_path + ".ops") as file:
        ops = json.load(file)
    return ops["ops"], ops["log"]


def _ks(total: int, every: bool, only: set[int] | None = None, among: list[int] | None = None) -> list[int]:
    """Every k (`every`), or SAMPLE_KS of them spread evenly over the run (over `among`)."""
    if every:
        return [k for k in range(total) if only is None or k in only]
    pool = among or list(range(total))
    return sorted({pool[int(i)] for i in np.linspace(0, len(pool) - 1, SAMPLE_KS)})


@pytest.fixture
def slow_turns(request) -> int:
    """The every-operation campaigns' run length (`--io-fault-turns`, else SLOW_TURNS)."""
    turns = request.config.getoption("--io-fault-turns") or SLOW_TURNS
    if turns < MIN_SLOW_TURNS:
        raise pytest.UsageError(f"--io-fault-turns {turns}: below {MIN_SLOW_TURNS} a run misses operation kinds")
    return turns


@pytest.fixture
def slow_ks(request) -> set[int] | None:
    """`--io-fault-ks A-B,C-D`: the operations k the every-operation campaigns try (a
    window of the run: a rotation's operations, say), else None: every k."""
    spec = request.config.getoption("--io-fault-ks")
    if not spec:
        return None
    try:
        return {k for part in spec.split(",") for k in range(*map(int, part.split("-")))}
    except ValueError as exc:
        raise pytest.UsageError(f"--io-fault-ks {spec!r}: ranges A-B, comma-separated ({exc})") from exc


def fault_campaign(tmp_path, durability: Durability, kind: str, persistent: bool, every: bool,
                   slow_turns: int = SLOW_TURNS, only_ks: set[int] | None = None) -> dict:
    turns = slow_turns if every else TURNS
    template = _seeded_store(tmp_path / "template", durability, turns)
    total, _names = _count_ops(template, tmp_path / "count", durability, turns)
    outcomes = {"ops": total, "tried": 0, "stopped": 0, "ran_on": 0}
    for k in _ks(total, every, only_ks):
        data_dir, log_path = _copy(template, tmp_path / f"k{k}")
        pid = _child(data_dir, log_path, 8, durability, turns, FaultyIO(FaultPlan(k, kind, persistent)))
        code = _wait(pid)
        if os.path.exists(log_path + ".err"):
            pytest.fail(f"{kind} at operation {k} ({durability.value}): an untyped error escaped:\n"
                        + open(log_path + ".err").read())
        assert code in (0, FAULT_EXIT), (k, code)
        outcomes["tried"] += 1
        outcomes["stopped" if code == FAULT_EXIT else "ran_on"] += 1
        check_after_recovery(data_dir, log_path, crashes=2)
        shutil.rmtree(tmp_path / f"k{k}")
    return outcomes


@pytest.mark.parametrize("durability", [Durability.PROCESS, Durability.POWER])
@pytest.mark.parametrize("kind,persistent", [("EIO", False), ("ENOSPC", True), ("short", False)])
def test_a_failed_operation_loses_nothing_acknowledged(tmp_path, durability, kind, persistent):
    outcomes = fault_campaign(tmp_path, durability, kind, persistent, every=False)
    assert outcomes["tried"] == min(SAMPLE_KS, outcomes["ops"]) and outcomes["ops"] > 50


@pytest.mark.slow
@pytest.mark.parametrize("durability", [Durability.PROCESS, Durability.POWER])
@pytest.mark.parametrize("kind,persistent", [("EIO", False), ("EIO", True), ("ENOSPC", True), ("short", False)])
def test_every_failed_operation_loses_nothing_acknowledged(tmp_path, durability, kind, persistent, slow_turns, slow_ks):
    outcomes = fault_campaign(tmp_path, durability, kind, persistent, every=True, slow_turns=slow_turns,
                              only_ks=slow_ks)
    print(f"\nCAMPAIGN faults {durability.value} {kind} persistent={persistent} turns={slow_turns}: {outcomes}")


def power_campaign(tmp_path, durability: Durability, mode: str, sector_bytes: int, every: bool,
                   slow_turns: int = SLOW_TURNS, only_ks: set[int] | None = None) -> dict:
    turns = slow_turns if every else TURNS
    template = _seeded_store(tmp_path / "template", durability, turns)
    total, names = _count_ops(template, tmp_path / "count", durability, turns)
    # The sample cuts the power as an fdatasync begins: what it would have made durable is
    # what the cut takes, the store log's records among them (every k: --run-slow).
    syncs = [k for k, name in enumerate(names) if name == "fdatasync"]
    figures = {"ops": total, "cuts": 0, "lost_items": 0, "cuts_losing": 0, "damaged_ranges": 0, "quarantined": 0,
               "torn_tails": 0, "catalog_problems": 0, "missing": 0, "sectors_garbled": 0,
               "log_sectors_garbled": 0}
    for k in _ks(total, every, only_ks, syncs):
        data_dir, log_path = _copy(template, tmp_path / f"k{k}")
        layer = PowerCut(data_dir, seed=k, at_op=k, mode=mode, sector_bytes=sector_bytes, report_path=log_path + ".cut")
        code = _wait(_child(data_dir, log_path, 8, durability, turns, layer))
        if os.path.exists(log_path + ".err"):
            pytest.fail(open(log_path + ".err").read())
        assert code == POWER_CUT_EXIT, (k, code)
        figures["cuts"] += 1
        with open(log_path + ".cut") as file:
            cut = json.load(file)
        figures["sectors_garbled"] += cut["sectors_garbled"]
        figures["log_sectors_garbled"] += sum(os.path.basename(path).startswith(STORE_LOG_FILE)
                                              for path, _offset in cut["garbled_at"])
        lost = _lost_after_cut(data_dir, log_path, figures)
        figures["lost_items"] += lost
        figures["cuts_losing"] += bool(lost)
        if durability is Durability.POWER:
            assert lost == 0, f"power cut at operation {k} ({mode}, {sector_bytes} B sectors) lost {lost} acknowledged items"
            assert not figures["quarantined"], f"power cut at operation {k} ({mode}): a segment was quarantined"
        shutil.rmtree(tmp_path / f"k{k}")
    return figures


def _lost_after_cut(data_dir: str, log_path: str, figures: dict) -> int:
    from pipeline.storage import DiskTier
    tier = DiskTier.open(data_dir)
    figures["damaged_ranges"] += len(tier.recovery.damaged)
    figures["quarantined"] += len(tier.recovery.quarantined)
    figures["torn_tails"] += len(tier.recovery.torn_tails)
    figures["catalog_problems"] += len(tier.recovery.catalog_problems)
    figures["missing"] += len(tier.recovery.missing)  # the driver never removes a segment itself
    tier.close()
    log = Log.read(log_path)
    live = live_items(data_dir, name_confirmed=True)
    lost = log.accepted - set(log.completed) - live
    unexpected = live - log.accepted - log.in_rings()
    assert not unexpected, f"live items nobody accepted after a power cut: {sorted(unexpected)[:10]}"
    redelivered = sum(n - 1 for n in log.completed.values()) + len(set(log.completed) & live)
    assert redelivered <= CONTRACT_ITEMS * 16, redelivered
    return len(lost)


@pytest.mark.parametrize("mode", ["drop", "keep"])
def test_a_power_cut_at_power_durability_loses_nothing_acknowledged(tmp_path, mode):
    figures = power_campaign(tmp_path, Durability.POWER, mode, 4096, every=False)
    assert (figures["catalog_problems"], figures["missing"]) == (0, 0), figures


@pytest.mark.parametrize("mode,sector_bytes", [("garble", 512), ("garble", 4096), ("mixed", 512), ("mixed", 4096)])
def test_torn_sectors_at_power_durability_lose_nothing_acknowledged(tmp_path, mode, sector_bytes):
    """Garbled sectors (a sector being written when the power went) cost no acknowledged
    item: no write of the store shares a sector with synced bytes (module docstring), so
    what is garbled was never acknowledged. Never unexpected or corrupt items either; and
    the store log loses no synced record, so recovery names no store log problem and no
    segment the broker deleted as MISSING."""
    figures = power_campaign(tmp_path, Durability.POWER, mode, sector_bytes, every=False)
    assert figures["cuts"] == min(SAMPLE_KS, figures["ops"]) and figures["lost_items"] == 0
    assert (figures["catalog_problems"], figures["missing"]) == (0, 0), figures
    # The sample garbles sectors of the store log: else it would test nothing of its
    # torn-write rule. `garble` garbles every sector being written at a cut; `mixed` draws
    # each one's fate, and its four cuts may spare the log.
    if mode == "garble":
        assert figures["log_sectors_garbled"] > 0, figures


def test_a_power_cut_at_process_durability_is_measured(tmp_path):
    figures = power_campaign(tmp_path, Durability.PROCESS, "drop", 4096, every=False)
    assert figures["cuts"] == min(SAMPLE_KS, figures["ops"])


@pytest.mark.slow
@pytest.mark.parametrize("durability,mode,sector_bytes",
                         [(Durability.POWER, m, b) for m in ("drop", "keep", "garble", "mixed") for b in (512, 4096)]
                         + [(Durability.PROCESS, "drop", 4096), (Durability.PROCESS, "garble", 512)])
def test_power_cut_at_every_operation(tmp_path, durability, mode, sector_bytes, slow_turns, slow_ks):
    figures = power_campaign(tmp_path, durability, mode, sector_bytes, every=True, slow_turns=slow_turns,
                             only_ks=slow_ks)
    print(f"\nCAMPAIGN power {durability.value} {mode} {sector_bytes} turns={slow_turns}: {figures}")
    if durability is Durability.POWER:
        assert (figures["catalog_problems"], figures["missing"]) == (0, 0), figures


def _namespace_child(data_dir: str, layer) -> int:
    """ensure_namespace on a fresh data directory in a child under `layer`; its exit status."""
    from pipeline.broker.peers import ensure_namespace

    pid = os.fork()
    if pid:
        return _wait(pid)
    status = UNTYPED_EXIT
    try:
        fileops.install(layer)
        try:
            ensure_namespace(data_dir, ran_before=False)
            status = 0
        except PipelineError:
            status = FAULT_EXIT
    finally:
        os._exit(status)


def test_the_namespace_file_is_written_through_the_file_layer(tmp_path):
    """The shared-memory namespace file (broker/peers.py) is made through fileops like every
    store write: the layer sees its write, fsync, link, unlink and directory fsync; a fault
    at any of them is a typed error that leaves no temporary file and no torn namespace; a
    power cut at any of them leaves the file whole or absent, never torn."""
    from pipeline.broker.peers import NAMESPACE_FILE, _path_namespace, ensure_namespace, namespace_for

    counting = FaultyIO(FaultPlan(None))
    previous = fileops.install(counting)
    try:
        ensure_namespace(str(tmp_path), ran_before=False)
    finally:
        fileops.install(previous)
    assert counting.log == ["write", "fsync", "link", "unlink", "fsync_directory"]
    for k in range(len(counting.log)):
        for kind, persistent in (("EIO", False), ("ENOSPC", True), ("short", False)):
            data = tmp_path / f"{kind}{k}"
            data.mkdir()
            code = _namespace_child(str(data), FaultyIO(FaultPlan(k, kind, persistent)))
            assert code in (0, FAULT_EXIT), (kind, k, code)  # a short write is completed: 0
            unlink_failed = k == 3 or (persistent and k < 3)
            assert bool([n for n in os.listdir(data) if n.endswith(".tmp")]) == unlink_failed, (kind, k)
            namespace_for(str(data))  # whole or absent: a torn one raises ConfigError
        for seed in range(4):
            data = tmp_path / f"cut{k}-{seed}"
            data.mkdir()
            code = _namespace_child(str(data), PowerCut(str(data), seed=seed, at_op=k, mode="mixed", sector_bytes=512))
            assert code == POWER_CUT_EXIT, (k, seed, code)
            found = namespace_for(str(data))
            assert (found == _path_namespace(str(data))) == (not (data / NAMESPACE_FILE).exists()), (k, seed)
