"""Process entry points: what they set up before their loops."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_quiet_gc_freezes_start_up_objects_and_raises_the_young_threshold():
    # In a fresh interpreter: the test runner's own collector settings stay as they are.
    code = (
        "import gc\n"
        "from pipeline.runtime.processes import GC_YOUNG_THRESHOLD, quiet_gc\n"
        "assert gc.get_freeze_count() == 0\n"
        "quiet_gc()\n"
        "assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD > 700, gc.get_threshold()\n"
        "assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()  # numpy, the package\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def budget_under(soft: int, hard: int, call: str = "open_files_budget") -> str:
    """`open_files_budget` (or `call`) of a default broker in a fresh interpreter whose
    descriptor limit is (soft, hard): what it returns and the soft limit after, or the error."""
    code = (
        "import resource\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
        "from pipeline.broker.config import BrokerConfig\n"
        f"from pipeline.runtime.processes import {call}\n"
        "try:\n"
        f"    print({call}(BrokerConfig('/tmp/x')), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_broker_keeps_no_more_segment_files_open_than_its_descriptor_limit_allows():
    """Each open segment file holds two descriptors (its own and mmap's): at 1,024 the old
    512-file cache took every one and the broker died with EMFILE. The soft limit is raised
    to the hard one; what is left after the peers' connections sizes the cache; a limit that
    leaves too little refuses the start, saying what to raise."""
    from pipeline.broker.config import BrokerConfig
    from pipeline.runtime.processes import BROKER_FD_HEADROOM, FDS_PER_OPEN_SEGMENT, MIN_OPEN_SEGMENT_FILES

    config = BrokerConfig("/tmp/x")
    peers = config.max_consumers + config.max_producers + config.max_unregistered_peers
    assert budget_under(1024, 1024) == f"{(1024 - BROKER_FD_HEADROOM - peers) // FDS_PER_OPEN_SEGMENT} 1024"
    from pipeline.storage.segments import DEFAULT_OPEN_FILES_MAX

    # raised to the hard limit: the store's default
    assert budget_under(1024, 8192) == f"{DEFAULT_OPEN_FILES_MAX} 8192"
    least = BROKER_FD_HEADROOM + peers + MIN_OPEN_SEGMENT_FILES * FDS_PER_OPEN_SEGMENT
    assert budget_under(least, least) == f"{MIN_OPEN_SEGMENT_FILES} {least}"  # at the limit
    assert budget_under(least - 1, least - 1).startswith(f"ConfigError the descriptor limit (ulimit -n) is {least - 1}")


def test_a_descriptor_limit_a_broker_cannot_raise_to_its_need_is_refused_before_anything_starts():
    """The check before a run (`check_before_start`): the hard limit is what a broker may
    raise its own to; at its need the run goes on (whatever the soft limit), one below it is
    refused with what to raise, and nothing is raised in the checking process."""
    from pipeline.broker.config import BrokerConfig
    from pipeline.runtime.processes import broker_descriptors

    least = broker_descriptors(BrokerConfig("/tmp/x"))[1]
    assert budget_under(64, least, "check_descriptor_limit") == "None 64"  # at the limit
    refused = budget_under(64, least - 1, "check_descriptor_limit")
    assert refused.startswith(f"ConfigError the descriptor limit (ulimit -n) is {least - 1}: a broker needs at "
                              f"least {least}"), refused
