"""vLLM's parameters on vLLM's CPU build with the tiny model (marked `vllm`): a JSON-schema
answer that parses and validates, logprobs of the asked size, n choices, a tool call read by
the hermes parser, through `pipeline run-batch --engine vllm`; and the defaults a job fills in
equal to those vLLM's own OpenAI serving code makes of the same request. Random weights:
greedy decoding and structural checks only."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.jobs import ROOT, build_model, rows_by_id, write_requests

RUN_TIMEOUT_S = 600
SERVED = "tiny-llama"
ENGINE_OPTIONS = "load_format=dummy,max_model_len=2048,kv_cache_memory_bytes=8388608"
# Random weights give every token the same logit, so greedy decoding takes the lowest id a
# grammar allows: whitespace, wherever JSON allows it. vLLM's engine-wide option (its
# per-request one is not read by the xgrammar backend) keeps the JSON compact.
COMPACT_JSON = "llm_kwargs={structured_outputs_config={backend=\"xgrammar\",disable_any_whitespace=true}}"
CONTEXT = 2048
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"enum": [1, 2, 3]}},
          "required": ["answer", "score"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def chat(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": SERVED, "messages": [{"role": "user", "content": "Weather in Oslo?"}], **body}}


def completion(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": SERVED, "prompt": "Once upon a time", **body}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_model(tmp_path_factory.mktemp("model") / SERVED))


@pytest.mark.vllm
def test_structured_logprobs_n_and_tool_calls_through_the_vllm_engine(tmp_path, model_dir):
    import jsonschema

    records = [
        chat("schema", temperature=0, max_tokens=60,
             response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}),
        chat("logprobs", temperature=0, max_tokens=5, logprobs=True, top_logprobs=3),
        completion("completion-logprobs", temperature=0, max_tokens=4, logprobs=2),
        chat("n", n=2, temperature=0.8, seed=1, max_tokens=5),
        chat("tool", temperature=0, max_tokens=60, tools=[TOOL], structured_outputs={"regex": re.escape(CALL)}),
        chat("named", temperature=0, max_tokens=8, tools=[TOOL],
             tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    ]
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "pipeline", "run-batch", "-i",
                           str(write_requests(tmp_path / "in.jsonl", records)), "-o", str(out), "--model",
                           str(model_dir), "--engine", "vllm", "--engine-options", ENGINE_OPTIONS, "--engine-options", COMPACT_JSON,
                           "--consumers", "1",
                           "--tool-call-parser", "hermes", "--enable-auto-tool-choice"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {cid: row["response"] for cid, row in rows_by_id(out).items()}
    assert {r["status_code"] for r in rows.values()} == {200}, rows
    bodies = {cid: r["body"] for cid, r in rows.items()}

    (schema,) = bodies["schema"]["choices"]
    jsonschema.validate(json.loads(schema["message"]["content"]), SCHEMA)

    (chosen,) = bodies["logprobs"]["choices"]
    content = chosen["logprobs"]["content"]
    assert len(content) == bodies["logprobs"]["usage"]["completion_tokens"] > 0
    assert all(len(t["top_logprobs"]) == 3 and isinstance(t["logprob"], float) for t in content)
    (text,) = bodies["completion-logprobs"]["choices"]
    assert len(text["logprobs"]["tokens"]) == len(text["logprobs"]["token_logprobs"]) == 4
    assert all(1 <= len(top) <= 3 for top in text["logprobs"]["top_logprobs"])

    pair = bodies["n"]
    assert [c["index"] for c in pair["choices"]] == [0, 1] and pair["usage"]["completion_tokens"] == 10

    (tool,) = bodies["tool"]["choices"]
    assert tool["finish_reason"] == "tool_calls"
    (call,) = tool["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    (named,) = bodies["named"]["choices"]
    assert named["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.vllm
@pytest.mark.parametrize("generation_config", [None, {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                      "repetition_penalty": 1.05, "max_new_tokens": 100}])
def test_the_defaults_a_job_fills_in_are_those_of_vllms_server(tmp_path, model_dir, generation_config):
    from vllm.config import ModelConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    from pipeline.batchjob.requests import parse_line
    from pipeline.batchjob.sampling import ModelFacts
    from pipeline.consumer.engines.vllm import VllmEngine

    model = tmp_path / SERVED
    shutil.copytree(model_dir, model)
    if generation_config is not None:
        (model / "generation_config.json").write_text(json.dumps(generation_config))
    config = ModelConfig(model=str(model), max_model_len=CONTEXT)
    server_defaults = config.get_diff_sampling_param()
    facts = ModelFacts.load(str(model), config.get_vocab_size())
    engine = VllmEngine(model=str(model))
    bodies = [chat("a"), chat("b", temperature=0.2, max_tokens=10), chat("c", n=2, seed=4, top_k=3),
              chat("d", logprobs=True, top_logprobs=2, presence_penalty=0.5, min_p=0.1),
              chat("e", stop="x", stop_token_ids=[5], min_tokens=1, ignore_eos=True, max_completion_tokens=30),
              completion("f"), completion("g", max_tokens=None, logprobs=3), completion("h", n=3, temperature=0.5)]
    prompt_tokens = 17
    for record in bodies:
        request = parse_line(json.dumps(record).encode(), 0, 1, SERVED)
        assert request.error is None, request.error
        ours = engine._sampling(facts.params_for(request.params, prompt_tokens, CONTEXT), prompt_tokens)
        kind = ChatCompletionRequest if record["url"].endswith("chat/completions") else CompletionRequest
        theirs_request = kind(**record["body"])
        asked = getattr(theirs_request, "max_completion_tokens", None)
        asked = asked if asked is not None else theirs_request.max_tokens
        theirs = theirs_request.to_sampling_params(
            get_max_tokens(CONTEXT, asked, prompt_tokens, server_defaults), server_defaults)
        for name in ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                     "logprobs", "skip_special_tokens", "include_stop_str_in_output"):
            assert getattr(ours, name) == getattr(theirs, name), (record["custom_id"], name)
