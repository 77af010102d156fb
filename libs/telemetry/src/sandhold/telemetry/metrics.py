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

from sandhold.telemetry.log_metrics import CATALOG, Labels, LogMetrics

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter

_REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _Instruments:
    def __init__(self, meter: Meter) -> None:
        self.handled = meter.create_counter(
            "sandhold_messages_handled",
            description="Messages a consumer handled (or failed to), by consumer, type, outcome",
        )
        self.latency = meter.create_histogram(
            "sandhold_message_latency",
            unit="s",
            description="Stored in JetStream to handled, by consumer and type: for the "
            "requests consumer, a client request's latency up to the scheduler's reply",
        )
        self.replies = meter.create_counter(
            "sandhold_replies", description="Replies to client requests: ok, or the refusal's code"
        )
        self.redeliveries = meter.create_counter(
            "sandhold_redeliveries", description="Messages a consumer got again, by consumer"
        )
        self.dead_letters = meter.create_counter(
            "sandhold_dead_letters",
            description="Messages given up on (terminated, never retried), by consumer",
        )
        self.lease_misses = meter.create_counter(
            "sandhold_lease_renewal_failures", description="Lease renewals that failed, by host"
        )


_instruments: _Instruments | None = None
_meter: Meter | None = None
port: int | None = None  # where this process's /metrics listens, once `serve` ran


# --- what one process sees ------------------------------------------------------


def message_handled(consumer: str, subject: str, outcome: str, seconds: float) -> None:
    if _instruments is not None:
        # A request's type is in its subject (`<prefix>.req.<type>`); work's is not.
        _, _, request_type = subject.partition(".req.")
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


# --- the endpoint ------------------------------------------------------------------


def serve(service: str, listen_on: int, *, addr: str | None = None) -> int:
    """Start this process's `/metrics` on `listen_on` (0: any free port) of `addr`
    (default `SANDHOLD_METRICS_ADDR`, else every interface); returns the port."""
    global _instruments, _meter, port
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
    from opentelemetry.sdk.resources import Resource
    from prometheus_client import start_http_server

    views = [
        View(
            instrument_name=m.name.removesuffix("_seconds"),
            aggregation=ExplicitBucketHistogramAggregation(m.buckets),
        )
        for m in CATALOG
        if m.kind == "histogram"
    ]
    views.append(
        View(
            instrument_name="sandhold_message_latency",
            aggregation=ExplicitBucketHistogramAggregation(_REQUEST_BUCKETS),
        )
    )
    provider = MeterProvider(
        metric_readers=[PrometheusMetricReader()],
        resource=Resource.create({"service.name": f"sandhold-{service}"}),
        views=views,
    )
    _meter = provider.get_meter("sandhold")
    _instruments = _Instruments(_meter)
    addr = addr or os.environ.get("SANDHOLD_METRICS_ADDR", "0.0.0.0")
    server, _ = start_http_server(listen_on, addr=addr)
    port = server.server_port
    return port


def export_log_metrics(folded: LogMetrics, *, clock=time.time) -> None:
    """Publish `folded`'s counters and gauges (read at scrape time) and every
    histogram value it observes from now on. Call before folding the first event,
    so the histograms hold the whole log."""
    assert _meter is not None, "serve() first"
    from opentelemetry.metrics import Observation

    def counter(name: str):
        return lambda _options: [Observation(v, dict(k)) for k, v in folded.counters[name].items()]

    def gauge(name: str):
        return lambda _options: [
            Observation(v, dict(k)) for k, v in folded.gauges(clock())[name].items()
        ]

    histograms = {}
    for metric in CATALOG:
        # OpenTelemetry's Prometheus exporter adds `_total` and the unit's `_seconds`.
        if metric.kind == "counter":
            _meter.create_observable_counter(
                metric.name.removesuffix("_total"),
                callbacks=[counter(metric.name)],
                description=metric.help,
            )
        elif metric.kind == "gauge":
            _meter.create_observable_gauge(
                metric.name, callbacks=[gauge(metric.name)], description=metric.help
            )
        else:
            histograms[metric.name] = _meter.create_histogram(
                metric.name.removesuffix("_seconds"), unit="s", description=metric.help
            )

    def observe(name: str, value: float, key: Labels) -> None:
        histograms[name].record(value, dict(key))

    folded.on_observation(observe)
