"""A second local user against a broker's metrics endpoint (SPEC §7, §12): a broker started
with `--metrics-port` answers its owner and closes that user's connections at accept (so
that user's connections, however many and however held, starve no scrape of the owner's);
started with `--metrics-token-file` it answers only requests carrying the token, that
user's included (a Prometheus running as another user scrapes that way). The broker is a real detached
process (`pipeline broker start`); the user runs as a throwaway account (`tests/support/users.py`),
skipped, with the reason, where none can be made.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from pipeline.reporting.metrics_endpoint import MAX_METRICS_CONNECTIONS
from tests.runtime.runs import free_port
from tests.security.live import pipeline
from tests.support.holders import HOLDER, holder_args, holding
from tests.support.users import other_user as make_other_user

pytestmark = pytest.mark.integration

TOKEN = "0123456789abcdef0123456789abcdef"
# Scrapes of the owner's while the other user holds connections, one every SCRAPE_INTERVAL_S.
HOSTILE_SCRAPES = 30
SCRAPE_INTERVAL_S = 0.1

# What the other user runs: one GET of argv[1], with the Authorization header argv[2] if
# given; prints the HTTP status, or "closed" when the endpoint closed the connection unanswered.
SCRAPE = r"""
import sys, urllib.error, urllib.request
headers = {"Authorization": sys.argv[2]} if len(sys.argv) > 2 else {}
try:
    with urllib.request.urlopen(urllib.request.Request(sys.argv[1], headers=headers), timeout=30) as response:
        print(response.status)
except urllib.error.HTTPError as exc:
    print(exc.code)
except (ConnectionError, urllib.error.URLError, OSError):
    print("closed")
"""


@pytest.fixture
def other_user():
    with make_other_user() as user:
        yield user


def scrape_as(user, url: str, *authorization: str) -> int | str:
    said = user.run(SCRAPE, url, *authorization).strip()
    return said if said == "closed" else int(said)


def scrape_as_owner(url: str, *authorization: str) -> int:
    headers = {"Authorization": authorization[0]} if authorization else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def start_broker(data: str, port: int, *options: str) -> None:
    pipeline("broker", "start", "--data-dir", data, "--detach", "--metrics-port", str(port), *options)


def test_another_users_connections_are_closed_and_the_owner_answered(other_user, tmp_path):
    data, port = str(tmp_path / "data"), free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    start_broker(data, port)
    try:
        assert scrape_as_owner(url) == 200
        assert scrape_as(other_user, url) == "closed"
        assert scrape_as(other_user, url, f"Bearer {TOKEN}") == "closed"  # no token file: a token opens nothing
    finally:
        pipeline("broker", "stop", "--data-dir", data)


def test_another_user_holding_connections_starves_no_scrape_of_the_owner(other_user, tmp_path):
    """That user opens MAX_METRICS_CONNECTIONS connections, sends a byte on each every half
    second and reconnects whenever one is closed; every scrape of the owner's is answered."""
    data, port = str(tmp_path / "data"), free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    start_broker(data, port)
    try:
        with holding(other_user.command(HOLDER, *holder_args(port, MAX_METRICS_CONNECTIONS))):
            codes = []
            for _ in range(HOSTILE_SCRAPES):
                codes.append(scrape_as_owner(url))
                time.sleep(SCRAPE_INTERVAL_S)
        assert codes == [200] * HOSTILE_SCRAPES
    finally:
        pipeline("broker", "stop", "--data-dir", data)


def test_with_a_token_file_anyone_with_the_token_is_answered_and_no_one_else(other_user, tmp_path):
    data, port = str(tmp_path / "data"), free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    start_broker(data, port, "--metrics-token-file", str(token_file))
    try:
        assert scrape_as(other_user, url, f"Bearer {TOKEN}") == 200
        assert scrape_as(other_user, url) == 401
        assert scrape_as(other_user, url, "Bearer wrong") == 401
        assert scrape_as_owner(url) == 401  # the owner too needs the token, once there is one
        assert scrape_as_owner(url, f"Bearer {TOKEN}") == 200
    finally:
        pipeline("broker", "stop", "--data-dir", data)
