"""The single-writer fence on a real nats-server: expected sequence + msg id."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.js.api import StreamConfig
from nats.js.errors import APIError
from sandhold.bus.append import (
    WrongSequence,
    append,
    last_sequence,
    stream_last_sequence,
    wrong_last_sequence,
)
from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore, Executed
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain.envelope import wrap
from sandhold.domain.events import SandboxCreated, SandboxStopRequested

from tests.support.bus import create_sandbox


def _created(sandbox_id: str, key: str = "k") -> SandboxCreated:
    return SandboxCreated(sandbox_id=sandbox_id, request_key=key, request_digest="d")


def _envelopes(sandbox_id: str, events, id_base: str):
    return wrap(
        events,
        aggregate_id=sandbox_id,
        id_base=id_base,
        actor="test",
        causation_id=id_base,
        correlation_id=id_base,
        time=time.time(),
    )


async def test_two_writers_racing_exactly_one_wins_and_the_loser_redecides(nc, names: Names):
    js = nc.jetstream()
    a = AggregateStore(js, names, "sandbox", sb.evolve, actor="writer-a")
    b = AggregateStore(js, names, "sandbox", sb.evolve, actor="writer-b")
    await a.start()
    await b.start()
    sandbox_id = await create_sandbox(a, "create-1")
    await b.sync(sandbox_id)

    # Both decide a different run on the same state: seen-by-b is now stale for one of them.
    decided_on: dict[str, int] = {}

    def decider(store_name: str, request: rq.RunCommand):
        def decide(state):
            decided_on.setdefault(store_name, 0)
            decided_on[store_name] += 1
            return sb.decide(state, request)

        return decide

    run_a = rq.RunCommand(key="run-a", sandbox_id=sandbox_id, argv=["true"])
    run_b = rq.RunCommand(key="run-b", sandbox_id=sandbox_id, argv=["false"])
    ra, rb = await asyncio.gather(
        a.execute(
            sandbox_id, decider("a", run_a), id_base="ra", causation_id="ra", correlation_id="ra"
        ),
        b.execute(
            sandbox_id, decider("b", run_b), id_base="rb", causation_id="rb", correlation_id="rb"
        ),
    )
    # Exactly one decided once; the other was refused by JetStream, re-read and decided again.
    assert sorted(decided_on.values()) == [1, 2]
    assert ra.seq != rb.seq
    final, _ = await a.sync(sandbox_id)
    assert final is not None
    assert {c.argv[0] for c in final.commands.values()} == {"true", "false"}
    await a.stop()
    await b.stop()


async def test_a_store_that_reads_on_demand_decides_on_what_it_last_read(nc, names: Names):
    """No read before a decision (a host's report pays no round trip for one):
    events decided on a state another writer moved past are refused by the fence
    and decided again after a read; "nothing to do" and a refusal are believed
    only of a state just read."""
    js = nc.jetstream()
    reader = AggregateStore(js, names, "sandbox", sb.evolve, actor="host", follow=False)
    writer = AggregateStore(js, names, "sandbox", sb.evolve, actor="scheduler", follow=False)
    sandbox_id = await create_sandbox(writer, "create-1")
    seen: list[int] = []  # how many commands each decision of the reader saw

    async def decided(store: AggregateStore, key: str, decide) -> Executed:
        def watched(state):
            if store is reader:
                seen.append(len(state.commands) if state is not None else -1)
            return decide(state)

        return await store.execute(
            sandbox_id, watched, id_base=key, causation_id=key, correlation_id=key
        )

    def run(key: str):
        request = rq.RunCommand(key=key, sandbox_id=sandbox_id, argv=["true"])
        return lambda state: sb.decide(state, request)

    # Never read: refused on nothing, then read and decided again.
    await decided(reader, "run-a", run("run-a"))
    assert seen == [-1, 0]

    # Up to date (its own append): decided once, no read before it.
    seen.clear()
    await decided(reader, "run-b", run("run-b"))
    assert seen == [1]

    # Another writer moved on: decided on the old state, refused by the fence,
    # decided again on the state read after it.
    await decided(writer, "run-c", run("run-c"))
    seen.clear()
    done = await decided(reader, "run-d", run("run-d"))
    assert seen == [2, 3]
    assert done.state is not None and len(done.state.commands) == 4

    # "Nothing to do", decided on an old state, is decided again on a fresh read
    # before it is believed.
    await decided(writer, "run-e", run("run-e"))
    seen.clear()
    again = await decided(reader, "nothing", lambda _state: [])
    assert seen == [4, 5] and again.appended == []
    _, last = await writer.sync(sandbox_id)
    assert again.seq == last


async def test_plain_append_with_a_stale_sequence_is_refused(nc, names: Names):
    js = nc.jetstream()
    subject = names.events("sandbox", "sb-0000000000000001")
    first = _envelopes("sb-0000000000000001", [_created("sb-0000000000000001")], "one")
    [seq] = await append(js, names.events_stream, subject, first, 0)
    stale = _envelopes(
        "sb-0000000000000001", [SandboxStopRequested(request_key="s", request_digest="d")], "two"
    )
    with pytest.raises(WrongSequence):
        await append(js, names.events_stream, subject, stale, 0)
    assert await last_sequence(js, names.events_stream, subject) == seq


async def test_the_streams_last_sequence_is_its_newest_message_on_any_subject(nc, names: Names):
    js = nc.jetstream()
    assert await stream_last_sequence(js, names.events_stream) == 0
    seqs = []
    for sid in ("sb-0000000000000001", "sb-0000000000000002"):
        envelopes = _envelopes(sid, [_created(sid)], sid)
        seqs += await append(js, names.events_stream, names.events("sandbox", sid), envelopes, 0)
    first, second = seqs
    one = names.events("sandbox", "sb-0000000000000001")
    assert first < second
    assert await stream_last_sequence(js, names.events_stream) == second
    assert await last_sequence(js, names.events_stream, one) == first


async def test_hundred_rounds_of_three_racers_accept_exactly_one_each(nc, names: Names):
    js = nc.jetstream()
    subject = names.events("sandbox", "sb-0000000000000002")
    expected = 0
    for round_no in range(100):
        attempts = [
            append(
                js,
                names.events_stream,
                subject,
                _envelopes(
                    "sb-0000000000000002", [_created("x", f"{round_no}-{w}")], f"r{round_no}w{w}"
                ),
                expected,
            )
            for w in range(3)
        ]
        results = await asyncio.gather(*attempts, return_exceptions=True)
        winners = [r for r in results if not isinstance(r, BaseException)]
        assert len(winners) == 1, results
        assert all(isinstance(r, WrongSequence) for r in results if isinstance(r, BaseException))
        expected = winners[0][0]


async def test_r1_retry_after_lost_ack_is_recognised_as_our_own(nc, names: Names):
    """On R1 the sequence check runs before de-duplication (10071): we must look
    at the subject's last message and find our own id there."""
    js = nc.jetstream()
    subject = names.events("sandbox", "sb-0000000000000003")
    envelopes = _envelopes("sb-0000000000000003", [_created("sb-0000000000000003")], "once")
    [seq] = await append(js, names.events_stream, subject, envelopes, 0)
    # The same append again, as a retry whose first ack was lost.
    [again] = await append(js, names.events_stream, subject, envelopes, 0)
    assert again == seq
    info = await js.stream_info(names.events_stream)
    assert info.state.messages == 1


async def _wait_for_cluster_jetstream(nc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            await nc.jetstream().account_info()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_r3_retry_after_lost_ack_returns_the_original(nats_cluster, names: Names):
    """On R3 the server answers a retried append with the original ack, duplicate=True."""
    nc = await nats.connect(nats_cluster.admin_urls)
    try:
        await _wait_for_cluster_jetstream(nc)
        js = nc.jetstream()
        stream = names.events_stream
        for _ in range(100):
            try:
                await js.add_stream(
                    StreamConfig(name=stream, subjects=[f"{names.prefix}.ev.>"], num_replicas=3)
                )
                break
            except Exception:
                await asyncio.sleep(0.2)
        subject = names.events("sandbox", "sb-0000000000000004")
        envelopes = _envelopes("sb-0000000000000004", [_created("sb-0000000000000004")], "r3")
        [seq] = await append(js, stream, subject, envelopes, 0)
        [again] = await append(js, stream, subject, envelopes, 0)
        assert again == seq
        info = await js.stream_info(stream)
        assert info.state.messages == 1
        assert info.config.num_replicas == 3
        await js.delete_stream(stream)
    finally:
        await nc.close()


async def test_a_different_decision_at_the_same_point_is_not_mistaken_for_ours(nc, names: Names):
    """Two writers decide at the same sequence with the same id base but different
    content (e.g. two schedulers choosing different hosts): the loser must see a
    conflict, not a duplicate of its own append."""
    js = nc.jetstream()
    sid = "sb-0000000000000005"
    subject = names.events("sandbox", sid)
    [seq] = await append(js, names.events_stream, subject, _envelopes(sid, [_created(sid)], "c"), 0)
    from sandhold.domain.events import SandboxPlaced

    mine = _envelopes(sid, [SandboxPlaced(host="a", generation=1)], f"plan@{seq}")
    theirs = _envelopes(sid, [SandboxPlaced(host="b", generation=1)], f"plan@{seq}")
    await append(js, names.events_stream, subject, mine, seq)
    with pytest.raises(WrongSequence):
        await append(js, names.events_stream, subject, theirs, seq)


def test_both_of_the_servers_codes_for_a_wrong_last_sequence_are_a_refusal_by_the_fence():
    """A clustered leader may answer 10164 ("wrong last sequence", no number)
    where a single server answers 10071: both are someone appending first (read
    again, decide again), not an error to give up on; another code is not."""
    for code in (10071, 10164):
        assert wrong_last_sequence(APIError(code=400, err_code=code, description="wrong"))
    assert not wrong_last_sequence(APIError(code=400, err_code=10060, description="other"))
