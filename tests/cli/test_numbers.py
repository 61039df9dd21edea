"""pipeline.cli.numbers: every float option of every command is a finite number in its range
(nan compares false with both of click's bounds, so click's own FloatRange let it through),
refused in click's one-line usage error before anything starts."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.cli.batch import PROMPT_TIME_LIMIT_RANGE_S
from pipeline.cli.numbers import FiniteFloat


def commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


FLOAT_OPTIONS = [(path, option) for path, command in commands(main) for option in command.params
                 if isinstance(option.type, (click.types.FloatParamType, click.FloatRange))]


def test_the_commands_have_float_options_and_each_is_a_finite_float() -> None:
    names = {(" ".join(path), option.opts[0]) for path, option in FLOAT_OPTIONS}
    assert {("run-batch", "--prompt-time-limit-s"), ("launch", "--replay-speed"), ("produce", "--replay-speed"),
            ("broker start", "--heartbeat-timeout-s"), ("broker stop", "--timeout-s"),
            ("consumer stop", "--timeout-s")} <= names
    assert [(path, option.opts[0]) for path, option in FLOAT_OPTIONS if not isinstance(option.type, FiniteFloat)] == []


@pytest.mark.parametrize("path, option", FLOAT_OPTIONS, ids=lambda p: " ".join(p) if isinstance(p, tuple) else "")
@pytest.mark.parametrize("text", ["nan", "NaN", "-nan", "inf", "-inf", "1e400"])
def test_no_float_option_takes_nan_or_an_infinity(path: tuple[str, ...], option: click.Option, text: str) -> None:
    with pytest.raises(click.BadParameter):
        option.type.convert(text, option, None)


def test_run_batch_refuses_a_nan_time_limit_in_one_line_before_reading_its_files(tmp_path) -> None:
    result = CliRunner().invoke(main, ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out"),
                                       "--model", str(tmp_path), "--prompt-time-limit-s", "nan"])
    assert result.exit_code == 2
    assert "Invalid value for '--prompt-time-limit-s': 'nan' is not a finite number" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out.run").exists()


def test_the_time_limit_takes_its_bounds_and_refuses_past_them() -> None:
    limit = FiniteFloat(*PROMPT_TIME_LIMIT_RANGE_S)
    low, high = PROMPT_TIME_LIMIT_RANGE_S
    assert (limit.convert(str(low), None, None), limit.convert(str(high), None, None)) == (low, high)
    for text in ("0", "-1", str(low - 0.001), str(high + 0.001)):
        with pytest.raises(click.BadParameter, match="not in the range"):
            limit.convert(text, None, None)


def test_an_unbounded_finite_float_takes_any_finite_number() -> None:
    assert FiniteFloat().convert("1e308", None, None) == 1e308
    assert FiniteFloat(min=0, min_open=True).convert("1e-300", None, None) == 1e-300
    with pytest.raises(click.BadParameter, match="not in the range"):
        FiniteFloat(min=0, min_open=True).convert("0", None, None)
