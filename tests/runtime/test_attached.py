"""A run of producers alone on a node (`runtime/attached.py`): done once every request is
answered, never by the node's own quiet; answers that stand still are checked against what
is still queued, at most every ATTACHED_STALL_S, and a request neither answered nor queued
ends the run failed; the producers publish at most a window past the answers (simulated
clock; no process is started)."""

from __future__ import annotations

from pipeline.producer.workload import WorkItem, Workload
from pipeline.runtime.attached import ATTACHED_STALL_S, NODE_WINDOW_ITEMS, AttachedLauncher
from pipeline.runtime.inventory import ProducerLedger
from pipeline.runtime.local import CTX
from pipeline.runtime.producer_processes import _allowed
from pipeline.runtime.settings import LaunchSettings


def _no_item(_k: int) -> WorkItem:
    raise AssertionError("no producer runs here")


def launcher(tmp_path, answered: list[int], lost: list[int], asked: list[int]) -> tuple[AttachedLauncher, list]:
    def unqueued() -> int:
        asked.append(answered[0])
        return lost[0]

    run = AttachedLauncher(LaunchSettings(data_dir=str(tmp_path / "job"), producers=1),
                           Workload("job", 0, _no_item, total_tokens=0, models=(0,)), str(tmp_path / "node"), 10,
                           answered=lambda: answered[0], unqueued=unqueued)
    clock = [100.0]
    run.clock = lambda: clock[0]
    return run, clock


def test_the_run_is_done_when_every_request_is_answered(tmp_path) -> None:
    answered, lost, asked = [3], [0], []
    run, _clock = launcher(tmp_path, answered, lost, asked)
    assert not run._done(None)
    answered[0] = 10
    assert run._done(None) and asked == []  # nothing was scanned for


def test_still_answers_are_checked_against_the_queue_at_most_every_stall_period(tmp_path) -> None:
    answered, lost, asked = [3], [0], []
    run, clock = launcher(tmp_path, answered, lost, asked)
    for step in range(int(3 * ATTACHED_STALL_S)):  # a second a watch; the answers move, then stand
        answered[0] = min(6, 3 + step)
        assert not run._done(None) and run._failure() == ""
        clock[0] += 1.0
    assert len(asked) == 2 and asked[0] == 6  # once per stall period once they stood still
    lost[0] = 2
    clock[0] += ATTACHED_STALL_S
    assert not run._done(None)
    assert "2 requests are neither answered nor queued" in run._failure()


def test_the_producers_may_publish_up_to_a_window_past_the_answers(tmp_path) -> None:
    answered, lost, asked = [0], [0], []
    run, _clock = launcher(tmp_path, answered, lost, asked)
    run._supervise()
    run.ledger.registered(0, 7)
    run.ledger.published(0, NODE_WINDOW_ITEMS - 1)
    assert run.ledger.may_publish()
    run.ledger.published(0, NODE_WINDOW_ITEMS)
    assert not run.ledger.may_publish()  # a window's worth out and none answered: they wait
    answered[0] = 5
    run._supervise()
    assert run.ledger.may_publish()
    run.ledger.published(0, NODE_WINDOW_ITEMS + 5)
    assert not run.ledger.may_publish()


def test_a_producer_holds_its_items_while_it_may_not_publish_unless_stopped() -> None:
    ledger = ProducerLedger.create(CTX, 1)
    ledger.registered(0, 7)
    ledger.set_allowance(0)  # nothing more may go out
    stopped = [True]
    assert list(_allowed(iter(range(3)), ledger, lambda: stopped[0])) == [0, 1, 2]  # a stop lets them through
    ledger.set_allowance(-1)
    stopped[0] = False
    assert list(_allowed(iter(range(200)), ledger, lambda: stopped[0])) == list(range(200))
