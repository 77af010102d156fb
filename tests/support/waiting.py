"""Waiting for something to become true, with a deadline (never a fixed sleep)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


async def wait_until(
    predicate: Callable[[], Any],
    *,
    timeout: float = 20.0,
    interval: float = 0.02,
    what: str = "",
) -> Any:
    """Poll `predicate` (sync or async) until truthy and return its value; fail
    naming `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(interval)


class Readiness:
    """The services' readiness announcements (`<prefix>.svc.ready`), as they come:
    what a test waits for instead of sleeping while a service starts up."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self._sub: Any = None

    async def listen(self, nc: Any, names: Any) -> Readiness:
        import msgspec

        async def on_ready(msg: Any) -> None:
            self.seen.append(msgspec.json.decode(msg.data))

        self._sub = await nc.subscribe(names.ready, cb=on_ready)
        await nc.flush()
        return self

    async def wait_for(self, service: str, pid: int, *, timeout: float = 60.0) -> None:
        """Until the process `pid` of `service` said it is serving."""

        def said() -> bool:
            return any(r.get("service") == service and r.get("pid") == pid for r in self.seen)

        await wait_until(said, timeout=timeout, what=f"{service} (pid {pid}) ready")

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
