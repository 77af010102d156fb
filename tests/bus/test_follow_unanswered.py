"""A follower that starts while the server does not answer says so, rather than
wait its minute unheard, and catches up once it answers. A real server, stopped
with SIGSTOP."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg
from sandhold.bus import follow
from sandhold.bus.codec import decode_envelope
from sandhold.bus.names import Names
from sandhold.bus.server import NatsServer
from sandhold.bus.store import AggregateStore
from sandhold.domain import sandbox as sb
from sandhold.domain.envelope import Envelope

from tests.support.bus import make_streams
from tests.support.procs import stopped
from tests.support.waiting import wait_until
from tests.twins.support import running_sandbox


async def test_a_store_started_while_the_server_does_not_answer_says_so_then_catches_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    names = Names("sh")
    server = NatsServer(tmp_path / "nats", names=names)
    server.start()
    conn = None
    try:
        await make_streams(server, names)
        conn = await nats.connect(server.admin_url)
        ids = [await running_sandbox(conn, names, f"sb-{i}", "h1") for i in range(3)]
        store = AggregateStore(conn.jetstream(), names, "sandbox", sb.evolve, actor="test")
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            await wait_until(lambda: stopped(server.pid), timeout=30, what="the server stopped")
            with caplog.at_level(logging.WARNING, logger="sandhold.bus.follow"):
                starting = asyncio.create_task(store.start())
                await wait_until(
                    lambda: "no answer" in caplog.text or starting.done(),
                    timeout=30,
                    what="the follower's start saying it has no answer",
                )
                assert not starting.done(), f"started with the server stopped: {caplog.text!r}"
                assert f"following sandbox event on {names.events_stream}: no answer" in caplog.text
        finally:
            os.kill(server.pid, signal.SIGCONT)
        try:
            await asyncio.wait_for(starting, 60)
            assert sorted(store.ids()) == sorted(ids)
        finally:
            await store.stop()
    finally:
        if conn is not None:
            await conn.close()
        server.stop()


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
