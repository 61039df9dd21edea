"""The processes' own settings from a launch's `[broker]` / `[consumer]` tables and `--set`:
parsed, checked against each settings object's limits, and reaching the running processes."""

from __future__ import annotations

import pytest

from pipeline.broker.config import MAX_AGE_BOUND_S
from pipeline.broker.lanes import LaneConfig, WasteMeasure
from pipeline.runtime.settings import LaunchSettings
from pipeline.runtime.tables import (
    MAX_KEY_PARTS,
    broker_config,
    consumer_settings,
    merged,
    non_defaults,
    parse_assignments,
)
from pipeline.wire.errors import SettingsError
from pipeline.wire.layouts.names import LANE_ID_LIMIT
from pipeline.wire.protocol import MAX_CREDIT_BATCHES


def test_assignments_nest_by_their_dots_and_read_toml_values():
    assert parse_assignments(["broker.lanes.max_lanes=512", "broker.max_age_s=2.5", "consumer.fsync_results=true",
                              "broker.lanes.measure=literal", 'broker.lanes.measure="queued_min"']) == {
        "broker": {"lanes": {"max_lanes": 512, "measure": "queued_min"}, "max_age_s": 2.5},
        "consumer": {"fsync_results": True}}


@pytest.mark.parametrize("pair, why", [
    ("broker.max_age_s", "expected KEY=VALUE"),
    ("broker..x=1", "expected KEY=VALUE"),
    ("a.b.c.d=1", f"at most {MAX_KEY_PARTS} parts"),
])
def test_a_malformed_assignment_is_refused(pair, why):
    with pytest.raises(SettingsError, match=why):
        parse_assignments([pair])


def test_a_key_set_to_a_value_then_used_as_a_table_is_refused():
    with pytest.raises(SettingsError, match="broker is set to a value and used as a table"):
        parse_assignments(["broker=1", "broker.max_age_s=3"])


def test_tables_merge_key_by_key():
    assert merged({"broker": {"max_age_s": 1, "lanes": {"max_lanes": 4}}}, {"broker": {"lanes": {"measure": "x"}}}) \
        == {"broker": {"max_age_s": 1, "lanes": {"max_lanes": 4, "measure": "x"}}}


def test_a_broker_table_builds_the_brokers_settings(tmp_path):
    config = broker_config(str(tmp_path), {"max_age_s": 30, "work_slice_s": 0.005,
                                           "lanes": {"max_lanes": 64, "measure": "literal"}}, "test")
    assert config.max_age_s == 30.0 and config.work_slice_s == 0.005
    assert config.lanes == LaneConfig(max_lanes=64, measure=WasteMeasure.LITERAL)
    assert non_defaults(config, frozenset({"data_dir"})) == {"work_slice_s": 0.005, "lanes.max_lanes": 64,
                                                             "lanes.measure": "literal", "max_age_s": 30.0}


@pytest.mark.parametrize("table, why", [
    ({"max_age": 3}, "test: broker: unknown setting 'max_age'"),
    ({"data_dir": "/elsewhere"}, "unknown setting 'data_dir'"),  # it has its own option
    ({"max_age_s": "soon"}, "test: broker.max_age_s must be float, got 'soon'"),
    ({"max_consumers": 2.0}, "broker.max_consumers must be int, got 2.0"),
    ({"lanes": 5}, "broker.lanes must be a table, got 5"),
    ({"lanes": {"measure": "smallest"}}, "broker.lanes.measure must be one of"),
    ({"lanes": {"max_lanes": LANE_ID_LIMIT + 1}}, f"max_lanes must be <= {LANE_ID_LIMIT}"),
    ({"max_age_s": MAX_AGE_BOUND_S * 1.001}, "max_age_s .* must be a number of seconds in"),
    ({"max_age_s": 0}, "max_age_s 0.0 must be a number of seconds in"),
])
def test_a_bad_broker_setting_names_its_source_and_key(tmp_path, table, why):
    with pytest.raises(SettingsError, match=why):
        broker_config(str(tmp_path), table, "test")


def test_broker_settings_at_their_limits_are_taken(tmp_path):
    config = broker_config(str(tmp_path), {"max_age_s": MAX_AGE_BOUND_S, "lanes": {"max_lanes": LANE_ID_LIMIT}}, "t")
    assert config.max_age_s == MAX_AGE_BOUND_S and config.lanes.max_lanes == LANE_ID_LIMIT


def test_consumer_credit_bounds_are_checked_at_and_past_their_limit():
    assert consumer_settings({"credit_min_batches": 1, "credit_max_batches": MAX_CREDIT_BATCHES}, "t") == {
        "credit_min_batches": 1, "credit_max_batches": MAX_CREDIT_BATCHES}
    for table in ({"credit_max_batches": MAX_CREDIT_BATCHES + 1}, {"credit_min_batches": 0},
                  {"credit_min_batches": 9, "credit_max_batches": 8}):
        with pytest.raises(SettingsError, match="credit window bounds"):
            consumer_settings(table, "t")
    with pytest.raises(SettingsError, match="unknown setting 'max_batch_items'"):  # the contract has its options
        consumer_settings({"max_batch_items": 8}, "t")


def test_the_launch_file_and_the_command_line_reach_the_process_tables(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[launch]\nitems = 10\n[broker]\nmax_age_s = 30\n[broker.lanes]\nmax_lanes = 64\n'
                    '[consumer]\ncredit_max_batches = 8\n')
    settings = LaunchSettings.resolve(str(path), parse_assignments(["broker.lanes.max_lanes=32"]))
    assert settings.broker == {"max_age_s": 30, "lanes": {"max_lanes": 32}}
    assert settings.consumer == {"credit_max_batches": 8}
    with pytest.raises(SettingsError, match=r"run.toml: broker.lanes: unknown setting 'max_lane'"):
        path.write_text("[broker.lanes]\nmax_lane = 3\n")
        LaunchSettings.resolve(str(path))
