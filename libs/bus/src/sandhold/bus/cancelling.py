"""Cancelling tasks so that they end.

On Python 3.11 `asyncio.wait_for` returns its result, and swallows the
cancellation, when the cancellation arrives in the loop iteration in which
what it waited for finished. nats-py waits so for every request (a publish's
ack, a pull's messages), so a task cancelled once may carry on to its next
wait, which may be for a sibling already gone (a sender for the next chunk of
a cancelled feeder): awaited, it never ends. A save's store hung so in the
suite. Cancelling again until each task has ended is what ends them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

# How long a cancelled task is given before it is cancelled again.
AGAIN_S = 0.1


async def cancel_and_wait(
    tasks: Iterable[asyncio.Future[Any]], *, timeout: float | None = None
) -> bool:
    """Cancel the tasks, and again every `AGAIN_S`, until each has ended; False
    if some had not when `timeout` passed. Cancelled itself meanwhile, it goes
    on until they have ended (or the timeout), then raises the cancellation:
    a caller's tasks never outlive the caller's stop unseen."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    pending = {task for task in tasks if not task.done()}
    interrupted: asyncio.CancelledError | None = None
    while pending:
        left = AGAIN_S if deadline is None else min(AGAIN_S, deadline - loop.time())
        if left <= 0:
            break
        for task in pending:
            task.cancel()
        try:
            _, pending = await asyncio.wait(pending, timeout=left)
        except asyncio.CancelledError as err:
            interrupted = err
    for task in tasks:  # retrieved: no "exception was never retrieved" at exit
        if task.done() and not task.cancelled():
            task.exception()
    if interrupted is not None:
        raise interrupted
    return not pending


async def finish(work: Awaitable[T]) -> T:
    """Run `work` to its end whatever cancellations come meanwhile, then raise
    the first of them: for what must not be left half-done by a task being
    ended, as `cancel_and_wait` cancels again and again (a frozen sandbox's
    thaw: a frozen process cannot even be killed)."""
    task = asyncio.ensure_future(work)
    interrupted: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as err:
            if task.done():
                break  # (the work itself was cancelled: said below)
            interrupted = interrupted or err
    result = task.result()  # raises the work's own error, or its cancellation
    if interrupted is not None:
        raise interrupted
    return result
