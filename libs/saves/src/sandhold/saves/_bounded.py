"""Run an async function over many items with at most `concurrency` in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def for_each(
    items: Iterable[T], fn: Callable[[T], Awaitable[object]], *, concurrency: int
) -> None:
    """Await `fn(item)` for every item, `concurrency` at a time.

    The first failure cancels the rest and is raised as itself (not wrapped in
    an ExceptionGroup), so callers can catch `MissingChunk` and friends.
    Workers share one iterator, so a million items never become a million tasks.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    pending = iter(items)

    async def worker() -> None:
        for item in pending:
            await fn(item)

    workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        raise
