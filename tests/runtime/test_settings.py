"""Launch settings: embedded defaults, then a TOML file, then the command line."""

from __future__ import annotations

import pytest

from pipeline.runtime.settings import DEMO_ITEMS, LaunchSettings
from pipeline.wire.errors import SettingsError


def write(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_defaults_are_the_demo_on_disk_with_the_sim_engine():
    settings = LaunchSettings.resolve()
    assert (settings.workload, settings.storage, settings.durability, settings.engine) == ("demo", "disk", "process", "sim")
    assert settings.data_dir is None and settings.items is None and DEMO_ITEMS > 0


def test_file_overrides_defaults_and_command_line_overrides_file(tmp_path):
    path = write(tmp_path, 'items = 500\nproducers = 3\nreplay_speed = 2\n[engine_options]\ncapacity_tokens = 4096\n')
    settings = LaunchSettings.resolve(path, {"producers": 1, "storage": None})
    assert settings.items == 500 and settings.producers == 1 and settings.storage == "disk"
    assert settings.replay_speed == 2.0 and isinstance(settings.replay_speed, float)
    assert settings.engine_options == {"capacity_tokens": 4096}


def test_a_launch_table_is_read_like_the_top_level(tmp_path):
    assert LaunchSettings.resolve(write(tmp_path, "[launch]\nconsumers = 4\n")).consumers == 4
    with pytest.raises(SettingsError, match=r"beside a \[launch\] table a file holds only \[broker\], \[consumer\] tables"):
        LaunchSettings.resolve(write(tmp_path, "items = 3\n[launch]\nconsumers = 4\n"))


@pytest.mark.parametrize("text, message", [
    ("itmes = 5\n", "unknown setting 'itmes'"),
    ('items = "5"\n', "items must be int"),
    ("items = true\n", "items must be int"),
    ("items = -5\n", r"items must be in \[1, "),
    ("items = 1099511627776\n", r"items must be in \[1, 1,099,511,627,775\]"),
    ("replay_speed = 0\n", "replay_speed must be a finite number above 0"),
    ("replay_speed = nan\n", "replay_speed must be a finite number above 0"),
    ("metrics_port = 70000\n", r"metrics_port must be in \[0, 65,535\]"),
    ("workload_seed = -1\n", r"workload_seed must be in \[0, "),
    ("seed = 3\n", "seed is now workload_seed"),
    ("max_tokens = 4096\n", "max_tokens is now max_batch_tokens"),
    ("producers = 129\n", r"producers must be in \[1, 128\]"),
    ("consumers = 129\n", r"consumers must be in \[1, 128\]"),
    ('report = "/nonexistent-dir/r.json"\n', "the directory /nonexistent-dir does not exist"),
    ("items = \n", "not valid TOML"),
])
def test_bad_settings_name_the_file_and_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(SettingsError, match=message) as caught:
        LaunchSettings.resolve(path)
    assert path in str(caught.value)


def test_a_bad_value_on_the_command_line_is_named_so(tmp_path):
    with pytest.raises(SettingsError, match=r"the command line: producers must be in \[1, 128\], got 0"):
        LaunchSettings.resolve(write(tmp_path, "items = 5\n"), {"producers": 0})


@pytest.mark.parametrize("key, at_limit, past", [("producers", 128, 129), ("consumers", 128, 129),
                                                 ("items", (1 << 40) - 1, 1 << 40),
                                                 ("workload_seed", 2**63 - 1, 2**63)])
def test_counts_are_accepted_at_their_limit_and_refused_one_past(tmp_path, key, at_limit, past):
    assert getattr(LaunchSettings.resolve(None, {key: at_limit}), key) == at_limit
    with pytest.raises(SettingsError, match=f"{key} must be in"):
        LaunchSettings.resolve(None, {key: past})


def test_a_missing_config_file_is_an_error(tmp_path):
    with pytest.raises(SettingsError, match="cannot read the config file"):
        LaunchSettings.resolve(str(tmp_path / "nope.toml"))


@pytest.mark.parametrize("text, message", [
    ('storage = "ram"\n', "storage must be one of disk, memory, got 'ram'"),
    ('durability = "fsync"\n', "durability must be one of power, process"),
    ('engine = "tpu"\n', "engine must be one of sim, vllm, got 'tpu'"),
    ('engine = "vllm"\n', "vllm engine: model \\(a model directory\\) is required"),
    ('engine = "vllm"\n[engine_options]\nmodel = "m"\nbogus = 1\n', "vllm engine: unknown options bogus"),
    ('storage = "memory"\ndurability = "power"\n', "needs storage 'disk'"),
    ("[engine_options]\nblock_size = 16\n", "engine_options"),
    ("[engine_options]\nblock_size_tokens = 0\n", "bad config"),
])
def test_names_and_engine_options_are_checked_before_anything_starts(tmp_path, text, message):
    with pytest.raises(SettingsError, match=message):
        LaunchSettings.resolve(write(tmp_path, text))


def test_a_metrics_token_file_is_read_before_anything_starts(tmp_path):
    token = tmp_path / "token"
    token.write_text("abc\n")
    token.chmod(0o644)
    path = write(tmp_path, f'metrics_port = 0\nmetrics_token_file = "{token}"\n')
    with pytest.raises(SettingsError, match=rf"{path}: metrics_token_file {token}: mode 0644 .*: chmod 600 {token}$"):
        LaunchSettings.resolve(path)
    token.chmod(0o600)
    assert LaunchSettings.resolve(path).metrics_token_file == str(token)
    with pytest.raises(SettingsError, match="metrics_token_file is given without metrics_port: no metrics are served"):
        LaunchSettings.resolve(None, {"metrics_token_file": str(token)})
