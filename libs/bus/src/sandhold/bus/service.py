"""What every service shell shares: connecting, readiness, signals, uvloop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from typing import Protocol

import msgspec
import nats
from nats.aio.client import Client as NATS
from sandhold.bus.names import Names
from sandhold.telemetry import metrics, setup

log = logging.getLogger(__name__)


class Service(Protocol):
    name: str

    async def run(self) -> None: ...

    async def shutdown(self) -> None: ...


async def connect(url: str | list[str], *, name: str) -> NATS:
    servers = url if isinstance(url, list) else url.split(",")
    return await nats.connect(
        servers=servers,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        allow_reconnect=True,
    )


async def announce_ready(nc: NATS, names: Names, service: str, **extra: object) -> None:
    """Tell `sandhold up` (or anyone listening) that this service is serving."""
    if metrics.port is not None:
        extra = {"metrics_port": metrics.port, **extra}
    body = msgspec.json.encode({"service": service, "pid": os.getpid(), **extra})
    await nc.publish(names.ready, body)
    await nc.flush()


def common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats",
        default=os.environ.get("SANDHOLD_NATS_URL"),
        required=False,
        help="NATS server URL(s), comma separated",
    )
    parser.add_argument(
        "--prefix",
        default=os.environ.get("SANDHOLD_PREFIX", "sh"),
        help="subject and stream prefix (default sh)",
    )
    parser.add_argument("--replicas", type=int, default=1, help="stream replicas (3 on a cluster)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=_env_int("SANDHOLD_METRICS_PORT"),
        help="serve this process's Prometheus /metrics on this port (0: any free one)",
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def run_service(
    make: Callable[[argparse.Namespace], Service],
    parser: argparse.ArgumentParser,
    argv: list[str] | None = None,
) -> None:
    """Parse arguments, then run the service on uvloop until SIGTERM/SIGINT."""
    args = parser.parse_args(argv)
    if not args.nats:
        parser.error("--nats URL (or SANDHOLD_NATS_URL) is required")
    # Logs, traces and metrics, named after the service (`sandhold run <service>`).
    setup(parser.prog.rsplit(" ", 1)[-1], metrics_port=args.metrics_port)
    import uvloop

    async def main() -> None:
        service = make(args)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(service.shutdown()))
        await service.run()

    uvloop.run(main())


async def close_quickly(nc: NATS, *stores: object) -> None:
    """Unsubscribe the stores' consumers, flush what we published, then close.

    Not `drain()`: draining an ordered consumer can make nats-py try to recreate
    it against a connection that no longer takes requests, which stalls shutdown.
    """
    for store in stores:
        stop = getattr(store, "stop", None)
        if stop is not None:
            with contextlib.suppress(Exception):
                await stop()
    with contextlib.suppress(Exception):
        await nc.flush(timeout=2)
    await nc.close()
