"""pipeline.consumer.engines.base.EngineResult.fail_long_texts: a prompt whose texts are
past MAX_ANSWER_TEXT_CHARS becomes the engine's failure of that prompt, the others kept."""

from __future__ import annotations

import pytest

from pipeline.consumer.engines.base import EngineCounters, EngineResult, Sample
from pipeline.wire import generation


def result(texts, samples=None, errors=None) -> EngineResult:
    count = len(texts)
    return EngineResult([[1]] * count, [0] * count, ["stop"] * count, EngineCounters(), texts, errors, samples)


def test_texts_at_the_limit_are_kept_and_one_character_more_fails_that_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipeline.consumer.engines.base.MAX_ANSWER_TEXT_CHARS", 10)
    found = result(["x" * 10, "x" * 11, None])
    found.fail_long_texts()
    assert found.errors is not None and found.errors[0] is None and found.errors[2] is None
    assert "decoded this answer to 11 characters, more than 10" in found.errors[1]


def test_samples_and_their_logprob_texts_count_and_an_earlier_error_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipeline.consumer.engines.base.MAX_ANSWER_TEXT_CHARS", 10)
    # A row holds its first sample's text twice (as "text" and in "samples"): both count.
    samples = [[Sample([1], "stop", "xx", [[(1, -0.1, "y" * 6)]])], [Sample([1], "stop", "xx", [[(1, -0.1, "y" * 7)]])],
               None]
    found = result(["xx", "xx", "x" * 20], samples, [None, None, "the engine's own"])
    found.fail_long_texts()
    assert found.errors[0] is None and "11 characters" in found.errors[1] and found.errors[2] == "the engine's own"


def test_a_result_without_texts_is_left_as_it_is() -> None:
    found = EngineResult([[1, 2]], [0], ["length"], EngineCounters())
    found.fail_long_texts()
    assert found.errors is None
    assert generation.MAX_ANSWER_TEXT_CHARS * 6 <= 64 << 20  # a row at the limit stays within the job's row limit
