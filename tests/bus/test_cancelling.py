"""Cancelling tasks so that they end, also those that swallow a cancellation
(as Python 3.11's `wait_for` does in nats-py's requests: see `cancelling`)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sandhold.bus.cancelling import AGAIN_S, cancel_and_wait
from sandhold.bus.electing import patiently


async def _swallows_one(started: asyncio.Event, never: asyncio.Event) -> None:
    started.set()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(3600)
    await never.wait()  # a sibling's work that will not come


async def test_a_task_that_swallowed_its_cancellation_is_cancelled_again() -> None:
    started, never = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(_swallows_one(started, never))
    plain = asyncio.create_task(never.wait())
    await started.wait()
    assert await asyncio.wait_for(cancel_and_wait([task, plain]), 10) is True
    assert task.cancelled() and plain.cancelled()


async def test_one_that_never_ends_is_given_up_on_at_the_timeout() -> None:
    stop = False

    async def stubborn() -> None:
        while not stop:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    try:
        assert await asyncio.wait_for(cancel_and_wait([task], timeout=3 * AGAIN_S), 10) is False
        assert not task.done()
    finally:
        stop = True
        task.cancel()
        await task


async def test_cancelled_itself_it_still_sees_them_end_then_raises() -> None:
    started, never = asyncio.Event(), asyncio.Event()
    child = asyncio.create_task(_swallows_one(started, never))
    await started.wait()
    waiting = asyncio.create_task(cancel_and_wait([child]))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 10)
    assert child.cancelled()


async def test_a_failed_task_is_waited_for_and_its_error_retrieved() -> None:
    async def fails() -> None:
        raise KeyError("x")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task]) is True
    assert isinstance(task.exception(), KeyError)


async def test_patiently_never_swallows_a_cancellation_that_comes_with_the_answer() -> None:
    """The answer and the cancel in one loop iteration: `wait_for` (3.11) would
    return the answer and drop the cancel; the attempt's timeout must not."""
    answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def call() -> int:
        return await answer

    asking = asyncio.create_task(patiently(call, attempt_s=5.0))
    await asyncio.sleep(0)  # it waits for the answer
    answer.set_result(1)
    asking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asking, 10)
