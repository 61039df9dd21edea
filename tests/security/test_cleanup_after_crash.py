"""`pipeline tools cleanup DATA_DIR` after real crashes (SIGKILL of every stage process): it
lists what the run left (dry run: nothing changes), removes it with --yes, and touches
nothing else: not a live run (refused), not what a live process maps, not a ring holding
items never stored (the next broker stores them), not another data directory's objects.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import psutil
import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.producer.client import BrokerProducer
from pipeline.runtime.cleanup import apply_cleanup, held_run_lock, plan_cleanup
from pipeline.runtime.daemon import read_pid
from pipeline.runtime.datadir import hold_for_launch, release_launch
from pipeline.runtime.inventory import producer_ring_names, ring_stock
from pipeline.wire.client import broker_status
from pipeline.wire.errors import DataDirError, LiveRunError
from tests.runtime.runs import shm_objects_of, wait_for
from tests.security.live import COMMAND_TIMEOUT_S, ROOT, pipeline, submit

pytestmark = pytest.mark.integration

# Items of the replayed workload, 10 ms apart: `produce` is still submitting when killed.
REPLAYED_ITEMS = 5000


def cleanup(data: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "tools", "cleanup", data, *args], capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT_S, cwd=ROOT)


def listing(data: str) -> dict:
    """What a dry run lists, in the form of `cleanup --json` (made in this process: each
    command costs a second or two on a loaded machine)."""
    with held_run_lock(data):
        plan = plan_cleanup(data)
    return {"prefix": plan.prefix, "remove": [found.to_json() for found in plan.remove],
            "keep": [found.to_json() for found in plan.keep]}


def state(data: str) -> tuple[list[str], list[str]]:
    return sorted(shm_objects_of(data)), sorted(os.listdir(BrokerConfig(data).run_dir))


def kill_stage(data: str, stage: str) -> None:
    pid = read_pid(os.path.join(BrokerConfig(data).run_dir, f"{stage}.pid"))
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 30,
             f"{stage} to die")
    if stage == "broker":  # and its lock to go with it (CI once saw it still held just after)
        wait_for(lambda: _lock_free(data), 30, "the dead broker's lock to be released")


def _lock_free(data: str) -> bool:
    try:
        with held_run_lock(data):
            return True
    except LiveRunError:
        return False


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a command and every process under it, all stopped first: a child that saw its
    parent die first would get its PDEATHSIG (SIGTERM) and begin a graceful stop, removing
    what a crash leaves (seen: a broker that unlinked its descriptor rings and socket). The
    tree is listed again until a listing finds no member it has not stopped: a process
    forked between a listing and its parent's stop would otherwise run on. The deepest die
    first: a parent killed while its stopped children live orphans their process groups,
    and the kernel sends an orphaned group with stopped members SIGHUP and SIGCONT (seen
    under load: the broker resumed with its PDEATHSIG pending and stopped gracefully)."""
    stopped: dict[int, psutil.Process] = {}
    while True:
        try:
            root = psutil.Process(process.pid)
            members = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            members = []
        new = [member for member in members if member.pid not in stopped]
        if not new:
            break
        for member in new:
            stopped[member.pid] = member
            try:
                member.suspend()
            except psutil.NoSuchProcess:
                pass
    depth = {pid: _depth(member, stopped) for pid, member in stopped.items()}
    for member in sorted(stopped.values(), key=lambda member: -depth[member.pid]):
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()
    wait_for(lambda: all(_dead(member) for member in stopped.values()), 30, "the killed processes to exit")


def _depth(member: psutil.Process, tree: dict[int, psutil.Process]) -> int:
    """How many of `tree`'s members are above `member`."""
    depth = 0
    try:
        parent = member.ppid()
        while parent in tree:
            depth += 1
            parent = tree[parent].ppid()
    except psutil.NoSuchProcess:
        pass
    return depth


def _dead(process: psutil.Process) -> bool:
    """Gone, or a zombie (its descriptors, locks and mappings are released by then)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def unstored_items(data: str) -> int:
    return int(ring_stock(producer_ring_names(data)).item_ids.size)


def write_replayed(path: str) -> None:
    shapes = [list(range(1000 + 100 * s, 1048 + 100 * s)) for s in range(3)]
    with open(path, "w") as file:
        for k in range(REPLAYED_ITEMS):
            file.write(json.dumps({"components": [shapes[k % 3]], "suffix": list(range(1, 2 + k % 50)),
                                   "timestamp_ms": 10 * k}) + "\n")


def test_cleanup_after_every_stage_was_killed(tmp_path):
    data, other = str(tmp_path / "data"), str(tmp_path / "other")
    workload = str(tmp_path / "replayed.jsonl")
    write_replayed(workload)
    produce = None
    try:
        pipeline("broker", "start", "--data-dir", other, "--detach")  # another data directory, live
        pipeline("broker", "start", "--data-dir", data, "--detach")
        pipeline("consumer", "start", "--data-dir", data, "--name", "c0", "--detach")
        produce = subprocess.Popen([sys.executable, "-m", "pipeline", "produce", workload, "--data-dir", data,
                                    "--replay-speed", "1"], cwd=ROOT, start_new_session=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: broker_status(BrokerConfig(data).socket_path).items_completed > 0, 60, "a completion")
        refused = cleanup(data, "--yes")  # a live run: refused, one line, nothing touched
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert "a broker is running on" in refused.stderr and "Traceback" not in refused.stderr
        other_before = state(other)

        kill_stage(data, "broker")  # the producers go on submitting into their rings
        wait_for(lambda: unstored_items(data) > 0, 60, "items waiting in a producer ring")
        live = listing(data)  # the producers and the consumer are alive: what they map is kept
        kept = {found["path"]: found["why"] for found in live["keep"]}
        assert any("in use by pid" in why and "-p" in path for path, why in kept.items()), kept
        assert kept[os.path.join(data, "run", "consumer-c0.pid")].startswith("pid ")
        gone = {found["path"] for found in live["remove"]}
        assert {os.path.join(data, "run", "broker.pid"), os.path.join(data, "run", "broker.sock")} <= gone
        assert all(path.startswith(os.path.join(data, "run")) or f"{live['prefix']}g" in path for path in gone), gone

        kill_stage(data, "consumer-c0")
        kill_tree(produce)  # `produce` and its producer processes (each in its own group)
        unstored = unstored_items(data)
        before = state(data)
        dry = cleanup(data, "--json")
        assert dry.returncode == 0 and json.loads(dry.stdout)["dry_run"] and "nothing removed" in cleanup(data).stdout
        assert state(data) == before  # a dry run changes nothing
        plan = json.loads(dry.stdout)
        removed = {os.path.basename(found["path"]) for found in plan["remove"]}
        kept = {os.path.basename(found["path"]) for found in plan["keep"]}
        prefix = plan["prefix"]
        assert {"broker.pid", "consumer-c0.pid", "broker.sock", f"sem.{prefix}bell"} <= removed
        assert any(name.startswith(f"{prefix}g") for name in removed)  # the descriptor ring
        assert kept and all(name.startswith((f"{prefix}p", f"sem.{prefix}p")) for name in kept), kept
        assert any(f"holds {unstored:,} item" in found["why"] and "the broker never stored" in found["why"]
                   for found in plan["keep"])

        done = cleanup(data, "--yes")
        assert done.returncode == 0 and f"removed {len(plan['remove'])}, kept {len(plan['keep'])}" in done.stdout
        objects, run_files = state(data)
        assert objects == sorted(kept)  # only the rings holding unstored items, and their semaphores
        assert [name for name in run_files if not name.endswith(".log")] == ["broker.lock"]
        assert state(other) == other_before  # the other data directory's run: untouched
        assert listing(data)["remove"] == []

        pipeline("broker", "start", "--data-dir", data, "--detach")  # the next broker stores what was kept
        adopted = wait_for(lambda: broker_status(BrokerConfig(data).socket_path).items_adopted, 60, "adoption")
        assert 0 < adopted <= unstored
    finally:
        if produce is not None:
            kill_tree(produce)
        for directory in (data, other):
            subprocess.run([sys.executable, "-m", "pipeline", "consumer", "stop", "--data-dir", directory],
                           capture_output=True, timeout=COMMAND_TIMEOUT_S, cwd=ROOT)
            subprocess.run([sys.executable, "-m", "pipeline", "broker", "stop", "--data-dir", directory],
                           capture_output=True, timeout=COMMAND_TIMEOUT_S, cwd=ROOT)
            cleanup(directory, "--yes", "--discard-unstored")
    assert shm_objects_of(data) == shm_objects_of(other) == []


def test_cleanup_after_a_killed_memory_tier_broker(tmp_path):
    data = str(tmp_path / "data")
    try:
        pipeline("broker", "start", "--data-dir", data, "--storage", "memory", "--detach")
        producer = BrokerProducer(BrokerConfig(data).socket_path, capacity_bytes=4 << 20, timeout_s=60)
        submit(producer, 0, 20, seed=4)
        producer.wait_stored(timeout_s=60)
        producer.close(timeout_s=30)
        kill_stage(data, "broker")
        plan = listing(data)
        assert {found["kind"] for found in plan["remove"]} == {"memory tier", "semaphore", "pid file", "socket"}
        assert plan["keep"] == []
        assert cleanup(data, "--yes").returncode == 0
        assert shm_objects_of(data) == [] and listing(data)["remove"] == []
    finally:
        subprocess.run([sys.executable, "-m", "pipeline", "broker", "stop", "--data-dir", data],
                       capture_output=True, timeout=COMMAND_TIMEOUT_S, cwd=ROOT)
        cleanup(data, "--yes", "--discard-unstored")


def test_pid_files_and_sockets_are_judged_one_by_one(tmp_path):
    """Only stage pid files whose process is gone, their dead writers' temporaries, and the
    broker socket nobody listens on; never a pid file of a live stage, one that cannot be
    read, a socket something listens on, or any other file."""
    data = tmp_path / "data"
    run = data / "run"
    run.mkdir(parents=True, mode=0o700)
    os.chmod(data, 0o700)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    (run / "broker.pid").write_text(f"{dead} 1.0\n")
    other_program = subprocess.Popen(["sleep", "600"])  # alive, but not a stage: a reused pid
    (run / "consumer-x.pid").write_text(f"{other_program.pid}\n")
    (run / "consumer-y.pid").write_text("garbage\n")
    (run / f"broker.pid.{dead}.tmp").write_text("")
    (run / f"consumer-x.pid.{os.getpid()}.tmp").write_text("")
    for name in ("broker.log", "broker.lock", "notes.txt", "other.sock"):
        (run / name).write_text("")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(run / "broker.sock"))
    listener.listen()
    try:
        with held_run_lock(str(data)):
            plan = plan_cleanup(str(data))
            removed = apply_cleanup(plan)
    finally:
        listener.close()
        other_program.kill()
        other_program.wait()
    assert sorted(os.path.basename(found.path) for found in removed) == sorted(
        ["broker.pid", "consumer-x.pid", f"broker.pid.{dead}.tmp"])
    kept = {os.path.basename(found.path): found.why for found in plan.keep}
    assert kept == {"consumer-y.pid": "holds no pid that can be read: left alone",
                    f"consumer-x.pid.{os.getpid()}.tmp": f"being written by pid {os.getpid()}",
                    "broker.sock": "a process listens on it"}
    assert sorted(os.listdir(run)) == sorted(["broker.lock", "broker.log", "broker.sock", "consumer-y.pid",
                                              f"consumer-x.pid.{os.getpid()}.tmp", "notes.txt", "other.sock"])


@pytest.mark.parametrize("make, message", [
    (lambda path: None, "is not a directory: no data directory to clean"),
    (lambda path: os.makedirs(path, mode=0o700), "is not a data directory"),
    (lambda path: (os.makedirs(os.path.join(path, "run"), mode=0o700), os.chmod(path, 0o777)), "chmod 700"),
])
def test_what_is_not_a_trusted_data_directory_is_refused_in_one_line(tmp_path, make, message):
    data = str(tmp_path / "data")
    make(data)
    with pytest.raises(DataDirError, match=message):
        plan_cleanup(data)
    done = cleanup(data, "--yes")
    assert done.returncode == 1 and message in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_cleanup_refuses_while_a_launch_holds_the_data_directory(tmp_path):
    """A launch holds its data directory before its broker starts and after it stops (it
    takes stock, then removes what is left itself): the cleanup refuses then too."""
    data = str(tmp_path / "data")
    held = hold_for_launch(data)
    try:
        done = cleanup(data, "--yes")
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
        assert f"a run is in progress on {data} (pid {os.getpid()}, a `pipeline launch` or `run-batch`" in done.stderr
    finally:
        release_launch(held)
    assert cleanup(data, "--yes").returncode == 0


def test_cleanup_after_a_killed_launch(tmp_path):
    """`pipeline launch` and every process under it killed mid-run: what is left is found,
    removed but for the rings holding unstored items, and the next launch runs there."""
    data, workload = str(tmp_path / "data"), str(tmp_path / "replayed.jsonl")
    write_replayed(workload)
    launch = subprocess.Popen([sys.executable, "-m", "pipeline", "launch", "--data-dir", data, "--workload", workload,
                               "--replay-speed", "1", "--consumers", "1"], cwd=ROOT, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: os.path.exists(BrokerConfig(data).socket_path)
                 and broker_status(BrokerConfig(data).socket_path).items_completed > 0, 60, "the launch serving")
        kill_tree(launch)
        plan = listing(data)
        prefix = plan["prefix"]
        assert {found["kind"] for found in plan["remove"]} >= {"descriptor ring", "semaphore", "socket"}, plan
        assert all(os.path.basename(found["path"]).startswith((f"{prefix}p", f"sem.{prefix}p"))
                   and ("never stored" in found["why"] or "which is kept" in found["why"]) for found in plan["keep"])
        assert cleanup(data, "--yes").returncode == 0
        assert sorted(shm_objects_of(data)) == sorted(os.path.basename(found["path"]) for found in plan["keep"])
    finally:
        kill_tree(launch)
        cleanup(data, "--yes", "--discard-unstored")
    assert shm_objects_of(data) == []


def test_producer_rings_are_judged_by_what_they_hold(tmp_path):
    """A ring whose producer died making it (identity never written) holds nothing: removed;
    one holding a record never stored: kept, and removed only with discard_unstored."""
    from pipeline.broker.peers import ensure_namespace, object_prefix, producer_ring_name
    from pipeline.producer.producer import Producer
    from pipeline.runtime.datadir import prepare_data_dir
    from shm.objects import create_shared_memory
    from shm.ring_layout import HEADER_SIZE_BYTES, MIN_CAPACITY_BYTES

    data = str(tmp_path / "data")
    prepare_data_dir(data)
    namespace = ensure_namespace(data, ran_before=False)
    unfinished, holding = producer_ring_name(namespace, 7), producer_ring_name(namespace, 8)
    memory, _inode = create_shared_memory(unfinished, HEADER_SIZE_BYTES + MIN_CAPACITY_BYTES)
    memory.close()
    producer = Producer.create(holding, producer_id=8, capacity_bytes=4 << 20)
    producer.submit(0, 12345, np.arange(10, dtype=np.int32))  # never stored: no broker ran
    producer.close()
    try:
        with held_run_lock(data):
            plan = plan_cleanup(data)
        assert [(found.name, found.why) for found in plan.remove] == [
            (unfinished, "its producer died making it: it never held anything")]
        assert [found.name for found in plan.keep] == [holding, f"{holding}.d", f"{holding}.s"]
        assert plan.keep[0].why.startswith("holds 1 item the broker never stored")
        with held_run_lock(data):
            discarded = plan_cleanup(data, discard_unstored=True)
            apply_cleanup(discarded)
        assert discarded.keep == [] and "discarded as asked (they are lost)" in discarded.remove[1].why
        assert shm_objects_of(data) == [] and object_prefix(namespace) == discarded.prefix
    finally:
        from shm.objects import unlink_quietly

        unlink_quietly([unfinished, holding], [f"{holding}.d", f"{holding}.s"])
