"""vLLM's engine flags on `pipeline run-batch`, as a user types them: the context a job checks
prompts against, a chat template given on the command line (and counted in the job), the
GPUs each engine takes; flags the run cannot take refused in one line before anything
starts. Real commands, the sim engine, the tiny model, GPUs named by CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
import resource
import subprocess

import pytest

from tests.support.jobs import ROOT, RUN_TIMEOUT_S, build_model, chat, command, rows_by_id, run_batch, write_requests

pytestmark = pytest.mark.integration

# A template of our own: every message's content, nothing else (the tiny model's own
# wraps each turn in header tokens, so the same requests make longer prompts).
BARE_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def refused(done, *words: str) -> None:
    """Refused with one error (a job's mismatch lists its changes on the lines after it)."""
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


def test_max_model_len_is_the_context_prompts_and_max_tokens_are_checked_against(tmp_path, model_dir):
    records = [chat("short", "hi", system=None, max_tokens=4), chat("long", "word " * 80, system=None),
               chat("asks-too-much", "hi", system=None, max_tokens=60)]
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", records)), "-o", str(out), "--model", model_dir,
                     "--max-model-len", "64")
    assert done.returncode == 0, done.stderr
    rows = rows_by_id(out)
    assert rows["short"]["response"]["status_code"] == 200
    long = rows["long"]["response"]["body"]["error"]
    assert long["code"] == "context_length_exceeded" and "more than the 63" in long["message"]
    assert "maximum context length is 64 tokens" in rows["asks-too-much"]["response"]["body"]["error"]["message"]


def test_a_chat_template_on_the_command_line_makes_the_prompts_and_is_part_of_the_job(tmp_path, model_dir):
    records = [chat(f"r{k}", f"question {k}") for k in range(6)]
    requests = write_requests(tmp_path / "in.jsonl", records)
    template = tmp_path / "bare.jinja"
    template.write_text(BARE_TEMPLATE)

    def prompt_tokens(out, *flags: str) -> int:
        done = run_batch("-i", str(requests), "-o", str(out), "--model", model_dir, *flags)
        assert done.returncode == 0, done.stderr
        return sum(row["response"]["body"]["usage"]["prompt_tokens"] for row in rows_by_id(out).values())

    own = prompt_tokens(tmp_path / "own.jsonl")
    bare = prompt_tokens(tmp_path / "bare.jsonl", "--chat-template", str(template))
    inline = prompt_tokens(tmp_path / "inline.jsonl", "--chat-template", BARE_TEMPLATE)  # the text itself, as vLLM
    assert bare == inline < own
    data = tmp_path / "job.run"
    args = ["-i", str(requests), "-o", str(tmp_path / "kept.jsonl"), "--model", model_dir, "--data-dir", str(data)]
    assert run_batch(*args, "--chat-template", str(template)).returncode == 0
    template.write_text(BARE_TEMPLATE + "!")  # the same path, another template: another job
    refused(run_batch(*args, "--chat-template", str(template), "--overwrite"),
                   "chat template (--chat-template): xxh3 ")


@pytest.mark.parametrize("visible, flags, names", [
    ("0,1,2,3", ["-tp", "2"], ["gpu0_1", "gpu2_3"]),
    ("0,1,2,3", ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"], ["gpu0_1_2_3"]),
])
def test_each_consumer_is_one_engine_over_tensor_times_pipeline_parallel_gpus(tmp_path, model_dir, visible, flags,
                                                                              names):
    data = tmp_path / "data"
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", [chat("a"), chat("b")])), "-o",
                     str(tmp_path / "out.jsonl"), "--model", model_dir, "--data-dir", str(data), *flags,
                     env={**os.environ, "CUDA_VISIBLE_DEVICES": visible})
    assert done.returncode == 0, done.stderr
    assert sorted(p.stem for p in data.glob("results/run-*/*.jsonl")) == names


@pytest.mark.parametrize("visible, flags, words", [
    ("0,1,2", ["-tp", "2"], ["3 GPUs (0,1,2) do not divide into engines of 2"]),
    ("0,1", ["-tp", "4"], ["an engine of 4 GPUs", "only 2 are visible"]),
    ("", ["--gpu-memory-utilization", "0.8"], ["--gpu-memory-utilization: not options of this command",
                                               "the sim engine takes of them only --max-model-len"]),
    ("", ["--seed", "1"], ["--seed: vLLM's engine flag, and the sim engine makes up its outputs"]),
    ("", ["--max-model-len", "auto"], ["--max-model-len auto", "known only once vLLM has loaded"]),
    ("", ["--max-tokens", "4096"], ["--max-tokens: now --max-batch-tokens"]),
    ("", ["--chat-template", "/nonexistent/t.jinja"], ["--chat-template /nonexistent/t.jinja: looks like a file's path"]),
    ("", ["--chat-template", "{% for %}"], ["--chat-template: the chat template does not compile"]),
])
def test_what_a_run_cannot_take_is_refused_before_anything_starts(tmp_path, model_dir, visible, flags, words):
    data = tmp_path / "data"
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", [chat("a")])), "-o", str(tmp_path / "out.jsonl"),
                     "--model", model_dir, "--data-dir", str(data), *flags,
                     env={**os.environ, "CUDA_VISIBLE_DEVICES": visible})
    refused(done, *words)
    assert not data.exists() and "checking" not in done.stderr and "same command" not in done.stderr


def test_a_descriptor_limit_the_broker_cannot_run_under_is_refused_before_the_input_is_read(tmp_path, model_dir):
    data = tmp_path / "data"
    args = command("-i", str(write_requests(tmp_path / "in.jsonl", [chat("a")])), "-o", str(tmp_path / "out.jsonl"),
                   "--model", model_dir, "--data-dir", str(data))
    done = subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    refused(done, "the descriptor limit (ulimit -n) is 64: a broker needs at least", "raise it (ulimit -n 1024)")
    assert not data.exists() and "same command" not in done.stderr
