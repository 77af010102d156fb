"""`bulk_read`: a long catch-up read on a connection of its own (benchmark (b)),
handing over exactly what nats-py's ordered consumer would, and giving way to
it, with nothing skipped or handed over twice, wherever it stops."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg
from sandhold.bus import bulk, credentials, follow
from sandhold.bus.codec import FENCE_HEADER, decode_envelope
from sandhold.bus.connection import connect
from sandhold.bus.follow import Follower
from sandhold.bus.names import Names
from sandhold.bus.server import NatsServer
from sandhold.bus.store import AggregateStore
from sandhold.domain import sandbox as sb
from sandhold.domain.envelope import Envelope

from tests.support.bus import make_streams
from tests.twins.support import running_sandbox

NAMES = Names("bk")
SANDBOXES = 40  # 160 sandbox events, with a host's events and two strays among them


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    running = NatsServer(tmp_path_factory.mktemp("bulk") / "nats", names=NAMES)
    for role in ("scheduler", "metrics"):
        credentials.issue(running.credentials_dir, role)
    running.start()
    try:
        asyncio.run(make_streams(running, NAMES))
        asyncio.run(_write_log(running))
        yield running
    finally:
        running.stop()


async def _write_log(server: NatsServer) -> None:
    """Sandboxes' histories, a host's events between them, and on a sandbox
    subject one message stored without the fence and one fenced but not JSON."""
    admin = await nats.connect(server.admin_url)
    try:
        js = admin.jetstream()
        for n in range(SANDBOXES):
            await running_sandbox(admin, NAMES, f"bulk-{n}", "h1")
            if n % 10 == 3:  # (not a sandbox event: no reader here sees it)
                await js.publish(NAMES.events("host", "h1"), b"{}")
            if n == 17:
                await js.publish(NAMES.events("sandbox", "sb-unfenced"), b"{}")
            if n == 23:
                await js.publish(
                    NAMES.events("sandbox", "sb-unreadable"), b"not json",
                    headers={FENCE_HEADER: "0"},
                )  # fmt: skip
    finally:
        await admin.close()


@pytest.fixture
async def scheduler(server: NatsServer) -> AsyncIterator[nats.NATS]:
    """A connection as the scheduler: its own user, inbox and rights."""
    own = credentials.load(credentials.path_of(server.credentials_dir, "scheduler"))
    nc = await connect(server.url, name="test-scheduler", credentials=own)
    try:
        yield nc
    finally:
        await nc.close()


Seen = tuple[int, str, dict[str, str] | None, bytes, Envelope]


async def _follow(nc: nats.NATS, *, bulk_on: bool, **kwargs: Any) -> tuple[list[Seen], Follower]:
    """Every sandbox event the log holds, as a follower hands it over."""
    seen: list[Seen] = []

    def keep(seq: int, msg: Msg, envelope: Envelope) -> None:
        seen.append((seq, msg.subject, msg.headers, bytes(msg.data), envelope))

    follower: Follower[Envelope] = Follower(
        nc.jetstream(), NAMES.events_stream, NAMES.events("sandbox", ">"),
        decode_envelope, keep, bulk=bulk_on, **kwargs,
    )  # fmt: skip
    try:
        await follower.start(timeout=30)
    finally:
        await follower.stop()
    return seen, follower


@pytest.mark.parametrize("batch", [7, 1000])
async def test_a_bulk_read_hands_over_what_the_usual_consumer_does(
    scheduler: nats.NATS, monkeypatch: pytest.MonkeyPatch, batch: int
):
    """Same sequences, subjects, headers, bytes and values, the two strays
    skipped and counted alike, read as a service user, across pull batches."""
    monkeypatch.setattr(follow, "BULK_SPAN", 1)
    monkeypatch.setattr(bulk, "BATCH", batch)
    usual, plain = await _follow(scheduler, bulk_on=False)
    got, fast = await _follow(scheduler, bulk_on=True)
    assert len(usual) >= 4 * SANDBOXES  # (one test adds a sandbox to the log)
    assert got == usual
    assert (fast.unfenced, fast.undecodable) == (plain.unfenced, plain.undecodable) == (1, 1)
    assert fast.bulk_taken == len(usual) + 2  # every one of them, the strays too
    assert plain.bulk_taken == 0


async def test_a_follower_under_the_bulk_span_reads_as_usual(scheduler: nats.NATS):
    """A short catch-up is not worth a connection of its own."""
    seen, follower = await _follow(scheduler, bulk_on=True)
    assert len(seen) >= 4 * SANDBOXES
    assert follower.bulk_taken == 0  # the log is shorter than BULK_SPAN


async def test_a_bulk_read_cut_short_is_finished_by_the_usual_consumer(
    server: NatsServer, scheduler: nats.NATS, monkeypatch: pytest.MonkeyPatch
):
    """Its consumer deleted under it a few messages in: the ordered consumer
    reads on from there, nothing skipped, nothing handed over twice."""
    monkeypatch.setattr(follow, "BULK_SPAN", 1)
    monkeypatch.setattr(bulk, "BATCH", 5)
    usual, _ = await _follow(scheduler, bulk_on=False)
    seen: list[int] = []

    def keep(seq: int, msg: Msg, envelope: Envelope) -> None:
        seen.append(seq)
        if len(seen) == 3:
            # Done before this returns (the loop is held): whatever the bulk read
            # has not been sent by now it is never sent.
            _in_a_thread(_delete_bulk_consumers(server.admin_url))

    follower: Follower[Envelope] = Follower(
        scheduler.jetstream(), NAMES.events_stream, NAMES.events("sandbox", ">"),
        decode_envelope, keep, bulk=True,
    )  # fmt: skip
    try:
        await follower.start(timeout=30)
    finally:
        await follower.stop()
    assert seen == [seq for seq, *_ in usual]
    assert 3 <= follower.bulk_taken < len(usual) // 2


async def test_a_store_rebuilt_through_a_bulk_read_is_the_usual_one(
    scheduler: nats.NATS, monkeypatch: pytest.MonkeyPatch
):
    """Every sandbox's state and sequence, as the scheduler folds them."""

    async def rebuilt() -> tuple[dict[str, sb.Sandbox], dict[str, int], int]:
        store = AggregateStore(scheduler.jetstream(), NAMES, "sandbox", sb.evolve, actor="t")
        await store.start(timeout=30)
        await store.stop()
        assert store._follower is not None
        states = {}
        seqs = {}
        for sandbox_id in store.ids():
            state, seq = store.get(sandbox_id)
            assert state is not None
            states[sandbox_id] = state
            seqs[sandbox_id] = seq
        return states, seqs, store._follower.bulk_taken

    monkeypatch.setattr(follow, "BULK_SPAN", 10**9)
    usual_states, usual_seqs, none = await rebuilt()
    monkeypatch.setattr(follow, "BULK_SPAN", 1)
    states, seqs, taken = await rebuilt()
    assert len(states) >= SANDBOXES and none == 0 and taken > 0
    assert (states, seqs) == (usual_states, usual_seqs)


def _in_a_thread(work: Any) -> None:
    """`work` (a coroutine) run to its end on a loop of its own, this one held."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(work)
        except BaseException as err:  # noqa: BLE001 - raised in the caller below
            failed.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the deletion did not finish in 30 s"
    if failed:
        raise failed[0]


async def _delete_bulk_consumers(url: str) -> None:
    admin = await nats.connect(url)
    try:
        js = admin.jetstream()
        names = [c.name for c in await js.consumers_info(NAMES.events_stream)]
        bulk_ones = [name for name in names if name.startswith("bulk-")]
        assert bulk_ones, f"no bulk read's consumer among {names}"
        for name in bulk_ones:
            await js.delete_consumer(NAMES.events_stream, name)
    finally:
        await admin.close()


def test_headers_are_read_as_nats_py_reads_them():
    block = (
        b"NATS/1.0\r\nNats-Msg-Id: a:b\r\n  Spaced :  v  \r\nBad Name: x\r\n"
        b"Caf\xc3\xa9: y\r\nNo-Colon\r\nEmpty:\r\nUtf: \xc3\xa9\r\n\x1cSep: z\r\n"
        b"Nbsp: \xc2\xa0kept\xc2\xa0\r\nBad-Utf: \xff\xfe\r\n:no-name\r\nTab\tIn: t\r\n\r\n"
    )
    expected = nats.NATS._parse_header_lines(block[len(b"NATS/1.0\r\n") :])
    assert bulk._headers(block) == expected
    assert expected["Nats-Msg-Id"] == "a:b" and expected["Nbsp"] == "\xa0kept\xa0"
    assert set(expected) == {"Nats-Msg-Id", "Spaced", "Empty", "Utf", "Nbsp", "Bad-Utf", ""}


async def test_a_bulk_read_ends_where_the_log_does_and_the_usual_consumer_waits_on(
    server: NatsServer, scheduler: nats.NATS, monkeypatch: pytest.MonkeyPatch, caplog: Any
):
    """Asked to reach past the log's end, it hands over what there is and ends
    at once (the server's count of what is pending says so, not a pull that
    expires); the follower takes the rest live."""
    monkeypatch.setattr(follow, "BULK_SPAN", 1)
    usual, _ = await _follow(scheduler, bulk_on=False)
    js = scheduler.jetstream()
    last = (await js.stream_info(NAMES.events_stream)).state.last_seq
    seen: list[int] = []
    follower: Follower[Envelope] = Follower(
        js, NAMES.events_stream, NAMES.events("sandbox", ">"), decode_envelope,
        lambda seq, msg, envelope: seen.append(seq), bulk=True,
    )  # fmt: skip
    try:
        with caplog.at_level(logging.INFO, logger="sandhold.bus.bulk"):
            await follower.start(timeout=None, target=last + 4)
        assert "stopped" not in caplog.text
        assert follower.bulk_taken == len(usual) + 2 and not follower.caught_up.is_set()
        admin = await nats.connect(server.admin_url)
        try:
            sandbox_id = await running_sandbox(admin, NAMES, "bulk-late", "h1")
        finally:
            await admin.close()
        await follower.reach(last + 4, timeout=30)
    finally:
        await follower.stop()
    assert seen == [seq for seq, *_ in usual] + [last + 1, last + 2, last + 3, last + 4]
    assert follower.caught_up.is_set() and sandbox_id
