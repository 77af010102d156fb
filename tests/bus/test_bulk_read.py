"""`bulk_read`: a long catch-up read on a connection of its own (benchmark (b)),
handing over exactly what nats-py's ordered consumer would, and giving way to
it, with nothing skipped or handed over twice, wherever it stops. `bulk_get`:
many direct gets on a connection of their own (a restore's chunks), each
answer handed over once, what it did not hand over left to the caller."""

from __future__ import annotations

import asyncio
import contextlib
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

from tests.support.bus import make_streams, not_answering
from tests.support.waiting import wait_until
from tests.twins.support import running_sandbox

NAMES = Names("bk")
SANDBOXES = 40  # 160 sandbox events, with a host's events and two strays among them


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    running = NatsServer(tmp_path_factory.mktemp("bulk") / "nats", names=NAMES)
    for role in ("scheduler", "metrics"):
        credentials.issue(running.credentials_dir, role)
    credentials.issue(running.credentials_dir, "host-agent", host="h1")
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


@contextlib.asynccontextmanager
async def connected_as(server: NatsServer, user: str) -> AsyncIterator[nats.NATS]:
    """A connection as `user`: its own inbox and rights, as the service's."""
    own = credentials.load(credentials.path_of(server.credentials_dir, user))
    nc = await connect(server.url, name=f"test-{user}", credentials=own)
    try:
        yield nc
    finally:
        await nc.close()


@pytest.fixture
async def scheduler(server: NatsServer) -> AsyncIterator[nats.NATS]:
    async with connected_as(server, "scheduler") as nc:
        yield nc


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
    server: NatsServer, scheduler: nats.NATS, monkeypatch: pytest.MonkeyPatch, batch: int
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
    admin = await nats.connect(server.admin_url)
    try:
        await wait_until(
            lambda: _bulk_consumers_gone(admin), timeout=30, what="the bulk consumer deleted"
        )
    finally:
        await admin.close()


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


async def _bulk_consumers_gone(nc: nats.NATS) -> bool:
    infos = await nc.jetstream().consumers_info(NAMES.events_stream)
    return not any(info.name.startswith("bulk-") for info in infos)


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
    # No header at all: None, as nats-py's message has (not an empty dict).
    assert bulk._headers(b"NATS/1.0\r\n\r\n") is None
    assert bulk._headers(b"NATS/1.0\r\nBad Name: x\r\n\r\n") is None
    assert set(expected) == {"Nats-Msg-Id", "Spaced", "Empty", "Utf", "Nbsp", "Bad-Utf", ""}


async def test_a_bulk_read_ends_where_the_log_does_and_the_usual_consumer_waits_on(
    server: NatsServer, scheduler: nats.NATS, monkeypatch: pytest.MonkeyPatch, caplog: Any
):
    """Asked to reach past the log's end, it hands over what there is and ends
    at once (the server's count of what is pending says so, not a pull that
    expires or a stall); the follower takes the rest live."""
    monkeypatch.setattr(follow, "BULK_SPAN", 1)
    usual, _ = await _follow(scheduler, bulk_on=False)
    js = scheduler.jetstream()
    last = (await js.stream_info(NAMES.events_stream)).state.last_seq
    seen: list[int] = []
    follower: Follower[Envelope] = Follower(
        js, NAMES.events_stream, NAMES.events("sandbox", ">"), decode_envelope,
        lambda seq, msg, envelope: seen.append(seq), bulk=True,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="sandhold.bus.bulk"):
        starting = asyncio.create_task(follower.start(timeout=60, target=last + 4))
        try:
            # The bulk read is over once the usual consumer is made.
            await wait_until(
                lambda: follower._sub is not None or starting.done(), timeout=30,
                what="the bulk read over",
            )  # fmt: skip
            assert "stopped" not in caplog.text
            assert follower.bulk_taken == len(usual) + 2 and not follower.caught_up.is_set()
            admin = await nats.connect(server.admin_url)
            try:
                await running_sandbox(admin, NAMES, "bulk-late", "h1")
            finally:
                await admin.close()
            await starting
        finally:
            starting.cancel()
            await follower.stop()
    assert seen == [seq for seq, *_ in usual] + [last + 1, last + 2, last + 3, last + 4]
    assert follower.caught_up.is_set()


async def test_a_paced_follower_caught_up_by_a_bulk_read_that_took_its_time_has_started(
    server: NatsServer, monkeypatch: pytest.MonkeyPatch
):
    """The metrics fold's way (paced, every event kind): a bulk read that
    caught up but returned only at the start's deadline (its clean-up slow)
    leaves the start done, not timed out."""
    monkeypatch.setattr(follow, "BULK_SPAN", 1)
    real = follow.bulk_read

    async def slow_to_return(*args: Any, **kwargs: Any) -> None:
        await real(*args, **kwargs)
        await asyncio.sleep(3600)  # until the deadline cuts it

    monkeypatch.setattr(follow, "bulk_read", slow_to_return)
    seen: list[int] = []
    async with connected_as(server, "metrics") as nc:
        follower: Follower[bytes] = Follower(
            nc.jetstream(), NAMES.events_stream, f"{NAMES.prefix}.ev.>", bytes,
            lambda seq, msg, data: seen.append(seq), bulk=True, pace_s=0.2,
        )  # fmt: skip
        try:
            await follower.start(timeout=3)
            assert follower.caught_up.is_set() and len(seen) > 4 * SANDBOXES
            assert follower.bulk_taken == len(seen) + follower.unfenced  # (the host's, unfenced)
        finally:
            await follower.stop()


def test_the_reader_parses_the_protocol_however_it_is_cut():
    """Frames split anywhere, a reply subject with a domain in it, a message
    stored without headers, the server's PING and INFO between them: the same
    messages in order, a PONG, and a status ends the read."""
    body = b"{}"
    head = b"NATS/1.0\r\nNats-Expected-Last-Subject-Sequence: 0\r\n\r\n"
    status = b"NATS/1.0 409 Leadership Change\r\n\r\n"
    frames = [
        b'INFO {"server_id":"x"}\r\n',
        b"HMSG s.a 1 $JS.ACK.S.c.1.10.1.1733550000000000000.2 %d %d\r\n%s%s\r\n"
        % (len(head), len(head) + len(body), head, body),
        b"PING\r\n",
        b"MSG s.b 1 $JS.ACK.S.c.1.12.2.1733550000000000000.1 2\r\n{}\r\n",
        b"HMSG s.c 1 $JS.ACK.dom.acchash.S.c.1.15.3.1733550000000000000.5.tok %d %d\r\n%s%s\r\n"
        % (len(head), len(head) + len(body), head, body),
        b"HMSG _INBOX.x 1 %d %d\r\n%s\r\n" % (len(status), len(status), status),
    ]
    wire = b"".join(frames)
    for cut in (1, 3, 7, 64, len(wire)):
        asyncio.run(_parsed(wire, cut))


async def _parsed(wire: bytes, cut: int) -> None:
    taken: list[tuple[int, str, dict[str, str] | None]] = []

    def take(seq: int, msg: Msg) -> None:
        taken.append((seq, msg.subject, msg.headers))

    reader = bulk._Reader(b"pull", b"inbox", {}, "test", take, 10**9, 2, None)  # type: ignore[arg-type]
    written: list[bytes] = []
    reader.connection_made(_Transport(written))  # type: ignore[arg-type]
    for at in range(0, len(wire), cut):
        reader.data_received(wire[at : at + cut])
    fence = {FENCE_HEADER: "0"}
    assert taken == [(10, "s.a", fence), (12, "s.b", None), (15, "s.c", fence)], cut
    assert b"PONG\r\n" in written and written[0].startswith(b"CONNECT "), cut
    with pytest.raises(bulk.Stopped, match="409 Leadership Change"):
        await reader.run()
    reader.close()


class _Transport:
    def __init__(self, written: list[bytes]) -> None:
        self.written = written

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


# --- bulk_get ---------------------------------------------------------------------


@pytest.fixture
async def host_agent(server: NatsServer) -> AsyncIterator[nats.NATS]:
    """As host h1's agent: direct gets only, no consumer."""
    async with connected_as(server, "host-h1") as nc:
        yield nc


@pytest.fixture(scope="module")
def chunks(server: NatsServer) -> list[tuple[str, bytes]]:
    """Subjects of the save store with their data, of many sizes (none empty)."""
    stored = [(NAMES.chunk(f"{n:064x}"), bytes([n]) * (1 + 997 * n)) for n in range(60)]

    async def put() -> None:
        admin = await nats.connect(server.admin_url)
        try:
            for subject, data in stored:
                await admin.jetstream().publish(subject, data)
        finally:
            await admin.close()

    asyncio.run(put())
    return stored


async def test_bulk_gets_hand_over_each_subjects_message_and_leave_the_absent(
    host_agent: nats.NATS, chunks: list[tuple[str, bytes]]
):
    """As the host-agent (direct gets are all it may make): each present subject
    handed over once with its data, at most `in_flight` asked at a time, the
    absent ones left for the caller."""
    subjects = [subject for subject, _ in chunks]
    subjects[7:7] = [NAMES.chunk("f" * 64)]  # absent
    subjects.append(NAMES.chunk("e" * 64))  # absent
    data = dict(chunks)
    got: dict[int, bytes] = {}
    asked: list[int] = []
    most = 0

    async def before(index: int) -> None:
        nonlocal most
        asked.append(index)
        most = max(most, len(asked) - len(got))

    def take(index: int, payload: bytes) -> None:
        assert index not in got
        got[index] = payload

    left = await bulk.bulk_get(
        host_agent, host_agent.jetstream(), NAMES.saves_stream, subjects, take=take,
        before=before, in_flight=4,
    )  # fmt: skip
    assert left == [7, len(subjects) - 1]
    assert {subjects[i]: payload for i, payload in got.items()} == data
    assert asked == list(range(len(subjects))) and 1 < most <= 4 + 2  # (+ the absent)


async def test_a_bulk_get_cut_short_leaves_the_rest_and_raises_what_before_raises(
    host_agent: nats.NATS, chunks: list[tuple[str, bytes]]
):
    subjects = [subject for subject, _ in chunks]
    got: list[int] = []

    def take(index: int, payload: bytes) -> None:
        if len(got) == 5:
            raise ValueError("not this one")  # ends the read: this one is left too
        got.append(index)

    left = await bulk.bulk_get(
        host_agent, host_agent.jetstream(), NAMES.saves_stream, subjects, take=take, in_flight=2
    )
    assert len(got) == 5 and sorted(got + left) == list(range(len(subjects)))

    async def before(index: int) -> None:
        if index == 3:
            raise RuntimeError("no room")

    with pytest.raises(RuntimeError, match="no room"):
        await bulk.bulk_get(
            host_agent, host_agent.jetstream(), NAMES.saves_stream, subjects,
            take=lambda index, payload: None, before=before,
        )  # fmt: skip


async def test_a_bulk_get_that_stops_while_waiting_for_room_returns(
    host_agent: nats.NATS, chunks: list[tuple[str, bytes]]
):
    """A restore's room is freed only by answers handed over: once the read
    stops (here `take` refuses the first answer), it does not wait for room
    that cannot come, and every chunk is left to the caller."""
    subjects = [subject for subject, _ in chunks]
    never = asyncio.Event()

    async def before(index: int) -> None:
        if index >= 2:
            await never.wait()  # (room freed only when an answer is written)

    def take(index: int, payload: bytes) -> None:
        raise ValueError("a wrong length")

    async with asyncio.timeout(30):
        left = await bulk.bulk_get(
            host_agent, host_agent.jetstream(), NAMES.saves_stream, subjects, take=take,
            before=before, in_flight=4,
        )  # fmt: skip
    assert left == list(range(len(subjects)))


async def test_a_bulk_get_from_a_server_that_says_nothing_gives_up(
    server: NatsServer, host_agent: nats.NATS, monkeypatch: pytest.MonkeyPatch
):
    """Connected (the kernel took the connection) to a server that never says
    hello: given up after `STALL_S`, everything left to the caller."""
    monkeypatch.setattr(bulk, "STALL_S", 1.0)
    subjects = [NAMES.chunk(f"{n:064x}") for n in range(3)]
    async with not_answering(server), asyncio.timeout(30):
        left = await bulk.bulk_get(
            host_agent, host_agent.jetstream(), NAMES.saves_stream, subjects,
            take=lambda index, payload: None,
        )  # fmt: skip
    assert left == [0, 1, 2]
