"""vLLM's engine flags read off their words without vLLM (`vllm_options.flag_words`): what
the host fills in and what a job's manifest pins, before vLLM's parser reads them in the
consumer. Checked against argparse as vLLM's parser declares such flags (a value, several,
or BooleanOptionalAction), over random command lines; and the merge of what vLLM read."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.consumer.engines.vllm_options import flag_option_names, flag_words, with_flag_options

NAMES = st.from_regex(r"[a-z]{1,6}(-[a-z]{1,6}){0,2}", fullmatch=True).filter(lambda n: not n.startswith("no-"))
WORDS = st.from_regex(r"[a-z][a-z0-9_.]{0,8}", fullmatch=True).filter(lambda w: w not in ("true", "false"))
INTS = st.integers(-10**6, 10**6)
# One flag: (name, kind, value); a kind as vLLM declares it to argparse.
FLAGS = st.one_of(
    st.tuples(NAMES, st.just("bool"), st.booleans()),
    st.tuples(NAMES, st.just("int"), INTS),
    st.tuples(NAMES, st.just("word"), WORDS),
    st.tuples(NAMES, st.just("words"), st.lists(WORDS, min_size=2, max_size=3)),
)


def _reference(flags: list[tuple[str, str, object]], words: list[str]) -> dict[str, object]:
    """What argparse, told each flag's kind as vLLM's parser is, reads from `words`."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name, kind, _value in flags:
        option = "--" + name
        if kind == "bool":
            parser.add_argument(option, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(option, type=int if kind == "int" else str,
                                nargs="+" if kind == "words" else None, default=None)
    return {dest: value for dest, value in vars(parser.parse_args(words)).items() if value is not None}


def _typed(name: str, kind: str, value: object, equals: bool, underscores: bool) -> list[str]:
    option = "--" + (name.replace("-", "_") if underscores else name)
    if kind == "bool":
        return [option] if value else ["--no-" + option[2:]]
    if kind == "words":
        return [option, *value]  # type: ignore[misc]
    return [f"{option}={value}"] if equals else [option, str(value)]


def _dashed(word: str) -> str:
    """A flag's name with dashes, as argparse knows it (vLLM's parser takes underscores too)."""
    if not word.startswith("--"):
        return word
    name, equals, value = word.partition("=")
    return name.replace("_", "-") + equals + value


@given(st.lists(FLAGS, max_size=6, unique_by=lambda f: f[0].replace("-", "_")), st.data())
def test_the_words_read_as_argparse_reads_vllms_flags(flags, data):
    words: list[str] = []
    for name, kind, value in flags:
        words += _typed(name, kind, value, data.draw(st.booleans()), data.draw(st.booleans()))
    expected = _reference(flags, [_dashed(word) for word in words])
    assert dict(flag_words(words)) == expected
    assert [dest for dest, _ in flag_words(words)] == [name.replace("-", "_") for name, _k, _v in flags]


@pytest.mark.parametrize("words, read", [
    ([], []),
    (["--dtype", "bfloat16"], [("dtype", "bfloat16")]),
    (["--dtype=bfloat16"], [("dtype", "bfloat16")]),
    (["--max_num_seqs", "64"], [("max_num_seqs", 64)]),
    (["--gpu-memory-utilization", "0.85"], [("gpu_memory_utilization", 0.85)]),
    (["--seed", "-5", "--enforce-eager"], [("seed", -5), ("enforce_eager", True)]),
    (["--no-enable-prefix-caching"], [("enable_prefix_caching", False)]),
    (["--trust-remote-code", "true"], [("trust_remote_code", True)]),
    (["--kv-cache-memory-bytes", "8M"], [("kv_cache_memory_bytes", "8M")]),
    (["--swap-space", "1e3"], [("swap_space", 1e3)]),
    (["--x", "nan"], [("x", "nan")]),  # a word that float() reads, which no flag means as a number
    (["-q", "fp8", "-O3"], [("-q", "fp8"), ("-O3", True)]),  # short flags: only vLLM knows their long names
    (["--compilation-config", '{"level": -1}'], [("compilation_config", '{"level": -1}')]),
])
def test_each_form_of_a_flag(words, read):
    assert flag_words(words) == read


def test_the_options_a_command_line_sets_count_its_flags_and_llm_kwargs():
    options = {"model": "/m", "llm_kwargs": {"max_num_seqs": 8},
               "vllm_flags": ["--gpu-memory-utilization", "0.5", "--no-enforce-eager", "--block_size=32"]}
    assert flag_option_names(options) == {"model", "max_num_seqs", "gpu_memory_utilization", "enforce_eager",
                                          "block_size"}
    assert flag_option_names({"llm_kwargs": "not a table"}) == set()


def test_what_vllm_read_wins_over_the_options_and_llm_kwargs_merge_key_by_key():
    options = {"model": "/m", "dtype": "auto", "llm_kwargs": {"max_num_seqs": 8, "swap_space": 1},
               "vllm_flags": ["--dtype", "half", "--max-num-seqs", "16"]}
    read = {"dtype": "half", "llm_kwargs": {"max_num_seqs": 16}}
    assert with_flag_options(options, read) == {"model": "/m", "dtype": "half",
                                                "llm_kwargs": {"max_num_seqs": 16, "swap_space": 1}}
    assert with_flag_options(options, {}) == {k: v for k, v in options.items() if k != "vllm_flags"}
    assert "vllm_flags" in options  # the caller's options are not changed
