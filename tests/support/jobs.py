"""Running `pipeline run-batch` as a user does, for the job tests: the tiny model, request
files, the command, and its output read back."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.support.repo import ROOT

# A run on 2 cores: the tiny model's tokenizer in the producers, 2 sim consumers.
RUN_TIMEOUT_S = 180
# Each batch of a slow run sleeps in the sim's cost model, so a job lasts seconds and a stop
# lands in the middle of it.
SLOW_CONFIG = "[engine_options]\ncost_s_per_padded_token = 2e-4\n"
SERVED = "tiny-llama"


# The tiny model built once for every test process (training its tokenizer takes 2.7 s of
# CPU; 19 test modules each built one), copied where a test wants it. Ignored by git.
MODEL_CACHE = ROOT / ".cache" / "tiny-llama-tests"


def build_model(path: Path) -> str:
    """The tiny model directory (tokenizer and chat template, no weights) at `path`."""
    sys.path.insert(0, str(ROOT))
    from tools.tiny_llama import build

    MODEL_CACHE.parent.mkdir(parents=True, exist_ok=True)
    with open(MODEL_CACHE.parent / "tiny-llama-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # xdist's workers: one builds, the others wait for it
        build(MODEL_CACHE)  # nothing when it is current
    shutil.copytree(MODEL_CACHE, path, dirs_exist_ok=True)
    return str(path)


def copy_model(model_dir: str, path: Path) -> Path:
    shutil.copytree(model_dir, path)
    return path


def chat(custom_id: str, content: str = "Hello there", system: str | None = "You are terse.", **body) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": SERVED, "messages": messages, "max_tokens": 4, **body}}


def completion(custom_id: str, prompt: object = "Once upon a time", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": SERVED, "prompt": prompt, "max_tokens": 4, **body}}


def embedding(custom_id: str, input: object = "A passage to embed", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": SERVED, "input": input, **body}}


def write_requests(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", "run-batch", "--engine", "sim", *args]


def run_batch(*args: str, timeout_s: float = RUN_TIMEOUT_S, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env)


def start_batch(*args: str) -> subprocess.Popen:
    return subprocess.Popen(command(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def output_rows(path: Path) -> list[dict]:
    raw = path.read_text()
    assert raw.endswith("\n") and raw.isascii()
    return [json.loads(line) for line in raw.splitlines()]


def check_output(path: Path, records: list[dict]) -> list[dict]:
    """Exactly one line per request, in input order; every well-formed request completed."""
    rows = output_rows(path)
    assert [row["custom_id"] for row in rows] == [r["custom_id"] for r in records]
    return rows


def rows_by_id(path: Path) -> dict[str, dict]:
    rows = output_rows(path)
    ids = [row["custom_id"] for row in rows]
    assert len(ids) == len(set(ids)), "a custom_id has two lines"
    return dict(zip(ids, rows))


def answered_lines(data: Path) -> int:
    """Result lines the consumers wrote so far (every run, every consumer)."""
    return sum(len(p.read_bytes().splitlines()) for p in data.glob("results/**/*.jsonl"))


def wait_until(ready, what: str, timeout_s: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def broker_pid(data: Path) -> int | None:
    try:
        return int((data / "run" / "broker.lock").read_text())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for_orphans(data: Path) -> None:
    """Until a killed run's broker is gone (its lock free): the next run starts its own."""
    wait_until(lambda: (pid := broker_pid(data)) is None or not alive(pid), "the killed run's broker to go")
