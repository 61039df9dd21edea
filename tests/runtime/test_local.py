"""A node's processes where they meet what already runs (pipeline/runtime/local.py), with
real commands and processes: a launch or run-batch holds its data directory for the whole
run and is refused at once when another run or a broker holds it, the live run going on
untouched; the clean-up after a run removes nothing of a live run (nothing at all while a
broker holds the data directory, never what a live process maps); and a run /dev/shm cannot
hold is refused before anything starts, in one line saying what to raise, never a SIGBUS
(a real small /dev/shm in a private mount namespace), at the limit and one page past it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pipeline.broker.config import DESCRIPTOR_RING_BYTES
from pipeline.broker.peers import namespace_for, object_prefix
from pipeline.producer.producer import DEFAULT_RING_CAPACITY_BYTES
from pipeline.runtime.local import remove_leftovers
from shm.objects import PAGE_BYTES, create_shared_memory, object_path, unlink_quietly
from shm.ring_layout import HEADER_SIZE_BYTES
from tests.consumer.tmpfs import with_small_dev_shm
from tests.runtime.runs import shm_objects_of
from tests.support.commands import RUN_TIMEOUT_S
from tests.support.repo import ROOT

pytestmark = pytest.mark.integration

# Commands that race run with lagging producers (tests/runtime/lagging_launch.py: 1 s a
# submit call of 256 items): the one that gets the data directory runs 10 s or more, so
# the other, started a fraction of a second later, meets it running however loaded the
# machine is (with plain producers a run-batch on a loaded machine once ended before the
# second one had even started).
ITEMS = 6000
REQUESTS = 1000
# Docker's default /dev/shm.
DOCKER_SHM_BYTES = 64 << 20


def pipeline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=ROOT)


def start_lagging(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.runtime.lagging_launch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def one_line_error(err: str) -> str:
    """The command's one error line (and no traceback)."""
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, err
    return errors[0]


def race(first: list[str], second: list[str], gap_s: float) -> tuple[subprocess.CompletedProcess, ...]:
    """Start two commands `gap_s` apart; (the one that ended first, the other), each with
    its output; the first must end while the other still runs."""
    a = start_lagging(*first)
    time.sleep(gap_s)
    b = start_lagging(*second)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while a.poll() is None and b.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        ended, other = (a, b) if a.poll() is not None else (b, a)
        assert ended.poll() is not None and other.poll() is None, "one must be refused while the other runs"
        out, err = ended.communicate()
        refused = subprocess.CompletedProcess(ended.args, ended.returncode, out, err)
        out, err = other.communicate(timeout=RUN_TIMEOUT_S)
        return refused, subprocess.CompletedProcess(other.args, other.returncode, out, err)
    finally:
        for process in (a, b):
            if process.poll() is None:
                process.kill()
                process.communicate()


@pytest.mark.parametrize("gap_s", [0.1, 0.3])
def test_of_two_launches_started_together_on_one_data_directory_the_second_is_refused_at_once(tmp_path, gap_s):
    data = str(tmp_path / "data")
    reports = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    refused, ran = race(*(["launch", "--items", str(ITEMS), "--data-dir", data, "--report", report]
                          for report in reports), gap_s=gap_s)
    assert refused.returncode == 1
    line = one_line_error(refused.stderr)
    assert f"another run is using the data directory {data}: pid " in line and "launch.lock" in line
    assert ran.returncode == 0, ran.stderr
    (written,) = [json.load(open(path)) for path in reports if os.path.exists(path)]
    assert written["items_with_results"] == ITEMS and written["lost"] == 0 and written["accounting_ok"]
    assert shm_objects_of(data) == []


def test_a_run_batch_started_on_a_job_in_progress_is_refused_and_the_job_completes(tmp_path):
    from tools.make_batch_example import requests as example_requests
    from tools.tiny_llama import build

    model = str(build(tmp_path / "tiny-llama"))
    records = example_requests(REQUESTS, "tiny-llama")
    source, out, config = tmp_path / "requests.jsonl", tmp_path / "out.jsonl", tmp_path / "slow.toml"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    config.write_text("[engine_options]\ncost_s_per_padded_token = 1e-3\n")
    command = ["run-batch", "--engine", "sim", "-i", str(source), "-o", str(out), "--model", model,
               "--config", str(config)]
    refused, ran = race(command, command, gap_s=0.2)
    assert refused.returncode == 1
    assert "a run of this job holds" in one_line_error(refused.stderr)  # the job's own lock, before the launch's
    assert "finishes the job" not in refused.stderr
    assert ran.returncode == 0, ran.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["custom_id"] for row in rows] == [r["custom_id"] for r in records]
    assert all(row["response"]["status_code"] == 200 for row in rows)


def test_a_launch_on_the_data_directory_of_a_staged_broker_is_refused_and_the_broker_serves_on(tmp_path):
    data, workload = str(tmp_path / "data"), tmp_path / "jobs.jsonl"
    workload.write_text("".join(json.dumps({"components": [[1, 2, 3]], "suffix": [k % 50 + 1]}) + "\n"
                                for k in range(100)))
    started = pipeline("broker", "start", "--data-dir", data, "--detach")
    assert started.returncode == 0, started.stderr
    try:
        before = sorted(shm_objects_of(data))
        broker_pid = started.stdout.split("pid ")[1].split(",")[0]
        refused = pipeline("launch", "--items", "300", "--data-dir", data)
        assert refused.returncode == 1
        line = one_line_error(refused.stderr)
        assert f"a broker is running on {data} (pid {broker_pid} holds" in line and "pipeline produce" in line
        assert sorted(shm_objects_of(data)) == before  # the doorbell of the live broker is still there
        fed = pipeline("produce", str(workload), "--data-dir", data)
        assert fed.returncode == 0 and "all stored" in fed.stdout, fed.stderr
        status = pipeline("status", "--data-dir", data, "--json")
        assert json.loads(status.stdout)["items_received"] == 100
    finally:
        pipeline("broker", "stop", "--data-dir", data)
    assert shm_objects_of(data) == []


def _map_until_released(name: str, mapped, release) -> None:
    memory, _inode = create_shared_memory(name, PAGE_BYTES)
    mapped.set()
    release.wait(60)
    memory.close()


def test_the_clean_up_after_a_run_removes_nothing_of_a_live_run(tmp_path, ctx):
    data = str(tmp_path / "data")
    started = pipeline("broker", "start", "--data-dir", data, "--detach")
    assert started.returncode == 0, started.stderr
    prefix = object_prefix(namespace_for(data))
    left, in_use = f"/{prefix}p7", f"/{prefix}p8"  # a dead producer's ring; a live one's
    mapping, _inode = create_shared_memory(left, PAGE_BYTES)
    mapping.close()
    mapped, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_map_until_released, args=(in_use, mapped, release))
    child.start()
    try:
        assert mapped.wait(30)
        assert remove_leftovers(data) == []  # the broker holds the data directory: nothing goes
        assert os.path.exists(object_path(left)) and os.path.exists(object_path(in_use))
        assert pipeline("broker", "stop", "--data-dir", data).returncode == 0
        assert remove_leftovers(data) == [left]  # the live child maps the other
        assert os.path.exists(object_path(in_use))
    finally:
        release.set()
        child.join(30)
        if child.is_alive():
            child.kill()
        pipeline("broker", "stop", "--data-dir", data)
    assert remove_leftovers(data) == [in_use]
    assert shm_objects_of(data) == []
    unlink_quietly([left, in_use], [])


# ---------------------------------------------------------------------- a small /dev/shm


def test_a_launch_that_dev_shm_cannot_hold_is_refused_before_it_starts(tmp_path):
    data = str(tmp_path / "data")
    done = with_small_dev_shm(DOCKER_SHM_BYTES, [sys.executable, "-m", "pipeline", "launch", "--items", "300",
                                                 "--data-dir", data], timeout_s=RUN_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 1, done.stderr  # not -7: no SIGBUS
    line = one_line_error(done.stderr)
    assert ("/dev/shm has 64.0 MiB free of 64.0 MiB, and this run needs 130.1 MiB there (2 producer rings of "
            "64.0 MiB, 2 consumer descriptor rings of 1.0 MiB, the doorbell): raise it to at least 131 MiB "
            "(`docker run --shm-size=131m`, or as root `mount -o remount,size=131m /dev/shm`)") in line
    assert "--producers" not in line  # no number of producers fits: not offered
    assert not os.path.exists(os.path.join(data, "results")) and not os.path.exists(os.path.join(data, "run",
                                                                                                   "broker.lock"))


def test_a_shortage_names_how_many_producers_would_fit(tmp_path):
    data = str(tmp_path / "data")
    done = with_small_dev_shm(200 << 20, [sys.executable, "-m", "pipeline", "launch", "--items", "300", "--producers",
                                          "3", "--storage", "memory", "--data-dir", data],
                              timeout_s=RUN_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    line = one_line_error(done.stderr)
    # 8 MiB to work in, and the 2% of /dev/shm (1 to 256 MiB) the store leaves free.
    assert "the memory tier's store (at least 12.0 MiB, the 2% of /dev/shm it leaves free included)" in line
    assert line.endswith("or lower --producers to 2")


def test_a_run_batch_that_dev_shm_cannot_hold_is_refused_without_saying_the_same_command_finishes(tmp_path):
    from tools.make_batch_example import requests as example_requests
    from tools.tiny_llama import build

    model = str(build(tmp_path / "tiny-llama"))
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in example_requests(20, "tiny-llama")))
    done = with_small_dev_shm(DOCKER_SHM_BYTES, [sys.executable, "-m", "pipeline", "run-batch", "--engine", "sim",
                                                 "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--model",
                                                 model], timeout_s=RUN_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert "raise it to at least 131 MiB" in one_line_error(done.stderr)
    assert "finishes the job" not in done.stderr and not (tmp_path / "out.jsonl").exists()


# In a private /dev/shm: the launcher made (its ledger is in /dev/shm by then), /dev/shm is
# remounted to leave exactly `free` bytes, then the run.
_LAUNCH_WITH_FREE = """
import json, subprocess, sys
from pipeline.producer.demos import named_workload
from pipeline.runtime.launcher import Launcher
from pipeline.runtime.settings import LaunchSettings
from shm.errors import ShmSpaceError
from shm.objects import shm_space
data, items, free = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
settings = LaunchSettings.resolve(None, {"items": items, "producers": 1, "consumers": 1, "data_dir": data})
launcher = Launcher(settings, named_workload("demo", items))
now_free, total = shm_space()
subprocess.run(["mount", "-o", f"remount,size={total - now_free + free}", "/dev/shm"], check=True)
try:
    outcome = launcher.run()
except ShmSpaceError as exc:
    print(json.dumps({"refused": str(exc)}))
else:
    report = outcome.report
    print(json.dumps({"exit": outcome.exit_code, "items_with_results": report["items_with_results"],
                      "lost": report["lost"]}))
"""


@pytest.mark.parametrize("short_bytes", [0, PAGE_BYTES])
def test_a_dev_shm_of_exactly_what_a_run_needs_runs_it_and_one_page_less_is_refused(tmp_path, short_bytes):
    # One producer ring and one descriptor ring (each a header page, its data and two
    # semaphores), and the doorbell: counted here from what the run creates, not by the code.
    need = (HEADER_SIZE_BYTES + DEFAULT_RING_CAPACITY_BYTES + 2 * PAGE_BYTES
            + HEADER_SIZE_BYTES + DESCRIPTOR_RING_BYTES + 2 * PAGE_BYTES + PAGE_BYTES)
    data, items = str(tmp_path / "data"), 300
    done = with_small_dev_shm(DOCKER_SHM_BYTES * 2, [sys.executable, "-c", _LAUNCH_WITH_FREE, data, str(items),
                                                     str(need - short_bytes)], timeout_s=RUN_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    if short_bytes:
        assert f"this run needs {need / (1 << 20):.1f} MiB" in found["refused"]
        assert not os.path.exists(os.path.join(data, "results"))  # nothing started
    else:
        assert found == {"exit": 0, "items_with_results": items, "lost": 0}, done.stderr


# What the grandchild of `_leaves_a_grandchild` makes in /dev/shm and maps until it is
# killed, by role: as vLLM's engine core maps its message queues (psm_...) and semaphores.
_GRANDCHILD = """
import mmap, sys, time, posix_ipc
for name in sys.argv[1:]:
    if name.startswith("/dir-"):  # a file in a directory of /dev/shm, as the memory tier's segments
        import os
        os.makedirs("/dev/shm" + name, mode=0o700)
        with open("/dev/shm" + name + "/f", "wb+") as file:
            file.truncate(4096)
            globals()[name] = mmap.mmap(file.fileno(), 4096)
    elif name.startswith("/sem-"):
        posix_ipc.Semaphore(name, posix_ipc.O_CREX, 0o600)
    else:
        memory = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, 0o600, size=4096)
        globals()[name] = mmap.mmap(memory.fd, 4096)
        memory.close_fd()
print("ready", flush=True)
time.sleep(600)
"""


def _leaves_a_grandchild(ready, names: list[str]) -> None:
    """A child as the launcher starts one, that starts a process of its own (as a vllm
    consumer starts vLLM's engine core) mapping `names` in /dev/shm, and says its pid."""
    from pipeline.runtime.local import own_process_group

    own_process_group()
    grandchild = subprocess.Popen([sys.executable, "-c", _GRANDCHILD, *names], stdout=subprocess.PIPE, text=True)
    assert grandchild.stdout.readline() == "ready\n"
    ready.send(grandchild.pid)
    time.sleep(600)


def test_what_a_killed_child_started_is_stopped_with_it_and_what_only_it_mapped_removed():
    import mmap
    import signal

    import posix_ipc

    from pipeline.broker.peers import OBJECT_PREFIX_START
    from pipeline.runtime.local import CTX, start_child, stop_process

    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    private, semaphore, shared = f"/psm-{tag}", f"/sem-{tag}", f"/psm-shared-{tag}"
    ours, folder = f"/{OBJECT_PREFIX_START}test-{tag}", f"/dir-{tag}"
    paths = {name: object_path(name) for name in (private, shared, ours)} | {semaphore: f"/dev/shm/sem.{semaphore[1:]}",
                                                                           folder: f"/dev/shm{folder}/f"}
    ready, child_end = CTX.Pipe(duplex=False)
    child = CTX.Process(target=_leaves_a_grandchild, args=(child_end, [private, semaphore, shared, ours, folder]))
    start_child(child)
    grandchild = ready.recv()
    memory = posix_ipc.SharedMemory(shared)
    also_mapped = mmap.mmap(memory.fd, 4096)  # mapped here too: not only the killed ones'
    memory.close_fd()
    try:
        os.kill(child.pid, signal.SIGKILL)  # as kill -9 of a consumer: its engine core would live on
        child.join(10)
        assert _state(grandchild) not in ("gone", "Z")
        stop_process(child)
        deadline = time.monotonic() + 10
        while _state(grandchild) not in ("gone", "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(grandchild) in ("gone", "Z")
        assert not os.path.exists(paths[private]) and not os.path.exists(paths[semaphore])
        assert os.path.exists(paths[shared])  # another process maps it
        assert os.path.exists(paths[ours])  # the pipeline's own: the cleanup judges those
        assert os.path.exists(paths[folder])  # in a directory there: a store's (the memory tier), not an engine's
    finally:
        also_mapped.close()
        try:
            os.kill(grandchild, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)
        if os.path.isdir(f"/dev/shm{folder}"):
            os.rmdir(f"/dev/shm{folder}")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
