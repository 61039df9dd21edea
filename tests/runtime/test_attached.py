"""A run of producers alone on a node (`runtime/attached.py`): done once every request is
answered, never by the node's own quiet; answers that stand still are checked against what
is still queued, at most every ATTACHED_STALL_S, and a request neither answered nor queued
ends the run failed; the producers publish at most a window past the answers; the run reads
its answers every ATTACHED_WATCH_INTERVAL_S and asks the broker at most every
WATCH_INTERVAL_S (simulated clock; no process is started)."""

from __future__ import annotations

from pipeline.producer.workload import WorkItem, Workload
import pipeline.runtime.launcher as launcher_module
from pipeline.runtime.attached import ATTACHED_STALL_S, ATTACHED_WATCH_INTERVAL_S, NODE_WINDOW_ITEMS, AttachedLauncher
from pipeline.runtime.inventory import ProducerLedger
from pipeline.runtime.local import CTX
from pipeline.runtime.producer_processes import _allowed
from pipeline.runtime.launcher import WATCH_INTERVAL_S
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


class FakeTime:
    """The launcher module's clock: each sleep moves it; no real time passes."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def monotonic(self) -> float:
        return self.now_s

    def monotonic_ns(self) -> int:
        return int(self.now_s * 1e9)

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds


def test_a_run_on_a_node_reads_its_answers_every_tenth_of_a_second_and_asks_the_broker_less(tmp_path,
                                                                                          monkeypatch) -> None:
    answered, lost, seen = [0], [0], []
    run, _clock = launcher(tmp_path, answered, lost, seen)
    fake = FakeTime()
    asked: list[float] = []
    watched: list[float] = []
    monkeypatch.setattr(launcher_module, "time", fake)
    monkeypatch.setattr(launcher_module, "broker_status", lambda _path: asked.append(fake.now_s))
    run.data_dir_pin = type("Pin", (), {"check": lambda self: None})()

    def on_status(_status, now_s: float) -> None:
        watched.append(now_s)
        answered[0] += 1  # one answer a watch: all 10 after ten watches

    run.on_status = on_status
    status, why = run._watch(lambda: False)
    assert why == "completed" and len(watched) == 10
    assert [round(b - a, 6) for a, b in zip(watched, watched[1:])] == [ATTACHED_WATCH_INTERVAL_S] * 9
    assert len(asked) == 2 and asked[1] - asked[0] >= WATCH_INTERVAL_S  # the status: at most every 0.5 s
