"""Prometheus metrics from the broker's status (issue 6 item 6).

Every scrape calls `fetch()` for one status dict (the `status` request over the broker's
socket, answered by the broker loop like any client) and turns it into metric families, so
the metrics thread never touches the loop's state:

    server = MetricsServer.start(9100, lambda: broker_status(socket_path))
    ...                                    # GET http://127.0.0.1:9100/metrics
    server.close()

Names start with `shape_broker_`; counters end in `_total` (CounterMetricFamily adds it) and
keep the status fields' names, so a dashboard and the run report speak of the same things.
Label values are bounded: lane events and switch reasons are fixed sets, shapes are the
broker's top 16 plus one "other" row (model "all"), consumers are one per GPU.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pipeline.errors import PipelineError

log = logging.getLogger("pipeline.metrics")

Status = dict[str, Any]

# Every metric's name starts with this, so dashboards find them and no other exporter clashes.
PREFIX = "shape_broker_"
# How long `close()` waits for the HTTP server's thread; it stops within one poll (0.5 s).
CLOSE_TIMEOUT_S = 5.0
# The model label of the status's "other" row: it sums shapes of every model.
OTHER_MODEL_LABEL = "all"
# The signature of that row in `top_shapes`.
OTHER_SHAPE = "other"
UP_HELP = "1 if the broker answered the status request, else 0"

# (metric name, status fields summed, help). Recovered items count as received: SPEC's
# invariant received = routed = completed holds across restarts only with them in.
COUNTERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("items_received", ("items_received", "items_recovered"), "Items received, recovered ones included"),
    ("tokens_received", ("tokens_received", "tokens_recovered"), "Tokens received, recovered ones included"),
    ("items_recovered", ("items_recovered",), "Items recovered from disk at start (also in items_received)"),
    ("tokens_recovered", ("tokens_recovered",), "Tokens of the items recovered from disk at start"),
    ("items_routed", ("items_routed",), "Items handed to consumers (a redelivered item counts again)"),
    ("tokens_routed", ("tokens_routed",), "Tokens of the items routed, without padding"),
    ("items_completed", ("items_completed",), "Items whose completion the broker recorded"),
    ("tokens_completed", ("tokens_completed",), "Tokens of the items completed"),
    ("items_returned", ("items_returned",), "Items returned to their queue for redelivery"),
    ("duplicate_items", ("duplicate_items",), "Items received again with an id already stored (dropped)"),
    ("duplicate_completions", ("duplicate_completions",), "Completions of items already completed (ignored)"),
    ("batches_routed", ("batches_routed",), "Batches handed to consumers"),
    ("padded_tokens_routed", ("padded_tokens_routed",), "Tokens of the batches routed, padding included"),
    ("consumers_lost", ("consumers_lost",), "Consumers dropped for a closed connection or missed heartbeats"),
    ("items_adopted", ("items_adopted",), "Items stored from producer rings an earlier run left (also received)"),
    ("peers_refused", ("peers_refused",), "Connections refused: a malformed message, another user, past a limit"),
    ("peers_shed", ("peers_shed",), "Connections that never registered, closed: idle too long, or too many"),
    ("stalls", ("stalls",), "Gaps in the broker's loop long enough to be its own stall (paused, starved)"),
)

# (metric name, status field, help) of the plain top-level gauges.
GAUGES: tuple[tuple[str, str, str], ...] = (
    ("backlog_items", "backlog_items", "Items stored and not yet routed"),
    ("backlog_tokens", "backlog_tokens", "Tokens of the items stored and not yet routed"),
    ("pending_items", "pending_items", "Items routed and not yet completed"),
    ("shapes", "shapes", "(model, shape) pairs the broker holds lanes for"),
    ("lanes_in_use", "lanes_in_use", "Length lanes open now"),
    ("uptime_seconds", "uptime_s", "Seconds since this broker process started"),
    ("generation", "generation", "Broker generation on this data directory (one more at each start)"),
)

# The lane counters of the status's `lanes` dict, as the `event` label's values.
LANE_EVENTS: tuple[str, ...] = ("opened", "reused", "force_fits", "raises", "quiesced", "released", "revived",
                                "restored")

# (status field of a `top_shapes` row, metric name, help).
SHAPE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("queued_items", "shape_queued_items", "Items queued in this shape's lanes"),
    ("queued_tokens", "shape_queued_tokens", "Tokens queued in this shape's lanes"),
    ("lanes", "shape_lanes", "Length lanes this shape holds"),
    ("pending_items", "shape_pending_items", "Items of this shape routed and not yet completed"),
)

# (status field of a `per_consumer` row, help) of the per-consumer counters; the metric is
# `consumer_<field>_total`.
CONSUMER_COUNTERS: tuple[tuple[str, str], ...] = (
    ("batches", "Batches the consumer completed"),
    ("items_ok", "Items the consumer answered"),
    ("items_too_long", "Items the consumer refused as longer than its max input length"),
    ("items_corrupt", "Items the consumer found corrupt"),
    ("prompt_tokens", "Prompt tokens the consumer processed"),
    ("padded_tokens", "Tokens of the consumer's batches, padding included"),
    ("cacheable_tokens", "Prompt tokens inside a declared cacheable prefix"),
    ("cache_hit_tokens", "Prompt tokens served from the prefix cache"),
    ("cacheable_hit_tokens", "Cacheable prefix tokens served from the prefix cache"),
    ("compulsory_miss_tokens", "Cacheable tokens of each shape's first item (a miss no order avoids)"),
    ("output_tokens", "Tokens the consumer generated"),
)


class StatusCollector:
    """A prometheus_client custom collector over `fetch() -> status dict`.

    Owner: the registry it is registered in. `collect()` runs on whichever thread scrapes
    (the HTTP server's request threads, possibly two at once), so `fetch` must be
    thread-safe; a fresh socket request per call is.
    """

    def __init__(self, fetch: Callable[[], Status]) -> None:
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


def status_metrics(status: Status) -> Iterator[Metric]:
    """Every metric family of one status dict; a missing field reads as 0."""
    yield from _totals(status)
    yield from _levels(status)
    yield from _shapes(status.get("top_shapes", []))
    yield from _consumers(status.get("per_consumer", {}))


def _totals(status: Status) -> Iterator[Metric]:
    for name, fields, help_text in COUNTERS:
        yield _counter(name, help_text, sum(status.get(f, 0) for f in fields))
    switches = CounterMetricFamily(PREFIX + "shape_switches", "Changes of a model's current shape, by reason",
                                   labels=["reason"])
    for reason, count in sorted(status.get("switches", {}).items()):
        switches.add_metric([reason], count)
    yield switches
    lanes = status.get("lanes", {})
    events = CounterMetricFamily(PREFIX + "lane_events", "Lane events summed over shapes, by event",
                                 labels=["event"])
    for event in LANE_EVENTS:
        events.add_metric([event], lanes.get(event, 0))
    yield events


def _levels(status: Status) -> Iterator[Metric]:
    for name, field, help_text in GAUGES:
        yield _gauge(name, help_text, status.get(field, 0))
    yield _gauge("lanes_max_in_use", "Sum over shapes of each shape's peak number of lanes",
                 status.get("lanes", {}).get("max_in_use", 0))
    yield _gauge("consumers_connected", "Consumers registered now", len(status.get("consumers", {})))
    yield _gauge("disk_full", "1 while the disk tier refuses writes for lack of space",
                 int(status.get("disk_full", False)))
    damage = GaugeMetricFamily(PREFIX + "store_damage", "What recovery found in the store that it could not "
                               "deliver or had to repair, by kind (named in the broker's log)", labels=["kind"])
    for kind, count in sorted(status.get("store_damage", {}).items()):
        damage.add_metric([kind], count)
    yield damage
    tokens, padded = status.get("tokens_routed", 0), status.get("padded_tokens_routed", 0)
    # NOTE: 1.0 rather than no sample before the first batch: no padding has been wasted yet.
    yield _gauge("padding_efficiency_ratio", "Tokens routed over padded tokens routed",
                 tokens / padded if padded else 1.0)
    batches = status.get("batches_routed", 0)
    # No sample before the first batch: a mean of nothing is no number, and 0 would read as empty batches.
    yield _gauge("batch_fill_mean_ratio", "Mean share of its consumer's contract a routed batch fills",
                 status.get("batch_fill_sum", 0.0) / batches if batches else None)


def _shapes(rows: list[dict]) -> Iterator[Metric]:
    families = [(field, GaugeMetricFamily(PREFIX + name, help_text, labels=["model", "shape"]))
                for field, name, help_text in SHAPE_GAUGES]
    for row in rows:
        shape = row.get("signature", OTHER_SHAPE)
        model = OTHER_MODEL_LABEL if shape == OTHER_SHAPE else str(row.get("model", 0))
        for field, family in families:
            family.add_metric([model, shape], row.get(field, 0))
    for _, family in families:
        yield family


def _consumers(per_consumer: dict[str, dict]) -> Iterator[Metric]:
    names = sorted(per_consumer)
    for field, help_text in CONSUMER_COUNTERS:
        family = CounterMetricFamily(PREFIX + f"consumer_{field}", help_text, labels=["consumer"])
        for name in names:
            family.add_metric([name], per_consumer[name].get(field, 0))
        yield family
    connected = GaugeMetricFamily(PREFIX + "consumer_connected", "1 while the consumer is registered",
                                  labels=["consumer"])
    hit_ratio = GaugeMetricFamily(
        PREFIX + "consumer_cache_hit_ratio",
        "Cacheable hit tokens over cacheable tokens less compulsory misses (the hits a perfect order could get)",
        labels=["consumer"])
    for name in names:
        row = per_consumer[name]
        connected.add_metric([name], int(row.get("connected", False)))
        reachable = row.get("cacheable_tokens", 0) - row.get("compulsory_miss_tokens", 0)
        if reachable > 0:
            hit_ratio.add_metric([name], row.get("cacheable_hit_tokens", 0) / reachable)
    yield connected
    yield hit_ratio


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, help_text, value=value)


def _gauge(name: str, help_text: str, value: float | None) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help_text, value=value)


def render(status: Status) -> str:
    """The Prometheus text exposition of one status dict."""
    registry = CollectorRegistry()
    registry.register(StatusCollector(lambda: status))
    return generate_latest(registry).decode()


class MetricsServer:
    """An HTTP endpoint serving the metrics of `fetch()` in the Prometheus text format.

    Owner: the process that starts it (broker or launcher), which calls `close()` once. It
    has its own registry, not prometheus_client's global one, so two servers in a process
    (tests) do not collide and no process metrics slip in. prometheus_client serves from a
    daemon thread and answers each request on a thread of its own, where `fetch` runs:
    `fetch` must be thread-safe.
    """

    def __init__(self, httpd: WSGIServer, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self._closed = False

    @classmethod
    def start(cls, port: int, fetch: Callable[[], Status], host: str = "127.0.0.1") -> MetricsServer:
        """Listen on host:port (port 0: a free port, read back from `port`). The default host
        is the loopback: a metrics port is opened to the network only when asked."""
        registry = CollectorRegistry()
        registry.register(StatusCollector(fetch))
        try:
            httpd, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:  # a port in use, say: the message names it
            raise OSError(exc.errno, f"metrics port {host}:{port}: {exc.strerror}") from exc
        return cls(httpd, thread)

    @property
    def port(self) -> int:
        return self._httpd.server_port

    def close(self) -> None:
        """Stop serving, close the listening socket and join the serving thread."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(CLOSE_TIMEOUT_S)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
