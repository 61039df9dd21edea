"""Results files read for the accounting: a torn last line is counted, anything else bad is
an error naming the file and line."""

from __future__ import annotations

import json

import pytest

from pipeline.accounting import summarize_results
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
