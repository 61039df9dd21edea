"""Shared test fixtures: unique shared-memory names per test, and checks that nothing leaks."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import uuid

import pytest

from shm.objects import unlink_quietly

# Prefix of every POSIX object a test creates, so leftovers are found and removed.
TEST_PREFIX = "sbrk-test"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run the long stress variants")


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs_vllm = [item for item in items if "vllm" in item.keywords]
    if needs_vllm and os.environ.get(REQUIRE_VLLM_ENV) != "1":
        why = vllm_import_error()
        if why is not None:
            skip_vllm = pytest.mark.skip(reason=f"{why}; `{VLLM_ENV_COMMAND}` builds .venv-vllm and runs these tests")
            for item in needs_vllm:
                item.add_marker(skip_vllm)
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long stress variant: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


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
