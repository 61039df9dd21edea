"""`pipeline run-batch` as a user runs it: a real command, real processes, the sim engine on
the tiny model's tokenizer and chat template. Exactly one output line per request, in input
order; bad requests answered 400 and the job goes on; and a job stopped any way (kill -9 of
the broker or of a consumer, Ctrl-C) finished by the same command, nothing run twice that
was answered, no torn or duplicated line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.jobs import RUN_TIMEOUT_S, check_output, run_batch, write_requests
from tests.support.repo import ROOT
from tools.make_batch_example import requests as example_requests

pytestmark = pytest.mark.integration

# Each batch of the slow runs sleeps in the sim's cost model, so a job lasts seconds and a
# kill lands in the middle of it.
SLOW = "[engine_options]\ncost_s_per_padded_token = 1e-3\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tools.tiny_llama import build

    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    build(path)
    return str(path)


def test_a_job_of_chat_and_completion_requests_gets_one_answer_each(tmp_path, model_dir):
    records = example_requests(60, "tiny-llama")
    source = write_requests(tmp_path / "requests.jsonl", records)
    out = tmp_path / "out.jsonl"
    report = tmp_path / "report.json"
    done = run_batch("-i", str(source), "-o", str(out), "--model", model_dir, "--report", str(report))
    assert done.returncode == 0, done.stderr
    rows = check_output(out, records)
    job = json.loads(report.read_text())["job"]
    usage = [row["response"]["body"]["usage"] for row in rows]
    assert job["request_counts"] == {"total": 60, "completed": 60, "failed": 0}
    assert job["usage"] == {"prompt_tokens": sum(u["prompt_tokens"] for u in usage),
                            "completion_tokens": sum(u["completion_tokens"] for u in usage),
                            "total_tokens": sum(u["total_tokens"] for u in usage),
                            "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)}
    for row, record in zip(rows, records):
        body = row["response"]["body"]
        assert row["response"]["status_code"] == 200 and row["error"] is None
        assert body["object"] == ("chat.completion" if record["url"].endswith("chat/completions") else "text_completion")
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
        wanted = record["body"].get("max_completion_tokens", record["body"].get("max_tokens"))
        # The sim's made-up answers end with the model's eos after 4 tokens, unless cut before it.
        assert (usage["completion_tokens"], body["choices"][0]["finish_reason"]) == (
            (wanted, "length") if wanted <= 4 else (5, "stop"))
    cached = sum(row["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for row in rows)
    assert cached > 0  # requests under one system prompt share its blocks
    assert "60 completed, 0 failed" in done.stderr
    assert not (tmp_path / "out.jsonl.run").exists()  # the default data directory goes once the output is written


def test_bad_requests_are_answered_400_and_the_job_goes_on(tmp_path, model_dir):
    good = example_requests(6, "tiny-llama")
    bad = [
        {"custom_id": "wrong-model", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]}},
        {"custom_id": "n-two", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny-llama", "n": 2, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}},
        {"custom_id": "embeddings", "method": "POST", "url": "/v1/embeddings", "body": {"model": "tiny-llama"}},
        {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny-llama", "prompt": "word " * 3000}},
    ]
    records = good[:3] + bad + good[3:]
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(write_requests(tmp_path / "r.jsonl", records)), "-o", str(out), "--model", model_dir)
    assert done.returncode == 0, done.stderr
    rows = {row["custom_id"]: row for row in check_output(out, records)}
    for name, param in (("wrong-model", "model"), ("n-two", "n"), ("embeddings", None), ("too-long", "prompt")):
        error = rows[name]["response"]["body"]["error"]
        assert rows[name]["response"]["status_code"] == 400 and error["message"]
        if param:
            assert error["param"] == param, (name, error)
    assert all(rows[r["custom_id"]]["response"]["status_code"] == 200 for r in good)
    assert "6 completed, 4 failed (4 with status 400)" in done.stderr


def test_a_file_with_a_duplicate_custom_id_is_refused_before_anything_runs(tmp_path, model_dir):
    records = example_requests(3, "tiny-llama")
    records[2]["custom_id"] = records[0]["custom_id"]
    source = write_requests(tmp_path / "r.jsonl", records)
    done = run_batch("-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--model", model_dir)
    assert done.returncode == 1 and f"{source}:3" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.jsonl.run").exists()


def _wait_for_orphans(data: Path) -> None:
    """Until the killed run's broker is gone (its lock free): the next run starts its own."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (pid := _broker_pid(data)) is not None and _alive(pid):
        assert time.monotonic() < deadline, "the killed run's broker is still alive"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _broker_pid(data: Path) -> int | None:
    try:
        return int((data / "run" / "broker.lock").read_text())
    except (OSError, ValueError):
        return None


def _answered_lines(data: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in data.glob("results/run-*/*.jsonl"))


def _consumer_pid(data: Path) -> int | None:
    done = subprocess.run([sys.executable, "-m", "pipeline", "status", "--data-dir", str(data), "--json"],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)
    if done.returncode != 0:
        return None
    consumers = json.loads(done.stdout).get("consumers") or {}
    return next((c["pid"] for c in consumers.values()), None)


@pytest.mark.parametrize("how", ["ctrl-c"])  # kill -9 of each process: test_run_batch_resume.py
def test_a_stopped_job_is_finished_by_the_same_command(tmp_path, model_dir, how):
    records = example_requests(400, "tiny-llama")
    source = write_requests(tmp_path / "r.jsonl", records)
    config = tmp_path / "slow.toml"
    config.write_text(SLOW)
    out, data = tmp_path / "out.jsonl", tmp_path / "data"
    args = ["-i", str(source), "-o", str(out), "--model", model_dir, "--data-dir", str(data), "--config", str(config)]
    first = subprocess.Popen([sys.executable, "-m", "pipeline", "run-batch", "--engine", "sim", *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while _answered_lines(data) < 40:  # some answered, most not
            assert first.poll() is None and time.monotonic() < deadline, "the job ended before the stop"
            time.sleep(0.05)
        if how == "kill-broker":
            os.kill(_broker_pid(data), signal.SIGKILL)
        elif how == "kill-consumer":
            while (pid := _consumer_pid(data)) is None:  # status may miss a consumer between two polls
                assert first.poll() is None and time.monotonic() < deadline, "the job ended before the stop"
            os.kill(pid, signal.SIGKILL)
        elif how == "kill-run-batch":  # the launcher itself: its children stop with it (PDEATHSIG)
            first.kill()
        else:
            first.send_signal(signal.SIGINT)
        first.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if first.poll() is None:
            first.kill()
    if how == "kill-run-batch":
        _wait_for_orphans(data)
    answered_first = _answered_lines(data)
    if how != "kill-consumer":  # the launcher goes on without a dead consumer when the other lives
        assert first.returncode != 0 and not out.exists()
    again = run_batch(*args)
    assert again.returncode == 0, again.stderr
    rows = check_output(out, records)
    assert {row["response"]["status_code"] for row in rows} == {200}
    assert f"{len(records):,} completed, 0 failed" in again.stderr
    # Nothing answered in the first run ran again: the second run's results hold only the rest
    # (and, after a kill, the batches that were in flight at it, counted as duplicates).
    assert _answered_lines(data) - answered_first <= len(records) - answered_first + 64 * 4


def test_another_file_on_the_same_data_directory_is_refused(tmp_path, model_dir):
    data = tmp_path / "data"
    first = write_requests(tmp_path / "a.jsonl", example_requests(4, "tiny-llama"))
    assert run_batch("-i", str(first), "-o", str(tmp_path / "a.out"), "--model", model_dir,
                     "--data-dir", str(data)).returncode == 0
    other = write_requests(tmp_path / "b.jsonl", example_requests(5, "tiny-llama", seed=1))
    done = run_batch("-i", str(other), "-o", str(tmp_path / "b.out"), "--model", model_dir, "--data-dir", str(data))
    assert done.returncode == 1 and "holds a job this run would change" in done.stderr
    assert "the input file changed since the job started" in done.stderr and "Traceback" not in done.stderr


def test_a_job_of_more_shapes_than_the_broker_keeps_live_waits_for_them_and_ends_whole(tmp_path, model_dir):
    """Each request its own system prompt, more of them than `max_live_shapes`: the broker
    stops reading the producers' rings while that many shapes are live (its memory holds
    per live shape), and the job still ends with one answer per request."""
    records = [{"custom_id": f"r{k}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "tiny-llama", "max_tokens": 4,
                         "messages": [{"role": "system", "content": f"You assist customer {k}."},
                                      {"role": "user", "content": "Hello"}]}} for k in range(240)]
    source = write_requests(tmp_path / "requests.jsonl", records)
    config = tmp_path / "slow.toml"
    config.write_text(SLOW + "\n[broker]\nmax_live_shapes = 16\npool_min_shapes = 0\n")
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(source), "-o", str(out), "--model", model_dir, "--engine", "sim",
                     "--config", str(config), "-v")
    assert done.returncode == 0, done.stderr
    assert "live shapes (max_live_shapes): the producers' rings wait" in done.stderr
    rows = check_output(out, records)
    assert all(row["response"]["status_code"] == 200 for row in rows)
