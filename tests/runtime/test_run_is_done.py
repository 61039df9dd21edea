"""When a launch's watch ends the run: every item this run's producers published received,
nothing unfinished; work taken over from an earlier run (recovered from the store, adopted
from its rings) is not what this run published."""

from __future__ import annotations

from pipeline.runtime.inventory import run_is_done
from pipeline.wire.status import BrokerStatus


def test_done_once_every_published_item_is_received_and_finished():
    assert run_is_done(BrokerStatus(items_received=100), 100)
    assert run_is_done(BrokerStatus(), 0)
    assert not run_is_done(BrokerStatus(items_received=99), 100)
    assert not run_is_done(BrokerStatus(items_received=100, backlog_items=1), 100)
    assert not run_is_done(BrokerStatus(items_received=100, pending_items=1), 100)


def test_work_taken_over_does_not_stand_in_for_records_still_in_the_rings():
    """A resumed run: 4,858 items recovered from the store and 2,394 adopted from the rings
    an earlier run left, all completed; 1,578 of this run's 489,030 published records not
    read yet. Counting what was taken over as received would end the run here."""
    published, unread, recovered, adopted = 489_030, 1_578, 4_858, 2_394
    reading = BrokerStatus(items_received=published - unread + adopted, items_recovered=recovered,
                           items_adopted=adopted)
    assert reading.items_received_all >= published  # received all told, taken-over work included
    assert not run_is_done(reading, published)
    assert run_is_done(BrokerStatus(items_received=published + adopted, items_recovered=recovered,
                                    items_adopted=adopted), published)
