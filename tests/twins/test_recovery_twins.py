"""Two recovery services on one log: a host declared lost and fenced once, each of
its sandboxes once; and a watcher that fell behind declares nothing."""

from __future__ import annotations

import nats
from sandhold.bus import leases
from sandhold.bus.names import Names
from sandhold.bus.read import read_subjects
from sandhold.recovery.service import Recovery

from tests.support.waiting import wait_until
from tests.twins.support import Running, register_host, renew_lease, running_sandbox


async def _types(nc: nats.NATS, names: Names, kind: str, aggregate_id: str) -> list[str]:
    records = await read_subjects(
        nc.jetstream(), names.events_stream, names.events(kind, aggregate_id)
    )
    return [r.envelope.type for r in records]


async def test_two_recovery_services_declare_a_lost_host_and_its_sandboxes_once(
    nc: nats.NATS, nats_url: str, names: Names
):
    await register_host(nc, names, "h1", capacity=4)
    await renew_lease(nc, names, "h1")  # once: then the host dies
    ids = [await running_sandbox(nc, names, f"sb-{i}", "h1") for i in range(3)]
    running = Running()
    try:
        twins = [
            running.start(Recovery(nats_url, names, lease_ttl=1.0, fence_margin=0.5, tick_s=0.02))
            for _ in range(2)
        ]

        def all_fenced(recovery: Recovery) -> bool:
            if not hasattr(recovery, "sandboxes"):
                return False
            host, _ = recovery.hosts.get("h1")
            states = [recovery.sandboxes.get(i)[0] for i in ids]
            return (
                host is not None
                and host.status == "fenced"
                and all(s is not None and s.lost is not None and s.lost.fenced for s in states)
            )

        # Both folds say so: whatever either decides from now on is nothing, and
        # whatever either decided before is in the log or refused by the fence.
        await wait_until(lambda: all(all_fenced(r) for r in twins), timeout=30, what="fenced")
        assert await _types(nc, names, "host", "h1") == [
            "host.registered",
            "host.lost",
            "host.fenced",
        ]
        for sandbox_id in ids:
            types = await _types(nc, names, "sandbox", sandbox_id)
            assert types.count("sandbox.lost") == 1 and types.count("sandbox.fenced") == 1
    finally:
        await running.close()


async def test_a_renewal_the_watcher_has_not_delivered_keeps_the_host_from_being_lost(
    nc: nats.NATS, nats_url: str, names: Names
):
    kv = await leases.lease_bucket(nc.jetstream(), names)
    recovery = Recovery(nats_url, names)
    recovery._kv = kv
    recovery.leases = leases.LeaseWatcher(kv, ttl=5.0)  # never started: it delivers nothing
    assert not await recovery._renewed_unseen("h1")  # no lease at all
    await renew_lease(nc, names, "h1")
    assert await recovery._renewed_unseen("h1")  # stored, not yet seen here
    await recovery.leases.start()
    try:
        await wait_until(lambda: recovery.leases.lease("h1") is not None, what="delivered")
        assert not await recovery._renewed_unseen("h1")  # seen: nothing newer
    finally:
        await recovery.leases.stop()
