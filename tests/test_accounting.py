"""Results files read for the accounting: a torn last line is counted, anything else bad is
an error naming the file and line."""

from __future__ import annotations

import json

import pytest

from pipeline.accounting import reconcile, summarize_results
from pipeline.errors import ResultsFileError


def row(item_id: int) -> str:
    return json.dumps({"item_id": item_id, "status": "ok", "prompt_tokens": 10, "cached_tokens": 4}) + "\n"


def test_a_torn_last_line_is_counted_not_read(tmp_path):
    (tmp_path / "c0.jsonl").write_text(row(1) + row(2) + '{"item_id": 3, "sta')
    (tmp_path / "c1.jsonl").write_text(row(2))
    summary = summarize_results(str(tmp_path))
    assert (summary.items, summary.lines, summary.duplicates, summary.torn_lines) == (2, 3, 1, 1)
    assert summary.per_consumer["c0"]["lines"] == 2


def test_a_bad_line_before_the_last_names_the_file_and_line(tmp_path):
    path = tmp_path / "c0.jsonl"
    path.write_text(row(1) + "garbage\n" + row(2))
    with pytest.raises(ResultsFileError, match=f"{path}:2: not a result line"):
        summarize_results(str(tmp_path))


def test_an_unfinished_item_with_a_result_is_counted_once(tmp_path):
    # A consumer wrote results for items 3 and 4 and died before its completion arrived:
    # they went back to the queue (unfinished) and have results. Nothing is lost.
    (tmp_path / "c0.jsonl").write_text(row(1) + row(2) + row(3) + row(4))
    summary = summarize_results(str(tmp_path))
    status = {"items_received": 6, "tokens_received": 60, "items_routed": 6, "tokens_routed": 60,
              "items_completed": 2, "tokens_completed": 20, "backlog_items": 4, "pending_items": 0}
    without = reconcile(summary, status)
    assert without["lost"] == -2  # counted twice when the store was not read
    accounted = reconcile(summary, status, unfinished_ids={3, 4, 5, 6})
    assert accounted["items_unfinished_with_results"] == 2
    assert accounted["lost"] == 0
    one_more = status | {"items_received": 7}  # a seventh item: neither in the store nor done
    assert reconcile(summary, one_more, unfinished_ids={3, 4, 5, 6})["lost"] == 1
