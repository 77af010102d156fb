"""Service instances' leases on a real nats-server: an instance holds its own
while it renews, in terms that begin anew after a lapse; its twins see it live
by their own clock, and a value that names another instance is not believed."""

from __future__ import annotations

import time

import msgspec
import nats
from sandhold.bus.instances import (
    InstanceLease,
    InstanceWatcher,
    OwnLease,
    instance_bucket,
    instance_key,
)
from sandhold.bus.names import Names

from tests.support.waiting import wait_until

ROLE = "orchestrator"


async def test_an_instance_holds_its_lease_while_it_renews_and_its_twin_sees_it(
    nc: nats.NATS, names: Names
):
    kv = await instance_bucket(nc.jetstream(), names)
    twin = InstanceWatcher(kv, ROLE, ttl=5.0)
    await twin.start()
    lease = OwnLease(kv, ROLE, "orchestrator-1", ttl=5.0)
    assert not lease.held() and lease.term == 0
    await lease.renew()
    assert lease.held() and lease.term == 1
    await wait_until(lambda: twin.has_seen(lease.term_revision), what="the renewal seen")
    assert twin.is_live("orchestrator-1")
    value = msgspec.json.decode((await kv.get(lease.key)).value or b"", type=InstanceLease)
    assert (value.instance, value.ttl_s, value.interval_s) == ("orchestrator-1", 5.0, 1.0)
    await lease.renew()
    assert lease.term == 1  # renewed in time: the same term
    await twin.stop()


async def test_a_lease_that_lapsed_is_held_again_in_a_new_term(nc: nats.NATS, names: Names):
    kv = await instance_bucket(nc.jetstream(), names)
    lease = OwnLease(kv, ROLE, "orchestrator-1", ttl=0.5)
    await lease.renew()
    first = lease.term_revision
    await wait_until(lambda: not lease.held(), timeout=5, what="the lease to lapse")
    await lease.renew()
    assert lease.held() and lease.term == 2 and lease.term_revision > first


async def test_a_twin_that_stops_renewing_is_no_longer_live(nc: nats.NATS, names: Names):
    kv = await instance_bucket(nc.jetstream(), names)
    lease = OwnLease(kv, ROLE, "orchestrator-2", ttl=0.5)
    watcher = InstanceWatcher(kv, ROLE, ttl=0.8)
    await watcher.start()
    sent = time.monotonic()  # the renewal cannot arrive before it was sent
    await lease.renew()
    await wait_until(lambda: watcher.has_seen(lease.term_revision), what="the renewal seen")
    assert watcher.is_live("orchestrator-2")
    await wait_until(
        lambda: not watcher.is_live("orchestrator-2"), timeout=5, what="the twin not live"
    )
    assert time.monotonic() - sent >= 0.75  # not before the watcher's ttl
    await watcher.stop()


async def test_a_twin_holding_a_longer_lease_is_live_for_as_long_as_it_holds(
    nc: nats.NATS, names: Names
):
    """Each instance may be given its own --lease-ttl: a watcher with a shorter
    one must not count a twin dead while that twin still holds its lease."""
    kv = await instance_bucket(nc.jetstream(), names)
    lease = OwnLease(kv, ROLE, "orchestrator-2", ttl=2.0)
    watcher = InstanceWatcher(kv, ROLE, ttl=0.5, margin=0.2)
    await watcher.start()
    sent = time.monotonic()
    await lease.renew()
    await wait_until(lambda: watcher.has_seen(lease.term_revision), what="the renewal seen")
    await wait_until(
        lambda: not watcher.is_live("orchestrator-2"), timeout=10, what="the twin not live"
    )
    assert time.monotonic() - sent >= 2.1  # its own ttl (2 s) and the margin, not ours
    await watcher.stop()


async def test_an_instance_never_seen_is_given_a_ttl_from_the_watchs_start(
    nc: nats.NATS, names: Names
):
    kv = await instance_bucket(nc.jetstream(), names)
    watcher = InstanceWatcher(kv, ROLE, ttl=0.5)
    await watcher.start()
    assert watcher.is_live("orchestrator-9")  # its lease may not have arrived yet
    await wait_until(lambda: not watcher.is_live("orchestrator-9"), timeout=5, what="not live")
    await watcher.stop()


async def test_a_lease_that_names_another_instance_is_not_believed(nc: nats.NATS, names: Names):
    kv = await instance_bucket(nc.jetstream(), names)
    watcher = InstanceWatcher(kv, ROLE, ttl=0.5)
    await watcher.start()
    await wait_until(lambda: not watcher.is_live("orchestrator-2"), timeout=5, what="not live")
    forged = InstanceLease(
        instance="orchestrator-2", pid=1, renewed_at=time.time(), interval_s=1.0, ttl_s=5.0
    )
    revision = await kv.put(instance_key(ROLE, "orchestrator-1"), msgspec.json.encode(forged))
    await wait_until(lambda: watcher.has_seen(revision), what="the forged value seen")
    assert not watcher.is_live("orchestrator-2")  # written under another's key
    assert not watcher.is_live("orchestrator-1")  # and not what its own key holds
    await watcher.stop()
