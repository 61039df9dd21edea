"""The launcher's wait for vLLM's check of the engine (`Launcher.engine_check`): it comes once
the consumers have started and before any producer does, so a refusal stops the run with
nothing submitted and its consumers killed, a stop meanwhile ends the run as interrupted, and
the options the check read are what the report shows. Real processes (a broker, a sim
consumer), the check a function of this module."""

from __future__ import annotations

import pytest

from pipeline.wire.errors import SettingsError
from tests.support.launches import demo_launcher

pytestmark = pytest.mark.integration


def test_a_refusal_stops_the_run_before_any_producer_starts_and_kills_the_consumers(tmp_path):
    launcher = demo_launcher(tmp_path)
    seen: dict = {}

    def refuse(stop) -> dict:
        seen["consumers alive"] = [process.is_alive() for process in launcher.consumers]
        seen["producers"] = list(launcher.producers)
        raise SettingsError("vllm engine: refused")

    launcher.engine_check = refuse
    with pytest.raises(SettingsError, match="vllm engine: refused"):
        launcher.run()
    assert seen == {"consumers alive": [True], "producers": []}
    assert launcher.producers == [] and not any(process.is_alive() for process in launcher.consumers)
    assert launcher.ledger.total_published() == 0


def test_a_stop_while_the_check_runs_ends_the_run_as_interrupted_with_no_producer(tmp_path):
    launcher = demo_launcher(tmp_path)

    def stopped(stop) -> None:
        launcher.interrupts.count += 1  # as a Ctrl-C while the check runs
        assert stop()
        return None

    launcher.engine_check = stopped
    outcome = launcher.run()
    assert outcome.why == "interrupted" and launcher.producers == []
    assert launcher.ledger.total_published() == 0


def test_what_the_check_read_is_what_the_report_shows(tmp_path):
    launcher = demo_launcher(tmp_path)
    launcher.engine_check = lambda stop: {"cost_s_per_batch": 0.0}
    outcome = launcher.run()
    assert outcome.why == "completed"
    assert outcome.report["settings"]["engine"]["options"]["cost_s_per_batch"] == 0.0
