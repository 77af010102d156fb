"""Two instances of a service in one test process, on one JetStream: the log
they start from (hosts, running sandboxes) appended as their writers would."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import msgspec
import nats
from nats.aio.msg import Msg
from sandhold.bus import leases
from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore
from sandhold.domain import events as ev
from sandhold.domain import host as host_domain
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import task as tk


async def append(
    nc: nats.NATS, names: Names, kind: str, aggregate_id: str, events: list[ev.AnyEvent]
) -> None:
    evolve: Any = {"host": host_domain.evolve, "task": tk.evolve}.get(kind, sb.evolve)
    store: AggregateStore[Any] = AggregateStore(
        nc.jetstream(), names, kind, evolve, actor="test", follow=False
    )
    cause = uuid.uuid4().hex
    await store.execute(
        aggregate_id,
        lambda _state: events,
        id_base=f"test-{cause}",
        causation_id=cause,
        correlation_id=cause,
    )


async def register_host(nc: nats.NATS, names: Names, host: str, *, capacity: int) -> None:
    registered = ev.HostRegistered(
        host=host, epoch=1, capacity_sandboxes=capacity, memory_bytes=1 << 34
    )
    await append(nc, names, "host", host, [registered])


async def renew_lease(nc: nats.NATS, names: Names, host: str) -> None:
    kv = await leases.lease_bucket(nc.jetstream(), names)
    await leases.renew(kv, leases.Lease(host=host, epoch=1, renewed_at=time.time()))


async def keep_renewing(nc: nats.NATS, names: Names, host: str, every_s: float = 0.3) -> None:
    """A live host-agent's lease, as long as the task runs."""
    while True:
        await renew_lease(nc, names, host)
        await asyncio.sleep(every_s)


async def running_sandbox(nc: nats.NATS, names: Names, key: str, host: str) -> str:
    """A sandbox running on `host` (generation 1), as its log would say."""
    request = rq.CreateSandbox(key=key, tenant="default")
    sandbox_id = rq.sandbox_id_for("default", key)
    events = [
        *sb.decide(None, request),
        ev.SandboxPlaced(host=host, generation=1),
        ev.SandboxStarting(host=host, generation=1),
        ev.SandboxStarted(host=host, generation=1),
    ]
    await append(nc, names, "sandbox", sandbox_id, events)
    return sandbox_id


class Running:
    """Service instances run as tasks of the test; ended however the test ends."""

    def __init__(self) -> None:
        self.tasks: dict[object, asyncio.Task[None]] = {}

    def start(self, service: Any) -> Any:
        run: Coroutine[Any, Any, None] = service.run()
        self.tasks[service] = asyncio.create_task(run)
        return service

    async def stop(self, service: Any) -> None:
        """A graceful stop (SIGTERM): the service gives up what it holds."""
        await service.shutdown()
        task = self.tasks.pop(service)
        await asyncio.wait({task}, timeout=30)
        assert task.done(), f"{service} did not stop within 30 s"
        # One still starting up is interrupted at once (`Shell.stop`): its task
        # ends cancelled, as `run_service` takes it; anything else it raised counts.
        if not task.cancelled():
            task.result()

    async def kill(self, service: Any) -> None:
        """As near a kill -9 as a task gets: it ends without giving anything up."""
        for name in ("duty", "placement"):
            claim = getattr(service, name, None)
            if claim is not None:
                claim._kv = _KeepsItsKey(claim._kv)
        task = self.tasks.pop(service)
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 30)

    async def close(self) -> None:
        for service in list(self.tasks):
            with contextlib.suppress(BaseException):
                await self.stop(service)


class _KeepsItsKey:
    """A claim's bucket whose key outlives its holder, as after a kill -9."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    async def delete(self, *args: Any, **kwargs: Any) -> bool:
        return False


async def readiness(nc: nats.NATS, names: Names) -> list[str]:
    """The services that announced they are ready (what `sandhold up` waits for),
    filled in as announcements arrive: by then a service listens to all it serves."""
    announced: list[str] = []

    async def on_ready(msg: Msg) -> None:
        announced.append(msgspec.json.decode(msg.data)["service"])

    await nc.subscribe(names.ready, cb=on_ready)
    await nc.flush()
    return announced
