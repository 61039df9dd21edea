"""The API key file: its format at each limit and past it, one-line errors that never hold
the key, the file's mode, and whose a request is."""

from __future__ import annotations

import os

import pytest

from pipeline.service.auth import Tenants, check_host, is_loopback, parse_api_keys, read_api_keys
from pipeline.service.limits import MAX_API_KEYS, MAX_KEY_CHARS, MAX_TENANT_NAME_CHARS, MIN_KEY_CHARS
from pipeline.wire.errors import ApiKeysError, SettingsError

KEY_A = "sk-a-" + "1" * 20
KEY_B = "sk-b-" + "2" * 20


def test_keys_with_and_without_names():
    tenants = parse_api_keys(f"# comment\n\n{KEY_A}\n{KEY_B} team-b\nsk-b-rotated-{'3' * 10} team-b\n", "keys")
    assert len(tenants) == 3
    assert tenants.tenant(f"Bearer {KEY_B}") == "team-b"
    assert tenants.tenant(f"Bearer sk-b-rotated-{'3' * 10}") == "team-b"
    unnamed = tenants.tenant(f"bearer  {KEY_A} ")
    assert unnamed.startswith("key-") and KEY_A not in unnamed
    for wrong in (None, "", KEY_A, f"Basic {KEY_A}", "Bearer ", f"Bearer {KEY_A}x"):
        assert tenants.tenant(wrong) is None


@pytest.mark.parametrize("length, ok", [(MIN_KEY_CHARS, True), (MAX_KEY_CHARS, True), (MIN_KEY_CHARS - 1, False),
                                        (MAX_KEY_CHARS + 1, False)])
def test_a_keys_length_at_its_limits_and_past_them(length, ok):
    key = "k" * length
    if ok:
        assert parse_api_keys(key, "keys").tenant(f"Bearer {key}") is not None
    else:
        with pytest.raises(ApiKeysError) as refused:
            parse_api_keys(key, "keys")
        assert "keys:1:" in str(refused.value) and key not in str(refused.value)


@pytest.mark.parametrize("length, ok", [(MAX_TENANT_NAME_CHARS, True), (MAX_TENANT_NAME_CHARS + 1, False)])
def test_a_names_length_at_its_limit_and_past_it(length, ok):
    text = f"{KEY_A} {'n' * length}"
    if ok:
        assert parse_api_keys(text, "keys").names() == ["n" * length]
    else:
        with pytest.raises(ApiKeysError):
            parse_api_keys(text, "keys")


def test_keys_at_the_files_limit_and_past_it():
    keys = [f"sk-{k:020d}" for k in range(MAX_API_KEYS + 1)]
    assert len(parse_api_keys("\n".join(keys[:MAX_API_KEYS]), "keys")) == MAX_API_KEYS
    with pytest.raises(ApiKeysError) as refused:
        parse_api_keys("\n".join(keys), "keys")
    assert f"keys:{MAX_API_KEYS + 1}:" in str(refused.value)


@pytest.mark.parametrize("text, words", [
    (f"{KEY_A} team a", "3 words"),
    (f"{KEY_A}\n{KEY_A} again", "keys:2: this key is on an earlier line"),
    (f"{KEY_A} bad/name", "is not 1 to"),
    ("# only a comment\n", "no keys"),
    ("sk-\u00e9" + "x" * 20, "visible ASCII"),
])
def test_a_bad_line_is_one_error_naming_its_line_never_its_key(text, words):
    with pytest.raises(ApiKeysError) as refused:
        parse_api_keys(text, "keys")
    message = str(refused.value)
    assert words in message and "\n" not in message and KEY_A not in message


def test_a_key_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEY_A + "\n")
    os.chmod(path, 0o640)
    with pytest.raises(ApiKeysError, match="chmod 600"):
        read_api_keys(str(path))
    os.chmod(path, 0o600)
    assert len(read_api_keys(str(path))) == 1
    with pytest.raises(ApiKeysError, match="cannot read"):
        read_api_keys(str(tmp_path / "missing"))


def test_without_keys_only_loopback_is_served():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert is_loopback(host)
        check_host(host, None)
    for host in ("0.0.0.0", "10.0.0.1", "::", "example.com"):
        assert not is_loopback(host)
        with pytest.raises(SettingsError, match="--api-keys"):
            check_host(host, None)
        check_host(host, Tenants({b"x": "a"}))
