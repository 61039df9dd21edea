"""pipeline.batchjob.scan: one pass over a batch file checks every file-level rule (the
file's problems refuse the job, path:line named, the first 10 and the total), finds every
duplicate custom_id however the digests spill or collide, and keeps a sparse index that
points at the right bytes and lines."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from pipeline.batchjob import scan as scan_module
from pipeline.batchjob.layout import INDEX_ENTRY_DTYPE, INDEX_HEADER_DTYPE, INDEX_STRIDE
from pipeline.batchjob.manifest import JobManifest
from pipeline.batchjob.requests import parse_line
from pipeline.batchjob.scan import (
    DIGEST_RECORD_DTYPE,
    MAX_JSON_NESTING,
    MAX_LISTED_ERRORS,
    MAX_REQUEST_LINE_BYTES,
    InputScan,
    custom_id_digest,
    input_digest,
    read_index,
    scan_input,
    write_index,
)
from pipeline.wire.errors import BadInputError, BatchFileError, JobMismatchError, WorkloadError
from tests.batchjob.batchfiles import MODEL, chat, completion, line_of, write


def scan(tmp_path: Path, *lines: object, last_newline: bool = True) -> InputScan:
    return scan_input(str(write(tmp_path / "in.jsonl", *lines, last_newline=last_newline)), str(tmp_path / "work"), str(tmp_path / "lines.bin"))


def refusal(tmp_path: Path, *lines: object, last_newline: bool = True) -> str:
    with pytest.raises(BatchFileError) as caught:
        scan(tmp_path, *lines, last_newline=last_newline)
    return str(caught.value)


def lines_at(path: Path) -> list[tuple[int, bytes]]:
    """Each line of the file with its byte offset."""
    found, offset = [], 0
    for raw in path.read_bytes().split(b"\n"):
        found.append((offset, raw))
        offset += len(raw) + 1
    return found


# --- a good file ------------------------------------------------------------------------------


def test_a_good_file_gives_its_count_size_digest_and_first_index_entry(tmp_path: Path) -> None:
    spaced = ('{ "body" : {"model": "tiny", "prompt": "x"},  "url": "/v1/completions", "method": "POST", '
              '"custom_id": "c"}')
    path = write(tmp_path / "in.jsonl", "", "  ", chat("a", max_completion_tokens=5), completion("b", n=3), spaced)
    found = scan_input(str(path), str(tmp_path / "work"), str(tmp_path / "lines.bin"))
    data = path.read_bytes()
    assert (found.path, found.requests, found.input_bytes) == (str(path), 3, len(data))
    assert found.input_xxh3 == xxhash.xxh3_128_hexdigest(data)
    assert found.index.dtype == INDEX_ENTRY_DTYPE
    assert found.index.tolist() == [(data.index(b'{"custom_id": "a"'), 3)]
    assert not (tmp_path / "work").exists()  # nothing spilled, nothing made
    assert input_digest(str(path)) == (found.input_bytes, found.input_xxh3)


def test_the_error_is_a_workload_error_and_a_bad_input_error() -> None:
    assert issubclass(BatchFileError, WorkloadError) and issubclass(BatchFileError, BadInputError)


def test_a_file_without_a_last_newline_reads_its_last_line_and_has_its_size(tmp_path: Path) -> None:
    found = scan(tmp_path, chat("a"), chat("b"), last_newline=False)
    size = (tmp_path / "in.jsonl").stat().st_size
    assert found.requests == 2 and found.input_bytes == size
    assert input_digest(str(tmp_path / "in.jsonl")) == (size, found.input_xxh3)  # a resume finds the same input
    assert ":3: not JSON" in refusal(tmp_path, chat("a"), chat("b"), "not json", last_newline=False)


def test_blank_lines_are_skipped_and_counted_as_lines(tmp_path: Path) -> None:
    found = scan(tmp_path, "", chat("a"), "\t ", "", chat("b"), "   ")
    assert found.requests == 2
    message = refusal(tmp_path, "", chat("a"), "  ", chat("a"))
    assert ":4: custom_id 'a' is used by line 2 too" in message


def test_bodies_are_not_checked_beyond_being_objects(tmp_path: Path) -> None:
    """What a body asks for is the request's problem (answered 400), never the file's."""
    found = scan(tmp_path, chat("a", n=5, top_k=3), {**chat("b"), "url": "/v1/embeddings"}, chat("c", model="big"),
                 {**chat("d"), "body": {}})
    assert found.requests == 4


def test_a_lone_surrogate_in_a_body_is_the_requests_problem_not_the_files(tmp_path: Path) -> None:
    line = json.dumps(chat("s", messages=[{"role": "user", "content": "\ud800 and more"}]))
    assert "\\ud800" in line
    found = scan(tmp_path, chat("a"), line, completion("b", prompt="x\udfff"))
    assert found.requests == 3
    request = parse_line(line.encode(), 1, 2, MODEL)
    assert request.custom_id == "s" and request.error is None
    assert request.messages == [{"role": "user", "content": "\ud800 and more"}]


def test_a_lone_surrogate_in_a_custom_id_is_a_custom_id_like_any_other(tmp_path: Path) -> None:
    assert scan(tmp_path, chat("a\ud800"), chat("a\udc00"), chat("a")).requests == 3
    assert ":3: custom_id 'a\\ud800' is used by line 1 too" in refusal(tmp_path, chat("a\ud800"), chat("b"),
                                                                       chat("a\ud800"))


# --- the file's problems ----------------------------------------------------------------------


def _without(line: dict, *keys: str) -> dict:
    return {key: value for key, value in line.items() if key not in keys}


FILE_PROBLEMS = [
    ("not json", '{"custom_id": "x",', "not JSON"),
    ("not json after a good start", json.dumps(chat()) + " trailing", "not JSON"),
    ("not utf-8", b'{"custom_id": "\xff"}', "not UTF-8"),
    ("not utf-8 in a body", json.dumps(chat()).replace("Hi", "H\xe9").encode("latin-1"), "not UTF-8"),
    ("an array", "[1, 2]", "must be a JSON object, got an array"),
    ("a string", '"hello"', "must be a JSON object, got a string"),
    ("a number", "17", "must be a JSON object, got an integer 17"),
    ("null", "null", "must be a JSON object, got null"),
    ("no custom_id", _without(chat(), "custom_id"), "missing 'custom_id'"),
    ("no method", _without(chat(), "method"), "missing 'method'"),
    ("no url", _without(chat(), "url"), "missing 'url'"),
    ("no body", _without(chat(), "body"), "missing 'body'"),
    ("two missing", _without(chat(), "body", "url"), "missing 'url', 'body'"),
    ("an empty object", {}, "missing 'custom_id', 'method', 'url', 'body'"),
    ("unknown key", {**chat(), "priority": 1}, "unknown key 'priority'"),
    ("unknown keys", {**chat(), "priority": 1, "extra": 2}, "unknown keys 'extra', 'priority'"),
    ("custom_id a number", {**chat(), "custom_id": 17}, "custom_id must be a non-empty string, got an integer 17"),
    ("custom_id empty", {**chat(), "custom_id": ""}, "custom_id must be a non-empty string, got a string \"\""),
    ("custom_id null", {**chat(), "custom_id": None}, "custom_id must be a non-empty string, got null"),
    ("custom_id an object", {**chat(), "custom_id": {"id": 1}}, "custom_id must be a non-empty string, got an object"),
    ("method GET", {**chat(), "method": "GET"}, "method must be 'POST'"),
    ("method lower case", {**chat(), "method": "post"}, "method must be 'POST'"),
    ("method a number", {**chat(), "method": 1}, "method must be 'POST' (the Batch API's only method), got an integer 1"),
    ("url a number", {**chat(), "url": 5}, "url must be a string"),
    ("url null", {**chat(), "url": None},
     "url must be a string (an endpoint such as '/v1/chat/completions'), got null"),
    ("body an array", {**chat(), "body": []}, "body must be a JSON object"),
    ("body a string", {**chat(), "body": "{}"}, "body must be a JSON object (the endpoint's request), got a string"),
    ("body null", {**chat(), "body": None}, "body must be a JSON object (the endpoint's request), got null"),
]


@pytest.mark.parametrize(("line", "why"), [(line, why) for _, line, why in FILE_PROBLEMS],
                         ids=[name for name, _, _ in FILE_PROBLEMS])
def test_a_line_that_is_not_a_request_refuses_the_file_naming_path_and_line(tmp_path: Path, line: object,
                                                                            why: str) -> None:
    message = refusal(tmp_path, chat("good"), line, chat("after"))
    path = tmp_path / "in.jsonl"
    assert message.startswith(f"{path}: 1 bad line;") and "the job does not start" in message
    assert f"{path}:2: " in message and why in message
    assert f"{path}:1:" not in message and f"{path}:3:" not in message


def test_the_first_ten_bad_lines_are_listed_with_the_total(tmp_path: Path) -> None:
    bad = [{**chat(f"r{k}"), "method": "GET"} for k in range(15)]
    message = refusal(tmp_path, chat("good"), *bad, chat("good"))
    path = tmp_path / "in.jsonl"
    assert f"16 bad lines; nothing was submitted" in message and f"the first {MAX_LISTED_ERRORS}" in message
    listed = [line.removeprefix(f"  {path}:") for line in message.splitlines()[1:]]
    assert [line.split(":")[0] for line in listed] == [str(n) for n in range(2, 2 + MAX_LISTED_ERRORS)]


def test_the_first_ten_are_the_earliest_lines_whatever_order_they_are_found_in(tmp_path: Path) -> None:
    """Duplicates are found after the read: an early duplicate still comes first."""
    lines = [chat("a"), chat("a")] + [{**chat(f"r{k}"), "method": "GET"} for k in range(60)]
    message = refusal(tmp_path, *lines)
    assert "61 bad lines" in message
    listed = [line.split(":")[1] for line in message.splitlines()[1:]]
    assert listed == [str(n) for n in range(2, 2 + MAX_LISTED_ERRORS)]
    assert "custom_id 'a' is used by line 1 too" in message.splitlines()[1]


def test_a_duplicate_custom_id_names_both_lines(tmp_path: Path) -> None:
    message = refusal(tmp_path, chat("a"), chat("b"), completion("a"))
    assert f"{tmp_path / 'in.jsonl'}:3: custom_id 'a' is used by line 1 too" in message
    assert "1 bad line;" in message


def test_every_duplicate_is_named_against_the_first_line(tmp_path: Path) -> None:
    message = refusal(tmp_path, chat("a"), chat("b"), chat("a"), chat("b"), chat("a"))
    assert "3 bad lines" in message
    for line, first in ((3, 1), (4, 2), (5, 1)):
        assert f":{line}: custom_id '{'a' if first == 1 else 'b'}' is used by line {first} too" in message


@pytest.mark.parametrize("text", ["", "\n\n  \n", "\t"], ids=["empty", "blank", "a tab without newline"])
def test_a_file_without_requests_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(text)
    with pytest.raises(BatchFileError, match="no requests"):
        scan_input(str(path), str(tmp_path / "work"), str(tmp_path / "lines.bin"))


def test_a_missing_file_a_directory_a_device_and_a_fifo_are_refused(tmp_path: Path) -> None:
    with pytest.raises(BatchFileError, match="cannot read the batch file"):
        scan_input(str(tmp_path / "absent.jsonl"), str(tmp_path / "work"), str(tmp_path / "lines.bin"))
    for path, kind in ((str(tmp_path), "directory"), ("/dev/zero", "device"), ("/dev/null", "device")):
        with pytest.raises(BatchFileError, match=f"must be a regular file .*, not a {kind}"):
            scan_input(path, str(tmp_path / "work"), str(tmp_path / "lines.bin"))
        with pytest.raises(BatchFileError, match=f"not a {kind}"):
            input_digest(path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opened without a writer: refused, not waited on
    with pytest.raises(BatchFileError, match="not a pipe"):
        scan_input(str(fifo), str(tmp_path / "work"), str(tmp_path / "lines.bin"))
    with pytest.raises(BatchFileError, match="not a pipe"):
        input_digest(str(fifo))


def test_a_line_at_the_size_limit_is_read_and_one_byte_more_is_refused(tmp_path: Path) -> None:
    assert scan(tmp_path, line_of(MAX_REQUEST_LINE_BYTES), chat("next")).requests == 2
    message = refusal(tmp_path, chat("first"), line_of(MAX_REQUEST_LINE_BYTES + 1), chat("next"))
    assert f"{tmp_path / 'in.jsonl'}:2: longer than {MAX_REQUEST_LINE_BYTES:,} bytes" in message
    assert "1 bad line;" in message


def nested(custom_id: str, depth: int, inner: str = "[]") -> str:
    """A chat request line whose JSON nests `depth` levels (the line's own object counted),
    the extra levels as arrays in an unknown body field."""
    arrays = depth - 2  # the line's object and its body
    return (f'{{"custom_id": "{custom_id}", "method": "POST", "url": "/v1/chat/completions", "body": '
            f'{{"model": "{MODEL}", "messages": [], "x": {"[" * (arrays - 1)}{inner}{"]" * (arrays - 1)}}}}}')


def test_a_line_nested_at_the_limit_is_read_and_one_level_more_is_refused(tmp_path: Path) -> None:
    assert scan(tmp_path, nested("a", MAX_JSON_NESTING), chat("b")).requests == 2
    assert parse_line(nested("a", MAX_JSON_NESTING).encode(), 0, 1, MODEL).custom_id == "a"  # a producer parses it
    message = refusal(tmp_path, chat("a"), nested("b", MAX_JSON_NESTING + 1), chat("c"))
    assert f"{tmp_path / 'in.jsonl'}:2: nested deeper than {MAX_JSON_NESTING} levels" in message
    assert "1 bad line;" in message


@pytest.mark.parametrize("depth", [1000, 5000, 100_000])
def test_a_line_nested_past_the_interpreters_recursion_is_a_bad_line_not_a_crash(tmp_path: Path, depth: int) -> None:
    message = refusal(tmp_path, chat("a"), nested("b", depth), nested("c", depth, inner="[}"), chat("d"))
    assert "2 bad lines" in message
    assert [line.split(":")[1] for line in message.splitlines()[1:]] == ["2", "3"]
    assert message.count(f"nested deeper than {MAX_JSON_NESTING} levels") == 2


def test_brackets_in_strings_do_not_nest(tmp_path: Path) -> None:
    line = chat("a", messages=[{"role": "user", "content": "[{" * 5000 + '\\"]' + "}]" * 7}])
    deep_key = chat("b", **{'x"[[[' * 100: ["[" * 300]})
    assert scan(tmp_path, line, deep_key, nested("c", MAX_JSON_NESTING, inner=r'["[[[\\", "\\\"]]"]')).requests == 3


def test_an_over_long_line_across_many_blocks_is_one_bad_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines longer than the limit are skipped block by block, whatever the block size."""
    monkeypatch.setattr(scan_module, "MAX_REQUEST_LINE_BYTES", 200)
    lines = [chat("a"), line_of(201), chat("b"), line_of(5000), "", chat("c"), line_of(200), line_of(777)]
    messages = set()
    for block in (1, 7, 64, 199, 200, 201, 4096):
        monkeypatch.setattr(scan_module, "READ_BLOCK_BYTES", block)
        for last_newline in (True, False):
            message = refusal(tmp_path, *lines, last_newline=last_newline)
            messages.add(message)
    (message,) = messages
    assert "3 bad lines" in message
    assert [line.split(":")[1] for line in message.splitlines()[1:]] == ["2", "4", "8"]
    assert "longer than 200 bytes" in message


def test_reading_in_any_block_size_gives_the_same_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = ["", chat("a"), "  ", completion("b" * 300), chat("c\ud800"), "", chat("d")]
    expected = scan(tmp_path, *lines, last_newline=False)
    for block in (1, 2, 5, 64, 333):
        monkeypatch.setattr(scan_module, "READ_BLOCK_BYTES", block)
        found = scan(tmp_path, *lines, last_newline=False)
        assert (found.requests, found.input_bytes, found.input_xxh3) == (
            expected.requests, expected.input_bytes, expected.input_xxh3)
        assert found.index.tolist() == expected.index.tolist()


def test_requests_up_to_the_limit_are_read_and_one_more_stops_the_file(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The real limit is 2**28 requests; the check is the same at 3.
    monkeypatch.setattr(scan_module, "MAX_BATCH_REQUESTS", 3)
    lines = [chat(f"r{k}") for k in range(4)]
    assert scan(tmp_path, *lines[:3]).requests == 3
    assert scan(tmp_path, "", *lines[:3], "", " ").requests == 3  # blank lines are not requests
    message = refusal(tmp_path, *lines, {"not": "a request"})
    assert f"{tmp_path / 'in.jsonl'}:4: more than 3 requests in one file" in message
    assert "up to line 4, where reading stopped" in message and ":5:" not in message


def test_a_request_the_job_cannot_serve_counts_against_the_limit(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan_module, "MAX_BATCH_REQUESTS", 2)
    message = refusal(tmp_path, chat("a", n=2), chat("b", top_k=1), chat("c"))
    assert ":3: more than 2 requests" in message


# --- duplicates, however the digests fall ------------------------------------------------------


def _ids_with_duplicates(count: int) -> tuple[list[str], dict[int, int]]:
    """`count` custom_ids, every 97th repeating an earlier one; {duplicate's line: first line}."""
    ids, first_line, expected = [], {}, {}
    for k in range(count):
        custom_id = f"r{k - 50 if k % 97 == 96 else k}"
        line = k + 1
        if custom_id in first_line:
            expected[line] = first_line[custom_id]
        else:
            first_line[custom_id] = line
        ids.append(custom_id)
    return ids, expected


def _duplicates_named(message: str) -> dict[int, int]:
    found = {}
    for text in message.splitlines()[1:]:
        _path, line, why = text.strip().split(":", 2)
        assert "is used by line" in why, why
        found[int(line)] = int(why.split("is used by line ")[1].split()[0])
    return found


def test_duplicates_are_found_when_the_digests_spill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan_module, "SPILL_BUFFER_RECORDS", 16)
    monkeypatch.setattr(scan_module, "MAX_LISTED_ERRORS", 1000)
    ids, expected = _ids_with_duplicates(1000)
    assert len(expected) == 10
    message = refusal(tmp_path, *(chat(custom_id) for custom_id in ids))
    assert f"{len(expected)} bad lines" in message and _duplicates_named(message) == expected
    assert not (tmp_path / "work").exists()  # the spilled digests are removed
    unique = list(dict.fromkeys(ids))
    assert scan(tmp_path, *(chat(custom_id) for custom_id in unique)).requests == len(unique)
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("digest", [0, 42, (1 << 64) - 1])
@pytest.mark.parametrize("spill", [16, scan_module.SPILL_BUFFER_RECORDS])
def test_different_custom_ids_of_one_digest_are_told_apart_by_reading_both_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digest: int, spill: int) -> None:
    monkeypatch.setattr(scan_module, "custom_id_digest", lambda custom_id: digest)
    monkeypatch.setattr(scan_module, "SPILL_BUFFER_RECORDS", spill)
    monkeypatch.setattr(scan_module, "MAX_LISTED_ERRORS", 1000)
    ids = [f"id-{k}" for k in range(100)]
    assert scan(tmp_path, *(chat(custom_id) for custom_id in ids)).requests == 100  # no false duplicate
    ids, expected = _ids_with_duplicates(300)
    message = refusal(tmp_path, *("", *(chat(custom_id) for custom_id in ids)))
    assert _duplicates_named(message) == {line + 1: first + 1 for line, first in expected.items()}


def test_the_digest_is_of_the_custom_ids_bytes() -> None:
    assert custom_id_digest("req-1") == xxhash.xxh3_64_intdigest(b"req-1")
    assert custom_id_digest("a\ud800") != custom_id_digest("a\udc00")


def test_digests_a_killed_scan_left_behind_are_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan_module, "SPILL_BUFFER_RECORDS", 4)
    path = write(tmp_path / "in.jsonl", *(chat(f"r{k}") for k in range(20)))
    work = tmp_path / "work"
    work.mkdir()
    for k in range(20):  # a stale record of every request, as of another file where it was line 100 + k
        digest = custom_id_digest(f"r{k}")
        stale = np.array([(digest, 0, 100 + k)], dtype=DIGEST_RECORD_DTYPE)
        with open(work / f"ids-{digest >> 56:03d}.bin", "ab") as f:
            f.write(stale.tobytes())
    assert scan_input(str(path), str(work), str(tmp_path / "lines.bin")).requests == 20
    assert not work.exists()


# --- the sparse index ---------------------------------------------------------------------------


def test_the_sparse_index_points_at_each_strides_line_and_its_number(tmp_path: Path) -> None:
    count = 2 * INDEX_STRIDE + 7
    lines: list[object] = ["", " "]
    for k in range(count):
        lines.append(completion(f"r{k}", prompt="p" * (k % 13)))
        if k % 1000 == 999:
            lines.extend(["", "\t"])
    path = write(tmp_path / "in.jsonl", *lines)
    found = scan_input(str(path), str(tmp_path / "work"), str(tmp_path / "lines.bin"))
    assert found.requests == count and len(found.index) == 3
    at = lines_at(path)
    for entry, k in zip(found.index.tolist(), (0, INDEX_STRIDE, 2 * INDEX_STRIDE)):
        offset, line = entry
        assert at[line - 1][0] == offset
        assert json.loads(at[line - 1][1])["custom_id"] == f"r{k}"
        assert path.read_bytes()[offset:].split(b"\n", 1)[0] == at[line - 1][1]


def test_progress_is_reported_as_bytes_read_and_requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan_module, "READ_BLOCK_BYTES", 64)
    monkeypatch.setattr(scan_module, "PROGRESS_EVERY_BYTES", 500)
    path = write(tmp_path / "in.jsonl", *(chat(f"r{k}") for k in range(50)))
    calls: list[tuple[int, int]] = []
    found = scan_input(str(path), str(tmp_path / "work"), str(tmp_path / "lines.bin"), on_progress=lambda read, requests: calls.append(
        (read, requests)))
    size = path.stat().st_size
    assert len(calls) >= size // (2 * 500)
    reads = [read for read, _ in calls]
    assert all(later - earlier >= 500 for earlier, later in zip(reads, reads[1:]))
    assert all(500 <= read <= size and 0 < requests <= found.requests for read, requests in calls)


def test_each_request_line_is_handed_on_in_the_same_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan_module, "READ_BLOCK_BYTES", 64)  # lines across blocks
    path = write(tmp_path / "in.jsonl", chat("a"), "", "  ", completion("b"), chat("c"), last_newline=False)
    seen: list[tuple[int, int, int, bytes]] = []
    found = scan_input(str(path), str(tmp_path / "work"), None, on_request=lambda *request: seen.append(request))
    assert found.requests == 3 and [(index, line) for index, line, _, _ in seen] == [(0, 1), (1, 4), (2, 5)]
    data = path.read_bytes()
    assert all(data[offset:offset + len(raw)] == raw and json.loads(raw) for _, _, offset, raw in seen)
    assert not os.path.exists(tmp_path / "work")  # nothing spilled, and no line digests kept


def test_no_request_is_handed_on_after_the_first_bad_line(tmp_path: Path) -> None:
    path = write(tmp_path / "in.jsonl", chat("a"), chat("b"), "not json", chat("c"), chat("a"))
    seen: list[int] = []
    with pytest.raises(BatchFileError, match=r"in\.jsonl:3: not JSON") as error:
        scan_input(str(path), str(tmp_path / "work"), None, on_request=lambda index, *_: seen.append(index))
    assert "in.jsonl:5: custom_id 'a' is used by line 1 too" in str(error.value)
    assert seen == [0, 1]


# --- the index file -------------------------------------------------------------------------------


def _manifest(found: InputScan, **changes: object) -> JobManifest:
    fields = dict(job_id=1, created_s=0, input_path=found.path, input_bytes=found.input_bytes,
                  input_xxh3=found.input_xxh3, requests=found.requests, served_model=MODEL, output_path="/out",
                  output_order="input", error_file=None)
    fields.update(changes)
    return JobManifest(**fields)


@pytest.fixture
def indexed(tmp_path: Path) -> tuple[InputScan, Path]:
    found = scan(tmp_path, *(chat(f"r{k}") for k in range(INDEX_STRIDE + 1)))
    path = tmp_path / "input.idx"
    write_index(str(path), found)
    return found, path


def test_the_index_file_reads_back_as_the_scans_index(indexed: tuple[InputScan, Path]) -> None:
    found, path = indexed
    assert len(found.index) == 2
    assert read_index(str(path), _manifest(found)).tolist() == found.index.tolist()
    assert path.stat().st_size == INDEX_HEADER_DTYPE.itemsize + 2 * INDEX_ENTRY_DTYPE.itemsize
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("position", [0, 4, 8, 16, 24, 32, 47, 48, 56, 63])
def test_an_index_file_with_a_header_byte_changed_is_refused(indexed: tuple[InputScan, Path], position: int) -> None:
    found, path = indexed
    raw = bytearray(path.read_bytes())
    raw[position] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(JobMismatchError, match="not the input index of this job"):
        read_index(str(path), _manifest(found))


@pytest.mark.parametrize("change", [{"requests": INDEX_STRIDE + 2}, {"requests": INDEX_STRIDE * 2 + 1},
                                    {"input_xxh3": "0" * 32}], ids=["requests", "more entries", "input"])
def test_an_index_file_of_another_input_is_refused(indexed: tuple[InputScan, Path], change: dict) -> None:
    found, path = indexed
    with pytest.raises(JobMismatchError, match="not the input index of this job"):
        read_index(str(path), _manifest(found, **change))


@pytest.mark.parametrize("cut", [1, INDEX_ENTRY_DTYPE.itemsize, INDEX_ENTRY_DTYPE.itemsize * 2 + 1])
def test_a_short_or_missing_index_file_is_refused(indexed: tuple[InputScan, Path], cut: int) -> None:
    found, path = indexed
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(JobMismatchError, match="not the input index of this job"):
        read_index(str(path), _manifest(found))
    path.unlink()
    with pytest.raises(JobMismatchError, match="cannot read the job's input index"):
        read_index(str(path), _manifest(found))
