"""`pipeline serve` with the official `openai` client, unchanged: a batch's whole life,
cancel, expiry, list pagination, tenants that cannot see each other, a malformed upload,
and a server stopped (SIGTERM) and killed (-9) mid-batch that resumes with one line per
request. Real processes: the server, its run-batch jobs on the sim engine, the tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter

import psutil
import pytest

from tests.support.commands import one_line_error, pipeline
from tests.support.jobs import build_model, chat, completion, output_rows, run_batch, wait_until
from tests.support.repo import ROOT
from tests.support.service import (
    Server,
    ended,
    lines_of,
    modes,
    one_line_per_request,
    requests_file,
    upload,
    wait_batch,
)

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.integration

# Requests of a batch that lasts about half a minute on a slow server's sim engine, so a
# cancel, a deadline or a kill lands in it.
SLOW_REQUESTS = 1200
# A kill test's whole run: three server starts and a slow batch, on 2 busy cores.
LONG_TEST_S = 900
KEY_A = "sk-team-a-" + "a" * 24
KEY_B = "sk-team-b-" + "b" * 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture
def servers():
    started: list[Server] = []
    yield started
    for server in started:
        server.close()


def serve(servers: list, tmp_path, model_dir: str, *args: str, slow: bool = False) -> Server:
    server = Server(tmp_path, model_dir, *args, slow=slow).start()
    servers.append(server)
    return server


def test_a_batch_from_upload_to_its_output(tmp_path, model_dir, servers):
    server = serve(servers, tmp_path, model_dir)
    client = server.client()
    records = [chat(f"r{k}", f"question {k}") for k in range(20)] + \
        [chat("too-many", n=2, temperature=0)]  # refused by the job: a line in the error file
    source = upload(client, requests_file(tmp_path / "in.jsonl", records))
    assert (source.purpose, source.bytes, source.filename) == ("batch", (tmp_path / "in.jsonl").stat().st_size,
                                                               "in.jsonl")
    metadata = {"team": "a", "priority": "-1"}
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="90m",
                                  metadata=metadata)
    assert (batch.status, batch.request_counts.total, batch.metadata) == ("validating", 21, metadata)
    assert (batch.completion_window, batch.expires_at - batch.created_at) == ("90m", 90 * 60)
    done = wait_batch(client, batch.id, ended, "the batch to end")
    assert done.status == "completed", server.log()
    assert (done.request_counts.completed, done.request_counts.failed) == (20, 1)
    assert done.in_progress_at <= done.finalizing_at <= done.completed_at
    output, errors = one_line_per_request(client, done, records)
    assert all(row["response"]["status_code"] == 200 for row in output)
    assert [row["custom_id"] for row in errors] == ["too-many"]
    assert errors[0]["response"]["status_code"] == 400
    assert done.usage.input_tokens > 0 and done.model == "tiny-llama"
    listed = {f.id: f.purpose for f in client.files.list()}
    assert listed == {source.id: "batch", done.output_file_id: "batch_output", done.error_file_id: "batch_output"}
    assert modes(server.data_dir) == {("dir", 0o700), ("file", 0o600)}
    assert not os.listdir(server.data_dir / "jobs"), "a finished batch's job files are removed"
    status = pipeline("status", "--data-dir", str(server.data_dir))
    assert status.returncode == 0 and f"{done.id} completed" in status.stderr + status.stdout, status
    metrics = _get(server, "/metrics")
    assert 'shape_broker_service_batches{status="completed"} 1.0' in metrics
    assert _get(server, "/health") == '{"status":"ok"}'
    client.files.delete(done.output_file_id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(done.output_file_id)
    with pytest.raises(openai.ConflictError, match="Cannot cancel a batch with status 'completed'"):
        client.batches.cancel(done.id)


def test_a_malformed_upload_and_a_wrong_endpoint_are_400_with_openais_body(tmp_path, model_dir, servers):
    server = serve(servers, tmp_path, model_dir)
    client = server.client()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(chat("a")) + "\nnot json\n" + json.dumps(chat("a")) + "\n")
    with pytest.raises(openai.BadRequestError) as refused:
        upload(client, bad)
    error = refused.value.body
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", "file")
    assert "bad.jsonl:2:" in error["message"] and "bad.jsonl:3:" in error["message"]  # not JSON; custom_id twice
    assert str(tmp_path) not in error["message"]
    assert list(client.files.list()) == []
    source = upload(client, requests_file(tmp_path / "in.jsonl", [completion("c1")]))
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert refused.value.body["code"] == "mismatched_endpoint"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/completions", completion_window="24h")


def _cached_tokens(rows: list[dict]) -> int:
    return sum(row["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for row in rows)


def test_two_batches_run_on_one_node_and_share_its_cache(tmp_path, model_dir, servers):
    """Two batches over the same system prompts, submitted together: both run on the server's
    one node (its store and results, none of the jobs' own), and the second finds the prompts
    the first brought in the node's cache, where run one after the other through run-batch
    each job starts cold."""
    prompts = [f"You are agent {k}. " + " ".join(f"rule {k}.{j}: answer briefly and well." for j in range(40))
               for k in range(4)]
    jobs = [[chat(f"{name}{k}", f"question {name} {k}", system=prompts[k % 4]) for k in range(24)] for name in "ab"]
    files = [requests_file(tmp_path / f"{name}.jsonl", records) for name, records in zip("ab", jobs)]
    alone = 0
    for path in files:
        out = tmp_path / f"{path.stem}.out.jsonl"
        done = run_batch("-i", str(path), "-o", str(out), "--model", model_dir, "--engine", "sim")
        assert done.returncode == 0, done.stderr
        alone += _cached_tokens(output_rows(out))
    server = serve(servers, tmp_path, model_dir)
    client = server.client()
    batches = [client.batches.create(input_file_id=upload(client, path).id, endpoint="/v1/chat/completions",
                                     completion_window="24h") for path in files]
    together = 0
    for batch, records in zip(batches, jobs):
        done = wait_batch(client, batch.id, ended, "the batch to end")
        assert done.status == "completed", server.log()
        output, errors = one_line_per_request(client, done, records)
        assert errors == []
        together += _cached_tokens(output)
    assert together > alone, (together, alone)
    runs = list((server.data_dir / "node" / "results").iterdir())  # one node, started once
    assert len(runs) == 1 and sum(len(f.read_text().splitlines()) for f in runs[0].glob("*.jsonl")) == 48


def slow_batch(servers: list, tmp_path, model_dir: str, *args: str):
    """A slow server and a batch of SLOW_REQUESTS on it: (server, client, its input file, its
    requests, the batch as created)."""
    server = serve(servers, tmp_path, model_dir, *args, slow=True)
    client = server.client()
    records = [chat(f"r{k}", f"question {k}") for k in range(SLOW_REQUESTS)]
    source = upload(client, requests_file(tmp_path / "in.jsonl", records))
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    return server, client, source, records, batch


def test_cancel_mid_run_keeps_what_was_answered(tmp_path, model_dir, servers):
    server, client, _source, records, batch = slow_batch(servers, tmp_path, model_dir)
    wait_batch(client, batch.id, lambda b: b.request_counts.completed > 0, "the first answers")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    done = wait_batch(client, batch.id, ended, "the batch to end")
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at, server.log()
    output, errors = one_line_per_request(client, done, records)
    assert 0 < len(output) == done.request_counts.completed < SLOW_REQUESTS
    assert {row["error"]["code"] for row in errors} == {"batch_cancelled"}
    assert all(row["response"] is None for row in errors)
    # What the batch left queued on the node is answered without running it, not run.
    wait_until(lambda: "cancelled" in _node_statuses(server), "the node to skip the cancelled batch's items")
    statuses = _node_statuses(server)
    assert statuses["ok"] < SLOW_REQUESTS and statuses["ok"] + statuses["cancelled"] <= SLOW_REQUESTS, statuses


def _node_statuses(server: Server) -> Counter:
    """The statuses of the rows the node's consumers wrote."""
    rows = [json.loads(line) for path in (server.data_dir / "node" / "results").rglob("*.jsonl")
            for line in path.read_text().splitlines() if line.endswith("}")]
    return Counter(row["status"] for row in rows)


@pytest.mark.campaign
def test_a_batch_past_its_window_ends_expired_with_what_was_answered(tmp_path, model_dir, servers):
    server, client, _source, records, batch = slow_batch(servers, tmp_path, model_dir, "--test-completion-window-s",
                                                         "20")
    assert batch.expires_at == batch.created_at + 20
    done = wait_batch(client, batch.id, ended, "the batch to end")
    assert done.status == "expired" and done.expired_at >= done.expires_at, server.log()
    output, errors = one_line_per_request(client, done, records)
    assert len(output) == done.request_counts.completed < len(records)
    assert {row["error"]["code"] for row in errors} == {"batch_expired"}


def test_two_keys_cannot_see_each_others_objects_and_lists_page(tmp_path, model_dir, servers):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} team-a\n{KEY_B} team-b\n")
    keys.chmod(0o600)
    server = serve(servers, tmp_path, model_dir, "--api-keys", str(keys), slow=True)
    a, b = server.client(KEY_A), server.client(KEY_B)
    source = upload(a, requests_file(tmp_path / "in.jsonl", [chat(f"r{k}") for k in range(100)]))
    made = [a.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
            for _ in range(3)]
    newest_first = [batch.id for batch in reversed(made)]
    page = a.batches.list(limit=2)
    assert [x.id for x in page.data] == newest_first[:2] and page.has_more
    rest = a.batches.list(limit=2, after=page.data[-1].id)
    assert [x.id for x in rest.data] == newest_first[2:] and not rest.has_more
    assert [x.id for x in a.batches.list(limit=1)] == newest_first  # the client's own paging
    for call in (lambda: b.files.retrieve(source.id), lambda: b.files.content(source.id),
                 lambda: b.files.delete(source.id), lambda: b.batches.retrieve(made[0].id),
                 lambda: b.batches.cancel(made[0].id),
                 lambda: b.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as missing:
        b.batches.retrieve("batch_" + "0" * 24)
    assert str(missing.value.body["message"]).startswith("No batch found")
    assert list(b.files.list()) == [] and list(b.batches.list()) == []
    with pytest.raises(openai.AuthenticationError):
        server.client("sk-wrong-" + "x" * 20).files.list()
    seen_by_b, seen_by_a = _get(server, "/metrics", KEY_B), _get(server, "/metrics", KEY_A)
    assert "team-a" not in seen_by_b and not any(batch.id in seen_by_b for batch in made)
    counts_b = [line for line in seen_by_b.splitlines() if line.startswith("shape_broker_service_batches{")]
    assert counts_b and all(line.endswith(" 0.0") for line in counts_b)  # b has none of its own
    assert 'stored_bytes{tenant="team-a"}' in seen_by_a and "team-b" not in seen_by_a
    assert all(batch.id in seen_by_a for batch in made)
    assert KEY_A not in server.log() and KEY_B not in server.log()


@pytest.mark.campaign
@pytest.mark.timeout(LONG_TEST_S)
def test_a_server_stopped_then_killed_mid_batch_resumes_with_one_line_per_request(tmp_path, model_dir, servers):
    server, client, source, records, batch = slow_batch(servers, tmp_path, model_dir)
    first = wait_batch(client, batch.id, lambda b: b.request_counts.completed > 0, "the first answers")
    jobs = psutil.Process(server.process.pid).children()
    assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    assert not [job for job in jobs if job.is_running() and job.status() != psutil.STATUS_ZOMBIE]
    server.start()
    client = server.client()
    again = client.batches.retrieve(batch.id)
    assert again.status == "in_progress" and again.request_counts.completed >= first.request_counts.completed
    wait_batch(client, batch.id, lambda b: b.request_counts.completed > again.request_counts.completed,
               "answers after the restart")
    server.stop(signal.SIGKILL)
    server.start()
    client = server.client()
    assert [f.id for f in client.files.list()] == [source.id]
    done = wait_batch(client, batch.id, ended, "the batch to end")
    assert done.status == "completed", server.log()
    output, errors = one_line_per_request(client, done, records)
    assert len(output) == SLOW_REQUESTS and errors == []
    assert lines_of(client, done.output_file_id) == output


@pytest.mark.campaign
@pytest.mark.timeout(LONG_TEST_S)
def test_a_node_killed_mid_batch_is_started_again_and_the_batch_completes(tmp_path, model_dir, servers):
    server, client, source, records, batch = slow_batch(servers, tmp_path, model_dir)
    wait_batch(client, batch.id, lambda b: b.request_counts.completed > 0, "the first answers")
    found = [p for p in psutil.process_iter(["cmdline"]) if "pipeline.runtime.node" in (p.info["cmdline"] or [])
             and str(server.data_dir) in " ".join(p.info["cmdline"])]  # the node, and its broker and consumers
    nodes = [p for p in found if p.ppid() not in {q.pid for q in found}]
    assert len(nodes) == 1 and len(found) > 1, found
    nodes[0].kill()
    done = wait_batch(client, batch.id, ended, "the batch to end")
    assert done.status == "completed", server.log()
    output, errors = one_line_per_request(client, done, records)
    assert len(output) == SLOW_REQUESTS and errors == []


def test_serve_refuses_in_one_line(tmp_path, model_dir):
    def serve_command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pipeline", "serve", "--data-dir", str(tmp_path / "d"),
                               "--model", model_dir, "--engine", "sim", *args], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)

    one_line_error(serve_command("--host", "0.0.0.0"), "--api-keys")
    keys = tmp_path / "keys"
    keys.write_text("short\n")
    keys.chmod(0o600)
    one_line_error(serve_command("--api-keys", str(keys)), f"{keys}:1:")
    one_line_error(serve_command("--dtype", "bfloat16"), "--dtype")
    one_line_error(serve_command("--set", "storage=memory"), "storage")  # the node keeps every batch on disk
    assert not (tmp_path / "d").exists()


def _get(server: Server, path: str, key: str | None = None) -> str:
    import urllib.request

    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    request = urllib.request.Request(server.base_url.removesuffix("/v1") + path, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()
