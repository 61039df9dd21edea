"""A job stopped any way is finished by the same command with one line per custom_id; a
resume with anything the answers depend on changed is refused; the output in completion
order can be read while the job runs; `pipeline status` tells a stopped job from its files.
Real processes, kill -9, the sim engine with a cost model so that a job lasts seconds."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
import pytest
import xxhash

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

pytestmark = pytest.mark.integration

REQUESTS = 400
PRODUCER_KILL_REQUESTS = 20_000
# The sim's cost where a test stops the job after its first answers: slow enough that the
# stop lands before the last answer on an idle machine too.
STOPPED_COST = "1e-3"
# A resume's engine with no cost: how fast a job runs is not what its answers depend on, so
# a resume may change it, and the stopped job's rest takes no sleep.
QUICK_RESUME = ("--engine-options", "cost_s_per_padded_token=0")


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
            found[:] = producer_pids(job, data)
        return bool(found) or job.poll() is not None

    wait_until(look, f"a {target} process")
    assert found, f"the job ended before its {target} could be killed"
    with contextlib.suppress(ProcessLookupError):  # a producer may end between the look and the kill
        os.kill(found[0], signal.SIGKILL)


def stopped_after(args: list[str], data: Path, answers: int, signum: int = signal.SIGINT) -> tuple[int, str]:
    """A job started with `args`, sent `signum` once `answers` result lines exist: its exit
    status and stderr."""
    job = start_batch(*args)
    try:
        wait_until(lambda: answered_lines(data) >= answers, "answers")
        job.send_signal(signum)
        _out, err = job.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    return job.returncode, err


def producer_pids(job: subprocess.Popen, data: Path) -> list[int]:
    """The job's producer processes now: its children other than the broker and consumers."""
    children = {p.pid for p in psutil.Process(job.pid).children()}
    return sorted(children - consumer_pids(data) - {broker_pid(data)})


def check_one_line_each(out: Path, count: int = REQUESTS) -> dict[str, dict]:
    rows = rows_by_id(out)
    assert set(rows) == {f"r{k}" for k in range(count)}
    assert {row["response"]["status_code"] for row in rows.values()} == {200}
    return rows


# A broker's and a producer's kill run with the README's tests (each reaches recovery code
# no other test there does); the command's and a consumer's, as campaigns.
@pytest.mark.parametrize("target, order", [pytest.param("run-batch", "input", marks=pytest.mark.campaign),
                                           ("broker", "completion"),
                                           pytest.param("consumer", "completion", marks=pytest.mark.campaign),
                                           ("producer", "input"),
                                           pytest.param("run-batch", "completion", marks=pytest.mark.campaign)])
def test_a_job_killed_at_a_random_moment_is_finished_with_one_line_per_custom_id(tmp_path, model_dir, target, order):
    # A producer is killed while it still feeds: a file it takes seconds to tokenize.
    count = PRODUCER_KILL_REQUESTS if target == "producer" else REQUESTS
    # Slow enough that the kill lands mid-job on a loaded machine (`status` takes seconds there).
    args = slow_args(tmp_path, "--model", model_dir, "--output-order", order, count=count, slow=target != "producer",
                     cost="6e-4" if target != "producer" else "")
    data = tmp_path / "data"
    rng = random.Random(f"{target}-{order}")
    job = start_batch(*args)
    killed = False
    try:
        wait_until(lambda: answered_lines(data) >= rng.randrange(1, 120) or job.poll() is not None, "answers")
        if job.poll() is None:
            kill_target(job, data, target)
            killed = True
        _out, err = job.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    if killed and target in ("broker", "consumer"):  # a failure stopped the run: said as one
        assert "once what stopped the run (above) is dealt with, the same command finishes the job" in err, err
    wait_for_orphans(data)
    again = run_batch(*args)
    assert again.returncode == 0, again.stderr
    check_one_line_each(tmp_path / "out.jsonl", count)
    assert f"{count:,} completed, 0 failed" in again.stderr
    plan = re.search(r"([\d,]+) answered already \([\d,]+ failed\), ([\d,]+) waiting in the store, ([\d,]+) to submit",
                     again.stderr)
    assert plan and sum(int(n.replace(",", "")) for n in plan.groups()) == count, again.stderr  # each counted once


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
    resumed = run_batch(*args, *QUICK_RESUME)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{stopped['done']:,} answered already" in resumed.stderr or "answered already" in resumed.stderr


def test_a_closed_terminal_stops_the_job_saying_how_to_finish_it(tmp_path, model_dir):
    # In completion order: the resume goes on appending to the output the stop left whole.
    args = slow_args(tmp_path, "--model", model_dir, "--output-order", "completion", cost=STOPPED_COST)
    data = tmp_path / "data"
    code, err = stopped_after(args, data, 20, signal.SIGHUP)
    assert code != 0 and "the same command finishes the job" in err and "Traceback" not in err
    assert run_batch(*args, *QUICK_RESUME).returncode == 0
    check_one_line_each(tmp_path / "out.jsonl")


@pytest.mark.campaign
def test_the_completion_order_output_is_whole_lines_whenever_it_is_read(tmp_path, model_dir):
    args = slow_args(tmp_path, "--model", model_dir, "--output-order", "completion", "--error-file",
                     str(tmp_path / "errors.jsonl"))
    out = tmp_path / "out.jsonl"
    job = start_batch(*args)
    seen = 0
    try:
        while job.poll() is None:
            if out.exists():
                # A reader takes what is before the last newline: a read that races an append
                # may see the end of that write in part (the kernel does not make a file's
                # read and write atomic), never a line cut at an answer's end.
                raw = out.read_bytes()
                raw = raw[:raw.rfind(b"\n") + 1]
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
    stopped_after(args, data, 20)
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


@pytest.mark.campaign
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
    stopped_after(args, data, 40)
    damaged = 0
    for path in sorted(data.glob("segments/**/*.seg"))[:3]:
        raw = bytearray(path.read_bytes())
        for offset in range(4096 + 200, len(raw) - 100, 3000):  # inside entries, past the header page
            raw[offset] ^= 0xFF
            damaged += 1
        path.write_bytes(raw)
    assert damaged
    again = run_batch(*args, *QUICK_RESUME)
    assert again.returncode == 0, again.stderr
    check_one_line_each(tmp_path / "out.jsonl")
    assert "damaged" in again.stderr and "Traceback" not in again.stderr


def test_a_job_whose_input_moved_resumes_from_the_path_given_now(tmp_path, model_dir):
    args = slow_args(tmp_path, "--model", model_dir, cost=STOPPED_COST)
    stopped_after(args, tmp_path / "data", 20)
    moved = tmp_path / "moved.jsonl"
    os.rename(tmp_path / "in.jsonl", moved)
    at = args.index("-i") + 1
    args[at] = str(moved)
    done = run_batch(*args, *QUICK_RESUME)
    assert done.returncode == 0 and str(moved) in done.stderr, done.stderr
    check_one_line_each(tmp_path / "out.jsonl")


def test_a_job_whose_inputs_digest_ends_in_a_zero_byte_resumes(tmp_path, model_dir):
    source = tmp_path / "in.jsonl"
    for tag in range(100_000):  # about one input in 256
        source.write_text("".join(json.dumps(r) + "\n" for r in records(4) + [chat(f"pad{tag}")]))
        if xxhash.xxh3_128_digest(source.read_bytes())[-1] == 0:
            break
    args = ["-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--data-dir", str(tmp_path / "data"),
            "--model", model_dir]
    first = run_batch(*args)
    assert first.returncode == 0, first.stderr
    again = run_batch(*args)  # the job's kept index read back: the same input
    assert again.returncode == 0, again.stderr
    assert set(rows_by_id(tmp_path / "out.jsonl")) == {"r0", "r1", "r2", "r3", f"pad{tag}"}


def test_an_input_edited_in_place_where_it_was_answered_refuses_the_resume_before_any_output(tmp_path, model_dir):
    """The digest of a resumed job's input is read beside its run: a same-size edit of a line
    answered already (which no producer reads again) still refuses the job, and nothing is
    written."""
    from pipeline.batchjob.layout import ANSWER_RECORD_DTYPE

    args = slow_args(tmp_path, "--model", model_dir, cost=STOPPED_COST)
    stopped_after(args, tmp_path / "data", 20)
    answered = np.fromfile(tmp_path / "data" / "job" / "answers.bin", dtype=ANSWER_RECORD_DTYPE)["index"]
    assert answered.size
    source = tmp_path / "in.jsonl"
    original = source.read_bytes()
    lines = original.split(b"\n")
    lines[int(answered[0])] = lines[int(answered[0])].replace(b"question", b"QUESTION")
    source.write_bytes(b"\n".join(lines))
    assert source.stat().st_size == len(original)
    refused = run_batch(*args)
    assert refused.returncode == 1 and "the input file changed since the job started" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "out.jsonl").exists()
    source.write_bytes(original)
    done = run_batch(*args)
    assert done.returncode == 0, done.stderr
    check_one_line_each(tmp_path / "out.jsonl")


@pytest.mark.campaign
def test_a_model_directory_edited_mid_run_changes_no_answer(tmp_path, model_dir):
    """The template saved anew and a producer killed (so one loads the model again): every
    answer is the one the model as it was at the start makes."""
    reference = tmp_path / "reference"
    reference.mkdir()
    count = PRODUCER_KILL_REQUESTS
    done = run_batch(*slow_args(reference, "--model", model_dir, count=count, slow=False))
    assert done.returncode == 0, done.stderr
    model = copy_model(model_dir, tmp_path / "m" / "tiny-llama")
    args = slow_args(tmp_path, "--model", str(model), count=count, slow=False)
    job = start_batch(*args)
    try:
        wait_until(lambda: answered_lines(tmp_path / "data") >= 1 or job.poll() is not None, "answers")
        config = json.loads((model / "tokenizer_config.json").read_text())
        config["chat_template"] = "EDITED " + config["chat_template"]
        (model / "tokenizer_config.json").write_text(json.dumps(config))
        producers = producer_pids(job, tmp_path / "data")  # none left on a fast machine: no restart to test
        for pid in producers[:1]:
            with contextlib.suppress(ProcessLookupError):  # it may have ended since
                os.kill(pid, signal.SIGKILL)
        _out, err = job.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err
    got, want = rows_by_id(tmp_path / "out.jsonl"), rows_by_id(reference / "out.jsonl")
    assert set(got) == set(want)
    usage = {cid: row["response"]["body"]["usage"]["prompt_tokens"] for cid, row in got.items()}
    assert usage == {cid: row["response"]["body"]["usage"]["prompt_tokens"] for cid, row in want.items()}
    assert texts(tmp_path / "out.jsonl") == texts(reference / "out.jsonl")


def test_an_input_edited_in_place_mid_run_stops_the_job_and_nothing_of_it_is_answered(tmp_path, model_dir):
    """Same size, same offsets, another question on lines near the end of each producer's
    share: no answer is made of an edited line; the job stops naming it; with the file as it
    was, the same command finishes with the answers of the original."""
    count = PRODUCER_KILL_REQUESTS
    args = slow_args(tmp_path, "--model", model_dir, count=count, slow=False)
    source = tmp_path / "in.jsonl"
    original = source.read_bytes()
    starts = [0] + [k + 1 for k, byte in enumerate(original) if byte == ord("\n")]
    edited = [count // 2 - 5, count - 5]
    job = start_batch(*args)
    try:
        wait_until(lambda: answered_lines(tmp_path / "data") >= 1 or job.poll() is not None, "answers")
        with open(source, "r+b") as f:
            for index in edited:
                line = original[starts[index]:starts[index + 1]]
                f.seek(starts[index])
                f.write(line.replace(b"question", b"QUESTION"))
        _out, err = job.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    if job.returncode == 0:  # the producers had read every line before the edit: nothing to catch
        pytest.skip("the job read its whole input before the edit landed")
    assert job.returncode == 1 and "the input file was changed while the job ran" in err and "Traceback" not in err, err
    assert not (tmp_path / "out.jsonl").exists()
    refused = run_batch(*args)
    assert refused.returncode == 1 and "the input file changed since the job started" in refused.stderr
    source.write_bytes(original)
    done = run_batch(*args)
    assert done.returncode == 0, done.stderr
    check_one_line_each(tmp_path / "out.jsonl", count)
    # The sim's answer to a request is seeded by its own tokens: a job of the edited lines
    # alone, as they were, is their reference.
    reference = tmp_path / "reference"
    reference.mkdir()
    alone = write_requests(reference / "in.jsonl", [records(count)[k] for k in edited])
    assert run_batch("-i", str(alone), "-o", str(reference / "out.jsonl"), "--data-dir", str(reference / "data"),
                     "--model", model_dir).returncode == 0
    got, want = texts(tmp_path / "out.jsonl"), texts(reference / "out.jsonl")
    assert [got[f"r{k}"] for k in edited] == [want[f"r{k}"] for k in edited]


def test_outputs_that_do_not_fit_at_the_end_are_written_by_the_same_command_without_running(tmp_path, model_dir):
    from tests.consumer.tmpfs import small_tmpfs

    small = tmp_path / "small"
    with small_tmpfs(str(small), 64 << 10):
        args = slow_args(tmp_path, "--model", model_dir, slow=False)
        args[args.index("-o") + 1] = str(small / "out.jsonl")
        failed = run_batch(*args)
        assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
        assert "cannot write the outputs" in failed.stderr and "No space left on device" in failed.stderr
        assert "the same command writes them without running anything" in failed.stderr
        assert os.listdir(small) == []
        remounted = subprocess.run(["mount", "-o", "remount,size=4m", str(small)], capture_output=True, text=True)
        assert remounted.returncode == 0, remounted.stderr
        done = run_batch(*args)
        assert done.returncode == 0, done.stderr
        assert f"{REQUESTS:,} answered already" in done.stderr and "0 to submit" in done.stderr
        check_one_line_each(small / "out.jsonl")


def test_a_full_data_directory_disk_at_the_merge_is_named_and_a_resume_with_nothing_to_run_is_not_refused(
        tmp_path, model_dir):
    # Every answer is in, the outputs' disk too small: then the data directory's own disk
    # is filled. A rerun has nothing to run (no room check for a store it does not need);
    # its merge cannot copy the answers there, and says that disk, not the outputs'.
    from tests.consumer.tmpfs import fill, small_tmpfs

    small, disk = tmp_path / "small", tmp_path / "disk"
    with small_tmpfs(str(small), 64 << 10), small_tmpfs(str(disk), 64 << 20):
        args = slow_args(tmp_path, "--model", model_dir, slow=False)
        args[args.index("-o") + 1] = str(small / "out.jsonl")
        args[args.index("--data-dir") + 1] = str(disk / "data")
        failed = run_batch(*args)
        assert failed.returncode == 1 and "cannot write the outputs" in failed.stderr, failed.stderr
        filler = fill(str(disk))
        merge = run_batch(*args)
        assert merge.returncode == 1 and "Traceback" not in merge.stderr, merge.stderr
        assert "a run needs at least" not in merge.stderr, merge.stderr
        assert f"could not write its work files in {disk / 'data'}" in merge.stderr, merge.stderr
        assert "on the data directory's disk" in merge.stderr and "cannot write the outputs" not in merge.stderr
        os.unlink(filler)
        remounted = subprocess.run(["mount", "-o", "remount,size=4m", str(small)], capture_output=True, text=True)
        assert remounted.returncode == 0, remounted.stderr
        done = run_batch(*args)
        assert done.returncode == 0, done.stderr
        check_one_line_each(small / "out.jsonl")


def test_a_data_directory_whose_disk_fills_for_a_while_finishes_the_job_once_there_is_room(tmp_path, model_dir):
    from tests.consumer.tmpfs import fill

    disk = tmp_path / "disk"
    with data_dir_on_tmpfs(tmp_path, model_dir, disk, 64 << 20) as args:
        job = start_batch(*args)
        try:
            wait_until(lambda: answered_lines(disk / "data") >= 20 or job.poll() is not None, "answers")
            filler = fill(str(disk))
            time.sleep(3)  # several of the job's saves (every 2 s) meet the full disk
            os.unlink(filler)
            _out, err = job.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            if job.poll() is None:
                job.kill()
        assert job.returncode == 0 and "Traceback" not in err, err
        check_one_line_each(tmp_path / "out.jsonl")


@pytest.mark.campaign
def test_a_tokenizer_replaced_as_the_job_starts_decodes_no_answer(tmp_path, model_dir):
    """The swap lands between the job's copy of the model's files and its consumers' start:
    the sim's stop strings are found in text decoded by the copy, so no answer changes."""
    reference = tmp_path / "reference"
    reference.mkdir()
    records = [chat(f"r{k}", f"question {k}", stop=["e"], max_tokens=16) for k in range(300)]
    write_requests(reference / "in.jsonl", records)
    args = ["-o", "out.jsonl", "--data-dir", "data", "--config", str(write_config(tmp_path))]
    done = run_batch("-i", str(reference / "in.jsonl"), *fix(args, reference), "--model", model_dir)
    assert done.returncode == 0, done.stderr
    model = copy_model(model_dir, tmp_path / "m" / "tiny-llama")
    write_requests(tmp_path / "in.jsonl", records)
    job = start_batch("-i", str(tmp_path / "in.jsonl"), *fix(args, tmp_path), "--model", str(model))
    try:
        wait_until(lambda: (tmp_path / "data" / "job" / "model" / "tokenizer.json").exists() or job.poll() is not None,
                   "the job's copy of the model's files")
        tokenizer = json.loads((model / "tokenizer.json").read_text())
        tokenizer["decoder"] = {"type": "Sequence", "decoders": [tokenizer["decoder"], {
            "type": "Replace", "pattern": {"String": "e"}, "content": "Q"}]}
        (model / "tokenizer.json").write_text(json.dumps(tokenizer))
        job.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0
    assert texts(tmp_path / "out.jsonl") == texts(reference / "out.jsonl")


def write_config(tmp_path: Path) -> Path:
    config = tmp_path / "slow.toml"
    config.write_text(SLOW_CONFIG)
    return config


def fix(args: list[str], where: Path) -> list[str]:
    """`args` with its relative paths under `where`."""
    return [str(where / a) if a in ("out.jsonl", "data") else a for a in args]


def test_a_data_directory_on_a_disk_too_small_to_ever_hold_an_item_is_refused_at_once(tmp_path, model_dir):
    disk = tmp_path / "disk"
    with data_dir_on_tmpfs(tmp_path, model_dir, disk, 1 << 20) as args:
        done = run_batch(*args)
        assert done.returncode == 1 and "bytes free: a run needs at least" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and os.listdir(disk) == []


@contextmanager
def data_dir_on_tmpfs(tmp_path: Path, model_dir: str, disk: Path, size_bytes: int) -> Iterator[list[str]]:
    """A slow job's arguments with its data directory on a tmpfs of `size_bytes` at `disk`."""
    from tests.consumer.tmpfs import small_tmpfs

    with small_tmpfs(str(disk), size_bytes):
        args = slow_args(tmp_path, "--model", model_dir)
        args[args.index("--data-dir") + 1] = str(disk / "data")
        yield args


def test_a_completion_order_output_edited_in_place_between_runs_is_made_anew_whole(tmp_path, model_dir):
    args = slow_args(tmp_path, "--model", model_dir, "--output-order", "completion", cost=STOPPED_COST)
    stopped_after(args, tmp_path / "data", 20)
    out = tmp_path / "out.jsonl"
    lines = out.read_bytes().splitlines(keepends=True)
    assert len(lines) > 5
    with open(out, "r+b") as f:  # an editor saving in place: the same inode, a line fewer
        f.write(b"".join(lines[:4] + lines[5:]))
        f.truncate()
    done = run_batch(*args, *QUICK_RESUME)
    assert done.returncode == 0, done.stderr
    check_one_line_each(out)  # every line JSON, one per custom_id
