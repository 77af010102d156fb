"""Bounded concurrency: the limit holds, and the first failure stops the rest."""

from __future__ import annotations

import asyncio

import pytest
from sandhold.saves._bounded import SMALL_BYTES, SMALL_FACTOR, for_each, for_each_sized


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
