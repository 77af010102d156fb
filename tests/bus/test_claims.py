"""A claim on a duty: held by one instance at a time, taken over once its holder
stops renewing, given up at once on a graceful stop (a real KV bucket)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import nats
from sandhold.bus import credentials
from sandhold.bus.claims import Claim
from sandhold.bus.connection import connect
from sandhold.bus.instances import instance_bucket
from sandhold.bus.names import Names
from sandhold.bus.server import NatsServer

from tests.support.bus import make_streams
from tests.support.waiting import wait_until

TTL = 1.0


async def _claims(nc: nats.NATS, names: Names, *holders: str, **kw) -> list[Claim]:
    kv = await instance_bucket(nc.jetstream(), names)
    return [Claim(kv, "saver", "store", holder, ttl=TTL, **kw) for holder in holders]


async def test_two_racing_for_a_free_claim_one_holds_it(nc: nats.NATS, names: Names):
    a, b = await _claims(nc, names, "saver-1", "saver-2")
    await asyncio.gather(a.look(), b.look())
    assert [a.held(), b.held()].count(True) == 1
    holder, other = (a, b) if a.held() else (b, a)
    await other.look()  # looking again changes nothing while the holder renews
    await holder.look()
    assert holder.held() and not other.held()
    assert other.seen_holder == holder.holder


async def test_a_holder_that_stops_renewing_is_taken_over_after_the_ttl_never_before(
    nc: nats.NATS, names: Names
):
    changes: list[tuple[str, bool]] = []
    a, b = await _claims(nc, names, "saver-1", "saver-2")
    a._on_change = lambda held: changes.append(("a", held))
    b._on_change = lambda held: changes.append(("b", held))
    await a.look()
    assert a.held() and changes == [("a", True)]
    # `a` dies (kill -9: no renewal, no release); `b` keeps looking.
    loop = asyncio.get_running_loop()
    started = loop.time()
    running = asyncio.create_task(b.run())
    try:
        await wait_until(b.held, timeout=10, what="the twin taking the claim over")
        # Never both: by the time `b` acts, `a` stopped on its own clock.
        assert not a.held()
        assert loop.time() - started >= TTL
        assert b.term == 1 and b.seen_holder == "saver-2"
        # `a` comes back (it was only paused): its next look finds the claim taken.
        await a.look()
        assert not a.held() and a.seen_holder == "saver-2"
        assert changes == [("a", True), ("b", True), ("a", False)]
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def test_a_renewal_after_a_takeover_is_refused_and_the_old_holder_stops(
    nc: nats.NATS, names: Names
):
    a, b = await _claims(nc, names, "saver-1", "saver-2")
    await a.look()

    async def b_took_over() -> bool:  # `a` is paused meanwhile: it renews nothing
        await b.look()
        return b.held()

    await wait_until(b_took_over, timeout=10, interval=b.interval, what="b taking over")
    # A paused `a` wakes up and renews on the revision it wrote: refused.
    await a.look()
    assert not a.held() and b.held()
    await b.look()
    assert b.held()  # b's renewals go on


async def test_a_hold_that_ran_out_between_two_looks_is_told_as_a_new_term(
    nc: nats.NATS, names: Names
):
    """A renewal that comes after the hold ran out (the looks between failed: a
    stream leader killed) begins a new term, and `on_change` hears it: False,
    then True. The scheduler places only in the term it readied; told nothing,
    it held the claim and placed no sandbox again (a CI run of the leader-kill
    test hung on exactly this)."""
    changes: list[tuple[bool, int]] = []
    [claim] = await _claims(nc, names, "scheduler-2")
    claim._on_change = lambda held: changes.append((held, claim.term))
    await claim.look()
    assert changes == [(True, 1)]
    # No look succeeds while the hold runs out (nobody else wants the claim, so
    # the key stays ours and the next renewal on its revision succeeds).
    await wait_until(lambda: not claim.held(), timeout=10, what="the hold running out")
    await claim.look()
    assert claim.held() and claim.term == 2
    assert changes == [(True, 1), (False, 2), (True, 2)]
    await claim.look()  # renewed within the hold: nothing to tell
    assert changes == [(True, 1), (False, 2), (True, 2)]


async def test_a_claim_given_up_is_taken_at_the_next_look(nc: nats.NATS, names: Names):
    a, b = await _claims(nc, names, "saver-1", "saver-2")
    await a.look()
    await b.look()
    assert not b.held()
    await a.release()
    assert not a.held()
    await b.look()
    assert b.held()  # no TTL to wait out after a graceful stop
    await a.look()
    assert not a.held() and a.seen_holder == "saver-2"


async def test_a_renewal_whose_answer_was_lost_is_recognised_as_its_own(
    nc: nats.NATS, names: Names
):
    (a,) = await _claims(nc, names, "saver-1")
    await a.look()
    term = a.term
    a._revision -= 1  # as if the last renewal succeeded but its answer never came
    await a.look()
    assert a.held()
    await a.look()
    assert a.held() and a.term in (term, term + 1)


async def test_a_service_holds_its_own_roles_claims_and_no_other_roles(tmp_path: Path):
    # The claim keys are the role's own keys of the instance bucket (permissions.py):
    # each service's credential may hold its role's claims, no other role's.
    names = Names("sh")
    server = NatsServer(tmp_path / "nats", names=names)
    for role in ("saver", "scheduler"):
        credentials.issue(server.credentials_dir, role)
    server.start()
    try:
        await make_streams(server, names)
        conns = {}
        for role in ("saver", "scheduler"):
            own = credentials.load(credentials.path_of(server.credentials_dir, role))
            conns[role] = await connect(server.url, name=role, credentials=own)
        try:
            saver_kv = await instance_bucket(conns["saver"].jetstream(), names)
            mine = Claim(saver_kv, "saver", "store", "saver-1", ttl=TTL)
            await mine.look()
            assert mine.held()
            scheduler_kv = await instance_bucket(conns["scheduler"].jetstream(), names)
            placement = Claim(scheduler_kv, "scheduler", "placement", "scheduler-1", ttl=TTL)
            await placement.look()
            assert placement.held()
            theirs = Claim(scheduler_kv, "saver", "store", "scheduler-1", ttl=TTL)
            await mine.release()
            await theirs.look()  # the key is free: its write is refused all the same
            assert not theirs.held()
            await mine.look()
            assert mine.held()
        finally:
            for nc in conns.values():
                await nc.close()
    finally:
        server.stop()
