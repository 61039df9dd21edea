"""A consumer's results and registration going wrong, with real processes: a real broker, a
real producer, consumers as their own processes, a real small tmpfs for the full disk.

    a torn results tail       terminated before the next line is appended; read as one bad line
    results disk full         back off (doubling), hand back what it holds, finish once space is back
    another write error       fatal (status 2, one line naming path and errno), nothing lost
    a refused registration    fatal (status 2) with the broker's reason, never retried
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.broker.config import BrokerConfig
from pipeline.consumer.config import ConsumerConfig
from pipeline.reporting.accounting import summarize_results
from pipeline.runtime.local import start_consumer
from tests.consumer.tmpfs import fill, small_tmpfs
from tests.pipeline.harness import Workload, produce, start_broker, status, stop, wait_until
from tests.support.repo import ROOT

pytestmark = pytest.mark.integration

PAGE_BYTES = 4096
# Generous: these only keep a hang from hanging the suite; nothing is timed.
WAIT_S = 60.0
# The consumer as a command of its own (stderr captured): the stage command's logging and exit
# status, with a config the command line does not expose (the full-disk waits).
CONSUMER_MAIN = (
    "import json, sys\n"
    "from pipeline.cli.common import setup_logging\n"
    "from pipeline.consumer.config import ConsumerConfig\n"
    "from pipeline.runtime.processes import serve_consumer\n"
    "setup_logging(True)\n"
    "sys.exit(serve_consumer(ConsumerConfig(**json.loads(sys.argv[1]))))\n"
)
FULL_RE = re.compile(r"c0: results disk full: (.+); handing back (\d+) batches, retrying in ([0-9.e+-]+) s")


def spawn_consumer(stderr, preexec_fn=None, **config) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CONSUMER_MAIN, json.dumps(config)], stderr=stderr,
                            stdout=subprocess.DEVNULL, cwd=ROOT, preexec_fn=preexec_fn)


def end(process: subprocess.Popen) -> int:
    """SIGTERM (a graceful stop), then its exit status; SIGKILL if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def result_lines(path) -> list[dict]:
    """Every line of a results file, each of which must be a whole JSON line."""
    data = Path(path).read_bytes()
    assert not data or data.endswith(b"\n"), f"{path} ends in a partial line: {data[-80:]!r}"
    return [json.loads(line) for line in data.splitlines()]


def test_a_torn_results_tail_is_terminated_before_a_consumer_appends(tmp_path):
    data, results = str(tmp_path / "data"), tmp_path / "results"
    results.mkdir()
    path = results / "c0.jsonl"
    kept = json.dumps({"item_id": 1 << 60, "status": "ok", "prompt_tokens": 5, "cached_tokens": 0}).encode() + b"\n"
    torn = b'{"item_id":12,"batch_id":3,"dispatch_ns":99,"sta'  # a consumer killed mid-write
    path.write_bytes(kept + torn)
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    workload = Workload(shapes=3, items_per_producer=200, producers=1)
    consumer = start_consumer(ConsumerConfig(socket_path, str(results), "c0"))
    try:
        produce(socket_path, workload, 0)
        wait_until(lambda: status(socket_path).items_completed == 200, WAIT_S, "every item completed")
    finally:
        assert stop(consumer) == 0
        assert stop(broker) == 0
    raw = path.read_bytes().split(b"\n")
    assert raw[0] + b"\n" == kept and raw[1] == torn  # the evidence kept, terminated where it stood
    rows = [json.loads(line) for line in raw[2:-1]]
    assert raw[-1] == b"" and len({row["item_id"] for row in rows}) == 200
    summary = summarize_results(str(results))
    assert summary.items == 201 and summary.duplicates == 0 and summary.torn_lines == 0
    assert summary.bad_lines == 1 and len(summary.bad_line_examples) == 1
    assert summary.bad_line_examples[0].startswith(f"{path}:2: not JSON")


def test_a_full_results_disk_makes_the_consumer_back_off_hand_back_and_finish(tmp_path):
    data = str(tmp_path / "data")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    first_s, max_s = 0.05, 0.4
    log_path = tmp_path / "c0.log"
    try:
        with small_tmpfs(str(tmp_path / "results")) as results:
            # Room for about one batch's lines: the next one fills the disk in its middle.
            filler = fill(results, leave_bytes=2 * PAGE_BYTES)
            workload = Workload(shapes=3, items_per_producer=300, producers=1)
            produce(socket_path, workload, 0)  # every item stored before the consumer starts
            with open(log_path, "wb") as log_file:
                consumer = spawn_consumer(log_file, socket_path=socket_path, results_dir=results, name="c0",
                                          max_batch_items=16, results_full_first_wait_s=first_s,
                                          results_full_max_wait_s=max_s)
            try:
                wait_until(lambda: len(FULL_RE.findall(log_path.read_text())) >= 5, WAIT_S,
                           "five 'results disk full' warnings")
                result_lines(os.path.join(results, "c0.jsonl"))  # whole lines only, while full
                os.remove(filler)  # space comes back
                wait_until(lambda: status(socket_path).items_completed == 300, WAIT_S, "every item completed")
                final = status(socket_path)
            finally:
                code = end(consumer)
            assert code == 0
            rows = result_lines(os.path.join(results, "c0.jsonl"))
            summary = summarize_results(results)
    finally:
        assert stop(broker) == 0
    log = log_path.read_text()
    assert "Traceback" not in log, log
    full = FULL_RE.findall(log)
    waits = [float(wait) for _, _, wait in full]
    assert waits[0] == first_s
    for before, after in zip(waits, waits[1:]):  # doubling to the cap; first_s again after a write
        assert after in (first_s, min(2 * before, max_s)), waits
    assert all(int(held) >= 1 for _, held, _ in full)
    assert all(why.startswith(f"{results}/c0.jsonl: writing ") and "ENOSPC" in why for why, _, _ in full)
    # One registration per wait and the first one: a tight loop made thousands.
    registrations = final.consumers["c0"].consumer_id + 1
    assert registrations <= len(full) + 1, (registrations, len(full))
    assert summary.items == 300 and summary.bad_lines == 0 and summary.lines == len(rows)
    # Duplicates would be counted, but there are none: a batch whose write failed kept no
    # line and was never reported complete, so its redelivery wrote its only lines.
    assert summary.duplicates == 0
    assert final.items_completed == 300 and final.pending_items == 0 and final.backlog_items == 0


def test_an_error_writing_results_other_than_disk_full_is_fatal_and_loses_nothing(tmp_path):
    # EFBIG: the file size limit of the consumer's process (Python ignores SIGXFSZ), reached
    # in the middle of its second batch.
    data, results = str(tmp_path / "data"), str(tmp_path / "results")
    broker = start_broker(data)
    socket_path = BrokerConfig(data).socket_path
    limit = 6 << 10

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    try:
        produce(socket_path, Workload(shapes=3, items_per_producer=300, producers=1), 0)
        consumer = spawn_consumer(subprocess.PIPE, limit_file_size, socket_path=socket_path, results_dir=results,
                                  name="c0", max_batch_items=16)
        try:
            _, stderr = consumer.communicate(timeout=WAIT_S)  # it stops by itself
        finally:
            end(consumer)
        stderr = stderr.decode()
        path = os.path.join(results, "c0.jsonl")
        assert consumer.returncode == 2, stderr
        assert "Traceback" not in stderr, stderr
        critical = [line for line in stderr.splitlines() if " CRITICAL: " in line]
        assert len(critical) == 1 and f"{path}: writing " in critical[0] and "EFBIG" in critical[0], stderr
        # Its goodbye gave back what it held; what it completed is exactly what it wrote.
        wait_until(lambda: status(socket_path).pending_items == 0, WAIT_S, "the batches handed back")
        written = result_lines(path)
        assert 0 < len(written) and os.path.getsize(path) <= limit
        assert status(socket_path).items_completed == len(written)
        again = start_consumer(ConsumerConfig(socket_path, results, "c0"))
        try:
            wait_until(lambda: status(socket_path).items_completed == 300, WAIT_S, "every item completed")
        finally:
            assert stop(again) == 0
    finally:
        assert stop(broker) == 0
    summary = summarize_results(results)
    assert summary.items == 300 and summary.duplicates == 0 and summary.bad_lines == 0
    assert result_lines(path)[:len(written)] == written  # nothing written before was lost


def test_a_registration_the_broker_refuses_is_fatal_with_its_reason(tmp_path):
    # 20,000-item descriptors do not fit the broker's descriptor ring.
    data = str(tmp_path / "data")
    broker = start_broker(data)
    try:
        done = subprocess.run([sys.executable, "-m", "pipeline", "consumer", "start", "--data-dir", data,
                               "--name", "c0", "--max-batch", "20000"], capture_output=True, text=True,
                              timeout=WAIT_S, cwd=ROOT)
        registered = status(BrokerConfig(data).socket_path).consumers
    finally:
        assert stop(broker) == 0
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    critical = [line for line in done.stderr.splitlines() if " CRITICAL: " in line]
    assert len(critical) == 1, done.stderr
    assert "refused consumer 'c0'" in critical[0] and "max_batch_items 20000" in critical[0], critical
    assert "retrying" not in done.stderr and registered == {}
