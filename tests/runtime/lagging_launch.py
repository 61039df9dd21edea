"""`python -m tests.runtime.lagging_launch launch ...`: the `pipeline` command with every
producer's submit calls slowed by LAG_S, as on a loaded machine where the producers lag the
broker. A test that stops such a run mid-way cannot take the whole workload as accepted:
under load (2 cores, other test suites running) a broker killed at 1,000 items received left
a run whose producers had accepted 1,031 of 6,000, and the rerun's check against all 6,000
failed although nothing was lost.
"""

from __future__ import annotations

import time

import pipeline.producer.feed as feed_module
from pipeline.cli import main

# Per submit_many call (256 items): a producer's 3,000-item share then takes 12 s to feed.
LAG_S = 1.0

_submit = feed_module._Group.submit


def _lagging_submit(self) -> None:
    if self.items:
        time.sleep(LAG_S)
    _submit(self)


if __name__ == "__main__":
    feed_module._Group.submit = _lagging_submit  # forked producers inherit it
    main()
