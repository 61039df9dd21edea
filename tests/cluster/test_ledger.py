"""The cluster run's ledger against a reference, over random runs: nodes open, get items,
send them, answer them (from their current incarnation, a fenced-off one, twice), are lost
and come back. Whatever happens, an item is answered at most once, only by its owner at
its current epoch, and once every node left routes everything and answers it, every item
has exactly one answer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cluster.ledger import ACCEPTED, DUPLICATE, NOT_OWNER, STALE, JobLedger

SLOTS = ("a", "b", "c")


def test_a_small_story():
    ledger = JobLedger(3)
    a1 = ledger.open("a")
    ledger.open("b")
    for k in range(3):
        ledger.assign(k, "a")
    assert ledger.take("a", batch=2, window=10) == [0, 1]
    assert ledger.take("a", batch=2, window=2) == []  # the window is full
    assert ledger.accept("a", a1, 0) == ACCEPTED
    assert ledger.accept("a", a1, 0) == DUPLICATE
    assert ledger.accept("b", 1, 1) == NOT_OWNER
    assert ledger.close("a") == [1, 2]  # held 1, queued 2
    assert ledger.accept("a", a1, 1) == STALE  # the lost incarnation's late answer
    ledger.assign(1, "b")
    ledger.assign(2, "b")
    assert ledger.take("b", 10, 10) == [1, 2]
    ledger.check_invariants()


@settings(max_examples=100, deadline=None)
@given(count=st.integers(1, 30), data=st.data())
def test_every_item_is_answered_exactly_once_whatever_happens(count, data):
    ledger = JobLedger(count)
    epochs = {slot: ledger.open(slot) for slot in SLOTS}
    alive = set(SLOTS)
    old_epochs: dict[str, list[int]] = {slot: [] for slot in SLOTS}
    for k in range(count):
        ledger.assign(k, data.draw(st.sampled_from(SLOTS)))
    accepted: list[int] = []
    sent: dict[str, set[int]] = {slot: set() for slot in SLOTS}  # what each incarnation was sent, ever
    for _ in range(data.draw(st.integers(0, 60))):
        op = data.draw(st.sampled_from(["take", "answer", "stale", "lose", "join"]))
        slot = data.draw(st.sampled_from(SLOTS))
        if op == "take" and slot in alive:
            sent[slot] |= set(ledger.take(slot, data.draw(st.integers(1, 5)), data.draw(st.integers(1, 8))))
        elif op == "answer" and slot in alive and sent[slot]:
            k = data.draw(st.sampled_from(sorted(sent[slot])))
            verdict = ledger.accept(slot, epochs[slot], k)
            # The reference: accepted exactly when it is the first answer and slot still holds it.
            assert (verdict == ACCEPTED) == (k not in accepted and ledger.owner[k] == slot)
            if verdict == ACCEPTED:
                accepted.append(k)
        elif op == "stale" and old_epochs[slot]:
            assert ledger.accept(slot, data.draw(st.sampled_from(old_epochs[slot])), data.draw(
                st.integers(0, count - 1))) == STALE
        elif op == "lose" and slot in alive and len(alive) > 1:
            alive.discard(slot)
            old_epochs[slot].append(epochs[slot])
            sent[slot] = set()
            for k in ledger.close(slot):
                ledger.assign(k, data.draw(st.sampled_from(sorted(alive))))
        elif op == "join" and slot not in alive:
            alive.add(slot)
            epochs[slot] = ledger.open(slot)
            ledger.move_queued(slot, lambda k: k % 2 == 0)
        ledger.check_invariants()
    # The survivors answer what they hold, then send and answer everything left.
    for slot in sorted(alive):
        while ledger.held[slot] or ledger.queue[slot]:
            ledger.take(slot, 4, 8)
            for k in sorted(ledger.held[slot]):
                assert ledger.accept(slot, epochs[slot], k) == ACCEPTED
                accepted.append(k)
    assert sorted(accepted) == list(range(count)) and ledger.unanswered() == 0
    ledger.check_invariants()
