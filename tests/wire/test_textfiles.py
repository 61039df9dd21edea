"""pipeline.wire.textfiles' message helpers: what came from a file or the user is shown so
that a terminal never acts on it, and counts read as words."""

from __future__ import annotations

import pytest

from pipeline.wire.textfiles import counted, for_terminal, printable


@pytest.mark.parametrize("text", ["/runs/out.jsonl", "/runs/a b/ü 日本.jsonl", "it's \\ fine", ""])
def test_a_printable_string_is_shown_as_it_is(text: str) -> None:
    assert printable(text) == text and for_terminal(text) == text


@pytest.mark.parametrize("text, escaped", [
    ("/runs/\x1b[31mRED\n\r.jsonl", "'/runs/\\x1b[31mRED\\n\\r.jsonl'"),
    ("a\tb", "'a\\tb'"),
    ("tail\x7f\x9b", "'tail\\x7f\\x9b'"),  # DEL and the C1 CSI
    ("right\u202eto-left", "'right\\u202eto-left'"),  # a format character that reorders the text
    ("bytes\udcff", "'bytes\\udcff'"),  # a file name's undecodable byte
])
def test_a_string_a_terminal_would_act_on_is_shown_escaped_and_quoted(text: str, escaped: str) -> None:
    assert printable(text) == escaped and printable(text).isprintable()


def test_a_message_keeps_its_lines_and_escapes_the_rest_in_place() -> None:
    message = "Error: output file /runs/\x1b[2Jx.jsonl exists\n  line two\r"
    assert for_terminal(message) == "Error: output file /runs/\\x1b[2Jx.jsonl exists\n  line two\\r"
    assert for_terminal(printable("a\nb")) == "'a\\nb'"  # a value made printable first stays one line


@pytest.mark.parametrize("count, words", [(0, "0 requests"), (1, "1 request"), (2, "2 requests"),
                                          (1_000_000, "1,000,000 requests")])
def test_a_count_is_singular_at_one_only(count: int, words: str) -> None:
    assert counted(count, "request") == words
    assert counted(count, "entry", "entries").endswith("entry" if count == 1 else "entries")
