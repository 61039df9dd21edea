"""A bad request, however bad, is answered as an error line and never takes another request
or the job with it; foreign code (the chat template, the tokenizer) runs under a time and
memory limit per request; every option is checked before the job starts. Real commands,
the sim engine, the tiny model (or a copy of it with a hostile template)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.jobs import build_model, chat, completion, copy_model, rows_by_id, run_batch, write_requests

pytestmark = pytest.mark.integration

# The tiny model's template, with a branch that misbehaves on one request's content.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
HANGS = ("{% if messages[-1]['content'] == 'hang' %}{% for i in range(100000) %}{% for j in range(100000) %}"
         "{% endfor %}{% endfor %}{% endif %}" + TEMPLATE)
GROWS = ("{% if messages[-1]['content'] == 'grow' %}{% set s = namespace(x='ab') %}{% for i in range(60) %}"
         "{% set s.x = s.x ~ s.x %}{% endfor %}{{ s.x | length }}{% endif %}" + TEMPLATE)
HUGE_AT_LOAD = "{% if messages[-1]['content'] == 'huge' %}{{ 'A' * 3000000000 }}{% endif %}" + TEMPLATE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def hostile_model(model_dir: str, tmp_path: Path, template: str) -> str:
    path = copy_model(model_dir, tmp_path / "tiny-llama")
    (path / "chat_template.jinja").write_text(template)
    return str(path)


def good(count: int) -> list[dict]:
    return [chat(f"ok-{k}", f"question {k}") for k in range(count)]


def answered(tmp_path: Path, model_dir: str, records: list[dict], *args: str) -> dict[str, dict]:
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", records)), "-o", str(out), "--model", model_dir,
                     "--overwrite", *args)
    assert done.returncode == 0, done.stderr
    rows = rows_by_id(out)
    assert set(rows) == {r["custom_id"] for r in records}
    for record in records:
        if record["custom_id"].startswith("ok-"):
            assert rows[record["custom_id"]]["response"]["status_code"] == 200, rows[record["custom_id"]]
    return rows


def error_of(rows: dict[str, dict], custom_id: str) -> dict:
    row = rows[custom_id]
    assert row["response"]["status_code"] == 400, row
    return row["response"]["body"]["error"]


def test_lone_surrogates_are_answered_400_and_the_rest_run(tmp_path, model_dir):
    records = good(4) + [chat("bad-chat", "a \ud800 b"), completion("bad-prompt", "x \udfff"),
                         chat("bad-system", "fine", system="sys \ud83d")]
    rows = answered(tmp_path, model_dir, records)
    for name in ("bad-chat", "bad-prompt", "bad-system"):
        assert error_of(rows, name)["message"]


def test_a_prompt_past_the_brokers_item_cap_is_answered_at_the_producer(tmp_path, model_dir):
    big = copy_model(model_dir, tmp_path / "big-context" / "tiny-llama")
    config = json.loads((big / "config.json").read_text())
    config["max_position_embeddings"] = 1_000_000  # above the broker's 262,144-token item cap
    (big / "config.json").write_text(json.dumps(config))
    records = good(3) + [completion("huge", [5] * 262_145), completion("at-cap", [5] * 262_144, max_tokens=1)]
    rows = answered(tmp_path, str(big), records)
    error = error_of(rows, "huge")
    assert "262,145 tokens" in error["message"] and "262,144" in error["message"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert rows["at-cap"]["response"]["status_code"] == 200


def test_max_tokens_past_the_context_and_temperature_past_two_are_refused_per_request(tmp_path, model_dir):
    records = good(3) + [chat("long-ask", max_tokens=1_048_576), chat("hot", temperature=3),
                         chat("fits", max_tokens=2000)]
    rows = answered(tmp_path, model_dir, records)
    assert "maximum context length is 2048" in error_of(rows, "long-ask")["message"]
    assert error_of(rows, "long-ask")["param"] == "max_tokens" or "max_tokens" in error_of(rows, "long-ask")["message"]
    assert error_of(rows, "hot")["param"] == "temperature"
    assert rows["fits"]["response"]["status_code"] == 200


def test_a_template_that_never_ends_is_stopped_at_the_time_limit_and_answered_400(tmp_path, model_dir):
    model = hostile_model(model_dir, tmp_path, HANGS)
    records = good(3) + [chat("bad", "hang")] + good(6)[3:]
    rows = answered(tmp_path, model, records, "--prompt-time-limit-s", "1")
    message = error_of(rows, "bad")["message"]
    assert "time limit" in message and "--prompt-time-limit-s" in message


def test_a_template_that_grows_without_end_meets_the_memory_limit(tmp_path, model_dir):
    model = hostile_model(model_dir, tmp_path, GROWS)
    rows = answered(tmp_path, model, good(3) + [chat("bad", "grow")], "--prompt-memory-limit-mb", "256")
    assert "memory limit" in error_of(rows, "bad")["message"]


def test_a_template_with_a_huge_constant_loads_and_fails_only_the_request_that_reaches_it(tmp_path, model_dir):
    model = hostile_model(model_dir, tmp_path, HUGE_AT_LOAD)
    rows = answered(tmp_path, model, good(3) + [chat("bad", "huge")], "--prompt-memory-limit-mb", "256")
    assert "memory limit" in error_of(rows, "bad")["message"]


def test_a_text_too_large_to_tokenize_within_the_memory_limit_is_answered_400_before_it_is_tokenized(tmp_path,
                                                                                                      model_dir):
    """64 MiB of prompt memory holds the tokenizing of about 400 KiB of text: a 600 KB prompt
    is refused saying so (the Rust tokenizer would abort the producer), one of 300 KB runs."""
    records = good(3) + [chat("ok-fits", "word " * 60_000), chat("bad", "word " * 120_000)]
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", records)), "-o", str(tmp_path / "out.jsonl"),
                     "--model", model_dir, "--prompt-memory-limit-mb", "64", "--max-model-len", "200000",
                     "--max-input-len", "200000")
    assert done.returncode == 0, done.stderr
    rows = rows_by_id(tmp_path / "out.jsonl")
    message = error_of(rows, "bad")["message"]
    assert "bytes: tokenizing it takes about" in message and "--prompt-memory-limit-mb" in message, message
    assert rows["ok-fits"]["response"]["status_code"] == 200
    assert "starts again" not in done.stderr  # no producer died on it


def one_line_error(done, *words: str) -> None:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


@pytest.mark.parametrize("value, words", [("\"2048\"", ["max_position_embeddings", "config.json"]),
                                          ("1000000000000", ["max_position_embeddings", "config.json"])])
def test_a_broken_context_length_in_the_models_config_is_a_one_line_error(tmp_path, model_dir, value, words):
    broken = copy_model(model_dir, tmp_path / "broken")
    config = (broken / "config.json").read_text().replace('"max_position_embeddings": 2048',
                                                          f'"max_position_embeddings": {value}')
    (broken / "config.json").write_text(config)
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", good(2))), "-o", str(tmp_path / "out.jsonl"),
                     "--model", str(broken))
    one_line_error(done, *words, "--max-model-len")
    assert "--max-input-len" not in done.stderr  # it bounds prompts, and the context is still needed
    assert not (tmp_path / "out.jsonl.run").exists()
    given = run_batch("-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model", str(broken),
                      "--max-model-len", "2048", "--max-input-len", "100")  # what the message says works
    assert given.returncode == 0, given.stderr
    assert len(rows_by_id(tmp_path / "out.jsonl")) == 2


@pytest.mark.parametrize("config, words", [("items = 5\n", ["items", "not settings of a batch job"]),
                                           ("workload = \"demo\"\n", ["workload"]),
                                           ("[broker]\nmin_consumers = 5\n", ["min_consumers", "consumers"])])
def test_settings_that_cannot_work_are_refused_before_the_job_starts(tmp_path, model_dir, config, words):
    path = tmp_path / "run.toml"
    path.write_text(config)
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", good(2))), "-o", str(tmp_path / "out.jsonl"),
                     "--model", model_dir, "--config", str(path))
    one_line_error(done, *words)
    assert not (tmp_path / "out.jsonl").exists()


def test_a_data_directory_in_the_config_file_is_the_jobs(tmp_path, model_dir):
    path = tmp_path / "run.toml"
    path.write_text(f"data_dir = \"{tmp_path / 'from-config'}\"\n")
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", good(2))), "-o", str(tmp_path / "out.jsonl"),
                     "--model", model_dir, "--config", str(path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "from-config" / "job" / "manifest.json").exists()  # given, so kept


def test_plots_without_matplotlib_are_refused_before_the_job_starts(tmp_path, model_dir):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\nclass _NoPlots:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'matplotlib' or name.startswith('matplotlib.'):\n"
        "            raise ModuleNotFoundError(name)\n        return None\nsys.meta_path.insert(0, _NoPlots())\n")
    import os

    env = dict(os.environ, PYTHONPATH=f"{blocker}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", good(2))), "-o", str(tmp_path / "out.jsonl"),
                     "--model", model_dir, "--set", f"plots={tmp_path / 'charts'}", env=env)
    one_line_error(done, "matplotlib")
    assert not (tmp_path / "out.jsonl").exists()


def hostile_decoder_model(model_dir: str, tmp_path: Path, replacement: str, then: tuple[str, str] | None = None) -> str:
    """A copy of the tiny model whose tokenizer's decoder turns each token into `replacement`
    (then replaces the regex `then[0]` with `then[1]`)."""
    path = copy_model(model_dir, tmp_path / "tiny-llama")
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    steps = [{"type": "Replace", "pattern": {"Regex": "[\\s\\S]+"}, "content": replacement}]
    if then is not None:
        steps.append({"type": "Replace", "pattern": {"Regex": then[0]}, "content": then[1]})
    tokenizer["decoder"] = {"type": "Sequence", "decoders": steps}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(path)


def server_error_of(rows: dict[str, dict], custom_id: str) -> str:
    row = rows[custom_id]
    assert row["response"]["status_code"] == 500, row
    return row["response"]["body"]["error"]["message"]


def test_a_decoder_that_panics_answers_each_request_500_and_the_job_finishes(tmp_path, model_dir):
    model = hostile_decoder_model(model_dir, tmp_path, "x" * 40, then=("(x+x+)+y", "z"))  # onig's retry limit
    records = [chat("a"), completion("b"), chat("c", logprobs=True, top_logprobs=2)]
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", records)), "-o", str(out), "--model", model)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    rows = rows_by_id(out)
    for custom_id in ("a", "b", "c"):
        assert "failed to decode the answer: PanicException" in server_error_of(rows, custom_id)


def test_a_decoder_that_expands_each_token_is_refused_at_the_answer_text_limit(tmp_path, model_dir):
    from pipeline.wire.generation import MAX_ANSWER_TEXT_CHARS

    model = hostile_decoder_model(model_dir, tmp_path, "x" * (1 << 20))  # a MiB a token
    at_limit = MAX_ANSWER_TEXT_CHARS >> 20
    records = [chat("long", max_tokens=4 * at_limit, ignore_eos=True),
               chat("at-limit", max_tokens=at_limit, ignore_eos=True),
               chat("past", max_tokens=at_limit + 1, ignore_eos=True)]
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", records)), "-o", str(out), "--model", model)
    assert done.returncode == 0, done.stderr
    rows = rows_by_id(out)
    assert rows["at-limit"]["response"]["body"]["choices"][0]["message"]["content"] == "x" * MAX_ANSWER_TEXT_CHARS
    for custom_id in ("long", "past"):
        assert f"more than {MAX_ANSWER_TEXT_CHARS:,} (its decoder expands tokens)" in server_error_of(rows, custom_id)
    assert out.stat().st_size < 2 * MAX_ANSWER_TEXT_CHARS
