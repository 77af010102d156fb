"""Progress of long saves and restores: a bar on stderr when it is a terminal,
nothing otherwise (scripts and logs get the result line alone). The bar is
erased before the result is printed."""

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
        self.drawn = False

    def show(self, operation: str, done: int, total: int) -> None:
        fraction = done / total if total else 1.0
        text = f"{operation} {done / _MiB:.1f}/{total / _MiB:.1f} MiB"
        if not self.tty:
            return
        filled = int(fraction * 30)
        sys.stderr.write(f"\r[{'#' * filled}{' ' * (30 - filled)}] {fraction:4.0%} {text}\x1b[K")
        sys.stderr.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\r\x1b[K")  # the result line that follows starts clean
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
