"""The cluster run's pieces that need no Ray: the agent's reading of results files as they
grow, and the command's one-line error where Ray is not installed."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys

import pytest

from pipeline.cluster.agent import ResultsTail
from pipeline.cluster.driver import ClusterError, check_address_answers
from tests.support.repo import ROOT


def row(item_id: int) -> bytes:
    return json.dumps({"item_id": item_id, "status": "ok"}).encode() + b"\n"


def test_the_tail_reads_whole_lines_once_and_waits_for_a_line_being_written(tmp_path):
    tail = ResultsTail(str(tmp_path / "results"))
    assert tail.rows() == []  # no directory yet: the consumers have not written
    (tmp_path / "results").mkdir()
    path = tmp_path / "results" / "gpu0.jsonl"
    path.write_bytes(row(1) + row(2) + row(3)[:5])  # a batch being appended: its last line cut
    assert [r["item_id"] for r in tail.rows()] == [1, 2]
    assert tail.rows() == []  # nothing new, nothing twice
    with open(path, "ab") as f:
        f.write(row(3)[5:] + row(4))
    assert [r["item_id"] for r in tail.rows()] == [3, 4]
    (tmp_path / "results" / "gpu1.jsonl").write_bytes(b'{"item_id": 9, "sta\n' + row(5))  # a torn line, terminated
    assert [r["item_id"] for r in tail.rows()] == [5] and tail.bad_lines == 1


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")
def test_without_ray_the_command_says_how_to_get_it_and_makes_nothing(tmp_path):
    source = tmp_path / "requests.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "m", "prompt": "hi"}}) + "\n")
    done = subprocess.run([sys.executable, "-m", "pipeline", "run-batch", "--engine", "sim", "-i", str(source),
                           "-o", str(tmp_path / "out.jsonl"), "--model", str(tmp_path), "--ray", "auto"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.strip() == "Error: --ray needs Ray: pip install 'shape-broker[ray]'"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl"]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_address_that_answers_passes_and_one_that_does_not_is_a_cluster_error():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_address_answers(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=2.0)
    port = _closed_port()
    with pytest.raises(ClusterError, match=f"no Ray cluster answers at 127.0.0.1:{port}: Connection refused"):
        check_address_answers(f"127.0.0.1:{port}", timeout_s=2.0)


@pytest.mark.parametrize("address", ["127.0.0.1", ":6379", "head:", "head:port", "head:0", "head:65536"])
def test_an_address_without_a_usable_port_is_refused_as_such(address):
    with pytest.raises(ClusterError, match="expected HOST:PORT"):
        check_address_answers(address)


@pytest.mark.parametrize("address", ["auto", "ray://head:10001"])
def test_auto_and_ray_client_addresses_are_left_to_ray(address):
    check_address_answers(address, timeout_s=0.01)  # nothing is probed: no error


@pytest.mark.ray
@pytest.mark.parametrize("command", ["run-batch", "launch"])
def test_a_ray_address_nothing_answers_at_fails_at_once_in_one_line_and_makes_nothing(tmp_path, command):
    # ray.init itself retries such an address for minutes.
    source = tmp_path / "requests.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "m", "prompt": "hi"}}) + "\n")
    address = f"127.0.0.1:{_closed_port()}"
    args = (["run-batch", "--engine", "sim", "-i", str(source), "-o", str(tmp_path / "out.jsonl"),
             "--model", str(tmp_path)] if command == "run-batch" else
            ["launch", "--data-dir", str(tmp_path / "data")])
    done = subprocess.run([sys.executable, "-m", "pipeline", *args, "--ray", address],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"Error: no Ray cluster answers at {address}: Connection refused "
                                   "(nothing accepted a connection within 5 s)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl"]
