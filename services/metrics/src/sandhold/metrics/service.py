"""The metrics service: the log's facts as Prometheus metrics (decision 015).

It folds every event of the EVENTS stream into `LogMetrics` and serves them on
`/metrics` with its own process metrics: counts are exact after any restart,
and any number of these services agree. With a checkpoint directory it keeps
the fold there (decision 062), so a restart folds only the events after it.

    uv run sandhold run metrics --nats URL [--metrics-port 9464] [--checkpoint-dir DIR]
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from functools import cache
from pathlib import Path

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from sandhold.bus import checkpoint
from sandhold.bus.codec import decode_envelope
from sandhold.bus.follow import Follower
from sandhold.bus.names import Names
from sandhold.bus.service import Shell
from sandhold.bus.store import CHECKPOINT_EVERY_S, CHECKPOINT_MIN_EVENTS
from sandhold.domain.envelope import Envelope
from sandhold.telemetry import log_metrics, metrics
from sandhold.telemetry.log_metrics import LogMetrics

log = logging.getLogger("sandhold.metrics")

DEFAULT_PORT = 9464  # the usual port of an OpenTelemetry Prometheus exporter


class _Kept(msgspec.Struct, kw_only=True):
    version: str  # what folding means: the domain's and the fold's own code
    stream: str
    fold: bytes  # `log_metrics.dump`


@cache
def fold_version() -> str:
    digest = hashlib.sha256(checkpoint.fold_version().encode())
    digest.update(Path(log_metrics.__file__).read_bytes())
    return digest.hexdigest()[:16]


class MetricsService:
    name = "metrics"

    def __init__(self, nats_url: str, names: Names) -> None:
        self._names = names
        self._shell = Shell(self.name, nats_url, names)
        self.folded = LogMetrics()
        kept = os.environ.get(checkpoint.ENV)  # `--checkpoint-dir`
        self._path = Path(kept) / "metrics.checkpoint" if kept else None
        self._written = 0  # the position the last checkpoint covers
        self.from_checkpoint = 0  # where the fold started (0: the first event)

    async def run(self) -> None:
        async with self._shell as shell:
            if self._path is not None:
                await self._load(shell.js, self._path)
            metrics.export_log_metrics(self.folded)
            follower = await follow_log(shell.js, self._names, self.folded)
            shell.on_close(follower.stop)
            if self._path is not None:
                shell.spawn(self._keep_checkpointing(), "checkpoints")
                shell.on_close(self.checkpoint)
            log.info(
                "metrics ready on port %s (log folded up to %d, from %d)",
                metrics.port,
                self.folded.position,
                self.from_checkpoint,
            )
            await shell.serve()

    async def shutdown(self) -> None:
        self._shell.stop()

    # --- the checkpoint (decision 062) -------------------------------------------

    async def _load(self, js: JetStreamContext, path: Path) -> None:
        folded = await load_fold(js, self._names, path)
        if folded is not None:
            self.folded = folded
            self._written = self.from_checkpoint = folded.position

    async def checkpoint(self) -> int:
        """Write the fold now if it moved since the last one; the bytes written."""
        if self._path is None or self.folded.position <= self._written:
            return 0
        position = self.folded.position
        # Encoded here, on the loop, in one go (the fold changes between events);
        # written in a thread.
        data = msgspec.msgpack.encode(
            _Kept(
                version=fold_version(),
                stream=self._names.events_stream,
                fold=log_metrics.dump(self.folded),
            )
        )
        written = await asyncio.to_thread(checkpoint.write_atomically, self._path, data)
        self._written = position
        return written

    async def _keep_checkpointing(self) -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_EVERY_S)
            if self.folded.position - self._written < CHECKPOINT_MIN_EVENTS:
                continue
            started = time.monotonic()
            try:
                size = await self.checkpoint()
            except Exception:  # a full disk must not stop the service: it folds more
                log.exception("checkpoint not written")
                continue
            log.info("checkpoint: %d bytes in %.2fs", size, time.monotonic() - started)


async def load_fold(js: JetStreamContext, names: Names, path: Path) -> LogMetrics | None:
    """The fold a good checkpoint holds: written by this code, for this stream,
    whose last event the log still holds; None (fold from zero, as ever) if
    there is none or it is not believed. The service's start and `sandhold top`."""
    try:
        kept = msgspec.msgpack.decode(path.read_bytes(), type=_Kept)
        if kept.version != fold_version() or kept.stream != names.events_stream:
            raise ValueError("written by other code, or for another stream")
        folded = log_metrics.load(kept.fold)
        if folded.position and (
            why := await checkpoint.log_disowns(
                js, names.events_stream, folded.position, folded.last_event_id
            )
        ):
            raise ValueError(why)
    except FileNotFoundError:
        return None
    except Exception as err:  # noqa: BLE001 - not believed: folded from zero
        log.warning("%s: %s: folding from zero", path, err)
        return None
    return folded


PACE_S = 1.0


async def follow_log(
    js: JetStreamContext, names: Names, folded: LogMetrics, *, timeout: float = 120.0
) -> Follower[Envelope]:
    """Fold every event into `folded` after what it holds, then live; returns
    the follower once what the log held at the start is folded."""

    def count(seq: int, _msg: Msg, envelope: Envelope) -> None:
        folded.apply(seq, envelope)

    follower = Follower(
        js,
        names.events_stream,
        f"{names.prefix}.ev.>",
        decode_envelope,
        count,
        start_seq=folded.position + 1,
        what="event",
        # Scraped every few seconds: what came in the last second is folded at
        # once, not event by event on the cores the exec path runs on (087).
        pace_s=PACE_S,
        bulk=True,  # a first start folds the whole log
    )
    await follower.start(timeout=timeout)
    return follower
