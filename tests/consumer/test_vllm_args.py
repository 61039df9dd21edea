"""vLLM's flags read by a parser as vLLM's reads them (`read_flags`), and the check child's
protocol (`main`: one JSON answer a line), run in process with a stand-in for vLLM's parser
and check: the real ones are the `vllm` tests' (tests/batchjob/test_run_batch_vllm.py)."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from pipeline.consumer.engines import vllm_args
from pipeline.wire.errors import EngineOptionsError


def _parser() -> argparse.ArgumentParser:
    """Flags declared as vLLM declares them, refusing with ValueError as `vllm_args._parser` does."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--dtype", choices=["auto", "half", "bfloat16"], default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)

    def refuse(message: str) -> None:
        raise ValueError(f"vLLM: {message}")

    parser.error = refuse  # type: ignore[method-assign]
    return parser


def test_flags_read_become_engine_options_and_defaults_are_left_out():
    assert vllm_args.read_flags([], _parser()) == {}
    assert vllm_args.read_flags(["--dtype", "half", "--max-num-seqs=8"], _parser()) == {
        "dtype": "half", "llm_kwargs": {"max_num_seqs": 8}}
    assert vllm_args.read_flags(["--dtype", "auto"], _parser()) == {}  # vLLM's default: nothing given


@pytest.mark.parametrize("words, message", [
    (["--dtype", "float33"], "vLLM: argument --dtype: invalid choice: 'float33'"),
    (["--bogus", "1"], "vLLM: unrecognized arguments: --bogus 1"),
    (["--no-enable-prefix-caching"], "--enable-prefix-caching: prefix caching stays on"),
])
def test_what_the_parser_or_the_product_refuses_is_one_line(words, message):
    with pytest.raises(EngineOptionsError, match=message):
        vllm_args.read_flags(words, _parser())


def _serve(monkeypatch, request: dict) -> list[dict]:
    """The child's answer lines to one request (and more input after it, which it leaves)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(request) + "\n" + json.dumps(request) + "\n"))
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    assert vllm_args.main() == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.parametrize("request_, answer", [
    ({"check": {"vllm_flags": ["--dtype", "half"]}}, {"ok": {"dtype": "half"}}),
    ({"check": {"max_model_len": 4096}},
     {"error": "max_model_len (4096) is greater than the derived max_model_len (2048)"}),
    ({"check": {"vllm_flags": ["--dtype", "x"]}}, {"error": "vLLM: argument --dtype: invalid choice: 'x'"}),
])
def test_the_child_answers_one_check_in_one_line(monkeypatch, request_, answer):
    checked: list[dict] = []
    monkeypatch.setattr(vllm_args, "_parser", _parser)

    def check(parser, options):
        checked.append(options)
        if options.get("max_model_len", 0) > 2048:
            raise ValueError("max_model_len (4096) is greater\n  than the derived max_model_len (2048)")
        return vllm_args.read_flags(options.get("vllm_flags") or [], parser)

    monkeypatch.setattr(vllm_args, "_check", check)
    answers = _serve(monkeypatch, request_)
    assert len(answers) == 1 and len(checked) == 1
    if "ok" in answer:
        assert answers[0] == answer
    else:  # vLLM's parser adds the choices after the reason
        assert list(answers[0]) == ["error"] and answers[0]["error"].startswith(answer["error"])


def test_the_child_answers_nothing_to_no_request(monkeypatch):
    monkeypatch.setattr(vllm_args, "_parser", _parser)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    assert vllm_args.main() == 0 and out.getvalue() == ""


def test_without_vllm_every_check_says_it_cannot_run(monkeypatch):
    def broken():
        raise ImportError("No module named 'vllm'")

    monkeypatch.setattr(vllm_args, "_parser", broken)
    assert _serve(monkeypatch, {"check": {}}) == [
        {"unavailable": "vLLM cannot be imported here: No module named 'vllm'"}]
