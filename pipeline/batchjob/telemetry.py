"""A running job's Prometheus metrics, served beside the broker's by the launcher's endpoint
(`--metrics-port`): the job's requests answered, by status, across every run of it; those
to do; and the latency from a request's submit (its producer made its item) to its answer
(its consumer wrote its result), as a histogram.

    telemetry = JobTelemetry(log)           # the job's answer log: the counts
    telemetry.observe(latencies_s)          # the collector, each poll (the main thread)
    registry.register(telemetry)            # scraped on the metrics thread

Names follow the broker's (`shape_broker_` prefix, counters ending in `_total`); the status
label is the response's HTTP status code, as OpenAI's output lines carry it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

PREFIX = "shape_broker_job_"
# Upper bounds of the latency buckets, seconds: from a batch's turn on an idle GPU to an
# offline job's day.
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14_400.0, 86_400.0)


class JobTelemetry:
    """A prometheus_client collector of one job. Owner: the job's process; `observe` runs on
    its main thread and `collect` on the metrics thread (a lock guards the histogram)."""

    def __init__(self, log=None) -> None:
        self.log = log  # the job's AnswerLog, set once it is read (before the metrics are served)
        self._lock = threading.Lock()
        self._buckets = np.zeros(len(LATENCY_BUCKETS_S) + 1, dtype=np.int64)  # the last: +Inf
        self._sum_s = 0.0

    def observe(self, latencies_s: Sequence[float]) -> None:
        if not latencies_s:
            return
        found = np.asarray(latencies_s, dtype=np.float64)
        counts = np.bincount(np.searchsorted(LATENCY_BUCKETS_S, found, side="left"), minlength=self._buckets.size)
        with self._lock:
            self._buckets += counts
            self._sum_s += float(found.sum())

    def collect(self) -> Iterator[Metric]:
        by_status = dict(self.log.by_status)
        answered = CounterMetricFamily(PREFIX + "requests_answered", "Requests of the job answered, by the "
                                       "response's HTTP status (200 completed), across its runs", labels=["status"])
        for status, count in sorted(by_status.items()):
            answered.add_metric([str(status)], count)
        yield answered
        yield GaugeMetricFamily(PREFIX + "requests", "Requests in the job's input", value=self.log.requests)
        yield GaugeMetricFamily(PREFIX + "requests_to_do", "Requests of the job without an answer yet",
                                value=self.log.requests - sum(by_status.values()))
        with self._lock:
            cumulative = np.cumsum(self._buckets).tolist()
            total_s = self._sum_s
        bounds = [*(f"{b:g}" for b in LATENCY_BUCKETS_S), "+Inf"]
        yield HistogramMetricFamily(PREFIX + "request_latency_seconds", "From a request's submit (its producer "
                                    "made its item) to its answer (its consumer wrote its result), this run",
                                    buckets=list(zip(bounds, cumulative)), sum_value=total_s)
