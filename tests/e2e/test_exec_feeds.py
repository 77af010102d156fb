"""Execs on a sandbox share one live follower of its events (decision 089).

The tests make the log's slow path fail: an exec that did not hear its
command's end live reads the sandbox's state after 2 s (`_wait_for_end`), and
here that raises, so a missed end fails the test instead of slowing it.
"""

from __future__ import annotations

import asyncio

import pytest
from sandhold.client import Client, connect
from sandhold.client import client as client_module
from sandhold.client import feeds as feeds_module
from sandhold.domain.errors import InfraError
from sandhold.domain.requests import command_id_for

from tests.e2e.conftest import running_sandbox
from tests.e2e.harness import Up
from tests.support.waiting import wait_until


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[feeds_module.Feed]:
    """Every feed made, in order."""
    feeds: list[feeds_module.Feed] = []

    class Counted(feeds_module.Feed):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            feeds.append(self)

    monkeypatch.setattr(feeds_module, "Feed", Counted)
    return feeds


def live_only(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_log_reads(*_: object) -> None:
        raise AssertionError("an exec read the log: it missed its command's end live")

    monkeypatch.setattr(client, "sandbox_state", no_log_reads)
    # A command's end heard live in 2 s on a quiet machine may take longer on
    # a loaded one: only an end never heard live is what these tests catch.
    monkeypatch.setattr(client_module, "LOG_CHECK_S", 30.0)


async def test_execs_one_after_another_share_one_follower_stopped_once_idle(
    client: Client, made: list[feeds_module.Feed], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(feeds_module, "IDLE_S", 1.0)
    sandbox_id = await running_sandbox(client)
    live_only(client, monkeypatch)
    for n in range(3):
        result = await client.exec(sandbox_id, ["sh", "-c", f"echo {n}; exit {n}"])
        assert (result.command.exit_code, result.stdout) == (n, f"{n}\n".encode())
    assert len(made) == 1  # one consumer of the sandbox's events for all three
    first = made[0]
    await wait_until(lambda: len(client._feeds) == 0, timeout=10, what="the idle feed gone")
    await wait_until(
        lambda: first.follower is not None and first.follower._sub is None,
        timeout=10,
        what="its consumer unsubscribed",
    )
    # The next exec makes a new one, positioned after everything before.
    result = await client.exec(sandbox_id, ["sh", "-c", "exit 7"])
    assert result.command.exit_code == 7
    assert len(made) == 2


async def test_execs_at_once_on_one_sandbox_each_hear_their_own_end(
    client: Client, made: list[feeds_module.Feed], monkeypatch: pytest.MonkeyPatch
) -> None:
    sandbox_id = await running_sandbox(client)
    live_only(client, monkeypatch)
    scripts = [f"exit {n}" if n % 2 else f"sleep 0.{n}; exit {n}" for n in range(1, 7)]
    results = await asyncio.gather(*(client.exec(sandbox_id, ["sh", "-c", s]) for s in scripts))
    assert [r.command.exit_code for r in results] == [1, 2, 3, 4, 5, 6]
    assert len(made) == 1


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Feeds read their position only once the event is set."""
    gate = asyncio.Event()
    read = feeds_module.stream_last_sequence

    async def held(*args: object, **kwargs: object) -> int:
        await gate.wait()
        return await read(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(feeds_module, "stream_last_sequence", held)
    return gate


async def test_an_exec_cancelled_while_the_feed_starts_leaves_the_others_theirs(
    client: Client,
    made: list[feeds_module.Feed],
    gated: asyncio.Event,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sandbox_id = await running_sandbox(client)
    live_only(client, monkeypatch)
    first = asyncio.create_task(client.exec(sandbox_id, ["sh", "-c", "exit 1"]))
    second = asyncio.create_task(client.exec(sandbox_id, ["sh", "-c", "exit 2"]))
    await wait_until(lambda: len(made) == 1 and made[0].holders == 2, what="both on the feed")
    first.cancel()  # while both wait for the feed's position
    with pytest.raises(asyncio.CancelledError):
        await first
    gated.set()
    assert (await second).command.exit_code == 2
    assert len(made) == 1


async def test_closing_the_client_stops_its_feeds_and_ends_the_execs_waiting(
    client: Client,
    made: list[feeds_module.Feed],
    gated: asyncio.Event,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(feeds_module, "FRESH_S", -1.0)  # every feed reads its position
    sandbox_id = await running_sandbox(client)
    gated.set()
    running = asyncio.create_task(client.exec(sandbox_id, ["sleep", "30"]))
    await wait_until(
        lambda: len(made) == 1 and made[0].positioned.done(), what="the first feed positioned"
    )
    other = await running_sandbox(client)
    gated.clear()
    positioning = asyncio.create_task(client.exec(other, ["true"]))
    await wait_until(lambda: len(made) == 2, what="a second feed, not positioned yet")
    async with asyncio.timeout(10):
        await client.close()
    # Every feed stopped, its consumer gone; nothing left to stop.
    assert len(client._feeds) == 0 and not client._feeds._stopping
    assert all(feed.following.done() for feed in made)
    assert made[0].follower is not None and made[0].follower._sub is None
    # The exec waiting for a position is told the client closed, at once.
    with pytest.raises(InfraError, match="closed"):
        async with asyncio.timeout(5):
            await positioning
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever a closed connection says
        async with asyncio.timeout(30):
            await running
    with pytest.raises(InfraError, match="closed"):
        await client.exec(sandbox_id, ["true"])


@pytest.fixture
def position_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The stream positions feeds read, in order."""
    reads: list[int] = []
    read = feeds_module.stream_last_sequence

    async def counted(*args: object, **kwargs: object) -> int:
        reads.append(await read(*args, **kwargs))  # type: ignore[arg-type]
        return reads[-1]

    monkeypatch.setattr(feeds_module, "stream_last_sequence", counted)
    return reads


@pytest.mark.parametrize("learned", ["moments ago", "too long ago"])
async def test_a_new_feed_starts_after_what_the_client_learned_unless_that_is_old(
    client: Client,
    made: list[feeds_module.Feed],
    position_reads: list[int],
    monkeypatch: pytest.MonkeyPatch,
    learned: str,
) -> None:
    first, second = await running_sandbox(client), await running_sandbox(client)
    live_only(client, monkeypatch)
    assert (await client.exec(first, ["sh", "-c", "exit 3"])).command.exit_code == 3
    assert len(position_reads) == 1
    # The first feed delivered its command's events, after the position it read.
    delivered = made[0].follower.position if made[0].follower is not None else 0
    assert delivered > position_reads[0]
    # (a loaded machine's seconds do not make "moments ago" old)
    monkeypatch.setattr(feeds_module, "FRESH_S", 60.0 if learned == "moments ago" else -1.0)
    assert (await client.exec(second, ["sh", "-c", "exit 4"])).command.exit_code == 4
    if learned == "moments ago":  # the second feed starts there, read from nowhere
        assert len(position_reads) == 1
        # (a save of the first sandbox since may have taught it a later one)
        assert made[1].positioned.result() >= delivered
    else:
        assert len(position_reads) == 2
        assert made[1].positioned.result() == position_reads[1]


async def test_an_exec_positioned_at_once_sends_nothing_once_the_client_closes(
    client: Client,
    up: Up,
    made: list[feeds_module.Feed],
    position_reads: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(feeds_module, "FRESH_S", 60.0)
    first, second = await running_sandbox(client), await running_sandbox(client)
    await client.exec(first, ["true"])  # the client learns a recent sequence
    # The first feed is slow to stop: the close waits for it (up to STOP_S,
    # made longer than any wait here) with the connection still open.
    monkeypatch.setattr(feeds_module, "STOP_S", 60.0)
    stopped = asyncio.Event()
    stop = made[0].stop

    async def slow_stop() -> None:
        await stopped.wait()
        await stop()

    monkeypatch.setattr(made[0], "stop", slow_stop)
    # The next exec is held after its feed is made (positioned at once, 099)
    # and before it sends its request, until the client is closing.
    gate = asyncio.Event()
    subscribe = client.nc.subscribe

    async def held(*args: object, **kwargs: object) -> object:
        await gate.wait()
        return await subscribe(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(client.nc, "subscribe", held)
    running = asyncio.create_task(client.exec(second, ["true"], key="after-close"))
    await wait_until(
        lambda: len(made) == 2 and made[1].positioned.done(), what="a feed positioned at once"
    )
    assert len(position_reads) == 1  # (the first feed's only: the second read nothing)
    closing = asyncio.create_task(client.close())
    try:
        await wait_until(lambda: client._feeds.closed, what="the client closing")
        gate.set()
        with pytest.raises(InfraError, match="the client is closed") as raised:
            async with asyncio.timeout(5):
                await running
        assert raised.value.retryable is False
    finally:
        stopped.set()
        gate.set()
    await closing
    async with await connect(up.url) as other:  # and the command was never asked for
        state = await other.sandbox_state(second)
    assert state is not None
    assert command_id_for(second, "after-close") not in state.commands
