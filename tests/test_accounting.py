"""Results files read for the accounting: a line that is not a result (torn, glued,
garbage, not a result object), wherever it is, is counted and named as path:line, and
reading goes on; only a file or directory that cannot be read is an error, naming it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pipeline.reporting.accounting import MAX_BAD_LINE_EXAMPLES, reconcile, summarize_results, take_stock
from pipeline.wire.errors import ResultsFileError
from pipeline.wire.status import BrokerStatus


def row(item_id: int) -> str:
    return json.dumps({"item_id": item_id, "status": "ok", "prompt_tokens": 10, "cached_tokens": 4}) + "\n"


def test_a_torn_last_line_is_counted_not_read(tmp_path):
    (tmp_path / "c0.jsonl").write_text(row(1) + row(2) + '{"item_id": 3, "sta')
    (tmp_path / "c1.jsonl").write_text(row(2))
    summary = summarize_results(str(tmp_path))
    assert (summary.items, summary.lines, summary.duplicates, summary.torn_lines) == (2, 3, 1, 1)
    assert summary.bad_lines == 1 and summary.per_consumer["c0"]["bad_lines"] == 1
    assert summary.bad_line_examples[0].startswith(f"{tmp_path / 'c0.jsonl'}:3: torn last line")
    assert summary.per_consumer["c0"]["lines"] == 2


def test_bad_lines_anywhere_are_counted_named_and_read_past(tmp_path):
    # What a hostile run left: a torn line glued to the next result (old consumers appended
    # to a torn tail), garbage bytes that are not UTF-8, a blank line, JSON that is not a
    # result object, a result with a field missing or of the wrong type (a bool is not an
    # id), and nesting deep enough to exhaust the JSON parser's recursion.
    path = tmp_path / "c0.jsonl"
    bad = [b'{"item_id": 3, "sta' + row(4).encode(), b"\xff\xfegarbage\n", b"\n", b"[1, 2]\n",
           b'{"item_id": 5, "status": "ok", "prompt_tokens": 10}\n',
           b'{"item_id": true, "status": "ok", "prompt_tokens": 1, "cached_tokens": 0}\n',
           b"[" * 100_000 + b"\n"]
    good = [row(k).encode() for k in (1, 2, 6, 7, 8, 9, 10, 11)]
    path.write_bytes(b"".join(line for pair in zip(good, bad) for line in pair) + good[-1])
    (tmp_path / "c1.jsonl").write_text(row(12))
    summary = summarize_results(str(tmp_path))
    assert summary.bad_lines == len(bad) and summary.torn_lines == 0
    assert summary.per_consumer == {"c0": {"lines": 8, "prompt_tokens": 80, "cached_tokens": 32, "bad_lines": 7},
                                    "c1": {"lines": 1, "prompt_tokens": 10, "cached_tokens": 4, "bad_lines": 0}}
    assert summary.item_ids == {1, 2, 6, 7, 8, 9, 10, 11, 12} and summary.lines == 9
    assert [e.split(": ", 1)[0] for e in summary.bad_line_examples] == [f"{path}:{n}" for n in range(2, 15, 2)]
    why = [e.split(": ", 1)[1] for e in summary.bad_line_examples]
    assert why[0].startswith("not JSON") and why[1].startswith("not JSON") and why[2].startswith("not JSON")
    assert why[3] == "not a result object (a JSON list)"
    assert why[4].startswith("not a result: field 'cached_tokens' is None")
    assert why[5].startswith("not a result: field 'item_id' is True")
    assert why[6].startswith("not JSON")


@pytest.mark.parametrize("count", [MAX_BAD_LINE_EXAMPLES, MAX_BAD_LINE_EXAMPLES + 1, 1000])
def test_bad_lines_past_the_example_limit_are_only_counted(tmp_path, count):
    (tmp_path / "c0.jsonl").write_text(row(1) + "garbage\n" * count + row(2))
    summary = summarize_results(str(tmp_path))
    assert summary.bad_lines == count and summary.items == 2
    assert len(summary.bad_line_examples) == MAX_BAD_LINE_EXAMPLES
    assert summary.bad_line_examples[-1].startswith(f"{tmp_path / 'c0.jsonl'}:{MAX_BAD_LINE_EXAMPLES + 1}: ")


def test_a_results_file_that_is_not_a_regular_file_is_counted_and_never_read(tmp_path):
    """A directory, a FIFO or a link to a device named like a results file: opening a FIFO
    would hang and /dev/zero would be read forever (10 GB in 30 s, seen in a hostile test run),
    so each is one bad line, named, and the other files are read."""
    (tmp_path / "c0.jsonl").mkdir()
    os.mkfifo(tmp_path / "c1.jsonl")
    (tmp_path / "c2.jsonl").symlink_to("/dev/zero")
    (tmp_path / "c3.jsonl").write_text(row(1) + row(2))
    summary = summarize_results(str(tmp_path))
    assert summary.items == 2 and summary.bad_lines == 3
    assert [e.split(": ", 1)[0] for e in summary.bad_line_examples] == [str(tmp_path / f"c{k}.jsonl") for k in range(3)]


def test_a_line_past_the_limit_is_skipped_in_bounded_memory(tmp_path, monkeypatch):
    monkeypatch.setattr("pipeline.reporting.accounting.MAX_RESULT_LINE_BYTES", 1000)
    (tmp_path / "c0.jsonl").write_bytes(row(1).encode() + b"x" * 5000 + b"\n" + row(2).encode() + b"y" * 5000)
    summary = summarize_results(str(tmp_path))
    assert summary.item_ids == {1, 2} and summary.bad_lines == 2
    assert all("longer than 1,000 bytes" in e for e in summary.bad_line_examples)


@pytest.mark.integration
@pytest.mark.parametrize("what", ["file", "directory"])
def test_an_unreadable_results_file_or_directory_is_an_error_naming_it(tmp_path, what):
    # Root reads anything, so as root the summary runs in a child that dropped to uid
    # 65534 (nobody), from inside tmp_path (whose parents that user may not enter).
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(tmp_path, 0o711)
    os.chmod(root, 0o755)
    (root / "c0.jsonl").write_text(row(1))
    os.chmod(root / "c0.jsonl" if what == "file" else root, 0o000 if what == "file" else 0o311)
    unreadable = "open/c0.jsonl" if what == "file" else "open"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the error's type and text through the pipe
        try:
            os.chdir(tmp_path)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            try:
                summarize_results("open")
                message = "no error"
            except ResultsFileError as exc:
                message = f"ResultsFileError: {exc}"
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails
                message = f"{type(exc).__name__}: {exc}"
            os.write(write, message.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    os.chmod(tmp_path / unreadable, 0o755 if what == "directory" else 0o644)
    assert message.startswith(f"ResultsFileError: {unreadable}: cannot "), message
    assert "Permission denied" in message
    assert what == "directory" or "results directory" not in message


def test_an_unfinished_item_with_a_result_is_counted_once(tmp_path):
    # A consumer wrote results for items 3 and 4 and died before its completion arrived:
    # they went back to the queue (unfinished: in the store) and have results. Nothing is
    # lost; a live broker's status alone judges nothing (lost None).
    (tmp_path / "c0.jsonl").write_text(row(1) + row(2) + row(3) + row(4))
    summary = summarize_results(str(tmp_path))
    status = BrokerStatus(items_received=6, tokens_received=60, items_routed=6, tokens_routed=60,
                          items_completed=2, tokens_completed=20, backlog_items=4, pending_items=0)
    assert reconcile(summary, status)["lost"] is None
    results = np.array(sorted(summary.item_ids), dtype=np.uint64)
    none = np.zeros(0, np.uint64)
    stock = take_stock([(0, 7)], results, np.array([3, 4, 5, 6], dtype=np.uint64), none, none)
    accounted = reconcile(summary, status, stock)
    assert (accounted["items_in_store"], accounted["items_unfinished"]) == (2, 2)
    assert accounted["lost"] == 1 and accounted["lost_examples"] == [0]  # item 0: nowhere
    stock = take_stock([(0, 7)], results, np.array([0, 3, 4, 5, 6], dtype=np.uint64), none, none)
    assert reconcile(summary, status, stock)["lost"] == 0