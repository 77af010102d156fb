"""The reconcile loop: what is marked now goes before what a sweep marked for later."""

from __future__ import annotations

import asyncio
import contextlib

from sandhold.bus.reconciler import DirtyLoop


async def test_an_id_marked_now_is_handled_before_the_ones_marked_for_later() -> None:
    handled: list[str] = []
    done = asyncio.Event()

    async def handle(aggregate_id: str) -> None:
        handled.append(aggregate_id)
        if len(handled) == 1:
            asyncio.get_running_loop().call_soon(loop.mark, "urgent")  # arrives mid-sweep
        if len(handled) == 11:
            done.set()

    loop = DirtyLoop(handle, what="testing")
    for i in range(10):
        loop.mark(f"waiting-{i}", later=True)
    loop.mark("waiting-3")  # marked both ways: handled once, as marked now
    running = asyncio.create_task(loop.run())
    try:
        await asyncio.wait_for(done.wait(), 5)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    assert handled[0] == "waiting-3" and handled[1] == "urgent"
    assert sorted(handled[2:]) == sorted(f"waiting-{i}" for i in range(10) if i != 3)
