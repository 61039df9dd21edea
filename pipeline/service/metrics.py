"""The batch service's Prometheus metrics (`GET /metrics`), from the store's records at each
scrape:

    shape_broker_service_batches{status}                   batches by status (every status, 0s too)
    shape_broker_service_requests{status}                  requests: completed, failed, to_do (of batches not ended)
    shape_broker_service_batch_requests_to_do{batch_id}    each unfinished batch's requests left
    shape_broker_service_batch_deadline_slack_seconds{batch_id}  time to its deadline (negative: passed)
    shape_broker_service_stored_bytes{tenant}              each tenant's stored bytes

Per-batch labels are for batches not ended only, so they are bounded by the tenants' active
batch limits. With API keys, a scrape shows the scraping key's tenant alone (its batches,
requests and stored bytes): one tenant never learns another's name, ids or use. The jobs
serve no metrics of their own (`serve` refuses a metrics port for them: they share one node).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from pipeline.reporting.metrics import PREFIX
from pipeline.service.states import STATUSES, TERMINAL
from pipeline.service.store import Store

SERVICE_PREFIX = PREFIX + "service_"


class ServiceCollector:
    """A prometheus_client collector over the store; `clock`: Unix seconds; `tenant`: whose
    batches and stored bytes it shows (None: every tenant's, a server without keys)."""

    def __init__(self, store: Store, clock: Callable[[], float], tenant: str | None = None) -> None:
        self.store = store
        self.clock = clock
        self.tenant = tenant

    def collect(self) -> Iterator[Metric]:
        batches = [b for b in self.store.all_batches() if self.tenant in (None, b.owner)]
        now = self.clock()
        by_status = GaugeMetricFamily(SERVICE_PREFIX + "batches", "Batches by status", labels=["status"])
        for status in STATUSES:
            by_status.add_metric([status], sum(1 for b in batches if b.life.status == status))
        yield by_status
        requests = GaugeMetricFamily(SERVICE_PREFIX + "requests", "Requests of every batch by status (to_do: of "
                                     "batches not ended)", labels=["status"])
        unfinished = [b for b in batches if b.life.status not in TERMINAL]
        requests.add_metric(["completed"], sum(b.completed for b in batches))
        requests.add_metric(["failed"], sum(b.failed for b in batches))
        requests.add_metric(["to_do"], sum(max(0, b.total - b.completed - b.failed) for b in unfinished))
        yield requests
        to_do = GaugeMetricFamily(SERVICE_PREFIX + "batch_requests_to_do", "Requests left of a batch not ended",
                                  labels=["batch_id"])
        slack = GaugeMetricFamily(SERVICE_PREFIX + "batch_deadline_slack_seconds", "Seconds to a batch's deadline "
                                  "(its completion window's end; negative once passed)", labels=["batch_id"])
        for batch in unfinished:
            to_do.add_metric([batch.id], max(0, batch.total - batch.completed - batch.failed))
            slack.add_metric([batch.id], batch.life.expires_at - now)
        yield to_do
        yield slack
        stored = GaugeMetricFamily(SERVICE_PREFIX + "stored_bytes", "Bytes of files each tenant stores",
                                   labels=["tenant"])
        with self.store.lock:
            for tenant, size in sorted(self.store.stored_bytes.items()):
                if self.tenant in (None, tenant):
                    stored.add_metric([tenant], size)
        yield stored


def render(collector: ServiceCollector) -> bytes:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry)
