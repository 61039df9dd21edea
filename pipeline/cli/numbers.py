"""The click type of the commands' number-of-seconds (and other float) options.

click's FloatRange compares the value with its bounds, and nan compares false with every
number, so `--prompt-time-limit-s nan` passed it; inf passes any unbounded side. A float
option here is FiniteFloat: a finite number in its range, else click's one-line usage error.
"""

from __future__ import annotations

import math
from typing import Any

import click


class FiniteFloat(click.FloatRange):
    """click.FloatRange that also refuses nan and the infinities, bounded or not."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number
