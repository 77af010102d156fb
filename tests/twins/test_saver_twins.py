"""Two savers on one log: one save per schedule slot, verification and garbage
collection by the one holding the store claim, `admin gc` answered once."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import nats
import pytest
from sandhold.bus.names import Names
from sandhold.bus.read import read_subjects
from sandhold.bus.store import AggregateStore
from sandhold.domain import events as ev
from sandhold.domain import sandbox as sb
from sandhold.domain import saver as policy
from sandhold.saver.service import Saver, retained_and_dropped

from tests.domain.history import RUNNING, given_sandbox
from tests.support.waiting import wait_until
from tests.twins.support import Running, readiness, running_sandbox

# Long enough that a renewal slowed by a loaded disk (every KV write is fsynced)
# does not hand the claim over mid-test; the twin still takes over within seconds.
CLAIM_TTL = 3.0


async def test_two_savers_deciding_a_due_save_at_once_request_one(
    nc: nats.NATS, nats_url: str, names: Names
):
    ids = [await running_sandbox(nc, names, f"sb-{i}", "h1") for i in range(6)]
    conns = [await nats.connect(nats_url) for _ in range(2)]
    try:
        twins = [
            AggregateStore(c.jetstream(), names, "sandbox", sb.evolve, actor="saver") for c in conns
        ]
        for store in twins:
            await store.start()
            await store.catch_up()
        later = time.time() + 3600  # every one of them is due

        def schedule(store: AggregateStore[sb.Sandbox], sandbox_id: str):
            _, seq = store.get(sandbox_id)
            return store.follow_up(
                sandbox_id,
                lambda s: policy.due_save(s, now=later, cause=f"scheduled@{seq}") if s else [],
                why="schedule",
            )

        # Both savers' schedules reach every sandbox at the same moment.
        await asyncio.gather(*(schedule(store, i) for i in ids for store in twins))
        for sandbox_id in ids:
            records = await read_subjects(
                nc.jetstream(), names.events_stream, names.events("sandbox", sandbox_id)
            )
            requested = [r for r in records if isinstance(r.envelope.event, ev.SaveRequested)]
            assert len(requested) == 1, sandbox_id
        for store in twins:
            await store.stop()
    finally:
        for c in conns:
            await c.close()


async def test_one_saver_holds_the_store_claim_and_answers_admin_gc_then_its_twin(
    nc: nats.NATS, nats_url: str, names: Names, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="sandhold")
    announced = await readiness(nc, names)
    running = Running()
    try:
        twins = [
            running.start(Saver(nats_url, names, instance=f"saver-{i}", claim_ttl=CLAIM_TTL))
            for i in (1, 2)
        ]
        # Ready as `up` knows it (announced): listening for `admin.gc` by then.
        await wait_until(
            lambda: (
                announced.count("saver") == 2 and [s.duty.held() for s in twins].count(True) == 1
            ),
            timeout=30,
            what="both savers ready, one holding the store claim",
        )
        holder = next(s for s in twins if s.duty.held())
        twin = next(s for s in twins if s is not holder)
        inbox = nc.new_inbox()
        answers = await nc.subscribe(inbox)
        await nc.publish(f"{names.prefix}.admin.gc", b'{"grace_s": 3600}', reply=inbox)
        first = msgspec.json.decode((await answers.next_msg(timeout=30)).data)
        assert first["ok"] is True and first["instance"] == holder.instance
        # The twin heard it too, and left it to the holder.
        await wait_until(lambda: "left to" in caplog.text, timeout=30, what="the twin standing by")
        await nc.flush()
        assert answers.delivered == 1
        # The holder stops (a rolling restart): the twin takes over at its next look.
        await running.stop(holder)
        await wait_until(twin.duty.held, timeout=10, what="the twin holding the claim")
        reply = await nc.request(f"{names.prefix}.admin.gc", b"{}", timeout=30)
        assert msgspec.json.decode(reply.data)["instance"] == twin.instance
    finally:
        await running.close()


def test_garbage_collection_keeps_saves_uploaded_and_awaiting_verification():
    # A verification a former claim holder still runs may append SaveCompleted:
    # the chunks its save names must outlive it.
    uploaded = given_sandbox(
        *RUNNING,
        ev.SaveRequested(save_id="sv-1", kind="scheduled", host="host-a", generation=1),
        ev.SaveUploaded(
            save_id="sv-1", host="host-a", generation=1, total_bytes=1, files=1,
            uploaded_bytes=1, uploaded_chunks=1, manifest_bytes=1, duration_ms=1.0,
        ),
    )  # fmt: skip
    assert [s.id for s in policy.awaiting_verification(uploaded)] == ["sv-1"]
    assert "sv-1" not in policy.retained(uploaded)
    retained, dropped = retained_and_dropped([uploaded])
    assert retained == ["sv-1"] and dropped == []
