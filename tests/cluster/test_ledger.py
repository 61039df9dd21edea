"""The cluster run's ledger against a reference, over random runs: items stream in (assigned
as they are read), nodes open, send them, answer them (from their current incarnation, a
fenced-off one, twice), are lost and come back. Whatever happens, an item is answered at
most once, only by its owner at its current epoch, the ledger holds only what is in flight
(with the work to send again), and once every node left routes everything and answers it,
every item has exactly one answer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cluster.ledger import ACCEPTED, DUPLICATE, NOT_OWNER, STALE, JobLedger

SLOTS = ("a", "b", "c")


def test_a_small_story():
    ledger = JobLedger(keys=9, items=3)
    a1 = ledger.open("a")
    ledger.open("b")
    for k in (0, 4, 8):
        ledger.assign(k, "a", f"item {k}")
    assert ledger.queued("a") == 3 and ledger.in_flight() == 3
    assert ledger.take("a", batch=2, window=10) == [0, 4]
    assert ledger.take("a", batch=2, window=2) == []  # the window is full
    assert ledger.accept("a", a1, 0) == ACCEPTED
    assert ledger.accept("a", a1, 0) == DUPLICATE
    assert ledger.accept("b", 1, 4) == NOT_OWNER
    assert ledger.accept("a", a1, 9) == NOT_OWNER  # no such key
    assert ledger.in_flight() == 2 and 0 not in ledger.work  # answered: nothing kept but its bit
    assert ledger.close("a") == [(4, "item 4"), (8, "item 8")]  # held 4, queued 8, with their work
    assert ledger.accept("a", a1, 4) == STALE  # the lost incarnation's late answer
    ledger.assign(4, "b", "item 4")
    ledger.assign(8, "b", "item 8")
    assert ledger.take("b", 10, 10) == [4, 8]
    assert [ledger.accept("b", 1, k) for k in (4, 8)] == [ACCEPTED, ACCEPTED]
    assert ledger.unanswered() == 0 and ledger.in_flight() == 0
    assert [ledger.is_answered(k) for k in range(9)] == [k in (0, 4, 8) for k in range(9)]
    ledger.check_invariants()


@settings(max_examples=100, deadline=None)
@given(count=st.integers(1, 30), data=st.data())
def test_every_item_is_answered_exactly_once_whatever_happens(count, data):
    ledger = JobLedger(keys=count + 3, items=count)
    epochs = {slot: ledger.open(slot) for slot in SLOTS}
    alive = set(SLOTS)
    old_epochs: dict[str, list[int]] = {slot: [] for slot in SLOTS}
    unread = list(range(count))  # keys not read yet: assigned as the run streams them
    accepted: list[int] = []
    sent: dict[str, set[int]] = {slot: set() for slot in SLOTS}  # what each incarnation was sent, ever
    for _ in range(data.draw(st.integers(0, 60))):
        op = data.draw(st.sampled_from(["read", "take", "answer", "stale", "lose", "join"]))
        slot = data.draw(st.sampled_from(SLOTS))
        if op == "read" and unread and slot in alive:
            k = unread.pop(0)
            ledger.assign(k, slot, ("work", k))
        elif op == "take" and slot in alive:
            sent[slot] |= set(ledger.take(slot, data.draw(st.integers(1, 5)), data.draw(st.integers(1, 8))))
        elif op == "answer" and slot in alive and sent[slot]:
            k = data.draw(st.sampled_from(sorted(sent[slot])))
            # The reference: accepted exactly when it is the first answer and slot still holds it.
            expected = k not in accepted and ledger.owner.get(k) == slot
            verdict = ledger.accept(slot, epochs[slot], k)
            assert (verdict == ACCEPTED) == expected
            if verdict == ACCEPTED:
                accepted.append(k)
        elif op == "stale" and old_epochs[slot]:
            assert ledger.accept(slot, data.draw(st.sampled_from(old_epochs[slot])), data.draw(
                st.integers(0, count - 1))) == STALE
        elif op == "lose" and slot in alive and len(alive) > 1:
            alive.discard(slot)
            old_epochs[slot].append(epochs[slot])
            sent[slot] = set()
            for k, work in ledger.close(slot):
                assert work == ("work", k)
                ledger.assign(k, data.draw(st.sampled_from(sorted(alive))), work)
        elif op == "join" and slot not in alive:
            alive.add(slot)
            epochs[slot] = ledger.open(slot)
            ledger.move_queued(slot, lambda k: k % 2 == 0)
        ledger.check_invariants()
        assert ledger.in_flight() == count - len(unread) - len(accepted)  # what was read, not answered
    # The rest is read, then the survivors answer what they hold, send and answer everything left.
    for k in unread:
        ledger.assign(k, min(alive), ("work", k))
    for slot in sorted(alive):
        while ledger.held[slot] or ledger.queue[slot]:
            ledger.take(slot, 4, 8)
            for k in sorted(ledger.held[slot]):
                assert ledger.accept(slot, epochs[slot], k) == ACCEPTED
                accepted.append(k)
    assert sorted(accepted) == list(range(count)) and ledger.unanswered() == 0 and ledger.in_flight() == 0
    ledger.check_invariants()
