"""Two schedulers on one log: requests shared, each host filled to its capacity
and no further, placement carried on by the twin of one that died."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import nats
from sandhold.bus.names import Names
from sandhold.client import connect
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.scheduler.service import Scheduler

from tests.support.waiting import wait_until
from tests.twins.support import Running, append, keep_renewing, readiness, register_host

CLAIM_TTL = 1.0


class _AnyOrder(set):
    """The sandboxes a reconcile pass takes in an order of its own: two scheduler
    processes (two hash seeds) do not take a backlog in the same order."""

    def pop(self):
        item = random.choice(list(self))
        self.discard(item)
        return item


async def _twins(nc: nats.NATS, nats_url: str, names: Names, running: Running) -> list[Scheduler]:
    announced = await readiness(nc, names)
    twins = [
        Scheduler(nats_url, names, instance=f"scheduler-{i}", claim_ttl=CLAIM_TTL) for i in (1, 2)
    ]
    for scheduler in twins:
        scheduler._dirty_loop._dirty = _AnyOrder()
        running.start(scheduler)
    await wait_until(
        lambda: (
            announced.count("scheduler") == 2  # both take requests off the queue
            and [s.placement.held() for s in twins].count(True) == 1
        ),
        timeout=30,
        what="both schedulers ready, one of them placing",
    )
    return twins


def _hosts_of(scheduler: Scheduler, ids: list[str]) -> dict[str | None, int]:
    count: dict[str | None, int] = {}
    for sandbox_id in ids:
        state, _ = scheduler.sandboxes.get(sandbox_id)
        assert state is not None
        count[state.host] = count.get(state.host, 0) + 1
    return count


async def test_two_schedulers_answer_each_request_and_fill_a_host_only_to_its_capacity(
    nc: nats.NATS, nats_url: str, names: Names
):
    running = Running()
    renewals = [asyncio.create_task(keep_renewing(nc, names, h)) for h in ("h1", "h2")]
    client = await connect(nats_url, prefix=names.prefix)
    try:
        # A backlog (created while no scheduler ran), then a burst of requests:
        # both schedulers take requests off the queue, and both reconcile every
        # sandbox, the backlog's at once when they start.
        backlog = []
        for i in range(4):
            request = rq.CreateSandbox(key=f"backlog-{i}", tenant="default")
            backlog.append(rq.sandbox_id_for("default", request.key))
            await append(nc, names, "sandbox", backlog[-1], sb.decide(None, request))
        await register_host(nc, names, "h1", capacity=3)
        twins = await _twins(nc, nats_url, names, running)
        views = await asyncio.gather(*(client.create_sandbox(key=f"burst-{i}") for i in range(4)))
        ids = [*backlog, *(v.id for v in views)]
        assert len(set(ids)) == 8
        one = twins[0]

        def placed() -> int:
            return sum(1 for i in ids if (one.sandboxes.get(i)[0] or sb_none).host is not None)

        await wait_until(lambda: placed() >= 3, timeout=20, what="h1 full")
        await one.sandboxes.catch_up()
        assert _hosts_of(one, ids) == {"h1": 3, None: 5}
        # Room appears elsewhere: the other five go there, none to h1.
        await register_host(nc, names, "h2", capacity=5)
        await wait_until(lambda: placed() == 8, timeout=20, what="all placed")
        for scheduler in twins:
            await scheduler.sandboxes.catch_up()
            assert _hosts_of(scheduler, ids) == {"h1": 3, "h2": 5}
    finally:
        await client.close()
        await running.close()
        for task in renewals:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_the_twin_of_a_placing_scheduler_that_died_places_after_the_claim_ttl(
    nc: nats.NATS, nats_url: str, names: Names
):
    running = Running()
    renewal = asyncio.create_task(keep_renewing(nc, names, "h1"))
    client = await connect(nats_url, prefix=names.prefix)
    try:
        await register_host(nc, names, "h1", capacity=4)
        twins = await _twins(nc, nats_url, names, running)
        placer = next(s for s in twins if s.placement.held())
        twin = next(s for s in twins if s is not placer)
        first = await client.create_sandbox(key="before")
        await wait_until(
            lambda: (twin.sandboxes.get(first.id)[0] or sb_none).host == "h1",
            timeout=20,
            what="placed while both run",
        )
        held_until = placer.placement.held_until  # by this process's clock, as the twin's
        await running.kill(placer)  # no release: its claim runs out
        after = await client.create_sandbox(key="after")  # answered by the twin
        took_over = await wait_until(
            lambda: twin.placement.held() and time.monotonic(),
            timeout=CLAIM_TTL * 5 + 10,
            interval=0.005,
            what="the twin holding the claim",
        )
        # Not before the dead one's hold ran out: it might only have been paused.
        assert took_over >= held_until
        await wait_until(
            lambda: (twin.sandboxes.get(after.id)[0] or sb_none).host == "h1",
            timeout=CLAIM_TTL * 5 + 10,
            what="placed by the twin",
        )
        assert twin.placement.held()
    finally:
        await client.close()
        await running.close()
        renewal.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewal


class _NoSandbox:
    host = None


sb_none: sb.Sandbox = _NoSandbox()  # type: ignore[assignment]
