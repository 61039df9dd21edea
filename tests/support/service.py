"""`pipeline serve` as an operator runs it, for the service tests: the server process on a
data directory (its log in a file), the official `openai` client against it, and what its
batches leave read back."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.repo import ROOT

# A server starts in seconds; a batch of the tiny model on the sim engine ends in tens of
# seconds on 2 busy cores. Only a hung server is stopped by these.
START_TIMEOUT_S = 120
BATCH_TIMEOUT_S = 300
STOP_TIMEOUT_S = 120
ADDRESS = re.compile(r"http://127\.0\.0\.1:(\d+)/v1")
POLL_S = 0.2
# The sim's cost per padded token of a slow server's jobs: a batch of a few hundred chat
# requests then lasts tens of seconds, so a cancel, a deadline or a kill lands in it.
SLOW_COST_S = 5e-3


class Server:
    """One `pipeline serve` process on `data_dir` (started again by `start` after a stop)."""

    def __init__(self, tmp_path: Path, model_dir: str, *args: str, data_dir: Path | None = None,
                 slow: bool = False) -> None:
        """`slow`: its jobs' sim engine costs SLOW_COST_S per padded token."""
        self.tmp_path = tmp_path
        self.data_dir = data_dir or tmp_path / "d"
        self.args = ["--model", model_dir, "--engine", "sim", "--producers", "1", *args]
        if slow:
            config = tmp_path / "slow.toml"
            config.write_text(f"[engine_options]\ncost_s_per_padded_token = {SLOW_COST_S}\n")
            self.args += ["--config", str(config)]
        self.log_path = tmp_path / "server.log"
        self.process: subprocess.Popen | None = None
        self.base_url = ""

    def start(self) -> Server:
        with open(self.log_path, "a") as log:
            log.write("--- start\n")
        offset = self.log_path.stat().st_size
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pipeline", "serve", "--data-dir", str(self.data_dir), "--port", "0",
                 *self.args], stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=ROOT)
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            found = ADDRESS.search(self.log_path.read_bytes()[offset:].decode(errors="replace"))
            if found:
                self.base_url = f"http://127.0.0.1:{found.group(1)}/v1"
                return self
            assert self.process.poll() is None, f"the server exited ({self.process.returncode}):\n{self.log()}"
            assert time.monotonic() < deadline, f"the server did not start:\n{self.log()}"
            time.sleep(POLL_S)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, key: str = "no-key"):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=60)

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Send `signum` and wait for the server to exit; its exit status."""
        assert self.process is not None
        self.process.send_signal(signum)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()

    def close(self) -> None:
        """Stop it gracefully (its jobs stop with it), where it still runs."""
        if self.process is not None and self.process.poll() is None:
            self.stop(signal.SIGTERM)


def requests_file(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def upload(client, path: Path):
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch")


def wait_batch(client, batch_id: str, until, what: str, timeout_s: float = BATCH_TIMEOUT_S):
    """Poll the batch until `until(batch)`; the batch then."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {batch}"
        time.sleep(POLL_S)


def ended(batch) -> bool:
    return batch.status in ("completed", "failed", "expired", "cancelled")


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    text = client.files.content(file_id).read().decode()
    assert text.endswith("\n")
    return [json.loads(line) for line in io.StringIO(text)]


def one_line_per_request(client, batch, records: list[dict]) -> tuple[list[dict], list[dict]]:
    """The batch's output and error lines: exactly one per custom_id of the input, across both."""
    output, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    ids = [row["custom_id"] for row in output + errors]
    assert len(ids) == len(set(ids)), "a custom_id has two lines"
    assert sorted(ids) == sorted(r["custom_id"] for r in records)
    return output, errors


def modes(data_dir: Path) -> set[tuple[str, int]]:
    """Every (kind, mode) under `data_dir`: 0700 directories and 0600 files."""
    found = set()
    for root, dirs, files in os.walk(data_dir):
        found.add(("dir", os.stat(root).st_mode & 0o777))
        found.update(("file", os.stat(os.path.join(root, name)).st_mode & 0o777) for name in files)
    return found
