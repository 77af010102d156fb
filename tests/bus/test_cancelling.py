"""Cancelling tasks so that they end, also those that swallow a cancellation
(as Python 3.11's `wait_for` does in nats-py's requests: see `cancelling`)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sandhold.bus.cancelling import AGAIN_S, cancel_and_wait, finish
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


async def test_what_is_finished_runs_to_its_end_through_repeated_cancels() -> None:
    """`finish`: as a save's thaw under `cancel_and_wait`, which cancels every
    AGAIN_S; the work ends, then the task's cancellation is raised."""
    release = asyncio.Event()
    done: list[str] = []

    async def thaw() -> None:
        await release.wait()
        done.append("thawed")

    async def save() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await finish(thaw())

    task = asyncio.create_task(save())
    await asyncio.sleep(0)
    ending = asyncio.create_task(cancel_and_wait([task], timeout=10))
    await asyncio.sleep(3 * AGAIN_S)  # cancelled again meanwhile, more than once
    assert not task.done() and done == []
    release.set()
    assert await asyncio.wait_for(ending, 10) is True
    assert done == ["thawed"] and task.cancelled()


async def test_what_is_finished_returns_its_result_and_raises_its_own_error() -> None:
    async def value() -> int:
        await asyncio.sleep(0)
        return 7

    async def broken() -> None:
        await asyncio.sleep(0)
        raise ValueError("its own")

    assert await finish(value()) == 7
    with pytest.raises(ValueError, match="its own"):
        await finish(broken())
