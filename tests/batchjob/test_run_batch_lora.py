"""`pipeline run-batch --lora-modules` on the sim engine: a request naming an adapter runs on
it (its answers other than the base model's, the same every run, the response naming the
adapter), each adapter a model of its own to the broker, a model neither served nor an
adapter refused naming them, and the job pinned to its adapters' contents."""

from __future__ import annotations

import pytest

from tests.support.jobs import build_model, chat, rows_by_id, run_batch, write_requests

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def _adapter(path) -> str:
    path.mkdir()
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}')
    (path / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    return str(path)


def _answers(rows: dict) -> dict[str, tuple[str, str]]:
    return {name: (row["response"]["body"]["model"], row["response"]["body"]["choices"][0]["message"]["content"])
            for name, row in rows.items() if row["response"]["status_code"] == 200}


def test_requests_naming_adapters_run_on_them_with_answers_of_their_own(tmp_path, model_dir):
    sql, chat_adapter = _adapter(tmp_path / "sql"), _adapter(tmp_path / "chat")
    records = [chat(f"{model}-{k}", f"question {k}", model=model, temperature=0, max_tokens=6)
               for k in range(5) for model in ("tiny-llama", "sql", "chat")]
    records.append(chat("unknown", model="neither"))
    source = write_requests(tmp_path / "r.jsonl", records)
    flags = ("--model", model_dir, "--consumers", "3", "--lora-modules", f"sql={sql}",
             f'{{"name": "chat", "path": "{chat_adapter}"}}')
    done = run_batch("-i", str(source), "-o", str(tmp_path / "out.jsonl"), *flags)
    assert done.returncode == 0, done.stderr
    rows = rows_by_id(tmp_path / "out.jsonl")
    answers = _answers(rows)
    for k in range(5):
        base, on_sql, on_chat = (answers[f"{m}-{k}"] for m in ("tiny-llama", "sql", "chat"))
        assert (base[0], on_sql[0], on_chat[0]) == ("tiny-llama", "sql", "chat")  # the model each ran on
        assert len({base[1], on_sql[1], on_chat[1]}) == 3, (base, on_sql, on_chat)
    error = rows["unknown"]["response"]["body"]["error"]
    assert error["param"] == "model" and "the LoRA adapters 'sql', 'chat'" in error["message"]
    again = run_batch("-i", str(source), "-o", str(tmp_path / "again.jsonl"), *flags)
    assert again.returncode == 0, again.stderr
    assert _answers(rows_by_id(tmp_path / "again.jsonl")) == answers  # the same adapter, the same answers


def test_fewer_consumers_than_models_is_refused_in_one_line_before_the_input_is_read(tmp_path, model_dir):
    flags = ("--model", model_dir, "--lora-modules", f"la={_adapter(tmp_path / 'a')}", f"lb={_adapter(tmp_path / 'b')}")
    source = write_requests(tmp_path / "r.jsonl", [chat(f"r{k}") for k in range(30)])
    done = run_batch("-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--data-dir", str(tmp_path / "data"),
                     *flags)  # 2 consumers by default
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("Error: --lora-modules: the base model and 2 LoRA adapters are 3 models, each "
                                  "served by a consumer of its own, and this run starts 2 consumers: pass "
                                  "--consumers 3 or more")
    assert not (tmp_path / "data").exists() and not (tmp_path / "out.jsonl").exists()
    at_the_limit = run_batch("-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--consumers", "3", *flags)
    assert at_the_limit.returncode == 0, at_the_limit.stderr


def test_a_job_resumed_with_an_adapter_whose_weights_changed_is_refused_naming_it(tmp_path, model_dir):
    sql = _adapter(tmp_path / "sql")
    source = write_requests(tmp_path / "r.jsonl", [chat("a", model="sql"), chat("b")])
    flags = ("--model", model_dir, "--lora-modules", f"sql={sql}", "--data-dir", str(tmp_path / "data"),
             "--keep-data-dir")
    first = run_batch("-i", str(source), "-o", str(tmp_path / "out.jsonl"), *flags)
    assert first.returncode == 0, first.stderr
    (tmp_path / "sql" / "adapter_model.safetensors").write_bytes(b"\1" * 64)
    resumed = run_batch("-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--overwrite", *flags)
    assert resumed.returncode == 1 and "LoRA adapter sql" in resumed.stderr, resumed.stderr
