"""The metrics service: the log's facts as Prometheus metrics (decision 015).

It folds every event of the EVENTS stream, from the first, into `LogMetrics`
and serves them on `/metrics` with its own process metrics: counts are exact
after any restart, and any number of these services agree.

    uv run sandhold run metrics --nats URL [--metrics-port 9464]
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from sandhold.bus.append import last_sequence
from sandhold.bus.codec import decode_envelope
from sandhold.bus.names import Names
from sandhold.bus.service import (
    announce_ready,
    close_quickly,
    common_arguments,
    connect,
    run_service,
)
from sandhold.bus.store import stream_sequence
from sandhold.telemetry import metrics
from sandhold.telemetry.log_metrics import LogMetrics

log = logging.getLogger("sandhold.metrics")

DEFAULT_PORT = 9464  # the usual port of an OpenTelemetry Prometheus exporter


class MetricsService:
    name = "metrics"

    def __init__(self, nats_url: str, names: Names) -> None:
        self._url = nats_url
        self._names = names
        self._stopping = asyncio.Event()
        self.folded = LogMetrics()

    async def run(self) -> None:
        metrics.export_log_metrics(self.folded)
        nc = await connect(self._url, name="sandhold-metrics")
        try:
            sub = await follow_log(nc.jetstream(), self._names, self.folded)
            await announce_ready(nc, self._names, self.name)
            log.info(
                "metrics ready on port %s (log folded up to %d)",
                metrics.port,
                self.folded.position,
            )
            await self._stopping.wait()
            await sub.unsubscribe()
        finally:
            await close_quickly(nc)

    async def shutdown(self) -> None:
        self._stopping.set()


async def follow_log(
    js: JetStreamContext, names: Names, folded: LogMetrics, *, timeout: float = 120.0
):
    """Fold every event into `folded`, from the first and then live; returns the
    subscription once what the log held at the start is folded."""
    subjects = f"{names.prefix}.ev.>"
    target = await last_sequence(js, names.events_stream, subjects)
    caught_up = asyncio.Event()
    if target == 0:
        caught_up.set()

    async def on_event(msg: Msg) -> None:
        seq = stream_sequence(msg)
        try:
            folded.apply(seq, decode_envelope(msg.data))
        except msgspec.DecodeError:
            log.error("undecodable event at %s seq %d: not counted", msg.subject, seq)
        except Exception:
            log.exception("event at %s seq %d could not be counted", msg.subject, seq)
        finally:
            if seq >= target:
                caught_up.set()

    sub = await js.subscribe(
        subjects,
        stream=names.events_stream,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
        cb=on_event,
        pending_msgs_limit=-1,
        pending_bytes_limit=-1,
    )
    await asyncio.wait_for(caught_up.wait(), timeout)
    return sub


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandhold run metrics")
    common_arguments(p)
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    if p.get_default("metrics_port") is None:  # neither --metrics-port nor its env var
        p.set_defaults(metrics_port=DEFAULT_PORT)
    run_service(lambda a: MetricsService(a.nats, Names(a.prefix)), p, argv)


if __name__ == "__main__":
    main()
