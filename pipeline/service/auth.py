"""Tenants: the API keys of `pipeline serve --api-keys FILE`, and whose a request is.

The file, one key a line, the key then, optionally, the tenant's name:

    # comment lines and blank lines are skipped
    sk-team-a-4f9c2e7b1d8a6c3e
    sk-team-b-0a1b2c3d4e5f6a7b   team-b
    sk-team-b-rotated-9e8d7c6b   team-b     (two keys of one name: one tenant, a key rotation)

A key: MIN_KEY_CHARS to MAX_KEY_CHARS visible ASCII characters, no space. A name: letters,
digits, '.', '_', '-', at most MAX_TENANT_NAME_CHARS; without one, the tenant is named by a
digest of its key (`key-` and 16 hex digits), so records and logs never hold a key. The file
must be readable by its owner only (it holds passwords). Keys are looked up by their
SHA-256: a request's token is hashed, never compared character by character.

Without a key file every request is the one tenant DEFAULT_TENANT's, and the server binds
loopback only (`check_host`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import stat

from pipeline.service.limits import (
    MAX_API_KEYS,
    MAX_KEY_CHARS,
    MAX_KEY_FILE_BYTES,
    MAX_TENANT_NAME_CHARS,
    MIN_KEY_CHARS,
)
from pipeline.wire.errors import ApiKeysError, SettingsError
from pipeline.wire.textfiles import read_small_file

# The tenant of a server without keys (loopback only).
DEFAULT_TENANT = "local"
_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_TENANT_NAME_CHARS}}}")
# Visible ASCII: what a header carries unchanged.
_KEY = re.compile(r"[\x21-\x7e]+")
# Hosts that are loopback by name.
LOOPBACK_NAMES = ("localhost",)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """The keys' digests and the tenant each is; `None` for a server without keys."""

    def __init__(self, by_digest: dict[bytes, str]) -> None:
        self.by_digest = by_digest

    def __len__(self) -> int:
        return len(self.by_digest)

    def names(self) -> list[str]:
        return sorted(set(self.by_digest.values()))

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an Authorization header (`Bearer KEY`), or None for no or a wrong key."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self.by_digest.get(key_digest(token.strip()))


def parse_api_keys(text: str, source: str) -> Tenants:
    """The tenants of a key file's text; ApiKeysError naming `source:line` (never the key)."""
    by_digest: dict[bytes, str] = {}
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"{source}:{number}"
        if len(words) > 2:
            raise ApiKeysError(f"{where}: {len(words)} words; a line is a key, then optionally its tenant's name")
        key = words[0]
        if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS or not _KEY.fullmatch(key):
            raise ApiKeysError(f"{where}: a key is {MIN_KEY_CHARS} to {MAX_KEY_CHARS} visible ASCII characters "
                               f"(this one is {len(key)} characters{'' if _KEY.fullmatch(key) else ', some not'})")
        name = words[1] if len(words) == 2 else "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
        if not _NAME.fullmatch(name):
            raise ApiKeysError(f"{where}: the name {name[:MAX_TENANT_NAME_CHARS]!r} is not 1 to "
                               f"{MAX_TENANT_NAME_CHARS} letters, digits, '.', '_' or '-'")
        digest = key_digest(key)
        if digest in by_digest:
            raise ApiKeysError(f"{where}: this key is on an earlier line too; give each key once")
        if len(by_digest) == MAX_API_KEYS:
            raise ApiKeysError(f"{where}: more than {MAX_API_KEYS:,} keys in one file")
        by_digest[digest] = name
    if not by_digest:
        raise ApiKeysError(f"{source}: no keys (a line is a key, then optionally its tenant's name)")
    return Tenants(by_digest)


def read_api_keys(path: str) -> Tenants:
    """The key file at `path`, checked: a regular file readable by its owner only, within
    MAX_KEY_FILE_BYTES, UTF-8, its lines keys (`parse_api_keys`)."""
    try:
        info = os.stat(path)
        raw = read_small_file(path, MAX_KEY_FILE_BYTES)
    except OSError as exc:
        raise ApiKeysError(f"--api-keys {path}: cannot read it ({exc.strerror or exc})") from exc
    if raw is None or not stat.S_ISREG(info.st_mode):
        raise ApiKeysError(f"--api-keys {path}: not a regular file")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise ApiKeysError(f"--api-keys {path}: mode {stat.S_IMODE(info.st_mode):04o} lets others read the keys; "
                           f"`chmod 600 {path}`")
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise ApiKeysError(f"--api-keys {path}: longer than {MAX_KEY_FILE_BYTES:,} bytes; a key file is a few "
                           f"lines")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiKeysError(f"--api-keys {path}: not UTF-8 text (byte {exc.start})") from None
    return parse_api_keys(text, path)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(host: str, tenants: Tenants | None) -> None:
    """A server without keys binds loopback only: anyone who reaches it is this machine's."""
    if tenants is None and not is_loopback(host):
        raise SettingsError(f"--host {host}: without --api-keys the server serves this machine only (127.0.0.1, "
                            f"::1, localhost); give a key file to serve others")
