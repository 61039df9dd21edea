"""Workload files (own format and the Mooncake trace) and the demo workload: round trips,
every kind of bad line refused with path:line, the shared-prefix rule against a brute-force
reference, round-robin shares, and determinism."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.producer import ProducerLimits, signature
from pipeline.producer.demos import DEMO_SHAPES, demo_workload
from pipeline.producer.workload import (
    BLOCK_STREAM,
    MAX_LISTED_ERRORS,
    MAX_TIMESTAMP_MS,
    VOCAB_SIZE,
    hashed_tokens,
    load_workload,
    shared_block_runs,
)
from pipeline.producer.workload import MOONCAKE_BLOCK_TOKENS as BLOCK
from pipeline.wire.errors import BadInputError, WorkloadError

SMALL = ProducerLimits(max_item_tokens=1000, max_payload_bytes=100, max_models=4)
WORKLOADS = Path(__file__).resolve().parents[2].parent / "shared" / "workloads"
TRACE = WORKLOADS / "mooncake_synthetic_trace.jsonl"
# Lines of the published trace the tests read: enough for many shared prefixes, fast to load.
TRACE_HEAD_LINES = 300


def write(tmp_path: Path, lines: list, name: str = "work.jsonl") -> Path:
    """A workload file: dicts are written as JSON, strings and bytes as they are."""
    path = tmp_path / name
    with open(path, "wb") as file:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            file.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return path


def trace_line(input_length: int, hash_ids: list[int], timestamp: float = 0) -> dict:
    return {"timestamp": timestamp, "input_length": input_length, "output_length": 1, "hash_ids": hash_ids}


# ---- own format ----------------------------------------------------------------------------

def test_own_format_round_trip(tmp_path):
    lines = [
        {"model": 2, "components": [[1, 2, 3], [4, 5]], "suffix": [6, 7], "payload": "job-1",
         "timestamp_ms": 12.5},
        {"model": 0, "components": [[1, 2, 3], [4, 5]], "suffix": [-8], "payload": "é"},
        {"components": [[9]], "suffix": [2**31 - 1, -2**31]},
    ]
    path = write(tmp_path, lines)
    workload = load_workload(path, SMALL)
    items = list(workload)
    assert len(workload) == 3 and workload.models == (0, 2) and workload.source == str(path)
    assert workload.total_tokens == 7 + 6 + 3
    for item, line, number in zip(items, lines, (1, 2, 3)):
        components = [np.array(c, dtype=np.int32) for c in line["components"]]
        assert item.model == line.get("model", 0) and item.line == number
        assert item.tokens.dtype == np.int32
        assert item.tokens.tolist() == [t for c in line["components"] for t in c] + line["suffix"]
        assert item.prefix_len == sum(len(c) for c in line["components"])
        assert item.signature == signature(components)
        assert item.payload == line.get("payload", "").encode("utf-8")
        assert item.timestamp_ms == line.get("timestamp_ms")
    # equal component lists share their arrays (and signature) and cannot be changed
    assert items[0].components[0] is items[1].components[0]
    with pytest.raises(ValueError):
        items[0].components[0][0] = 99


def test_own_format_defaults_and_blank_lines(tmp_path):
    path = write(tmp_path, ["", "  ", {"suffix": [5, 6]}, ""])
    (item,) = load_workload(path, SMALL)
    assert (item.model, item.payload, item.timestamp_ms, item.line) == (0, b"", None, 3)
    assert item.components == [] and item.prefix_len == 0
    assert item.signature == signature([])
    (only_prefix,) = load_workload(write(tmp_path, [{"components": [[1, 2]]}], "p.jsonl"), SMALL)
    assert only_prefix.prefix_len == only_prefix.length == 2 and len(only_prefix.suffix) == 0


GOOD = {"suffix": [1, 2, 3]}
MOONCAKE_GOOD = trace_line(600, [1, 2])

BAD_OWN_LINES = [
    ('{"suffix": [1, 2}', "not JSON"),
    ("[1, 2, 3]", "must be a JSON object, got list"),
    (b'{"suffix": [1], "payload": "\xff"}', "not UTF-8"),
    ({"suffix": "1 2 3"}, "suffix must be a list of token ids, got str"),
    ({"suffix": [1, 2.5]}, "suffix[1] is float 2.5"),
    ({"suffix": [1, True]}, "suffix[1] is bool True"),
    ({"suffix": [1, "7"]}, "suffix[1] is str '7'"),
    ({"suffix": [2**31]}, "suffix[0] is int 2147483648: a token id is an integer in int32"),
    ({"suffix": [5, -2**31 - 1]}, "suffix[1] is int -2147483649"),
    ({"suffix": [2**70]}, "suffix[0] is int 1180591620717411303424"),
    ({"components": [1, 2], "suffix": [3]}, "components[0] must be a list of token ids, got int 1"),
    ({"components": {"a": [1]}, "suffix": [3]}, "components must be a list"),
    ({"components": [[1], []], "suffix": [3]}, "components[1] is empty"),
    ({"components": [], "suffix": []}, "empty prompt"),
    ({"suffix": [1] * 1001}, "prompt of 1001 tokens, limit 1000"),
    ({"components": [[1] * 600], "suffix": [1] * 401}, "prompt of 1001 tokens, limit 1000"),
    ({"model": 4, "suffix": [1]}, "model 4 outside [0, 3]"),
    ({"model": -1, "suffix": [1]}, "model -1 outside [0, 3]"),
    ({"model": "0", "suffix": [1]}, "model must be an integer, got str '0'"),
    ({"model": 1.0, "suffix": [1]}, "model must be an integer, got float 1.0"),
    ({"payload": "x" * 101, "suffix": [1]}, "payload of 101 bytes, limit 100"),
    ({"payload": "é" * 51, "suffix": [1]}, "payload of 102 bytes, limit 100"),
    ({"payload": 5, "suffix": [1]}, "payload must be a string, got int 5"),
    ({"timestamp_ms": -1, "suffix": [1]}, "timestamp_ms must be a number of milliseconds in [0, 1,000,000,000,000], got int -1"),
    ({"timestamp_ms": 10**12 + 1, "suffix": [1]}, "in [0, 1,000,000,000,000], got int 1000000000001"),
    ({"timestamp_ms": 1e308, "suffix": [1]}, "in [0, 1,000,000,000,000], got float 1e+308"),
    ({"timestamp_ms": "soon", "suffix": [1]}, "timestamp_ms must be a number of milliseconds"),
    ('{"timestamp_ms": NaN, "suffix": [1]}', "got float nan"),
    ({"suffix": [1], "paylod": "x"}, "unknown field(s) 'paylod'"),
    ({"model": 0, "payload": "x"}, "neither format"),
    ({"suffix": [1], "hash_ids": [1]}, "mixes fields of both formats"),
    (MOONCAKE_GOOD, "this line is in the Mooncake format but the file is in the product's own format (set by line 1); one file holds one format"),
]


@pytest.mark.parametrize("line, why", BAD_OWN_LINES, ids=[why[:30] for _, why in BAD_OWN_LINES])
def test_bad_own_line_names_path_line_and_why(tmp_path, line, why):
    path = write(tmp_path, [GOOD, line, GOOD])
    with pytest.raises(WorkloadError) as caught:
        load_workload(path, SMALL)
    message = str(caught.value)
    assert f"{path}:2: " in message and why in message, message
    assert f"{path}: 1 bad line; nothing was submitted" in message
    assert isinstance(caught.value, BadInputError)


BAD_TRACE_LINES = [
    (trace_line(0, []), "input_length 0 outside [1, 1000]"),
    (trace_line(1001, [1, 2]), "input_length 1001 outside [1, 1000]"),
    (trace_line(600, [1, -2]), "hash_ids[1] -2 outside"),
    (trace_line(600, [1, 2**63]), "hash_ids[1] 9223372036854775808 outside"),
    (trace_line(600, [1, "2"]), "hash_ids[1] must be an integer, got str '2'"),
    (trace_line(600, "1 2"), "hash_ids must be a list of block ids, got str"),
    (trace_line(600, [1, 2, 3]), "3 hash_ids for input_length 600, which takes at most 2 blocks"),
    (trace_line(600, [1], timestamp=-5), "timestamp must be a number of milliseconds in [0, 1,000,000,000,000]"),
    ({"input_length": 600, "hash_ids": [1]}, "missing field 'timestamp'"),
    ({**MOONCAKE_GOOD, "output_length": -1}, "output_length -1 outside"),
    ({**MOONCAKE_GOOD, "extra": 1}, "unknown field(s) 'extra'"),
    (GOOD, "in the product's own format but the file is in the Mooncake format (set by line 1)"),
]


@pytest.mark.parametrize("line, why", BAD_TRACE_LINES, ids=[why[:30] for _, why in BAD_TRACE_LINES])
def test_bad_mooncake_line_names_path_line_and_why(tmp_path, line, why):
    path = write(tmp_path, [MOONCAKE_GOOD, line])
    with pytest.raises(WorkloadError) as caught:
        load_workload(path, SMALL)
    assert f"{path}:2: " in str(caught.value) and why in str(caught.value), str(caught.value)


def test_first_ten_bad_lines_and_the_total_are_reported(tmp_path):
    lines, bad = [], []
    for k in range(60):
        if k % 2:
            lines.append({"suffix": [1], "model": 99})
            bad.append(k + 1)
        else:
            lines.append(GOOD)
    path = write(tmp_path, lines)
    with pytest.raises(WorkloadError) as caught:
        load_workload(path, SMALL)
    message = str(caught.value)
    assert message.startswith(f"{path}: 30 bad lines; nothing was submitted and the run does not start, "
                              f"the first {MAX_LISTED_ERRORS}:")
    listed = [int(row.strip().split(":")[1]) for row in message.splitlines()[1:]]
    assert listed == bad[:MAX_LISTED_ERRORS]


def test_a_bad_first_line_does_not_hide_the_others(tmp_path):
    path = write(tmp_path, ["{oops", {"suffix": []}, GOOD])
    with pytest.raises(WorkloadError) as caught:
        load_workload(path, SMALL)
    assert f"{path}:1: not JSON" in str(caught.value) and f"{path}:2: empty prompt" in str(caught.value)


def test_empty_and_missing_files_are_refused(tmp_path):
    with pytest.raises(WorkloadError, match="no work items"):
        load_workload(write(tmp_path, ["", "   "]))
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(WorkloadError, match=f"{missing}: cannot read"):
        load_workload(missing)


# ---- Mooncake trace ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trace_head(tmp_path_factory) -> Path:
    if not TRACE.exists():
        pytest.skip(f"the Mooncake trace is not at {TRACE} (the shared workloads folder is absent)")
    path = tmp_path_factory.mktemp("trace") / "head.jsonl"
    with open(TRACE) as source, open(path, "w") as head:
        head.writelines(line for _, line in zip(range(TRACE_HEAD_LINES), source))
    return path


def read_rows(path: Path) -> list[dict]:
    with open(path) as file:
        return [json.loads(line) for line in file]


def test_mooncake_items_follow_their_lines(trace_head):
    rows = read_rows(trace_head)
    workload = load_workload(trace_head)
    assert len(workload) == len(rows) == TRACE_HEAD_LINES and workload.models == (0,)
    assert workload.total_tokens == sum(row["input_length"] for row in rows)
    runs = shared_block_runs([row["hash_ids"] for row in rows])
    for number, (item, row, run) in enumerate(zip(workload, rows, runs), start=1):
        tokens = item.tokens
        assert len(tokens) == item.length == row["input_length"]
        assert tokens.min() >= 0 and tokens.max() < VOCAB_SIZE
        assert (item.payload, item.line, item.model) == (str(number).encode(), number, 0)
        assert item.timestamp_ms == row["timestamp"]
        assert len(item.components) == min(run, row["input_length"] // BLOCK)
        assert item.prefix_len == BLOCK * len(item.components)
        assert item.signature == signature(item.components)
    assert sum(run > 0 for run in runs) >= 20  # the head does share prefixes (23 requests)


def test_mooncake_block_ids_make_the_same_tokens_everywhere(trace_head):
    rows = read_rows(trace_head)
    first_use: dict[int, np.ndarray] = {}
    reused = 0
    for item, row in zip(load_workload(trace_head), rows):
        tokens = item.tokens
        for position, block in enumerate(row["hash_ids"]):
            piece = tokens[position * BLOCK:(position + 1) * BLOCK]
            if block in first_use:
                seen = first_use[block]
                reused += 1
                assert np.array_equal(piece, seen[:len(piece)]) or np.array_equal(piece[:len(seen)], seen)
            else:
                first_use[block] = piece
    assert reused > 100


def test_mooncake_loads_are_deterministic(trace_head):
    first, second = load_workload(trace_head), load_workload(trace_head)
    for a, b in zip(first, second):
        assert np.array_equal(a.tokens, b.tokens) and a.signature == b.signature
    assert np.array_equal(hashed_tokens(7, [3, 4], 5), hashed_tokens(7, [3, 4], 5))
    assert not np.array_equal(hashed_tokens(7, [3], 512), hashed_tokens(8, [3], 512))


def test_mooncake_worked_example(tmp_path):
    # shared_block_runs' docstring: runs [3, 2, 1]; the first prompt's third block is cut
    # (2 whole blocks + 10 tokens), so only two whole blocks can be its components.
    lines = [trace_line(2 * BLOCK + 10, [1, 2, 3]), trace_line(3 * BLOCK, [1, 2, 4]),
             trace_line(3 * BLOCK, [1, 5, 3]), trace_line(BLOCK, [6])]
    assert shared_block_runs([line["hash_ids"] for line in lines]) == [3, 2, 1, 0]
    items = list(load_workload(write(tmp_path, lines)))
    assert [len(item.components) for item in items] == [2, 2, 1, 0]
    assert items[0].signature == items[1].signature != items[2].signature
    assert items[3].signature == signature([]) and items[3].prefix_len == 0
    block = {k: hashed_tokens(BLOCK_STREAM, [k], BLOCK)[0] for k in range(1, 7)}
    assert np.array_equal(items[0].tokens, np.concatenate([block[1], block[2], block[3][:10]]))
    assert np.array_equal(items[2].tokens, np.concatenate([block[1], block[5], block[3]]))
    assert np.array_equal(items[0].components[1], block[2])


def test_mooncake_prompt_beyond_its_blocks_is_filled_from_the_line(tmp_path):
    lines = [trace_line(BLOCK + 300, [1]), trace_line(BLOCK + 300, [1]), trace_line(200, [])]
    a, b, c = load_workload(write(tmp_path, lines))
    assert a.length == b.length == BLOCK + 300 and c.length == 200
    assert np.array_equal(a.tokens[:BLOCK], b.tokens[:BLOCK])  # the block: the same tokens
    assert not np.array_equal(a.tokens[BLOCK:], b.tokens[BLOCK:])  # the fill: its own line's
    assert len(a.components) == len(b.components) == 1 and c.components == []
    assert np.array_equal(a.tokens, next(iter(load_workload(write(tmp_path, lines, "again.jsonl")))).tokens)


def brute_force_runs(hash_ids: list[list[int]]) -> list[int]:
    """The rule read literally: block i is shared when some other request has the same id at
    position i; the run ends at the first block that is not."""
    runs = []
    for me, ids in enumerate(hash_ids):
        run = 0
        for i, block in enumerate(ids):
            if not any(other != me and len(theirs) > i and theirs[i] == block
                       for other, theirs in enumerate(hash_ids)):
                break
            run += 1
        runs.append(run)
    return runs


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), max_size=6), min_size=1, max_size=8))
def test_shared_runs_match_a_brute_force_search(hash_ids):
    assert shared_block_runs(hash_ids) == brute_force_runs(hash_ids)


# ---- round robin and the demo workload -----------------------------------------------------

@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_round_robin_shares_partition_the_workload_in_order(tmp_path, count):
    own = load_workload(write(tmp_path, [{"suffix": [k + 1], "payload": f"p{k}"} for k in range(20)]))
    for workload in (own, demo_workload(23)):
        everything = [item.payload for item in workload]
        shares = [[item.payload for item in workload.items(p, count)] for p in range(count)]
        joined = [payload for share in shares for payload in share]
        assert sorted(joined) == sorted(everything) and len(joined) == len(everything)
        for p, share in enumerate(shares):
            assert share == everything[p::count]  # disjoint, in file order
    with pytest.raises(ValueError):
        own.items(count, count)


def test_demo_workload_is_deterministic_and_realistic():
    workload = demo_workload(2000, seed=3, models=3)
    again = demo_workload(2000, seed=3, models=3)
    items = list(workload)
    assert len(workload) == len(items) == 2000
    for a, b in zip(items, again):
        assert np.array_equal(a.tokens, b.tokens) and a.signature == b.signature and a.model == b.model
    other_seed = next(iter(demo_workload(2000, seed=4, models=3)))
    assert not np.array_equal(items[0].tokens, other_seed.tokens)
    assert [item.payload for item in items[:3]] == [b"demo-0", b"demo-1", b"demo-2"]
    limits = ProducerLimits()
    assert all(1 <= item.length <= limits.max_item_tokens for item in items)
    assert all(item.signature == signature(item.components) for item in items[:50])
    assert workload.total_tokens == sum(item.length for item in items)
    popularity = Counter(item.signature for item in items)
    assert 12 <= len(popularity) <= DEMO_SHAPES
    assert popularity.most_common(1)[0][1] > 4 * popularity.most_common()[-1][1]  # Zipf-ish
    assert workload.models == (0, 1, 2)
    model_of = {}
    for item in items:
        assert model_of.setdefault(item.signature, item.model) == item.model  # a shape: one model
    prefixes = [item.prefix_len for item in items]
    assert min(prefixes) >= 32 and max(prefixes) <= 2048
    assert 100 < float(np.median([len(item.suffix) for item in items])) < 300


@pytest.mark.parametrize("args", [dict(items=0), dict(items=5, seed=-1), dict(items=5, seed=2**63), dict(items=5, models=0),
                                  dict(items=5, models=DEMO_SHAPES + 1)])
def test_demo_workload_refuses_bad_arguments(args):
    with pytest.raises(ValueError):
        demo_workload(**args)


def test_a_timestamp_at_the_limit_is_accepted(tmp_path):
    path = write(tmp_path, [GOOD, {"timestamp_ms": MAX_TIMESTAMP_MS, "suffix": [1]}])
    assert len(load_workload(path, SMALL)) == 2
