"""pipeline.batchjob.choices: a results row's outputs as OpenAI's choices, as vLLM's serving
code makes them: n choices, logprobs objects of both endpoints, tool calls, echo."""

from __future__ import annotations

import pytest

from pipeline.batchjob.choices import AnswerShape, Texts, make_choices
from pipeline.batchjob.params import KIND_CHAT, KIND_COMPLETION
from pipeline.batchjob.requests import BatchRequest
from pipeline.batchjob.tools import RequestTools, ToolCalling
from pipeline.wire.errors import BatchOutputError
from pipeline.wire.generation import GenerationParams

TEXTS = Texts(decode=lambda ids: "".join(chr(97 + t % 26) for t in ids), token=lambda t: f"<{t}>")
HERMES = ToolCalling("hermes", auto=True)


def row(*samples: dict) -> dict:
    return {"item_id": 1, "output": samples[0]["output"], "finish_reason": samples[0]["finish_reason"],
            "samples": list(samples)}


def test_each_sample_is_a_choice_with_its_own_finish_reason_and_text():
    choices = make_choices(row({"output": [0, 1], "finish_reason": "stop", "text": "hi"},
                               {"output": [2, 3, 4], "finish_reason": "length"}), AnswerShape(KIND_CHAT), TEXTS, "c")
    assert choices == [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": "cde"}, "logprobs": None, "finish_reason": "length"}]
    plain = make_choices({"output": [0], "finish_reason": "stop"}, AnswerShape(KIND_COMPLETION), TEXTS, "c")
    assert plain == [{"index": 0, "text": "a", "logprobs": None, "finish_reason": "stop"}]


def test_chat_logprobs_give_the_first_k_entries_as_top_logprobs():
    sample = {"output": [5, 6], "finish_reason": "length",
              "logprobs": [[[5, -0.5, "five"], [9, -1.5, None], [3, -2.0, "three"]], [[6, -0.25, "é"]]]}
    (choice,) = make_choices(row(sample), AnswerShape(KIND_CHAT, logprobs=2), TEXTS, "c")
    first, second = choice["logprobs"]["content"]
    assert first == {"token": "five", "logprob": -0.5, "bytes": list(b"five"), "top_logprobs": [
        {"token": "five", "logprob": -0.5, "bytes": list(b"five")},
        {"token": "<9>", "logprob": -1.5, "bytes": list(b"<9>")}]}  # no text from the engine: the tokenizer's
    assert second["bytes"] == [0xC3, 0xA9] and len(second["top_logprobs"]) == 1
    (bare,) = make_choices(row(sample), AnswerShape(KIND_CHAT, logprobs=0), TEXTS, "c")
    assert [t["top_logprobs"] for t in bare["logprobs"]["content"]] == [[], []]


def test_completion_logprobs_give_tokens_offsets_and_the_first_k_plus_one_entries():
    sample = {"output": [5, 6], "finish_reason": "length", "text": "ab",
              "logprobs": [[[5, -0.5, "ab"], [9, -1.5, "x"], [3, -2.0, "y"]], [[6, -0.25, "cde"], [7, -3.0, "z"]]]}
    (choice,) = make_choices(row(sample), AnswerShape(KIND_COMPLETION, logprobs=1), TEXTS, "c")
    assert choice["logprobs"] == {"text_offset": [0, 2], "token_logprobs": [-0.5, -0.25], "tokens": ["ab", "cde"],
                                  "top_logprobs": [{"ab": -0.5, "x": -1.5}, {"cde": -0.25, "z": -3.0}]}


def test_logprobs_not_matching_the_tokens_are_a_bad_row():
    sample = {"output": [5, 6], "finish_reason": "length", "logprobs": [[[5, -0.5, "a"]]]}
    with pytest.raises(BatchOutputError, match="a sample of 2 tokens has logprobs for 1"):
        make_choices(row(sample), AnswerShape(KIND_CHAT, logprobs=0), TEXTS, "c")


def test_an_auto_tool_call_is_the_messages_tool_calls_with_finish_reason_tool_calls():
    text = 'Let me see.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    shape = AnswerShape(KIND_CHAT, tools=RequestTools([{}], "auto"), calling=HERMES)
    (choice,) = make_choices(row({"output": [1], "finish_reason": "stop", "text": text}), shape, TEXTS, "call_t_4")
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": "Let me see.", "tool_calls": [
        {"id": "call_t_4_0_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}


def test_a_named_tool_choice_keeps_its_finish_reason_and_an_empty_content():
    shape = AnswerShape(KIND_CHAT, tools=RequestTools([{}], "get_weather", named=True), calling=HERMES)
    (choice,) = make_choices(row({"output": [1], "finish_reason": "stop", "text": '{"city": "Rome"}'}), shape, TEXTS,
                             "c")
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def _request(kind: str, **fields) -> BatchRequest:
    return BatchRequest(0, 1, "r", "/v1/x", kind, fields.get("messages"), fields.get("prompt"),
                        GenerationParams(), echo=True)


def test_echo_puts_the_prompt_or_the_assistants_last_message_in_front():
    completion = AnswerShape.of(_request(KIND_COMPLETION, prompt="Once "), ToolCalling(), TEXTS)
    (choice,) = make_choices({"output": [0], "finish_reason": "stop", "text": "upon"}, completion, TEXTS, "c")
    assert choice["text"] == "Once upon"
    ids = AnswerShape.of(_request(KIND_COMPLETION, prompt=[2, 3]), ToolCalling(), TEXTS)
    assert ids.echo == "cd"
    prefill = AnswerShape.of(_request(KIND_CHAT, messages=[{"role": "user", "content": "Hi"},
                                                           {"role": "assistant", "content": "Sure: "}]),
                             ToolCalling(), TEXTS)
    (choice,) = make_choices({"output": [0], "finish_reason": "stop", "text": "yes"}, prefill, TEXTS, "c")
    assert choice["message"]["content"] == "Sure: yes"
    user_last = AnswerShape.of(_request(KIND_CHAT, messages=[{"role": "user", "content": "Hi"}]), ToolCalling(), TEXTS)
    assert user_last.echo == ""
