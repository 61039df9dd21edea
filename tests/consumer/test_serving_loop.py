"""The consumer's serving loop (`Consumer._serve`) driven by a fake session and ring: one batch at a
time for a synchronous engine, nothing written for batches the broker took back, and the
batches held counted when they are handed back."""

from __future__ import annotations

import numpy as np

from pipeline.storage.segment import scan_segment
from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.engines import Engine, EngineCounters, EngineResult
from pipeline.consumer.engines.sim import SimConfig, SimEngine
from pipeline.consumer.process import Consumer
from pipeline.consumer.reader import SegmentReader
from pipeline.wire.layouts.descriptors import DESCRIPTOR_ITEM_DTYPE, descriptor_size_bytes, write_descriptor
from tests.support.segments import SIG, store
from tests.support.sessions import FakeSession as _Session


def _descriptors(tmp_path, batches, per_batch=3):
    path, (items, *_), segment = store(str(tmp_path), 0, batches * per_batch, 9)
    offsets = scan_segment(path).offsets
    bodies = []
    for b in range(batches):
        rows = np.zeros(per_batch, dtype=DESCRIPTOR_ITEM_DTYPE)
        sl = slice(b * per_batch, (b + 1) * per_batch)
        rows["offset"], rows["length"], rows["item_id"] = offsets[sl], items["length"][sl], items["item_id"][sl]
        buf = np.zeros(descriptor_size_bytes(per_batch), dtype=np.uint8)
        write_descriptor(buf, 0, batch_id=100 + b, signature=SIG, model=2, pad_to_tokens=4096, dispatch_ns=5,
                         items=rows)
        bodies.append(buf.tobytes())
    return bodies, segment


class _Recording(SimEngine):
    def __init__(self, events):
        super().__init__(SimConfig())
        self.events = events

    def submit(self, key, batch):
        self.events.append(("submit", key))
        super().submit(key, batch)


def test_a_synchronous_engine_completes_each_batch_before_taking_the_next(tmp_path):
    # process.py's docstring: "A synchronous engine (sim) runs each batch as it is submitted,
    # so the loop is one batch at a time". With the sim's wants_more() always True, _feed
    # drains the whole ring (every batch run) before the first result is written or
    # completed: completions come in bursts of the credit window, results wait.
    events = []
    bodies, segment = _descriptors(tmp_path, 4)
    config = ConsumerConfig("unused.sock", str(tmp_path / "results"), "c0", model=2, max_input_len=1 << 20)
    consumer = Consumer(config, engine=_Recording(events))
    session = _Session(str(tmp_path), bodies, events)
    consumer._reader = SegmentReader(str(tmp_path))
    stop_after = iter(range(100))
    consumer._serve(session, lambda: next(stop_after) >= 2 and session.ring.released == 4)
    consumer._results.close()
    consumer._reader.close()
    segment.close()
    assert events[:4] == [("submit", 0), ("complete", 100), ("submit", 1), ("complete", 101)], events


class _Pipelined(Engine):
    """Holds `depth` batches, then finishes them all on the next poll (a vLLM-like engine)."""

    name = "pipelined"

    def __init__(self, depth, on_poll=None):
        super().__init__()
        self.depth = depth
        self.held = []
        self.on_poll = on_poll

    def run(self, batch):
        n = len(batch.prompts)
        counted = EngineCounters(batches=1, prompts=n, prompt_tokens=sum(map(len, batch.prompts)))
        return EngineResult([[1]] * n, [0] * n, ["stop"] * n, counted)

    def submit(self, key, batch):
        self.held.append((key, self.run(batch)))

    def wants_more(self):
        return len(self.held) < self.depth

    def poll(self):
        if len(self.held) < self.depth:
            return []
        if self.on_poll is not None:
            self.on_poll()
        done, self.held = self.held, []
        return done

    def abort(self):
        dropped = [k for k, _ in self.held]
        self.held = []
        return dropped


def test_batches_finishing_in_the_engine_after_the_broker_declared_the_consumer_dead_are_not_written(tmp_path):
    # A consumer SIGSTOPped while batches run in a pipelined engine wakes up declared dead:
    # the broker gave those batches to another consumer. _feed checks the session only
    # before taking a new batch; a batch the engine finishes is written and "completed"
    # without any check, so its items are answered twice (once here, once by the other).
    bodies, segment = _descriptors(tmp_path, 2)
    session = _Session(str(tmp_path), bodies, [])
    dead = []

    def declared_dead():
        dead.append(True)

    def check_open():
        if dead:
            raise ConnectionError("the broker closed the connection (declared dead)")

    session.check_open = check_open
    config = ConsumerConfig("unused.sock", str(tmp_path / "results"), "c0", model=2, max_input_len=1 << 20)
    consumer = Consumer(config, engine=_Pipelined(2, on_poll=declared_dead))
    consumer._reader = SegmentReader(str(tmp_path))
    polls = iter(range(100))
    try:
        consumer._serve(session, lambda: next(polls) >= 3)
    except ConnectionError:
        pass
    consumer._results.close()
    consumer._reader.close()
    segment.close()
    written = open(consumer.results_path).read().splitlines()
    assert written == [], f"{len(written)} result lines written for batches the broker had taken back"


def test_batches_left_in_the_ring_after_the_broker_took_them_back_are_not_run(tmp_path):
    # The broker closes a lost consumer's connection before it hands that consumer's batches
    # to anyone else; the consumer learns that what its ring still holds is stale from the
    # session alone (no store file is read for it): once the session says the connection is
    # closed, no batch of the ring is taken, run or answered, whatever the engine.
    for engine in (SimEngine(SimConfig()), _Pipelined(2)):
        events = []
        bodies, segment = _descriptors(tmp_path / engine.name, 3)
        session = _Session(str(tmp_path / engine.name), bodies, events)
        open_checks = []

        def check_open(checks=open_checks):
            checks.append(True)
            if len(checks) > 1:  # open while the first batch is taken; closed from then on
                raise ConnectionError("the broker closed the connection (declared dead)")

        session.check_open = check_open
        config = ConsumerConfig("unused.sock", str(tmp_path / engine.name / "results"), "c0", model=2,
                                max_input_len=1 << 20)
        consumer = Consumer(config, engine=engine)
        consumer._reader = SegmentReader(str(tmp_path / engine.name))
        try:
            consumer._serve(session, lambda: False)
        except ConnectionError:
            pass
        consumer._results.close()
        consumer._reader.close()
        segment.close()
        assert session.ring.released <= 1, f"{engine.name}: {session.ring.released} batches taken"
        assert [e for e in events if e[0] == "complete"] == [], events
        assert open(consumer.results_path).read() == ""


def test_hand_back_counts_the_batches_in_flight_in_the_engine(tmp_path, caplog):
    # ResultsDiskFullError with 3 batches in the engine and none left in the ring: the
    # consumer holds 3 batches, hand_back says 1 (the one in hand + the ring's records).
    from pipeline.consumer.session import BrokerSession as RealSession
    from pipeline.wire.errors import ResultsDiskFullError

    bodies, segment = _descriptors(tmp_path, 3)
    session = _Session(str(tmp_path), bodies, [])
    config = ConsumerConfig("unused.sock", str(tmp_path / "results"), "c0", model=2, max_input_len=1 << 20)
    consumer = Consumer(config, engine=_Pipelined(3))
    consumer._reader = SegmentReader(str(tmp_path))

    def full(lines):
        raise ResultsDiskFullError("no space left on device")

    consumer._write = full
    raised = False
    try:
        consumer._serve(session, lambda: False)
    except ResultsDiskFullError:
        raised = True
    consumer._results.close()
    consumer._reader.close()
    segment.close()
    assert raised
    assert RealSession.hand_back(session) == 3
