"""The metrics service: the log's facts as Prometheus metrics (decision 015).

It folds every event of the EVENTS stream, from the first, into `LogMetrics`
and serves them on `/metrics` with its own process metrics: counts are exact
after any restart, and any number of these services agree.

    uv run sandhold run metrics --nats URL [--metrics-port 9464]
"""

from __future__ import annotations

import logging

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from sandhold.bus.codec import decode_envelope
from sandhold.bus.follow import Follower
from sandhold.bus.names import Names
from sandhold.bus.service import Shell
from sandhold.domain.envelope import Envelope
from sandhold.telemetry import metrics
from sandhold.telemetry.log_metrics import LogMetrics

log = logging.getLogger("sandhold.metrics")

DEFAULT_PORT = 9464  # the usual port of an OpenTelemetry Prometheus exporter


class MetricsService:
    name = "metrics"

    def __init__(self, nats_url: str, names: Names) -> None:
        self._names = names
        self._shell = Shell(self.name, nats_url, names)
        self.folded = LogMetrics()

    async def run(self) -> None:
        metrics.export_log_metrics(self.folded)
        async with self._shell as shell:
            follower = await follow_log(shell.js, self._names, self.folded)
            shell.on_close(follower.stop)
            log.info(
                "metrics ready on port %s (log folded up to %d)",
                metrics.port,
                self.folded.position,
            )
            await shell.serve()

    async def shutdown(self) -> None:
        self._shell.stop()


async def follow_log(
    js: JetStreamContext, names: Names, folded: LogMetrics, *, timeout: float = 120.0
) -> Follower[Envelope]:
    """Fold every event into `folded`, from the first and then live; returns the
    follower once what the log held at the start is folded."""

    def count(seq: int, _msg: Msg, envelope: Envelope) -> None:
        folded.apply(seq, envelope)

    follower = Follower(
        js, names.events_stream, f"{names.prefix}.ev.>", decode_envelope, count, what="event"
    )
    await follower.start(timeout=timeout)
    return follower
