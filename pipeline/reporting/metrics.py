"""Prometheus metrics from the broker's status.

Every scrape calls `fetch()` for one BrokerStatus (the `status` request over the broker's
socket, answered by the broker loop like any client) and turns it into metric families, so
the metrics thread never touches the loop's state:

    registry.register(StatusCollector(lambda: broker_status(socket_path)))

Names start with `shape_broker_`; counters end in `_total` (CounterMetricFamily adds it) and
keep the status fields' names, so a dashboard and the run report speak of the same things.
Which fields are exported, as what, and their help texts are declared once, on the record's
fields (pipeline.wire.status `Export`); the tables below are derived from them. Label values are
bounded: lane events and switch reasons are fixed sets, shapes are the broker's top 16 plus
one "other" row (model "all"), consumers are one per GPU.

The HTTP endpoint that serves them: pipeline.reporting.metrics_endpoint.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pipeline.wire.errors import PipelineError
from pipeline.wire.status import (
    COUNTER,
    GAUGE,
    BrokerStatus,
    ConsumerTotalsRow,
    ConsumerWork,
    Export,
    LaneEvents,
    TopShape,
    exports,
)

log = logging.getLogger("pipeline.metrics")

# Every metric's name starts with this, so dashboards find them and no other exporter clashes.
PREFIX = "shape_broker_"
# The model label of the status's "other" row: it sums shapes of every model.
OTHER_MODEL_LABEL = "all"
UP_HELP = "1 if the broker answered the status request, else 0"
PREFIX_REUSE_HELP = "Cache-hit tokens over prompt tokens (the Mooncake paper's cache ratio)"
# The prometheus_client family of each metric kind.
_FAMILY: dict[str, Any] = {COUNTER: CounterMetricFamily, GAUGE: GaugeMetricFamily}

# The record's exported fields, by kind, in field order. A labelled one (`label`) is one
# family with a sample per key; the others are one sample each. Recovered items count as
# received (the items_received metric's value is BrokerStatus.items_received_all): SPEC's
# invariant received = routed = completed holds across restarts only with them in.
COUNTERS: tuple[Export, ...] = exports(BrokerStatus, COUNTER)
GAUGES: tuple[Export, ...] = exports(BrokerStatus, GAUGE)
# The lane counters, as the `event` label's values; the gauge is `lanes_<name>`.
LANE_EVENTS: tuple[str, ...] = tuple(e.name for e in exports(LaneEvents, COUNTER))
LANE_GAUGES: tuple[Export, ...] = exports(LaneEvents, GAUGE)
# Gauges of a `top_shapes` row: the metric is `shape_<name>`.
SHAPE_GAUGES: tuple[Export, ...] = exports(TopShape, GAUGE)
# Counters and gauges of a `per_consumer` row: the metric is `consumer_<name>`.
CONSUMER_COUNTERS: tuple[Export, ...] = exports(ConsumerTotalsRow, COUNTER)
CONSUMER_GAUGES: tuple[Export, ...] = exports(ConsumerTotalsRow, GAUGE)


class StatusCollector:
    """A prometheus_client custom collector over `fetch() -> BrokerStatus`.

    Owner: the registry it is registered in. `collect()` runs on whichever thread scrapes
    (the HTTP server's request threads, possibly two at once), so `fetch` must be
    thread-safe; a fresh socket request per call is.
    """

    def __init__(self, fetch: Callable[[], BrokerStatus]) -> None:
        self.fetch = fetch

    def collect(self) -> Iterator[Metric]:
        # Only "cannot reach the broker" and "the broker refused" mean down; any other error
        # is a bug and fails the scrape loudly rather than reading as an outage.
        try:
            status = self.fetch()
        except (OSError, PipelineError) as exc:
            log.debug("metrics: broker status unavailable: %s", exc)
            yield _gauge("up", UP_HELP, 0)
            return
        yield _gauge("up", UP_HELP, 1)
        yield from status_metrics(status)


def status_metrics(status: BrokerStatus) -> Iterator[Metric]:
    """Every metric family of one status."""
    yield from _families(COUNTERS, status)
    yield from _families(GAUGES, status)
    yield from _families(LANE_GAUGES, status.lanes, "lanes_")
    yield _gauge("consumers_connected", "Consumers registered now", len(status.consumers))
    # NOTE: 1.0 rather than no sample before the first batch: no padding has been wasted yet.
    padding = status.routed_padding_efficiency
    yield _gauge("padding_efficiency_ratio", "Tokens routed over padded tokens routed",
                 1.0 if padding is None else padding)
    # No sample before the first batch: a mean of nothing is no number, and 0 would read as empty batches.
    yield _gauge("batch_fill_mean_ratio", "Mean share of its consumer's contract a routed batch fills",
                 status.mean_batch_fill)
    yield _gauge("split_cost_prefix_tokens", "Compulsory prefix tokens the consumers' caches paid beyond one "
                 "cache for the whole model: what splitting shapes across consumers cost", status.split_cost_tokens)
    yield from _shapes(status.top_shapes)
    yield from _consumers(status.per_consumer)


def _families(table: tuple[Export, ...], record: object, prefix: str = "") -> Iterator[Metric]:
    """One family per export of `record`: one sample, or one per key of a labelled one (a
    mapping, sorted, or a record of counters, in field order)."""
    for export in table:
        value = export.read(record)
        if not export.label:
            family = _FAMILY[export.kind](PREFIX + prefix + export.name, export.help, value=_number(value))
        else:
            family = _FAMILY[export.kind](PREFIX + prefix + export.name, export.help, labels=[export.label])
            pairs = sorted(value.items()) if isinstance(value, dict) else [
                (e.name, e.read(value)) for e in exports(type(value), export.kind)]
            for key, count in pairs:
                family.add_metric([key], count)
        yield family


def _shapes(rows: tuple[TopShape, ...]) -> Iterator[Metric]:
    families = [(export, GaugeMetricFamily(PREFIX + "shape_" + export.name, export.help, labels=["model", "shape"]))
                for export in SHAPE_GAUGES]
    for row in rows:
        model = OTHER_MODEL_LABEL if row.is_other else str(row.model)
        for export, family in families:
            family.add_metric([model, row.signature], export.read(row))
    for _, family in families:
        yield family


def _consumers(per_consumer: dict[str, ConsumerTotalsRow]) -> Iterator[Metric]:
    names = sorted(per_consumer)
    for table in (CONSUMER_COUNTERS, CONSUMER_GAUGES):
        for export in table:
            family = _FAMILY[export.kind](PREFIX + "consumer_" + export.name, export.help, labels=["consumer"])
            for name in names:
                family.add_metric([name], _number(export.read(per_consumer[name])))
            yield family
    yield _per_consumer_ratio(
        "consumer_cache_hit_ratio",
        "Cacheable hit tokens over cacheable tokens less compulsory misses (the hits a perfect order could get)",
        {name: per_consumer[name].work.cache_hit_rate for name in names})
    yield _per_consumer_ratio("consumer_prefix_reuse_ratio", PREFIX_REUSE_HELP,
                              {name: per_consumer[name].work.prefix_reuse for name in names})
    total = sum((row.work for row in per_consumer.values()), ConsumerWork())
    # No sample before a consumer reported a prompt token: a ratio of nothing is no number.
    yield _gauge("prefix_reuse_ratio", PREFIX_REUSE_HELP + ", over every consumer", total.prefix_reuse)


def _per_consumer_ratio(name: str, help_text: str, values: dict[str, float | None]) -> GaugeMetricFamily:
    """A gauge with a sample per consumer whose ratio is measured (None: nothing to divide
    yet, no sample)."""
    family = GaugeMetricFamily(PREFIX + name, help_text, labels=["consumer"])
    for consumer, value in values.items():
        if value is not None:
            family.add_metric([consumer], value)
    return family


def _number(value: float | bool) -> float:
    """A sample's value: a flag is 1 or 0."""
    return int(value) if isinstance(value, bool) else value


def _gauge(name: str, help_text: str, value: float | None) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help_text, value=value)


def render(status: BrokerStatus) -> str:
    """The Prometheus text exposition of one status."""
    registry = CollectorRegistry()
    registry.register(StatusCollector(lambda: status))
    return generate_latest(registry).decode()
