"""Run an async function over many items with a bounded number in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from sandhold.bus.cancelling import cancel_and_wait

T = TypeVar("T")

# Small chunks cost a round trip each, not memory: they get more in flight.
SMALL_BYTES = 64 * 1024
SMALL_FACTOR = 8


async def for_each(
    items: Iterable[T], fn: Callable[[T], Awaitable[object]], *, concurrency: int
) -> None:
    """Await `fn(item)` for every item, `concurrency` at a time.

    The first failure cancels the rest and is raised as itself (not wrapped in
    an ExceptionGroup), so callers can catch `MissingChunk` and friends.
    Workers share one iterator, so a million items never become a million tasks.
    """
    await _run([(iter(items), concurrency)], fn)


async def for_each_sized(
    items: Iterable[tuple[T, int]],
    fn: Callable[[T], Awaitable[object]],
    *,
    concurrency: int,
) -> None:
    """`for_each` over (item, size) pairs: `concurrency` items of `SMALL_BYTES` or
    more in flight (that bounds memory) and, beside them, `concurrency *
    SMALL_FACTOR` smaller ones, so many small files do not wait on round trips."""
    large: list[T] = []
    small: list[T] = []
    for item, size in items:
        (small if size < SMALL_BYTES else large).append(item)
    await _run([(iter(large), concurrency), (iter(small), concurrency * SMALL_FACTOR)], fn)


async def _run(groups: list[tuple[Iterator[T], int]], fn: Callable[[T], Awaitable[object]]) -> None:
    if any(count < 1 for _, count in groups):
        raise ValueError("concurrency must be at least 1")

    async def worker(pending: Iterator[T]) -> None:
        for item in pending:
            await fn(item)

    await all_or_none([worker(it) for it, count in groups for _ in range(count)])


async def all_or_none(coros: Sequence[Coroutine[Any, Any, object]]) -> None:
    """Run them together; the first failure cancels the others and is raised as
    itself. Cancelled, it cancels them and ends once they all have (cancelled
    again and again where need be: `cancel_and_wait`)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return  # (asyncio.wait refuses an empty set)
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        await cancel_and_wait(tasks)
        raise
    for task in tasks:
        if task.done() and not task.cancelled() and (error := task.exception()) is not None:
            await cancel_and_wait(tasks)
            raise error
    for task in tasks:
        task.result()  # (one cancelled by someone else: as gather, raised here)
