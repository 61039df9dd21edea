"""vLLM's sampling and output parameters through `pipeline run-batch --engine sim`: carried
to the engine per request and answered in OpenAI's format (n choices, logprobs objects,
tool calls, echo), with vLLM's server's defaults; what vLLM refuses answered 400 naming the
parameter. Real commands, the sim engine (its made-up answers have a real answer's shape),
the tiny model with a template that renders tools and a template argument."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.jobs import build_model, chat, completion, copy_model, rows_by_id, run_batch, write_requests

pytestmark = pytest.mark.integration

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# The tiny model's template (Llama 3's turns), with the tools and a `terse` argument rendered.
TEMPLATE = ("{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools: {{ tools | tojson }}"
            "<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] }}<|eot_id|>{% endfor %}{% if terse %}Be terse.{% endif %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
EOS_TEXT = "<|end_of_text|>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = copy_model(build_model(tmp_path_factory.mktemp("model") / "base"), tmp_path_factory.mktemp("m") / "tiny")
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return str(path)


def run(tmp_path: Path, model_dir: str, records: list[dict], *args: str) -> dict[str, dict]:
    tmp_path.mkdir(exist_ok=True)
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", records)), "-o", str(out), "--model", model_dir,
                     "--served-model-name", "tiny-llama", "--overwrite", "--producers", "1", *args)
    assert done.returncode == 0, done.stderr
    return {cid: row["response"] for cid, row in rows_by_id(out).items()}


def body(responses: dict[str, dict], custom_id: str) -> dict:
    response = responses[custom_id]
    assert response["status_code"] == 200, response
    return response["body"]


def error(responses: dict[str, dict], custom_id: str) -> dict:
    response = responses[custom_id]
    assert response["status_code"] == 400, response
    return response["body"]["error"]


def test_every_parameter_is_carried_and_answered_in_openais_format(tmp_path, model_dir):
    records = [
        chat("default", max_tokens=None), completion("default-completion", max_tokens=None),
        chat("n3", n=3, temperature=0.7, max_tokens=6),
        chat("chat-logprobs", logprobs=True, top_logprobs=3, max_tokens=4),
        completion("completion-logprobs", logprobs=2, max_tokens=4),
        completion("echo", "Once upon", echo=True, max_tokens=3),
        chat("ignore-eos", ignore_eos=True, max_tokens=12), chat("min-tokens", min_tokens=9, max_tokens=30),
        chat("specials", skip_special_tokens=False, include_stop_str_in_output=True, max_tokens=30),
        chat("stop-ids", stop_token_ids=list(range(100, 164)), ignore_eos=True, max_tokens=300),
        chat("schema", response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object"}}}, structured_outputs=None),
        chat("penalties", presence_penalty=1, frequency_penalty=-1, repetition_penalty=1.2, top_k=5, min_p=0.1,
             seed=3, logit_bias={"7": 100}),
        chat("kwargs", chat_template_kwargs={"terse": True}), chat("no-kwargs"),
        chat("tools-none", tools=[TOOL], tool_choice="none"),
        chat("named", tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
             max_tokens=4),
    ]
    answers = run(tmp_path, model_dir, records, "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    default = body(answers, "default")
    assert default["choices"][0]["finish_reason"] == "stop"  # the made-up model's eos, not a 16-token cut
    assert default["usage"]["completion_tokens"] == 5  # 4 made-up tokens and the eos
    assert body(answers, "default-completion")["usage"]["completion_tokens"] == 5

    n3 = body(answers, "n3")
    assert [c["index"] for c in n3["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in n3["choices"]}) == 3
    assert n3["usage"]["completion_tokens"] == 3 * 5 and n3["usage"]["total_tokens"] == n3["usage"]["prompt_tokens"] + 15

    (choice,) = body(answers, "chat-logprobs")["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == 4 and all(len(t["top_logprobs"]) == 3 and t["top_logprobs"][0]["token"] == t["token"]
                                     for t in content)
    assert all(t["bytes"] == list(t["token"].encode()) for t in content)
    completion_logprobs = body(answers, "completion-logprobs")["choices"][0]["logprobs"]
    assert len(completion_logprobs["tokens"]) == 4 and all(len(top) <= 3 for top in completion_logprobs["top_logprobs"])
    assert completion_logprobs["text_offset"][0] == 0

    assert body(answers, "echo")["choices"][0]["text"].startswith("Once upon")
    ignored = body(answers, "ignore-eos")
    assert ignored["usage"]["completion_tokens"] == 12 and ignored["choices"][0]["finish_reason"] == "length"
    assert body(answers, "min-tokens")["usage"]["completion_tokens"] == 10  # 9, then its eos
    assert body(answers, "specials")["choices"][0]["message"]["content"].endswith(EOS_TEXT)
    stopped = body(answers, "stop-ids")
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] < 300
    for custom_id in ("schema", "penalties", "tools-none"):
        assert body(answers, custom_id)["choices"][0]["message"]["content"]
    assert body(answers, "kwargs")["usage"]["prompt_tokens"] > body(answers, "no-kwargs")["usage"]["prompt_tokens"]
    assert body(answers, "tools-none")["usage"]["prompt_tokens"] > body(answers, "no-kwargs")["usage"]["prompt_tokens"]
    named = body(answers, "named")["choices"][0]
    (call,) = named["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert named["message"]["content"] == ""


def test_a_stop_string_ends_the_answer_before_it(tmp_path, model_dir):
    free = body(run(tmp_path / "a", model_dir, [chat("free", ignore_eos=True, max_tokens=20)]), "free")
    text = free["choices"][0]["message"]["content"]
    stop = text[5:8]
    answers = run(tmp_path / "b", model_dir, [chat("cut", ignore_eos=True, max_tokens=20, stop=[stop]),
                                              chat("kept", ignore_eos=True, max_tokens=20, stop=stop,
                                                   include_stop_str_in_output=True)])
    cut = body(answers, "cut")["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["message"]["content"] == text[:text.index(stop)]
    assert body(answers, "kept")["choices"][0]["message"]["content"] == text[:text.index(stop) + len(stop)]
    assert body(answers, "cut")["usage"]["completion_tokens"] < 20


def test_what_vllm_refuses_is_answered_400_naming_the_parameter_and_the_rest_run(tmp_path, model_dir):
    records = [
        chat("greedy-n", n=2, temperature=0), chat("too-many-logprobs", logprobs=True, top_logprobs=21),
        chat("out-of-vocab", logit_bias={"99999": 1}), chat("bad-schema", response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 5}}}),
        chat("guided", guided_json={"type": "object"}), chat("past-context", max_tokens=5000),
        chat("auto-tools", tools=[TOOL]), chat("fine", max_tokens=None),
        chat("bad-regex", structured_outputs={"regex": "(a+)+$("}),
        chat("bad-grammar", structured_outputs={"grammar": "root ::= ("}),
    ]
    answers = run(tmp_path, model_dir, records)
    assert error(answers, "greedy-n")["param"] == "n"
    assert error(answers, "too-many-logprobs")["param"] == "top_logprobs"
    assert "out-of-vocab" in error(answers, "out-of-vocab")["message"]
    assert error(answers, "bad-schema")["param"] == "response_format"
    assert "structured_outputs" in error(answers, "guided")["message"]
    assert "maximum context length is 2048" in error(answers, "past-context")["message"]
    assert "--enable-auto-tool-choice" in error(answers, "auto-tools")["message"]
    assert error(answers, "bad-regex")["param"] == "structured_outputs.regex"
    assert "unclosed group" in error(answers, "bad-regex")["message"]
    assert error(answers, "bad-grammar")["param"] == "structured_outputs.grammar"
    assert "Invalid grammar specification: expected ')'" in error(answers, "bad-grammar")["message"]
    assert body(answers, "fine")["choices"][0]["finish_reason"] == "stop"


def test_tool_call_flags_are_checked_before_the_job_starts(tmp_path, model_dir):
    done = run_batch("-i", str(write_requests(tmp_path / "in.jsonl", [chat("a")])), "-o", str(tmp_path / "o.jsonl"),
                     "--model", model_dir, "--enable-auto-tool-choice")
    assert done.returncode != 0 and "--enable-auto-tool-choice requires --tool-call-parser" in done.stderr
    assert not (tmp_path / "o.jsonl").exists()
    json.dumps(done.stderr)  # one line, printable
