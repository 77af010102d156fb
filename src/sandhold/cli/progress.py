"""Progress of long saves and restores: a bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator

import msgspec
from nats.aio.msg import Msg
from sandhold.client import Client

_MiB = 1024 * 1024


class _Render:
    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last_tenth = -1
        self.drawn = False

    def show(self, operation: str, done: int, total: int) -> None:
        fraction = done / total if total else 1.0
        text = f"{operation} {done / _MiB:.1f}/{total / _MiB:.1f} MiB"
        if self.tty:
            filled = int(fraction * 30)
            sys.stderr.write(f"\r[{'#' * filled}{' ' * (30 - filled)}] {fraction:4.0%} {text}")
            self.drawn = True
        elif int(fraction * 10) != self.last_tenth:
            self.last_tenth = int(fraction * 10)
            sys.stderr.write(f"{fraction:.0%} {text}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


@contextlib.asynccontextmanager
async def progress(client: Client, sandbox_id: str) -> AsyncIterator[None]:
    """Show the progress host-agents publish for this sandbox while the body runs."""
    render = _Render()

    async def on_progress(msg: Msg) -> None:
        body = msgspec.json.decode(msg.data)
        render.show(body["operation"], body["done_bytes"], body["total_bytes"])

    subject = f"{client.names.prefix}.progress.{sandbox_id}.*"
    sub = await client.nc.subscribe(subject, cb=on_progress)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        render.close()
