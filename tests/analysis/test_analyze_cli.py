"""`pipeline tools analyze`: figures worked out by hand on a small own-format file, the JSON
and the table, demo-chat, the Mooncake trace's bound, and one-line errors; an OpenAI Batch
file with --model, its figures computed here with the tokenizer alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests.support.jobs import SERVED, build_model, chat, completion, write_requests
from tests.support.reuse import reference_cached

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "workloads" / "mooncake_synthetic_trace.jsonl"
# Four prompts; with 2-token blocks: (1 2) is in the first three, (1 2 3 4) too, the rest once.
SMALL = [
    {"components": [[1, 2]], "suffix": [3, 4, 5]},
    {"components": [[1, 2]], "suffix": [3, 4, 6, 7]},
    {"components": [[1, 2], [3, 4]], "suffix": [9]},
    {"suffix": [8, 8, 8]},
]


def analyze(*args: str):
    return CliRunner().invoke(main, ["tools", "analyze", *args])


@pytest.fixture
def small_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in SMALL))
    return path


def test_small_file_figures(small_file):
    result = analyze(str(small_file), "--block-tokens", "2", "--cache-tokens", "2,4", "--json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    assert (got["items"], got["input_tokens"], got["block_tokens"], got["caches"]) == (4, 19, 2, 1)
    assert got["shapes"]["count"] == 3 and got["shapes"]["max_depth"] == 2
    top = got["shapes"]["top"]
    assert [(s["items"], s["tokens"], s["components"], s["depth"]) for s in top] == [
        (2, 11, 1, 1), (1, 5, 2, 2), (1, 3, 0, 0)]
    assert got["shared_prefix"] == {"item_tokens": 12, "distinct_tokens": 4, "share": 12 / 19}
    # prompts 2 and 3 find (1 2)(1 2 3 4) cached: 4 tokens each, the last block recomputed
    assert got["bound"]["hit_tokens"] == 8 and got["bound"]["reuse"] == 8 / 19
    rows = {(r["order"], r["cache_tokens"]): r["hit_tokens"] for r in got["reuse"]}
    # one block of cache keeps (1 2), the head of the prompt last run: 2 tokens for each of 2, 3
    assert rows == {("arrival", None): 8, ("arrival", 2): 4, ("prefix-sorted", 2): 4,
                    ("arrival", 4): 8, ("prefix-sorted", 4): 8}


def test_small_file_table(small_file):
    result = analyze(str(small_file), "--block-tokens", "2", "--cache-tokens", "4", "--caches", "2", "--top", "1")
    assert result.exit_code == 0, result.output
    assert "4 items, 19 input tokens" in result.output
    assert "bound (one unbounded cache, prefix-sorted): 42.1%" in result.output
    # with 2 caches both orders are replayed unbounded too
    assert re.search(r"^prefix-sorted +unbounded +2 ", result.output, re.M), result.output
    assert result.output.count("0x") == 1  # --top 1


def test_demo_chat_is_analyzed():
    result = analyze("demo-chat", "--items", "300", "--workload-seed", "2", "--json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    assert got["items"] == 300 and got["block_tokens"] == 16
    assert got["shapes"]["max_depth"] >= 3  # turns chain: each extends the one before
    assert got["bound"]["reuse"] > 0.5  # every later turn reuses its whole earlier conversation
    again = json.loads(analyze("demo-chat", "--items", "300", "--workload-seed", "2", "--json").output)
    assert again == got


def test_demo_template_is_analyzed():
    result = analyze("demo-template", "--items", "400", "--workload-seed", "1", "--caches", "2", "--cache-tokens", "32768",
                     "--json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    assert got["items"] == 400 and got["block_tokens"] == 16 and got["shapes"]["count"] > 32
    small = {r["order"]: r["reuse"] for r in got["reuse"] if r["cache_tokens"] == 32768}
    # 32 Ki tokens hold a few templates: arrival order thrashes, the prefix-sorted walk does not.
    assert small["prefix-sorted"] > small["arrival"] + 0.1


@pytest.mark.skipif(not TRACE.exists(), reason="the shared Mooncake trace is not here")
def test_mooncake_bound_at_its_512_token_blocks():
    """65.04%: full 512-token blocks only, as vLLM caches them (counting the trace's cut last
    blocks as well would give 65.12%)."""
    got = json.loads(analyze(str(TRACE), "--cache-tokens", "", "--json").output)
    assert got["block_tokens"] == 512
    assert got["bound"]["hit_tokens"] == 39_802_880 and got["input_tokens"] == 61_194_628


@pytest.mark.parametrize("args, message", [
    (["/nonexistent/work.jsonl"], "cannot read the workload file"),
    (["demo", "--cache-tokens", "64k"], "token counts separated by commas"),
    (["demo", "--cache-tokens", "0"], "positive number of tokens"),
    (["demo", "--items", "10", "--block-tokens", "0"], "block of 0 tokens"),
    (["demo", "--items", "10", "--caches", "65"], "65 caches"),
    (["demo", "--items", "10", "--cache-tokens", "8"], "cache of 8 tokens"),
])
def test_errors_are_one_line(args, message):
    result = analyze(*args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_a_bad_file_lists_its_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"suffix": [1]}\nnot json\n')
    result = analyze(str(path))
    assert result.exit_code == 1
    assert f"{path}:2: not JSON" in result.output


# --- a batch file (--model) ---------------------------------------------------------------------

SYSTEM_A = "You are a careful assistant. Answer every question in one short sentence, and say so when unsure."
SYSTEM_B = "Translate the user's words into French."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / SERVED)


def batch_file(path: Path) -> Path:
    return write_requests(path, [
        chat("a0", "What is the capital of Peru?", system=SYSTEM_A),
        chat("b0", "Good morning", system=SYSTEM_B),
        chat("a1", "How far is the moon?", system=SYSTEM_A),
        chat("c", "Hello there", system=None),
        chat("x", "Hi", model="gpt-4o"),  # a model the job does not serve: answered 400
        chat("a2", "Why is the sky blue?", system=SYSTEM_A),
        chat("b1", "Thank you very much", system=SYSTEM_B),
        completion("d", [5, 6, 7, 8, 9]),
    ])


def rendered(model_dir: str, path: Path) -> list[tuple[list[int], int]]:
    """Each request's prompt tokens and its declared prefix's length, from the tokenizer and
    the tiny model's chat template written out here (its turns delimited by special tokens:
    a prefix's tokens are the prompt's first ones)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

    def turn(role: str, text: str) -> str:
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>"

    out = []
    for line in path.read_text().splitlines():
        body = json.loads(line)["body"]
        if body["model"] != SERVED:
            continue
        if "prompt" in body:
            out.append((body["prompt"], 0))
            continue
        turns = [turn(m["role"], m["content"]) for m in body["messages"]]
        whole = "<|begin_of_text|>" + "".join(turns) + "<|start_header_id|>assistant<|end_header_id|>\n\n"
        tokens = tokenizer.encode(whole, add_special_tokens=False).ids
        prefix = tokenizer.encode("<|begin_of_text|>" + turns[0], add_special_tokens=False).ids if len(turns) > 1 else []
        assert tokens[:len(prefix)] == prefix
        out.append((tokens, len(prefix)))
    return out


def test_a_batch_files_figures(tmp_path, model_dir):
    path = batch_file(tmp_path / "requests.jsonl")
    result = analyze(str(path), "--model", model_dir, "--cache-tokens", "16,65536", "--json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    prompts = rendered(model_dir, path)
    assert (got["requests"], got["analyzed"], got["made"], got["served_model"]) == (8, 8, 7, SERVED)
    assert got["refused"]["count"] == 1 and got["refused"]["examples"][0]["line"] == 5
    assert got["prompt_tokens"] == sum(len(tokens) for tokens, _ in prompts)
    assert got["shapes"]["count"] == 3 and got["shapes"]["max_depth"] == 1  # A, B and no prefix
    a, b = prompts[0][1], prompts[1][1]
    assert got["shared_prefix"]["request_tokens"] == 3 * a + 2 * b and got["shared_prefix"]["distinct_tokens"] == a + b
    assert [(s["requests"], s["prefix_tokens"], s["first_line"]) for s in got["shapes"]["top"]] == [
        (3, a, 1), (2, b, 2), (2, 0, 4)]
    # Shape-grouped: the later requests of A and B find their prefix's full blocks (one
    # block of cache holds one); the first of each shape and the unprefixed ones nothing.
    later = [prompts[k] for k in (2, 4, 5)]  # a1, a2, b1 (the refused request made no prompt)

    def grouped(capacity_blocks: int) -> int:
        return sum(min(prefix // 16, capacity_blocks, (len(tokens) - 1) // 16) * 16 for tokens, prefix in later)

    rows = {(r["order"], r["cache_tokens"]): r["hit_tokens"] for r in got["reuse"]}
    assert rows == {
        ("arrival", 16): sum(reference_cached([t for t, _ in prompts], 16, 1)),
        ("shape-grouped", 16): grouped(1),
        ("arrival", 65536): sum(reference_cached([t for t, _ in prompts], 16, None)),
        ("shape-grouped", 65536): grouped(4096),
    }
    assert got["bound"]["hit_tokens"] == grouped(1 << 30) > 0


def test_a_batch_files_table(tmp_path, model_dir):
    path = batch_file(tmp_path / "requests.jsonl")
    result = analyze(str(path), "--model", model_dir, "--cache-tokens", "4096", "--items", "7")
    assert result.exit_code == 0, result.output
    assert f"batch file: {path}: 8 requests, the first 7 analyzed (model {model_dir}, served as {SERVED})" in result.output
    assert "1 would be answered 400 by run-batch's producers" in result.output
    assert "line 5: The model `gpt-4o` does not exist" in result.output
    assert "6 prompts" in result.output and "3 shapes" in result.output
    assert re.search(r"^shape-grouped +4,096 ", result.output, re.M), result.output


def test_a_bad_batch_file_names_its_lines(tmp_path, model_dir):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps(chat("a")) + "\n" + '{"custom_id": "b"}\n' + json.dumps(chat("a")) + "\n")
    result = analyze(str(path), "--model", model_dir)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"Error: {path}: 2 bad lines" in result.output
    assert f"{path}:2: missing 'method', 'url', 'body'" in result.output
    assert f"{path}:3: custom_id 'a' is used by line 1 too" in result.output


@pytest.mark.parametrize("args, message", [
    (["--caches", "2"], "--caches 2: a batch file is analyzed through one cache"),
    (["--cache-tokens", str(16 << 20 << 1)], "at most 1,048,576 blocks"),
    (["--chat-template", "no-such-file"], "--chat-template no-such-file: looks like a file's path"),
])
def test_a_batch_files_bad_options_are_one_line(tmp_path, model_dir, args, message):
    path = batch_file(tmp_path / "requests.jsonl")
    result = analyze(str(path), "--model", model_dir, *args)
    assert result.exit_code != 0 and message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_batch_file_options_need_the_model(tmp_path):
    result = analyze("demo", "--served-model-name", "x")
    assert result.exit_code != 0 and "give --model" in result.output
