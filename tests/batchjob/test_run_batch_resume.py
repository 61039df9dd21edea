"""A job stopped any way is finished by the same command with one line per custom_id; a
resume with anything the answers depend on changed is refused; the output in completion
order can be read while the job runs; `pipeline status` tells a stopped job from its files.
Real processes, kill -9, the sim engine with a cost model so that a job lasts seconds."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support.jobs import (
    ROOT,
    RUN_TIMEOUT_S,
    SLOW_CONFIG,
    answered_lines,
    broker_pid,
    build_model,
    chat,
    copy_model,
    rows_by_id,
    run_batch,
    start_batch,
    wait_for_orphans,
    wait_until,
    write_requests,
)

REQUESTS = 400
PRODUCER_KILL_REQUESTS = 20_000
# The sim's cost where a test stops the job after its first answers: slow enough that the
# stop lands before the last answer on an idle machine too.
STOPPED_COST = "1e-3"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def records(count: int = REQUESTS) -> list[dict]:
    systems = [f"You are helper {k}. " + "Be brief. " * (3 + k) for k in range(5)]
    return [chat(f"r{k}", f"question {k} " + "word " * (k % 7), system=systems[k % 5]) for k in range(count)]


def slow_args(tmp_path: Path, *more: str, count: int = REQUESTS, slow: bool = True, cost: str = "") -> list[str]:
    config = tmp_path / "slow.toml"
    config.write_text(f"[engine_options]\ncost_s_per_padded_token = {cost}\n" if cost else SLOW_CONFIG if slow else "")
    source = write_requests(tmp_path / "in.jsonl", records(count))
    return ["-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--data-dir", str(tmp_path / "data"),
            "--config", str(config), *more]


def status(data: Path, must: bool = True) -> dict:
    done = subprocess.run([sys.executable, "-m", "pipeline", "status", "--data-dir", str(data), "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 or not must, done.stderr
    return json.loads(done.stdout) if done.returncode == 0 else {}


def consumer_pids(data: Path) -> set[int]:
    done = subprocess.run([sys.executable, "-m", "pipeline", "status", "--data-dir", str(data), "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    consumers = json.loads(done.stdout).get("consumers") or {} if done.returncode == 0 else {}
    return {c["pid"] for c in consumers.values()}


def kill_target(job: subprocess.Popen, data: Path, target: str) -> None:
    """kill -9 of one of the job's processes: the command itself, its broker, a consumer
    (the broker's status names them) or a producer (the command's other children)."""
    if target == "run-batch":
        os.kill(job.pid, signal.SIGKILL)
        return
    found: list[int] = []

    def look() -> bool:
        consumers = consumer_pids(data)
        if target == "consumer":
            found[:] = sorted(consumers)
        elif target == "broker":
            found[:] = [pid] if (pid := broker_pid(data)) else []
        elif consumers:
            children = {p.pid for p in psutil.Process(job.pid).children()}
            found[:] = sorted(children - consumers - {broker_pid(data)})
        return bool(found) or job.poll() is not None

    wait_until(look, f"a {target} process")
    assert found, f"the job ended before its {target} could be killed"
    os.kill(found[0], signal.SIGKILL)


def check_one_line_each(out: Path, count: int = REQUESTS) -> dict[str, dict]:
    rows = rows_by_id(out)
    assert set(rows) == {f"r{k}" for k in range(count)}
    assert {row["response"]["status_code"] for row in rows.values()} == {200}
    return rows


@pytest.mark.parametrize("target, order", [("run-batch", "input"), ("broker", "completion"),
                                           ("consumer", "completion"), ("producer", "input"),
                                           ("run-batch", "completion")])
def test_a_job_killed_at_a_random_moment_is_finished_with_one_line_per_custom_id(tmp_path, model_dir, target, order):
    # A producer is killed while it still feeds: a file it takes seconds to tokenize.
    count = PRODUCER_KILL_REQUESTS if target == "producer" else REQUESTS
    # Slow enough that the kill lands mid-job on a loaded machine (`status` takes seconds there).
    args = slow_args(tmp_path, "--model", model_dir, "--output-order", order, count=count, slow=target != "producer",
                     cost="6e-4" if target != "producer" else "")
    data = tmp_path / "data"
    rng = random.Random(f"{target}-{order}")
    job = start_batch(*args)
    try:
        wait_until(lambda: answered_lines(data) >= rng.randrange(1, 120) or job.poll() is not None, "answers")
        if job.poll() is None:
            kill_target(job, data, target)
        job.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    wait_for_orphans(data)
    again = run_batch(*args)
    assert again.returncode == 0, again.stderr
    check_one_line_each(tmp_path / "out.jsonl", count)
    assert f"{count:,} completed, 0 failed" in again.stderr


def test_a_stopped_jobs_status_comes_from_its_files_and_says_how_to_finish_it(tmp_path, model_dir):
    args = slow_args(tmp_path, "--model", model_dir, cost="2e-3")  # a minute: `status` takes seconds on a busy host
    data = tmp_path / "data"
    job = start_batch(*args)
    try:
        wait_until(lambda: status(data, must=False).get("job", {}).get("done", 0) >= 20, "answers in the job's log")
        running = status(data)["job"]
        assert running["running"] and running["requests"] == REQUESTS
    finally:
        os.kill(job.pid, signal.SIGKILL)
        job.communicate(timeout=RUN_TIMEOUT_S)
    wait_for_orphans(data)
    stopped = status(data)["job"]
    assert stopped["state"] == "stopped" and not stopped["running"]
    assert 0 < stopped["done"] < REQUESTS and stopped["done"] + stopped["to_do"] == REQUESTS
    text = subprocess.run([sys.executable, "-m", "pipeline", "status", "--data-dir", str(data)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert text.returncode == 0 and "job stopped" in text.stdout and "finishes it" in text.stdout
    resumed = run_batch(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{stopped['done']:,} answered already" in resumed.stderr or "answered already" in resumed.stderr


def test_a_closed_terminal_stops_the_job_saying_how_to_finish_it(tmp_path, model_dir):
    args = slow_args(tmp_path, "--model", model_dir, cost=STOPPED_COST)
    data = tmp_path / "data"
    job = start_batch(*args)
    wait_until(lambda: answered_lines(data) >= 20, "answers")
    job.send_signal(signal.SIGHUP)
    _out, err = job.communicate(timeout=RUN_TIMEOUT_S)
    assert job.returncode != 0 and "the same command finishes the job" in err and "Traceback" not in err
    assert run_batch(*args).returncode == 0
    check_one_line_each(tmp_path / "out.jsonl")


def test_the_completion_order_output_is_whole_lines_whenever_it_is_read(tmp_path, model_dir):
    args = slow_args(tmp_path, "--model", model_dir, "--output-order", "completion", "--error-file",
                     str(tmp_path / "errors.jsonl"))
    out = tmp_path / "out.jsonl"
    job = start_batch(*args)
    seen = 0
    try:
        while job.poll() is None:
            if out.exists():
                raw = out.read_bytes()
                assert not raw or raw.endswith(b"\n")
                ids = [json.loads(line)["custom_id"] for line in raw.splitlines()]
                assert len(ids) == len(set(ids)) and len(ids) >= seen
                seen = len(ids)
    finally:
        job.communicate(timeout=RUN_TIMEOUT_S)
    assert job.returncode == 0
    assert 0 < seen and check_one_line_each(out)
    assert (tmp_path / "errors.jsonl").read_bytes() == b""


def test_a_resume_with_another_tokenizer_or_engine_option_is_refused_saying_what_changed(tmp_path, model_dir):
    model = copy_model(model_dir, tmp_path / "m" / "tiny-llama")
    args = slow_args(tmp_path, "--model", str(model), cost=STOPPED_COST)
    data = tmp_path / "data"
    job = start_batch(*args)
    wait_until(lambda: answered_lines(data) >= 20, "answers")
    job.send_signal(signal.SIGINT)
    job.communicate(timeout=RUN_TIMEOUT_S)
    tokenizer = model / "tokenizer.json"
    original = tokenizer.read_text()
    tokenizer.write_text(original + " ")  # the same JSON; another file
    refused = run_batch(*args)
    assert refused.returncode == 1 and "model file tokenizer.json" in refused.stderr and "Traceback" not in refused.stderr
    tokenizer.write_text(original)
    changed = run_batch(*args, "--engine-options", "vocab_size=4000")
    assert changed.returncode == 1 and "engine option vocab_size" in changed.stderr
    faster = run_batch(*args, "--engine-options", "cost_s_per_padded_token=0")  # how fast, not what: allowed
    assert faster.returncode == 0, faster.stderr
    check_one_line_each(tmp_path / "out.jsonl")


def texts(out: Path) -> dict[str, list]:
    return {cid: [c.get("message", c).get("content", c.get("text")) for c in row["response"]["body"]["choices"]]
            for cid, row in rows_by_id(out).items()}


def test_a_consumer_someone_joins_to_a_running_job_does_not_answer_for_it(tmp_path, model_dir):
    reference = tmp_path / "reference"
    reference.mkdir()
    assert run_batch(*slow_args(reference, "--model", model_dir, slow=False)).returncode == 0
    args = slow_args(tmp_path, "--model", model_dir)
    data = tmp_path / "data"
    job = start_batch(*args)
    extra = None
    try:
        wait_until(lambda: answered_lines(data) >= 10, "answers")
        extra = subprocess.Popen([sys.executable, "-m", "pipeline", "consumer", "start", "--data-dir", str(data),
                                  "--name", "joined", "--engine-options", "vocab_size=50"],  # other answers
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        job.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if extra is not None:
            extra.terminate()
            extra.wait(30)
        if job.poll() is None:
            job.kill()
    if job.returncode != 0:  # the joined consumer took requests: they run again
        assert run_batch(*args).returncode == 0
    check_one_line_each(tmp_path / "out.jsonl")
    assert texts(tmp_path / "out.jsonl") == texts(reference / "out.jsonl")  # every answer the job's own


def test_damaged_segments_whose_requests_all_got_answers_make_a_complete_output_and_exit_0(tmp_path, model_dir):
    args = slow_args(tmp_path, "--model", model_dir, "--keep-data-dir")
    data = tmp_path / "data"
    job = start_batch(*args)
    wait_until(lambda: answered_lines(data) >= 40, "answers")
    job.send_signal(signal.SIGINT)
    job.communicate(timeout=RUN_TIMEOUT_S)
    damaged = 0
    for path in sorted(data.glob("segments/**/*.seg"))[:3]:
        raw = bytearray(path.read_bytes())
        for offset in range(4096 + 200, len(raw) - 100, 3000):  # inside entries, past the header page
            raw[offset] ^= 0xFF
            damaged += 1
        path.write_bytes(raw)
    assert damaged
    again = run_batch(*args)
    assert again.returncode == 0, again.stderr
    check_one_line_each(tmp_path / "out.jsonl")
    assert "damaged" in again.stderr and "Traceback" not in again.stderr
