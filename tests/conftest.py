"""Shared test fixtures: unique shared-memory names per test, and checks that nothing leaks;
and the unit tier kept pure: a test marked with no tier that starts a process fails."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import multiprocessing.process
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from shm.objects import unlink_quietly

# Property tests judge outputs, never time: hypothesis's per-example deadline (200 ms) and
# its too-slow health check are wall-clock bounds, and on a loaded 2-core machine they
# failed a correct test (a 200 ms example took 1.2 s under a benchmark).
settings.register_profile("no-wall-clock", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("no-wall-clock")

# Prefix of every POSIX object a test creates, so leftovers are found and removed.
TEST_PREFIX = "sbrk-test"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run the long stress variants")
    parser.addoption("--io-fault-turns", type=int, default=None, metavar="N",
                     help="turns of a run in tests/storage/test_io_faults.py's every-operation campaigns "
                          "(default: its SLOW_TURNS)")
    parser.addoption("--io-fault-ks", default=None, metavar="A-B,C-D",
                     help="only these operations k (ranges, B excluded) in those campaigns (default: every k)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker's temporary folder named by its number alone (`.../pytest-N/0`,
    not `.../pytest-N/popen-gw0`), before pytest makes it: data directories under tmp_path
    hold a Unix socket, whose path may not pass 107 bytes, and the tests that nest theirs
    deepest are a few bytes under that with a serial run's folder."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and config.option.basetemp:
        config.option.basetemp = str(Path(config.option.basetemp).with_name(worker.removeprefix("gw")))


# What builds the environment the `vllm`-marked tests need (.venv-vllm and the tiny model),
# and runs them there.
VLLM_ENV_COMMAND = "python3 quickstart.py test-vllm"
# Where this is "1" (CI, and that command), a vLLM that cannot be imported fails the vllm
# tests instead of skipping them: the environment built to run them must run them.
REQUIRE_VLLM_ENV = "SHAPE_BROKER_REQUIRE_VLLM"


def vllm_import_error() -> str | None:
    """Why `import vllm` fails here, or None. Imported only when a vllm test was collected
    (it takes seconds); a missing package is found without importing anything."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed in this environment"
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # a broken install fails in many ways (torchvision's operators, ...)
        return f"import vllm failed: {type(exc).__name__}: {exc}"
    return None


# Likewise for the `ray`-marked tests (a local multi-node Ray cluster).
RAY_ENV_COMMAND = "python3 quickstart.py test-ray"
REQUIRE_RAY_ENV = "SHAPE_BROKER_REQUIRE_RAY"


def _skip_without(items: list[pytest.Item], marker: str, require_env: str, why, command: str) -> None:
    """Skip the tests marked `marker` with the reason where their package is missing,
    unless `require_env` says the environment was built to run them (then they fail)."""
    marked = [item for item in items if marker in item.keywords]
    if marked and os.environ.get(require_env) != "1":
        reason = why()
        if reason is not None:
            skip = pytest.mark.skip(reason=f"{reason}; `{command}` builds .venv-{marker} and runs these tests")
            for item in marked:
                item.add_marker(skip)


def ray_import_error() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed in this environment (pip install 'shape-broker[ray]')"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_without(items, "ray", REQUIRE_RAY_ENV, ray_import_error, RAY_ENV_COMMAND)
    _skip_without(items, "vllm", REQUIRE_VLLM_ENV, vllm_import_error, VLLM_ENV_COMMAND)
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long stress variant: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# The markers of the tiers whose tests may start processes (pyproject.toml says what each
# holds); a test with none of them is a unit test.
PROCESS_TIERS = ("integration", "campaign", "vllm", "ray")
# Every way a test starts a process, with its name in the error: subprocess.run and the like
# go through Popen, every multiprocessing context through BaseProcess.start, os.spawn* and
# pty.fork through os.fork.
PROCESS_STARTERS = ((os, "fork", "os.fork"), (os, "forkpty", "os.forkpty"), (os, "posix_spawn", "os.posix_spawn"),
                    (os, "posix_spawnp", "os.posix_spawnp"), (os, "system", "os.system"),
                    (subprocess.Popen, "__init__", "subprocess.Popen"),
                    (multiprocessing.process.BaseProcess, "start", "multiprocessing's Process.start"))


def _refuse(what: str):
    def refused(*args, **kwargs):
        # pytest.fail raises a BaseException: code under test that catches Exception or
        # OSError around the call does not swallow it.
        pytest.fail(f"a unit test started a process ({what}): mark it `integration` (it runs real processes) or "
                    "`campaign` (pyproject.toml), or keep its work in this process")
    return refused


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Setup, call and teardown of a unit test run with every process starter refused."""
    if any(item.get_closest_marker(tier) for tier in PROCESS_TIERS):
        return (yield)
    with pytest.MonkeyPatch.context() as patch:
        for owner, name, what in PROCESS_STARTERS:
            patch.setattr(owner, name, _refuse(what))
        return (yield)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Kill any child process a test left running, and fail the run for it. NOTE: without
    this, multiprocessing's exit handler joins a non-daemon child (a broker a failed test
    never stopped) forever: pytest printed its summary and CI then timed out at 90 minutes."""
    leftovers = mp.active_children()
    for child in leftovers:
        child.kill()
        child.join(5)
    if leftovers:
        names = ", ".join(f"{child.name} (pid {child.pid})" for child in leftovers)
        print(f"\nconftest: tests left child processes running, killed: {names}", flush=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _objects_with(tag: str) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if tag in name)


@pytest.fixture
def shm_name():
    """A factory of unique object names for this test; everything under them is removed after,
    and the test fails if anything was left behind by code that should have unlinked it."""
    tag = f"{TEST_PREFIX}-{uuid.uuid4().hex[:10]}"
    counter = iter(range(1_000_000))

    def make(role: str = "ring") -> str:
        return f"/{tag}-{role}-{next(counter)}"

    make.tag = tag  # type: ignore[attr-defined]
    yield make
    leftovers = _objects_with(tag)
    for name in leftovers:
        plain = name[4:] if name.startswith("sem.") else name
        unlink_quietly([f"/{plain}"], [f"/{plain}"])
    assert not leftovers, f"objects left in /dev/shm by code that should have unlinked them: {leftovers}"


@pytest.fixture
def ctx():
    """Fork context: child processes start fast and inherit the test's imports."""
    return mp.get_context("fork")
