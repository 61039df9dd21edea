"""A consumer's broker session and descriptor ring without a broker: the ring hands out
the given descriptor bodies in order; the session records what the consumer sends, and
each completion in `events`, for the tests of the consumer's serving loop."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class FakeRecord:
    body: memoryview
    start: int
    end: int


class FakeRing:
    name = "fake"
    capacity_bytes = 1 << 20

    def __init__(self, bodies):
        self.records = [FakeRecord(np.frombuffer(b, dtype=np.uint8), i, i + 1) for i, b in enumerate(bodies)]
        self.released = 0

    def peek(self, timeout_s=0.0):
        return self.records[self.released] if self.released < len(self.records) else None

    def release(self, end):
        self.released = end

    def poll(self):
        return self.peek()


class FakeSession:
    def __init__(self, data_dir, bodies, events):
        self.ring = FakeRing(bodies)
        self.data_dir = data_dir
        self.events = events
        self.sent = []

    def check_open(self):
        pass

    def send(self, *messages):
        for m in messages:
            self.sent.append(m)
            if m["type"] == "complete":
                self.events.append(("complete", m["batch_id"]))
