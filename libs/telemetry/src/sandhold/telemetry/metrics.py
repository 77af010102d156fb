"""OpenTelemetry metrics, read by Prometheus from an HTTP `/metrics` endpoint.

Two sources: what only one process sees (request latency, redeliveries, dead
letters, missed lease renewals: the functions below, no-ops until `serve` ran
in this process) and the facts of the log (`log_metrics`, exported by the
metrics service with `export_log_metrics`).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from sandhold.telemetry.log_metrics import CATALOG, LogMetrics, Metric

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation

_REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


# What one process sees, by the names Prometheus shows.
PROCESS_CATALOG: tuple[Metric, ...] = (
    Metric(
        "sandhold_messages_handled_total",
        "counter",
        "Messages a consumer handled (or failed to), by consumer, type and outcome",
    ),
    Metric(
        "sandhold_message_latency_seconds",
        "histogram",
        "Stored in JetStream to handled, by consumer and type: for the requests consumer, "
        "a client request's latency up to the scheduler's reply",
        _REQUEST_BUCKETS,
    ),
    Metric("sandhold_replies_total", "counter", "Replies to requests: ok, or the refusal's code"),
    Metric("sandhold_redeliveries_total", "counter", "Messages a consumer got again"),
    Metric(
        "sandhold_dead_letters_total",
        "counter",
        "Messages given up on (terminated, never retried), by consumer",
    ),
    Metric("sandhold_lease_renewal_failures_total", "counter", "Failed lease renewals, by host"),
)

# A host's chunk cache, read from the cache when scraped (`watch_chunk_cache`).
CHUNK_CACHE_CATALOG: tuple[Metric, ...] = (
    Metric("sandhold_chunk_cache_bytes", "gauge", "Bytes of chunks a host's cache holds"),
    Metric("sandhold_chunk_cache_limit_bytes", "gauge", "A host's chunk cache limit"),
    Metric(
        "sandhold_chunk_cache_hits_total",
        "counter",
        "Chunks a restore took from the host's cache instead of the save store",
    ),
    Metric(
        "sandhold_chunk_cache_misses_total",
        "counter",
        "Chunks a restore looked for in the host's cache and fetched",
    ),
    Metric(
        "sandhold_chunk_cache_evictions_total",
        "counter",
        "Chunks evicted (least recently used) to keep a host's cache within its limit",
    ),
)


def _instrument_name(metric: Metric) -> str:
    """OpenTelemetry's Prometheus exporter adds `_total` to counters and the
    unit's `_seconds`: the instrument is named without them."""
    return metric.name.removesuffix("_total").removesuffix("_seconds")


class _Instruments:
    def __init__(self, meter: Meter) -> None:
        counters: dict[str, Counter] = {}
        histograms: dict[str, Histogram] = {}
        for metric in PROCESS_CATALOG:
            if metric.kind == "counter":
                counters[metric.name] = meter.create_counter(
                    _instrument_name(metric), description=metric.help
                )
            else:
                histograms[metric.name] = meter.create_histogram(
                    _instrument_name(metric), unit="s", description=metric.help
                )
        self.handled = counters["sandhold_messages_handled_total"]
        self.latency = histograms["sandhold_message_latency_seconds"]
        self.replies = counters["sandhold_replies_total"]
        self.redeliveries = counters["sandhold_redeliveries_total"]
        self.dead_letters = counters["sandhold_dead_letters_total"]
        self.lease_misses = counters["sandhold_lease_renewal_failures_total"]


_instruments: _Instruments | None = None
_meter: Meter | None = None
port: int | None = None  # where this process's /metrics listens, once `serve` ran


# --- what one process sees ------------------------------------------------------


def message_handled(consumer: str, subject: str, outcome: str, seconds: float) -> None:
    if _instruments is not None:
        # A request's type is in its subject (`<prefix>.req.<family>.<verb>.<tenant>`;
        # the tenant is left out: no tenant ids in labels); work's is not.
        _, _, rest = subject.partition(".req.")
        request_type = ".".join(rest.split(".")[:2])
        _instruments.handled.add(
            1, {"consumer": consumer, "type": request_type, "outcome": outcome}
        )
        _instruments.latency.record(max(0.0, seconds), {"consumer": consumer, "type": request_type})


def replied(outcome: str) -> None:
    if _instruments is not None:
        _instruments.replies.add(1, {"outcome": outcome})


def redelivered(consumer: str) -> None:
    if _instruments is not None:
        _instruments.redeliveries.add(1, {"consumer": consumer})


def dead_lettered(consumer: str) -> None:
    if _instruments is not None:
        _instruments.dead_letters.add(1, {"consumer": consumer})


def lease_renewal_failed(host: str) -> None:
    if _instruments is not None:
        _instruments.lease_misses.add(1, {"host": host})


def watch_chunk_cache(host: str, figures: Callable[[], dict[str, float]]) -> None:
    """Publish a host's chunk cache: `figures()` (read at scrape time, from the
    Prometheus server's thread) gives `bytes`, `limit_bytes`, `hits`, `misses`,
    `evictions`. A no-op until `serve` ran."""
    if _meter is None:
        return
    from opentelemetry.metrics import Observation

    def read(field: str) -> Callable[[CallbackOptions], list[Observation]]:
        return lambda _options: [Observation(figures()[field], {"host": host})]

    for metric in CHUNK_CACHE_CATALOG:
        field = metric.name.removeprefix("sandhold_chunk_cache_").removesuffix("_total")
        if metric.kind == "counter":
            _meter.create_observable_counter(
                _instrument_name(metric), callbacks=[read(field)], description=metric.help
            )
        else:
            _meter.create_observable_gauge(
                metric.name, callbacks=[read(field)], description=metric.help
            )


# --- the endpoint ------------------------------------------------------------------


def serve(service: str, listen_on: int, *, addr: str | None = None) -> int:
    """Start this process's `/metrics` on `listen_on` (0: any free port) of `addr`
    (default `SANDHOLD_METRICS_ADDR`, else loopback only: a deployment whose
    Prometheus runs elsewhere says where to listen); returns the port."""
    global _instruments, _meter, port
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
    from opentelemetry.sdk.resources import Resource
    from prometheus_client import start_http_server

    views = [
        View(
            instrument_name=_instrument_name(m),
            aggregation=ExplicitBucketHistogramAggregation(m.buckets),
        )
        for m in (*CATALOG, *PROCESS_CATALOG)
        if m.kind == "histogram"
    ]
    provider = MeterProvider(
        metric_readers=[PrometheusMetricReader()],
        resource=Resource.create({"service.name": f"sandhold-{service}"}),
        views=views,
    )
    _meter = provider.get_meter("sandhold")
    _instruments = _Instruments(_meter)
    addr = addr or os.environ.get("SANDHOLD_METRICS_ADDR", "127.0.0.1")
    server, _ = start_http_server(listen_on, addr=addr)
    port = server.server_port
    return port


def export_log_metrics(folded: LogMetrics, *, clock: Callable[[], float] = time.time) -> None:
    """Publish `folded`'s counters, gauges and histograms, all read at scrape
    time: the histograms are the fold's own bucket counts (decision 062), so a
    fold started from a checkpoint shows the whole log's, as one from zero."""
    assert _meter is not None, "serve() first"
    from opentelemetry.metrics import Observation
    from prometheus_client import REGISTRY
    from prometheus_client.core import HistogramMetricFamily

    def counter(name: str) -> Callable[[CallbackOptions], list[Observation]]:
        # Called from the Prometheus server's thread: read copies (`LogMetrics.gauges`).
        return lambda _options: [Observation(v, dict(k)) for k, v in folded.counter_series(name)]

    def gauge(name: str) -> Callable[[CallbackOptions], list[Observation]]:
        return lambda _options: [
            Observation(v, dict(k)) for k, v in folded.gauges(clock())[name].items()
        ]

    histograms = []
    for metric in CATALOG:
        name = _instrument_name(metric)
        if metric.kind == "counter":
            _meter.create_observable_counter(
                name, callbacks=[counter(metric.name)], description=metric.help
            )
        elif metric.kind == "gauge":
            _meter.create_observable_gauge(
                metric.name, callbacks=[gauge(metric.name)], description=metric.help
            )
        else:
            histograms.append(metric)

    # As OpenTelemetry's exporter showed them when they were its instruments:
    # the same names, unit, bounds as written there and labels (its scope's too).
    scope = {"otel_scope_name": "sandhold", "otel_scope_schema_url": "", "otel_scope_version": ""}

    class LogHistograms:
        """The fold's histograms, for the Prometheus server (its own thread)."""

        def collect(self) -> Iterator[HistogramMetricFamily]:
            for metric in histograms:
                series = folded.histogram_series(metric.name)
                if not series:
                    continue
                bounds = [*(f"{b}" for b in metric.buckets), "+Inf"]
                names = sorted({*scope, *(n for key, _, _ in series for n, _ in key)})
                family = HistogramMetricFamily(
                    metric.name, metric.help, labels=names, unit="seconds"
                )
                for key, cumulative, total in series:
                    values = {**scope, **dict(key)}
                    family.add_metric(
                        [values.get(n, "") for n in names],
                        list(zip(bounds, cumulative, strict=True)),
                        total,
                    )
                yield family

    REGISTRY.register(LogHistograms())
