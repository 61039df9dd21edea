"""pipeline.batchjob.embeddings: an embeddings body read as vLLM's server reads it (every form
of `input`, encoding_format, dimensions refused with vLLM's message where the model cannot
cut its embeddings), and which endpoints a job serves by its runner, as vLLM decides it."""

from __future__ import annotations

import json
import re

import pytest

from pipeline.batchjob.embeddings import (
    EMBEDDINGS_URL,
    KIND_EMBEDDING,
    RUNNER_GENERATE,
    RUNNER_POOLING,
    EmbeddingFacts,
    EmbeddingInputs,
    embedding_inputs,
    endpoint_refusal,
    job_runner,
)
from pipeline.batchjob.params import Refused
from pipeline.batchjob.requests import KIND_CHAT, request_of
from pipeline.wire.generation import MAX_EMBEDDING_INPUTS


@pytest.mark.parametrize("given, inputs", [
    ("one text", ("one text",)),
    (["a", "b c"], ("a", "b c")),
    ([5, 6, 7], ([5, 6, 7],)),  # one list of token ids: one input
    ([[5, 6], [7]], ([5, 6], [7])),
    (["a", [1, 2]], ("a", [1, 2])),
])
def test_every_form_of_input_is_a_tuple_of_inputs(given, inputs):
    assert embedding_inputs({"input": given}) == EmbeddingInputs(inputs, "float", None)


@pytest.mark.parametrize("body, param, words", [
    ({}, "input", "Missing required parameter: 'input'."),
    ({"input": []}, "input", "input must be a string"),
    ({"input": [[]]}, "input", "input[0] must be a string or a non-empty array"),
    ({"input": [[1, -2]]}, "input", "input[0] holds an integer -2, not a token id"),
    ({"input": [[1, True]]}, "input", "not a token id"),
    ({"input": {"text": "x"}}, "input", "input must be a string"),
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format",
     "Invalid value: 'bytes'. Supported values are: 'float' and 'base64'."),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format",
     "Invalid value: 'int8'. Supported values are: 'float' and 'base64'."),
    ({"input": "x", "encoding_format": 8}, "encoding_format",
     "Invalid type for 'encoding_format': expected a string, but got an integer instead."),
    ({"input": "x", "dimensions": 0}, "dimensions", "dimensions must be at least 1, got 0."),
    ({"input": "x", "dimensions": True}, "dimensions",
     "Invalid type for 'dimensions': expected an integer, but got a boolean instead."),
    ({"input": "x", "dimensions": 8.5}, "dimensions",
     "Invalid type for 'dimensions': expected an integer, but got a number with a fractional part (8.5) instead."),
])
def test_what_vllm_refuses_is_refused_naming_the_parameter(body, param, words):
    with pytest.raises(Refused, match=re.escape(words)) as caught:
        embedding_inputs(body)
    assert caught.value.param == param


def test_dimensions_a_whole_number_is_that_integer_as_vllm_reads_it():
    assert embedding_inputs({"input": "x", "dimensions": 8.0}) == EmbeddingInputs(("x",), "float", 8)


def test_inputs_up_to_the_limit_are_taken_and_one_past_it_refused():
    assert len(embedding_inputs({"input": ["w"] * MAX_EMBEDDING_INPUTS}).inputs) == MAX_EMBEDDING_INPUTS
    with pytest.raises(Refused, match=f"{MAX_EMBEDDING_INPUTS + 1:,} inputs"):
        embedding_inputs({"input": ["w"] * (MAX_EMBEDDING_INPUTS + 1)})


def test_an_embeddings_line_is_a_request_of_its_own_kind_and_user_is_ignored():
    request = request_of(0, 1, "e", EMBEDDINGS_URL, {"model": "m", "input": ["a", "b"], "user": "u",
                                                      "encoding_format": "base64", "dimensions": None}, "m")
    assert request.error is None and request.kind == KIND_EMBEDDING
    assert request.embedding == EmbeddingInputs(("a", "b"), "base64", None)
    assert request.answer_reads_body  # base64: the collector reads its encoding_format back
    plain = request_of(0, 1, "e", EMBEDDINGS_URL, {"model": "m", "input": "a"}, "m")
    assert not plain.answer_reads_body
    wrong = request_of(0, 1, "e", EMBEDDINGS_URL, {"model": "m", "input": "a", "temperature": 0}, "m")
    assert wrong.error_param == "temperature" and "an embeddings request takes" in wrong.error
    other = request_of(0, 1, "e", EMBEDDINGS_URL, {"model": "x", "input": "a"}, "m")
    assert other.error_param == "model"


def _model(tmp_path, config: dict, sentence_transformers: bool = False) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if sentence_transformers:
        (tmp_path / "modules.json").write_text("[]")
    return str(tmp_path)


@pytest.mark.parametrize("architectures, runner", [
    (["LlamaForCausalLM"], RUNNER_GENERATE), (["BertModel"], RUNNER_POOLING),
    (["Qwen3ForSequenceClassification"], RUNNER_POOLING), (["XLMRobertaModel"], RUNNER_POOLING),
    (["GPT2LMHeadModel"], RUNNER_GENERATE), ([], RUNNER_GENERATE), (None, RUNNER_GENERATE),
])
def test_auto_takes_the_runner_of_the_architecture_as_vllm_does(tmp_path, architectures, runner):
    assert job_runner({}, _model(tmp_path, {"architectures": architectures})) == runner
    assert job_runner({"runner": "auto"}, _model(tmp_path, {"architectures": architectures})) == runner


def test_a_given_runner_wins_and_a_sentence_transformers_model_pools(tmp_path):
    llama = _model(tmp_path, {"architectures": ["LlamaForCausalLM"]})
    assert job_runner({"runner": RUNNER_POOLING}, llama) == RUNNER_POOLING
    assert job_runner({}, _model(tmp_path, {"architectures": ["LlamaForCausalLM"]}, True)) == RUNNER_POOLING
    assert job_runner({"runner": RUNNER_GENERATE}, llama) == RUNNER_GENERATE


def test_an_endpoint_the_runner_does_not_serve_gets_vllms_run_batch_message():
    assert endpoint_refusal(EMBEDDINGS_URL, KIND_EMBEDDING, RUNNER_POOLING) is None
    assert endpoint_refusal("/v1/chat/completions", KIND_CHAT, RUNNER_GENERATE) is None
    assert endpoint_refusal(EMBEDDINGS_URL, KIND_EMBEDDING, RUNNER_GENERATE) == \
        "Model does not support endpoint: /v1/embeddings"
    assert endpoint_refusal("/v1/chat/completions", KIND_CHAT, RUNNER_POOLING) == \
        "Model does not support endpoint: /v1/chat/completions"
    assert endpoint_refusal("/v1/rerank", None, RUNNER_POOLING) is None  # refused as unsupported already


def test_dimensions_are_refused_with_vllms_messages_unless_the_model_can_cut_its_embeddings(tmp_path):
    plain = EmbeddingFacts.load(_model(tmp_path, {"hidden_size": 128}))
    assert plain == EmbeddingFacts(128, False, None)
    plain.check(None, "m")
    with pytest.raises(Refused, match=r"Model 'm' does not support Matryoshka embeddings; dimensions must be unset "
                                      r"\(received dimensions=8\)"):
        plain.check(8, "m")
    cut = EmbeddingFacts.load(_model(tmp_path, {"hidden_size": 128, "is_matryoshka": True}))
    cut.check(1, "m")
    cut.check(128, "m")  # at the model's size
    with pytest.raises(Refused, match=r"only supports dimensions in range \[1, 128\], got 129"):
        cut.check(129, "m")
    listed = EmbeddingFacts.load(_model(tmp_path, {"hidden_size": 128, "matryoshka_dimensions": [32, 64]}))
    listed.check(64, "m")
    with pytest.raises(Refused, match=r"only supports Matryoshka dimensions \[32, 64\], got 48"):
        listed.check(48, "m")
