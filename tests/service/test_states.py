"""A batch's status as a pure state machine: each event's transitions against a reference
table, the invariants after any sequence of events, and what is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.service.states import (
    ANSWERED,
    CANCEL,
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EVENTS,
    EXPIRE,
    EXPIRED,
    FAIL,
    FAILED,
    FINALIZED,
    FINALIZING,
    IN_PROGRESS,
    RUNNING,
    STOP_CANCEL,
    STOP_EXPIRE,
    TERMINAL,
    VALIDATING,
    Lifecycle,
    TransitionError,
)

WINDOW_S = 100

# The reference: (status, stop, event) -> (status, stop) after it; absent: refused.
REFERENCE = {
    (VALIDATING, None, RUNNING): (IN_PROGRESS, None),
    (VALIDATING, None, ANSWERED): (FINALIZING, None),
    (VALIDATING, None, CANCEL): (CANCELLING, STOP_CANCEL),
    (VALIDATING, None, EXPIRE): (VALIDATING, STOP_EXPIRE),
    (VALIDATING, None, FAIL): (FAILED, None),
    (VALIDATING, STOP_EXPIRE, RUNNING): (IN_PROGRESS, STOP_EXPIRE),
    (VALIDATING, STOP_EXPIRE, ANSWERED): (FINALIZING, None),
    (VALIDATING, STOP_EXPIRE, CANCEL): (CANCELLING, STOP_CANCEL),
    (VALIDATING, STOP_EXPIRE, EXPIRE): (VALIDATING, STOP_EXPIRE),
    (VALIDATING, STOP_EXPIRE, FAIL): (FAILED, None),
    (VALIDATING, STOP_EXPIRE, FINALIZED): (EXPIRED, STOP_EXPIRE),
    (IN_PROGRESS, None, RUNNING): (IN_PROGRESS, None),
    (IN_PROGRESS, None, ANSWERED): (FINALIZING, None),
    (IN_PROGRESS, None, CANCEL): (CANCELLING, STOP_CANCEL),
    (IN_PROGRESS, None, EXPIRE): (IN_PROGRESS, STOP_EXPIRE),
    (IN_PROGRESS, None, FAIL): (FAILED, None),
    (IN_PROGRESS, STOP_EXPIRE, RUNNING): (IN_PROGRESS, STOP_EXPIRE),
    (IN_PROGRESS, STOP_EXPIRE, ANSWERED): (FINALIZING, None),
    (IN_PROGRESS, STOP_EXPIRE, CANCEL): (CANCELLING, STOP_CANCEL),
    (IN_PROGRESS, STOP_EXPIRE, EXPIRE): (IN_PROGRESS, STOP_EXPIRE),
    (IN_PROGRESS, STOP_EXPIRE, FAIL): (FAILED, None),
    (IN_PROGRESS, STOP_EXPIRE, FINALIZED): (EXPIRED, STOP_EXPIRE),
    (FINALIZING, None, FINALIZED): (COMPLETED, None),
    (CANCELLING, STOP_CANCEL, ANSWERED): (CANCELLING, STOP_CANCEL),
    (CANCELLING, STOP_CANCEL, CANCEL): (CANCELLING, STOP_CANCEL),
    (CANCELLING, STOP_CANCEL, FINALIZED): (CANCELLED, STOP_CANCEL),
}


def reach(status: str, stop: str | None) -> Lifecycle:
    """A batch in (`status`, `stop`), reached by its events from a new one."""
    paths = {(VALIDATING, None): [], (VALIDATING, STOP_EXPIRE): [EXPIRE], (IN_PROGRESS, None): [RUNNING],
             (IN_PROGRESS, STOP_EXPIRE): [RUNNING, EXPIRE], (FINALIZING, None): [ANSWERED],
             (CANCELLING, STOP_CANCEL): [CANCEL], (COMPLETED, None): [ANSWERED, FINALIZED],
             (FAILED, None): [FAIL], (EXPIRED, STOP_EXPIRE): [EXPIRE, FINALIZED],
             (CANCELLED, STOP_CANCEL): [CANCEL, FINALIZED]}
    life = Lifecycle.new(1000, WINDOW_S)
    for k, event in enumerate(paths[(status, stop)]):
        life.step(event, 1001 + k)
    assert (life.status, life.stop) == (status, stop)
    return life


STATES = [(VALIDATING, None), (VALIDATING, STOP_EXPIRE), (IN_PROGRESS, None), (IN_PROGRESS, STOP_EXPIRE),
          (FINALIZING, None), (CANCELLING, STOP_CANCEL), (COMPLETED, None), (FAILED, None),
          (EXPIRED, STOP_EXPIRE), (CANCELLED, STOP_CANCEL)]


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("event", EVENTS)
def test_every_event_in_every_state_follows_the_reference(state, event):
    life = reach(*state)
    expected = REFERENCE.get((*state, event))
    assert life.takes(event) == (expected is not None)
    if expected is None:
        with pytest.raises(TransitionError):
            life.step(event, 2000)
        assert (life.status, life.stop) == state
        return
    life.step(event, 2000)
    assert (life.status, life.stop) == expected
    life.check_invariants()


def test_a_terminal_batch_takes_nothing():
    for state in STATES:
        life = reach(*state)
        if life.status in TERMINAL:
            assert not any(life.takes(event) for event in EVENTS)


def test_each_status_is_stamped_when_entered():
    life = Lifecycle.new(1000, WINDOW_S)
    life.step(RUNNING, 1005)
    life.step(CANCEL, 1007)
    life.step(FINALIZED, 1009)
    assert (life.in_progress_at, life.cancelling_at, life.cancelled_at) == (1005, 1007, 1009)
    assert life.expires_at == 1000 + WINDOW_S and life.completed_at is None


def test_the_deadline_is_due_at_expires_at_and_not_before():
    life = Lifecycle.new(1000, WINDOW_S)
    assert not life.due(1000 + WINDOW_S - 1)
    assert life.due(1000 + WINDOW_S)
    life.step(EXPIRE, 1000 + WINDOW_S)
    assert not life.due(1000 + WINDOW_S + 1)  # stopping already


def test_a_clock_set_back_never_stamps_a_step_before_an_earlier_one():
    life = Lifecycle.new(1000, WINDOW_S)
    life.step(RUNNING, 1050)
    life.step(ANSWERED, 1040)
    life.step(FINALIZED, 990)
    life.check_invariants()
    assert life.finalizing_at == life.completed_at == 1050


@given(st.lists(st.tuples(st.sampled_from(EVENTS), st.integers(0, 50)), max_size=30))
def test_any_sequence_of_events_keeps_the_invariants(steps):
    life = Lifecycle.new(1000, WINDOW_S)
    now = 1000
    for event, gap in steps:
        now += gap
        before = (life.status, life.stop)
        if life.takes(event):
            life.step(event, now)
            assert (life.status, life.stop) == REFERENCE[(*before, event)]
        else:
            with pytest.raises(TransitionError):
                life.step(event, now)
        life.check_invariants()


def test_check_invariants_finds_a_broken_record():
    life = reach(CANCELLED, STOP_CANCEL)
    life.cancelling_at = None
    with pytest.raises(AssertionError):
        life.check_invariants()
    life = reach(COMPLETED, None)
    life.stop = STOP_EXPIRE
    with pytest.raises(AssertionError):
        life.check_invariants()
