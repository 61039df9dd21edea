"""Every bad option or hostile environment gets one line naming what and where, before
anything starts, never a traceback (each a real command that once gave a traceback)."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import threading

import pytest

from pipeline.wire.status import STATUS_VERSION
from tests.runtime.runs import shm_objects_of
from tests.support.commands import one_line_error, pipeline

pytestmark = pytest.mark.integration

IS_ROOT = os.geteuid() == 0


@pytest.mark.parametrize("args, words", [
    (["--workload-seed", "-1"], ["workload_seed must be in [0,", "-1"]),
    (["--producers", "100000"], ["producers must be in [1, 128]"]),
    (["--report", "/nonexistent-dir/report.json"], ["report /nonexistent-dir/report.json", "does not exist"]),
    (["--max-batch", "20000"], ["max_batch_items 20000"]),
    (["--set", "broker.lanes.max_lanes=10001"], ["broker.lanes: lane config: max_lanes must be <= 10000"]),
    (["--set", "consumer.credit_max_batches=0"], ["credit window bounds"]),
    (["--set", "broker.max_age=3"], ["broker: unknown setting 'max_age'"]),
    (["--set", "broker.lanes.max_lanes"], ["expected KEY=VALUE"]),
])
def test_launch_options_are_checked_before_anything_starts(tmp_path, args, words):
    data = tmp_path / "data"
    done = pipeline("launch", "--items", "10", "--data-dir", str(data), *args)
    one_line_error(done, *words)
    assert not data.exists()  # refused before the broker (or anything) started


@pytest.mark.parametrize("visible, args, words", [
    ("0,1,2", ["-tp", "2"], ["3 GPUs (0,1,2) do not divide into engines of 2"]),
    ("0,1,2,3,4,5", ["-tp", "2", "-pp", "2"], ["6 GPUs", "do not divide into engines of 4"]),
    ("", ["--dtype", "bfloat16"], ["--dtype: not options of this command", "the sim engine takes of them only"]),
    ("", ["--seed", "3"], ["--seed: vLLM's engine flag", "--workload-seed"]),
])
def test_launch_refuses_engine_flags_it_cannot_honour_before_anything_starts(tmp_path, monkeypatch, visible, args,
                                                                             words):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    data = tmp_path / "data"
    one_line_error(pipeline("launch", "--items", "10", "--data-dir", str(data), *args), *words)
    assert not data.exists()


def test_a_consumer_stage_pinned_to_gpus_that_are_not_its_engines_is_refused(tmp_path):
    done = pipeline("consumer", "start", "--data-dir", str(tmp_path / "data"), "--gpu", "0,1")
    one_line_error(done, "--gpu 0,1: 2 GPUs for an engine of 1")


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_replay_speed_that_is_not_a_finite_number_is_a_usage_error(tmp_path, value):
    for command in (["launch", "--items", "10"], ["produce", __file__]):
        done = pipeline(*command, "--data-dir", str(tmp_path / "data"), "--replay-speed", value)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert f"Invalid value for '--replay-speed': '{value}' is not a finite number" in done.stderr
        assert not (tmp_path / "data").exists()


def test_a_payload_that_is_not_unicode_text_names_the_line(tmp_path):
    workload = tmp_path / "jobs.jsonl"
    workload.write_text('{"components": [[1, 2]], "suffix": [3], "payload": "ok"}\n'
                        '{"components": [[1, 2]], "suffix": [3], "payload": "\\ud800"}\n')
    done = pipeline("launch", "--workload", str(workload), "--data-dir", str(tmp_path / "data"))
    one_line_error(done, f"{workload}:2", "payload is not valid Unicode text")


def test_a_data_directory_too_long_for_a_unix_socket_says_so_and_leaks_nothing(tmp_path):
    data = tmp_path / ("d" * 120)
    for args in (["launch", "--items", "10", "--data-dir", str(data)], ["broker", "start", "--data-dir", str(data)]):
        done = pipeline(*args)
        one_line_error(done, "at most 107")
        assert shm_objects_of(str(data)) == []


@pytest.mark.skipif(not IS_ROOT, reason="mounting a read-only file system needs root")
def test_broker_start_on_a_read_only_mount_is_one_line(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mount)]).returncode:
        pytest.skip("mount refused")
    try:
        done = pipeline("broker", "start", "--data-dir", str(mount / "data"))
        one_line_error(done, "Read-only file system", str(mount / "data"))
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def answering(data, reply: dict):
    """A server on the data directory's socket that answers one request with `reply`."""
    (data / "run").mkdir(parents=True, mode=0o700)
    os.chmod(data, 0o700)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(data / "run" / "broker.sock"))
    server.listen()

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(65536)  # the status request
        body = json.dumps(reply).encode()
        conn.sendall(struct.pack("<I", len(body)) + body)
        conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return server, thread


def test_status_when_the_socket_answers_with_an_error_is_one_line(tmp_path):
    """Something that is not our broker answers on the socket with an error message."""
    server, thread = answering(tmp_path / "data", {"type": "error", "message": "not a broker"})
    try:
        one_line_error(pipeline("status", "--data-dir", str(tmp_path / "data")), "not a broker")
    finally:
        server.close()
        thread.join(5)


@pytest.mark.parametrize("reply, named", [
    ({"type": "status_reply", "counters": {"items_received": 5}}, "'version'"),  # a broker before versions
    ({"type": "status_reply", "version": STATUS_VERSION + 1, "counters": {"items_received": 5}},
     f"version {STATUS_VERSION + 1} is not {STATUS_VERSION}"),
    ({"type": "status_reply", "version": STATUS_VERSION, "counters": {"items_received": 5}},
     "'tokens_received' is missing"),
])
def test_status_of_a_reply_this_version_cannot_read_is_one_line_naming_why(tmp_path, reply, named):
    """An older or newer broker's reply (or another program's), or one that lacks fields: it
    is refused in one line that says why, never misread (before the status record it
    showed what it had, as zeros)."""
    server, thread = answering(tmp_path / "data", reply)
    try:
        one_line_error(pipeline("status", "--data-dir", str(tmp_path / "data"), "--json"), "cannot read", named)
    finally:
        server.close()
        thread.join(5)


def test_a_broker_that_exits_at_start_is_one_line(tmp_path):
    """A second broker on a data directory a broker already serves."""
    data = tmp_path / "data"
    first = pipeline("broker", "start", "--data-dir", str(data), "--detach")
    assert first.returncode == 0, first.stderr
    try:
        second = pipeline("broker", "start", "--data-dir", str(data), "--detach")
        one_line_error(second, "already running")
    finally:
        pipeline("broker", "stop", "--data-dir", str(data))


@pytest.mark.parametrize("stage, pair, words", [
    ("broker", "lanes.max_lanes=10001", ["the command line: broker.lanes", "max_lanes must be <= 10000"]),
    ("broker", "max_age_s=-1", ["the command line: broker: broker setting max_age_s -1.0"]),
    ("consumer", "credit_min_batches=0", ["the command line: consumer", "credit window bounds 0 to 64"]),
])
def test_stage_settings_are_checked_before_the_stage_starts(tmp_path, stage, pair, words):
    data = tmp_path / "data"
    done = pipeline(stage, "start", "--data-dir", str(data), "--set", pair)
    one_line_error(done, *words)
    assert not (data / "run").exists()  # nothing of the stage was started
