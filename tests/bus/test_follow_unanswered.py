"""A follower that starts while the server does not answer says so, rather than
wait its minute unheard, and catches up once it answers. A real server, stopped
with SIGSTOP."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg
from sandhold.bus import follow
from sandhold.bus.codec import decode_envelope
from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore
from sandhold.domain import sandbox as sb
from sandhold.domain.envelope import Envelope

from tests.support.bus import not_answering, own_server, waiting_unanswered
from tests.support.waiting import wait_until
from tests.twins.support import running_sandbox


async def test_a_store_started_while_the_server_does_not_answer_says_so_then_catches_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    names = Names("sh")
    async with own_server(tmp_path / "nats", names) as (server, conn):
        ids = [await running_sandbox(conn, names, f"sb-{i}", "h1") for i in range(3)]
        store = AggregateStore(conn.jetstream(), names, "sandbox", sb.evolve, actor="test")
        async with not_answering(server):
            starting = await waiting_unanswered(
                store.start(), caplog, "sandhold.bus.follow", "the follower's start saying so"
            )
            assert f"following sandbox event on {names.events_stream}: no answer" in caplog.text
        try:
            await asyncio.wait_for(starting, 60)
            assert sorted(store.ids()) == sorted(ids)
        finally:
            await store.stop()


async def test_a_follower_waiting_for_messages_says_how_far_it_got(
    nc: nats.NATS, names: Names, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(follow, "SAY_AFTER_S", 0.2)
    first = await running_sandbox(nc, names, "sb-first", "h1")
    subjects = names.events("sandbox", ">")
    last = await follow.last_sequence(nc.jetstream(), names.events_stream, subjects)
    handled: list[str] = []

    def keep(_seq: int, _msg: Msg, envelope: Envelope) -> None:
        handled.append(envelope.aggregate_id)

    follower = follow.Follower(
        nc.jetstream(), names.events_stream, subjects, decode_envelope, keep,
        start_seq=last + 1, what="test event",
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="sandhold.bus.follow"):
        # Waiting for four events not appended yet: nothing comes for a while.
        starting = asyncio.create_task(follower.start(target=last + 4, timeout=60))
        try:
            await wait_until(lambda: "nothing received" in caplog.text, timeout=30, what="said")
            assert f"at {last} of {last + 4} after 0 s, nothing received" in caplog.text
            assert not starting.done()
            second = await running_sandbox(nc, names, "sb-second", "h1")  # (four events)
            await asyncio.wait_for(starting, 30)
            assert handled == [second] * 4 and first not in handled
        finally:
            await follower.stop()
            starting.cancel()
