"""The launcher's owner works while the broker recovers (`Launcher.while_broker_starts`):
called once the broker is forked, before it is awaited and before any consumer or producer
starts; a failure there stops the broker and starts nothing. Real processes."""

from __future__ import annotations

import pytest

from tests.support.launches import demo_launcher


pytestmark = pytest.mark.integration


def test_the_owner_works_while_the_broker_starts_and_before_anything_else(tmp_path):
    launcher = demo_launcher(tmp_path)
    calls: list[tuple] = []
    launcher.while_broker_starts = lambda: calls.append(
        ("beside", launcher.broker is not None and launcher.broker.is_alive(), len(launcher.consumers),
         len(launcher.producers)))
    launcher.before_producers = lambda storage_dir: calls.append(("before producers", len(launcher.consumers)))
    outcome = launcher.run()
    assert calls == [("beside", True, 0, 0), ("before producers", 1)]
    assert outcome.why == "completed"


def test_a_failure_beside_the_broker_stops_it_and_starts_nothing(tmp_path):
    launcher = demo_launcher(tmp_path)

    def fail() -> None:
        raise OSError(5, "the owner's read failed")

    launcher.while_broker_starts = fail
    with pytest.raises(OSError, match="the owner's read failed"):
        launcher.run()
    assert launcher.broker is not None and not launcher.broker.is_alive()
    assert launcher.consumers == [] and launcher.producers == []
    assert launcher.ledger.total_published() == 0
