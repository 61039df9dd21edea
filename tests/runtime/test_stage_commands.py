"""The stage commands on one data directory, as an operator runs them: a detached broker
with metrics, two detached consumers, `produce`, `status --json`, then graceful stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.runtime.datadir import hold_for_launch, release_launch
from tests.consumer.tmpfs import with_small_dev_shm
from tests.runtime.runs import free_port, shm_objects_of, wait_for
from tests.support.repo import ROOT

pytestmark = pytest.mark.integration

# Generous: each command takes about a second; this only keeps a hang from hanging the suite.
COMMAND_TIMEOUT_S = 120


def pipeline(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, cwd=ROOT)
    if done.returncode != 0:  # the whole of it: an assertion's repr cuts it short
        print(f"pipeline {' '.join(args)}: exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}")
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done


def status_json(data: str) -> dict:
    return json.loads(pipeline("status", "--data-dir", data, "--json").stdout)


def write_workload(path: Path, items: int) -> None:
    shapes = [list(range(1000 + 100 * s, 1000 + 100 * s + 48)) for s in range(3)]
    path.write_text("".join(json.dumps({"components": [shapes[k % 3]], "suffix": list(range(1, 2 + k % 200)),
                                        "payload": f"p{k}"}) + "\n" for k in range(items)))


def test_stages_start_produce_status_and_stop(tmp_path):
    data, port = str(tmp_path / "data"), free_port()
    workload = tmp_path / "jobs.jsonl"
    write_workload(workload, 600)
    run_dir = os.path.join(data, "run")
    try:
        assert "pid" in pipeline("broker", "start", "--data-dir", data, "--detach", "--metrics-port", str(port)).stdout
        for again in (["--detach"], []):  # a second broker is refused; the first keeps its pid file
            second = subprocess.run([sys.executable, "-m", "pipeline", "broker", "start", "--data-dir", data, *again],
                                    capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, cwd=ROOT)
            assert second.returncode == 1 and "broker is already running" in second.stderr
        assert os.path.exists(os.path.join(run_dir, "broker.pid"))
        pipeline("consumer", "start", "--data-dir", data, "--name", "c0", "--detach")
        pipeline("consumer", "start", "--data-dir", data, "--name", "c1", "--detach", "--max-batch", "8")
        assert sorted(n for n in os.listdir(run_dir) if n.endswith(".pid")) == [
            "broker.pid", "consumer-c0.pid", "consumer-c1.pid"]
        assert "all stored" in pipeline("produce", str(workload), "--data-dir", data, "--producers", "2").stdout
        report = wait_for(lambda: (s := status_json(data))["items_completed"] == 600 and s, 60, "600 completed")
        assert report["items_received"] == 600 and report["items_with_results"] == 600
        assert report["lost"] is None and report["accounting_ok"] is None  # not checked on a live broker
        assert report["backlog_items"] == report["backlog_tokens"] == report["pending_items"] == 0
        assert sorted(report["consumers"]) == ["c0", "c1"] and report["consumers"]["c1"]["max_batch_items"] == 8
        assert sorted(report["per_consumer"]) == ["c0", "c1"]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        completed = [s.value for f in text_string_to_metric_families(body) for s in f.samples
                     if s.name == "shape_broker_items_completed_total"]
        assert completed == [600]
        assert "stopped" in pipeline("consumer", "stop", "--data-dir", data, "--name", "c0").stdout
        assert sorted(status_json(data)["consumers"]) == ["c1"]
        assert "consumer-c1: stopped" in pipeline("consumer", "stop", "--data-dir", data).stdout
        assert status_json(data)["consumers_lost"] == 0  # both said goodbye
    finally:
        subprocess.run([sys.executable, "-m", "pipeline", "consumer", "stop", "--data-dir", data], cwd=ROOT,
                       capture_output=True, timeout=COMMAND_TIMEOUT_S)
        stopped = pipeline("broker", "stop", "--data-dir", data).stdout
    assert stopped.startswith("broker: stopped")
    assert pipeline("broker", "stop", "--data-dir", data).stdout.strip() == "broker: not running"
    assert [n for n in os.listdir(run_dir) if n.endswith(".pid")] == []
    assert sorted(os.listdir(os.path.join(data, "results"))) == ["c0.jsonl", "c1.jsonl"]
    assert shm_objects_of(data) == []


def test_status_and_produce_without_a_broker_say_so(tmp_path):
    data = str(tmp_path / "data")
    for args, said in ((["status", "--data-dir", data], f"no data directory at {data}"),
                       (["produce", __file__, "--data-dir", data], "no broker answers")):
        done = subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, cwd=ROOT)
        assert done.returncode == 1 and said in done.stderr, done.stderr
    os.makedirs(data, mode=0o700)
    done = subprocess.run([sys.executable, "-m", "pipeline", "status", "--data-dir", data], capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 1 and "no broker answers" in done.stderr, done.stderr


def test_no_broker_starts_on_the_data_directory_of_a_launch_in_progress(tmp_path):
    data = str(tmp_path / "data")
    held = hold_for_launch(data)  # as a launch holds it before its own broker starts
    try:
        done = subprocess.run([sys.executable, "-m", "pipeline", "broker", "start", "--data-dir", data, "--detach"],
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, cwd=ROOT)
        assert done.returncode == 1 and f"a run is in progress on {data} (pid {os.getpid()}," in done.stderr
        assert not os.path.exists(os.path.join(data, "run", "broker.lock"))
    finally:
        release_launch(held)


def test_a_produce_that_dev_shm_cannot_hold_is_refused_before_a_producer_starts(tmp_path):
    data, workload = str(tmp_path / "data"), tmp_path / "jobs.jsonl"
    write_workload(workload, 50)
    command = f"{sys.executable} -m pipeline"
    script = (f"{command} broker start --data-dir {data} --detach >/dev/null && "
              f"{command} produce {workload} --data-dir {data} --producers 2; code=$?; "
              f"{command} broker stop --data-dir {data} >/dev/null; exit $code")
    done = with_small_dev_shm(100 << 20, ["sh", "-c", script], timeout_s=COMMAND_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert ("this run needs 128.0 MiB there (2 producer rings of 64.0 MiB): raise it to at least 129 MiB "
            "(`docker run --shm-size=129m`, or as root `mount -o remount,size=129m /dev/shm`), or lower "
            "--producers to 1") in done.stderr


def test_an_interrupted_produce_says_how_much_was_stored(tmp_path):
    """Ctrl-C during `produce` of a replayed file: exit 130 and the broker's count of what
    was stored, not "all stored"."""
    data = str(tmp_path / "data")
    workload = tmp_path / "timed.jsonl"
    workload.write_text("".join(json.dumps({"components": [[1, 2, 3]], "suffix": [k + 1], "timestamp_ms": 200.0 * k})
                                + "\n" for k in range(100)))  # 20 s at replay speed 1
    try:
        pipeline("broker", "start", "--data-dir", data, "--detach")
        produce = subprocess.Popen([sys.executable, "-m", "pipeline", "produce", str(workload), "--data-dir", data,
                                    "--replay-speed", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, cwd=ROOT)
        wait_for(lambda: status_json(data)["items_received"] > 0, 60, "the first items stored")
        produce.send_signal(signal.SIGINT)
        out, err = produce.communicate(timeout=COMMAND_TIMEOUT_S)
        assert produce.returncode == 130, err
        assert "interrupted: " in err and "of 100 items stored" in err and "all stored" not in out
        stored = int(err.split("interrupted: ")[1].split(" of 100")[0])
        assert 0 < stored == status_json(data)["items_received"] < 100  # exact: what the rings hold is counted
    finally:
        pipeline("broker", "stop", "--data-dir", data)
    assert shm_objects_of(data) == []


def test_produce_counts_a_frame_its_ledger_missed_as_submitted(tmp_path):
    """`produce` after a producer was killed: what it calls submitted is the ledger's count,
    or one past the highest sequence its ring still holds, so a frame published just before
    the kill (not yet in the ledger) is not asked for again. A real ring of the data
    directory, its first frame released as a broker releases what it stored."""
    import numpy as np

    from pipeline.broker.peers import namespace_for, producer_ring_name
    from pipeline.cli.stages import published_and_unstored
    from pipeline.producer import Producer, ProducerLimits
    from shm.ring import RingReader

    data = str(tmp_path / "data")
    os.makedirs(data)
    limits = ProducerLimits(max_item_tokens=100, max_payload_bytes=0, frame_items=2)
    producer = Producer.create(producer_ring_name(namespace_for(data), 3), producer_id=3, capacity_bytes=1 << 16,
                               limits=limits)
    reader = RingReader.attach(producer.ring.name)
    try:
        producer.submit_many(0, 7, np.ones(60, dtype=np.int32), [10] * 6)  # three frames: seqs 0-1, 2-3, 4-5
        reader.release(reader.poll().end)  # the broker stored the first frame
        assert published_and_unstored(data, [(3, 6)]) == (6, 4)
        assert published_and_unstored(data, [(3, 4)]) == (6, 4)  # the last frame is in the ring, not the ledger
        assert published_and_unstored(data, [(3, 0), (4, 5)]) == (6 + 5, 4)  # producer 4: no ring, its ledger
    finally:
        reader.close()
        producer.close()
        producer.unlink()


def test_a_launch_on_a_staged_brokers_data_directory_is_refused_without_waiting_for_it(tmp_path):
    """A broker `pipeline broker start` runs is no killed launcher's orphan, which a launch
    waits for (up to ORPHAN_BROKER_WAIT_S): the launch is refused at once, naming what to do."""
    from pipeline.runtime.local import ORPHAN_BROKER_WAIT_S

    data = str(tmp_path / "data")
    try:
        pipeline("broker", "start", "--data-dir", data, "--detach")
        started_s = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pipeline", "launch", "--items", "10", "--data-dir", data],
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, cwd=ROOT)
        assert done.returncode == 1 and "a launch starts a broker of its own" in done.stderr, done.stderr
        assert time.monotonic() - started_s < ORPHAN_BROKER_WAIT_S
    finally:
        pipeline("broker", "stop", "--data-dir", data)
