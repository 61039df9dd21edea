"""`pipeline tools analyze`: figures worked out by hand on a small own-format file, the JSON
and the table, demo-chat, the Mooncake trace's bound, and one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main

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
