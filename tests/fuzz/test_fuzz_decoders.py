"""Every decoder the outside world reaches, fuzzed: arbitrary bytes and
mutations of valid encodings (bit flips, truncations, inserted and deleted bytes, each
header field overwritten with boundary values, odd JSON values in every position). Each
input is either decoded (and used as the product uses it next) or rejected with the
target's typed error and a message that says what was wrong; never another exception,
never more memory than the input's size and the named limits allow (tracemalloc peak).

Deterministic (derandomized); 200 examples per target and kind here, 20,000 behind
--run-slow. `tools/fuzz_atheris.py` runs the same targets under atheris (coverage-guided)
or a seeded mutation loop, for the campaign figures in RELIABILITY.md.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.storage.storelog import encode_records
from tests.fuzz import mutations, strategies
from tests.fuzz.targets import MAX_MESSAGE_CHARS, TARGETS, Target, close_all

DEFAULT_EXAMPLES = 200
SLOW_EXAMPLES = 20_000


@pytest.fixture(scope="module", autouse=True)
def _scratch():
    yield
    close_all()


def check(target: Target, data: bytes) -> None:
    """Run one input: a typed rejection with a bounded, non-empty message, or a result;
    and no more memory than the target's bound."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    try:
        target.run(data)
    except target.allowed as exc:
        message = str(exc)
        assert message and len(message) <= MAX_MESSAGE_CHARS, (type(exc).__name__, message[:200], len(message))
    finally:
        peak = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
    bound = target.memory_bound_bytes(len(data))
    assert peak <= bound, f"{target.name}: {peak} bytes allocated for a {len(data)}-byte input (bound {bound})"


_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])


def _fuzz(name: str, kind: str, examples: int) -> None:
    target = TARGETS[name]
    strategy = strategies.mutants(target) if kind == "mutants" else strategies.arbitrary()

    @settings(max_examples=examples, **_SETTINGS)
    @given(data=strategy)
    def run(data: bytes) -> None:
        check(target, data)

    run()


@pytest.mark.campaign
@pytest.mark.parametrize("kind", ["arbitrary", "mutants"])
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzzed_input_is_decoded_or_rejected_with_a_typed_error(name, kind):
    _fuzz(name, kind, DEFAULT_EXAMPLES)


@pytest.mark.campaign
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["arbitrary", "mutants"])
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzzed_input_is_decoded_or_rejected_many(name, kind):
    _fuzz(name, kind, SLOW_EXAMPLES)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_seed_is_decoded(name):
    """The seeds are valid encodings (a seed rejected would make the mutants test nothing
    but the rejection path)."""
    target = TARGETS[name]
    for seed in target.seeds:
        target.run(seed)


def _field(size: int) -> st.SearchStrategy[int]:
    return st.sampled_from(mutations.interesting_ints(size)) | st.integers(0, (1 << (8 * size)) - 1)


_life_record = st.builds(
    lambda kind, model, lane, signature, seq, count: encode_records(
        kind, (seq, 0), np.array([[model | lane << 32, signature, count, 1]], dtype=np.uint64)).tobytes(),
    st.integers(0, 8) | st.just(0xFFFF), _field(4), _field(4), _field(8), _field(8), _field(8))


@pytest.mark.campaign
@settings(max_examples=DEFAULT_EXAMPLES, **_SETTINGS)
@given(records=st.lists(_life_record, max_size=6))
def test_store_log_records_that_pass_their_checksum_are_recovered_or_named(records):
    # Byte mutations of a checksummed record only ever fail its checksum: these are records
    # a forger (or a bug) could write, every field at its boundaries (the keys tag too, left
    # zero), each one checksummed.
    check(TARGETS["store_log"], b"".join(records))


def test_the_campaign_tool_knows_every_target():
    # tools/fuzz_atheris.py names the targets without importing them (its children import
    # them under atheris); a target added here must be one it can run.
    import runpy
    from pathlib import Path

    tool = runpy.run_path(str(Path(__file__).resolve().parents[2] / "tools" / "fuzz_atheris.py"), run_name="tool")
    assert tool["TARGET_NAMES"] == sorted(TARGETS)
