"""`Follower`: the one way the log is read in order — replay, catch-up, live, resume.

Most of these read the output stream: the event log asks more of its messages
(the fence header, the last tests here), and these are about the reading."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import pytest
from nats.aio.msg import Msg
from sandhold.bus.codec import FENCE_HEADER
from sandhold.bus.follow import Follower, pull_batches
from sandhold.bus.names import Names
from sandhold.bus.server import NatsServer, free_port
from sandhold.bus.service import connect
from sandhold.bus.streams import ensure_streams

from tests.support.waiting import wait_until


def _number(data: bytes) -> int:
    return int(data)  # ValueError is not a decode error: numbers only in these tests


# Every message as it is stored, and what came at most every 0.2 s (decision 087).
PACES = pytest.mark.parametrize("pace_s", [None, 0.2], ids=["live", "paced"])


@PACES
async def test_it_replays_then_signals_caught_up_then_follows_live(
    nc: nats.NATS, names: Names, pace_s: float | None
):
    js = nc.jetstream()
    subject = names.output("sb-1", "c")
    for n in range(50):
        await js.publish(subject, str(n).encode())
    seen: list[tuple[int, int]] = []
    at_catch_up: list[int] = []

    def handle(seq: int, _msg: Msg, value: int) -> None:
        seen.append((seq, value))

    follower = Follower(
        js, names.output_stream, f"{names.prefix}.out.>", int, handle, pace_s=pace_s
    )
    try:
        await follower.start(timeout=10)
        at_catch_up.append(len(seen))
        for n in range(50, 60):
            await js.publish(subject, str(n).encode())
        await wait_until(lambda: len(seen) == 60, what="the live messages")
    finally:
        await follower.stop()
    assert at_catch_up == [50]  # caught up only once the 50 that were there were handled
    assert [value for _, value in seen] == list(range(60))
    assert [seq for seq, _ in seen] == sorted({seq for seq, _ in seen})  # in order, once each
    assert follower.position == seen[-1][0]


@PACES
async def test_it_starts_from_a_sequence(nc: nats.NATS, names: Names, pace_s: float | None):
    js = nc.jetstream()
    acks = [await js.publish(names.output("t-1", "c"), str(n).encode()) for n in range(5)]
    seen: list[int] = []
    follower = Follower(
        js,
        names.output_stream,
        f"{names.prefix}.out.>",
        int,
        lambda _seq, _msg, value: seen.append(value),
        start_seq=acks[3].seq,
        pace_s=pace_s,
    )
    await follower.start(timeout=10)
    await follower.stop()
    assert seen == [3, 4]


async def test_a_paced_follower_reached_for_does_not_wait_for_its_pace(nc: nats.NATS, names: Names):
    """A minute's pace; `reach` for what was just stored is answered by fetching
    it now (the deadline is far below the pace, far above a fetch)."""
    js = nc.jetstream()
    subject = names.output("sb-9", "c")
    await js.publish(subject, b"0")
    seen: list[int] = []
    follower = Follower(
        js, names.output_stream, subject, int, lambda _s, _m, v: seen.append(v), pace_s=60.0
    )
    try:
        await follower.start(timeout=10)
        assert seen == [0]
        ack = await js.publish(subject, b"1")
        await follower.reach(ack.seq, timeout=20)
        assert seen == [0, 1]
    finally:
        await follower.stop()


@PACES
async def test_undecodable_messages_and_failing_handlers_are_skipped_and_counted(
    nc: nats.NATS, names: Names, pace_s: float | None
):
    js = nc.jetstream()
    subject = names.output("sb-2", "c")
    import msgspec

    def decode(data: bytes) -> int:
        if not data.isdigit():
            raise msgspec.DecodeError("not a number")
        return int(data)

    handled: list[int] = []

    def handle(_seq: int, _msg: Msg, value: int) -> None:
        if value == 13:
            raise RuntimeError("unlucky")
        handled.append(value)

    for payload in (b"1", b"junk", b"13", b"2", b"junk"):
        await js.publish(subject, payload)
    follower = Follower(js, names.output_stream, subject, decode, handle, pace_s=pace_s)
    await follower.start(timeout=10)  # the last message is undecodable: catching up still ends
    await follower.stop()
    assert handled == [1, 2]
    assert (follower.undecodable, follower.failed) == (2, 1)


@PACES
async def test_it_resumes_where_it_was_after_the_server_restarts(tmp_path, pace_s: float | None):
    port = free_port()
    server = NatsServer(tmp_path / "nats", port=port)
    server.start()
    names = Names("resume")
    conn = await connect(server.admin_url, name="test-follow")
    seen: list[int] = []
    try:
        js = conn.jetstream()
        await ensure_streams(js, names)
        subject = names.output("sb-3", "c")
        for n in range(3):
            await js.publish(subject, str(n).encode())
        follower = Follower(
            js, names.output_stream, subject, int, lambda _s, _m, v: seen.append(v), pace_s=pace_s
        )
        await follower.start(timeout=10)
        server.kill()
        server.start()
        await wait_until(lambda: conn.is_connected, timeout=30, what="the reconnect")

        async def published(n: int) -> bool:
            try:  # JetStream may still be recovering its streams
                await js.publish(
                    subject, str(n).encode(), timeout=2, headers={"Nats-Msg-Id": f"n{n}"}
                )
            except nats.errors.TimeoutError:
                return False
            return True

        for n in range(3, 6):
            await wait_until(lambda n=n: published(n), timeout=30, what=f"publish {n}")
        await wait_until(lambda: len(seen) >= 6, timeout=30, what="the messages after the restart")
        await follower.stop()
        assert seen == list(range(6))  # nothing twice, nothing skipped
    finally:
        await conn.close()
        server.stop()
        await asyncio.sleep(0)


# --- pull_batches: the same read, at the reader's pace ------------------------------------


async def test_pull_batches_reads_after_a_sequence_in_batches_then_says_when_it_is_idle(
    nc: nats.NATS, names: Names
):
    js = nc.jetstream()
    subject = names.output("sb-p1", "c")
    acks = [await js.publish(subject, str(n).encode()) for n in range(10)]
    batches = pull_batches(js, names.output_stream, subject, after=acks[2].seq, batch=3, idle_s=0.3)
    got: list[list[int]] = []
    sequences: list[int] = []
    try:
        async for batch in batches:
            if not batch:
                break  # idle: everything there was has been read
            got.append([int(msg.data) for _, msg in batch])
            sequences += [seq for seq, _ in batch]
    finally:
        await batches.aclose()
    assert got == [[3, 4, 5], [6, 7, 8], [9]]
    assert sequences == [ack.seq for ack in acks[3:]]


async def test_pull_batches_takes_fewer_big_messages_at_a_time(nc: nats.NATS, names: Names):
    js = nc.jetstream()
    subject = names.output("sb-p2", "c")
    for n in range(20):
        await js.publish(subject, str(n % 10).encode() * 10_000)  # 10 KB each
    batches = pull_batches(
        js, names.output_stream, subject, after=0, batch=8, batch_bytes=25_000, idle_s=0.3
    )
    sizes: list[int] = []
    try:
        async for batch in batches:
            if not batch:
                break
            sizes.append(len(batch))
    finally:
        await batches.aclose()
    assert sum(sizes) == 20
    assert sizes[0] == 8 and max(sizes[1:]) <= 2  # learnt from the first batch's bytes


async def test_pull_batches_resumes_after_its_consumer_goes_away(nc: nats.NATS, names: Names):
    """A consumer removed under the reader (the server's idle clean-up, an
    operator) is made again after the last sequence handed out."""
    js = nc.jetstream()
    subject = names.output("sb-p3", "c")
    for n in range(3):
        await js.publish(subject, str(n).encode())
    batches = pull_batches(js, names.output_stream, subject, after=0, batch=10, idle_s=0.3)
    seen: list[int] = []
    try:
        first = await anext(batches)
        seen += [int(m.data) for _, m in first]
        [info] = [c async for c in _consumers(js, names.output_stream)]
        await js.delete_consumer(names.output_stream, info)
        for n in range(3, 6):
            await js.publish(subject, str(n).encode())
        async with asyncio.timeout(30):
            while len(seen) < 6:
                seen += [int(m.data) for _, m in await anext(batches)]
    finally:
        await batches.aclose()
    assert seen == list(range(6))  # nothing twice, nothing skipped
    assert [c async for c in _consumers(js, names.output_stream)] == []  # closed, removed


async def _consumers(js, stream: str):
    for info in await js.consumers_info(stream):
        yield info.name


# --- the event log: only what was appended behind the fence is an event --------------------


@PACES
async def test_a_message_on_the_event_log_without_the_fence_header_is_never_an_event(
    nc: nats.NATS, names: Names, pace_s: float | None
):
    js = nc.jetstream()
    subject = names.events("sandbox", "sb-0000000000000009")
    await js.publish(subject, b"1", headers={FENCE_HEADER: "0"})  # appended the one way
    await js.publish(subject, b"2")  # a raw publish: no fence
    last = await js.publish(subject, b"3", headers={FENCE_HEADER: "2"})
    seen: list[int] = []
    follower = Follower(
        js, names.events_stream, subject, int, lambda _s, _m, value: seen.append(value),
        pace_s=pace_s,
    )  # fmt: skip
    await follower.start(timeout=10)
    await follower.stop()
    assert seen == [1, 3]
    assert (follower.unfenced, follower.position) == (1, last.seq)

    batches = pull_batches(js, names.events_stream, subject, after=0, batch=10, idle_s=0.3)
    try:
        got = await anext(batches)
    finally:
        await batches.aclose()
    assert [int(m.data) for _, m in got] == [1, 3]


async def test_a_paced_follower_goes_on_past_a_message_it_cannot_read(nc: nats.NATS, names: Names):
    """A decoder that raises what no decoder should (here `int`'s ValueError):
    logged and counted, and the fold goes on, as a push callback's error does."""
    js = nc.jetstream()
    subject = names.output("sb-7", "c")
    for payload in (b"1", b"junk", b"2"):
        await js.publish(subject, payload)
    seen: list[int] = []
    follower = Follower(
        js, names.output_stream, subject, int, lambda _s, _m, v: seen.append(v), pace_s=0.2
    )
    try:
        await follower.start(timeout=10)
    finally:
        await follower.stop()
    assert seen == [1, 2]
    assert follower.failed == 1
