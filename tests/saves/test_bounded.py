"""Bounded concurrency: the limit holds, and the first failure stops the rest."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sandhold.saves._bounded import (
    SMALL_BYTES,
    SMALL_FACTOR,
    all_or_none,
    for_each,
    for_each_sized,
)


async def test_at_most_concurrency_in_flight() -> None:
    in_flight = peak = 0

    async def work(_: int) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0)
        in_flight -= 1

    await for_each(range(100), work, concurrency=7)
    assert peak == 7


async def test_first_failure_is_raised_as_itself_and_the_rest_cancelled() -> None:
    started: list[int] = []
    blocked = asyncio.Event()

    async def work(item: int) -> None:
        started.append(item)
        if item == 3:
            raise KeyError(item)
        await blocked.wait()  # never set: only cancellation ends these

    with pytest.raises(KeyError):
        await for_each(range(1000), work, concurrency=4)
    assert len(started) < 10


async def test_large_items_keep_to_the_limit_small_ones_do_not() -> None:
    in_flight = {"large": 0, "small": 0}
    peak = {"large": 0, "small": 0}
    release = asyncio.Event()

    async def work(kind: str) -> None:
        in_flight[kind] += 1
        peak[kind] = max(peak[kind], in_flight[kind])
        if in_flight["large"] == 4 and in_flight["small"] == 4 * SMALL_FACTOR:
            release.set()  # both groups full at once
        await release.wait()
        in_flight[kind] -= 1

    items = [("large", SMALL_BYTES)] * 50 + [("small", 10)] * 50
    await asyncio.wait_for(for_each_sized(items, work, concurrency=4), timeout=10)
    assert peak == {"large": 4, "small": 4 * SMALL_FACTOR}


async def _swallows_one_cancel(waiting: asyncio.Event, never: asyncio.Event) -> None:
    """As Python 3.11's `wait_for` does when what it waited for finished at the
    moment of the cancellation: the task goes on, here to a wait for a sibling
    that is gone (a sender for its feeder's next chunk)."""
    waiting.set()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(3600)
    await never.wait()


async def test_cancelled_it_ends_even_if_a_task_swallowed_its_cancellation() -> None:
    waiting, never = asyncio.Event(), asyncio.Event()
    running = asyncio.create_task(all_or_none([_swallows_one_cancel(waiting, never), never.wait()]))
    await asyncio.wait_for(waiting.wait(), 10)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(running, 10)  # a TimeoutError here: it waited for ever


async def test_a_failure_ends_it_even_if_a_task_swallowed_its_cancellation() -> None:
    waiting, never = asyncio.Event(), asyncio.Event()

    async def fails() -> None:
        await waiting.wait()
        raise KeyError("first")

    with pytest.raises(KeyError):
        await asyncio.wait_for(all_or_none([_swallows_one_cancel(waiting, never), fails()]), 10)
