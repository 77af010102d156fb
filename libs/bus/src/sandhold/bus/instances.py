"""Service instances' leases: where a service runs more than once, each instance
renews its own key and watches its twins' (decision 036).

Bucket `<PREFIX>_instances`, key `<role>.<instance>` (`orchestrator.orchestrator-2`),
value `InstanceLease`. A service's user may write its own role's keys only
(permissions.py), and a value names its own key. Instances of one role share
its credential: permissions keep other roles out; what keeps two instances of
one role apart is their names, which must be unique (decision 036).

Two clocks, both this process's own monotonic one: an instance *holds* its lease
while its last renewal that succeeded was sent less than `ttl` ago; a twin counts
as live while a renewal of its key arrived here less than `ttl + margin` ago
(`leases.RenewalWatcher`). Sending time is the conservative end for the holder,
arrival time for the watcher, so by the time a watcher takes over, the holder
has stopped acting on its own clock — the margin covers the rest (the holder's
check cadence, transit, skew in the arrival-age correction).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time

import msgspec
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from sandhold.bus.leases import RenewalWatcher
from sandhold.bus.names import Names

log = logging.getLogger(__name__)


class InstanceLease(msgspec.Struct, frozen=True, kw_only=True):
    instance: str
    pid: int
    renewed_at: float  # the instance's wall clock, for people reading the bucket
    interval_s: float  # how often it renews
    ttl_s: float  # how long it holds the lease without a renewal


_decode = msgspec.json.Decoder(InstanceLease).decode
_encode = msgspec.json.Encoder().encode


def instance_key(role: str, instance: str) -> str:
    return f"{role}.{instance}"


async def instance_bucket(js: JetStreamContext, names: Names) -> KeyValue:
    return await js.key_value(names.instance_bucket)


def renewal_interval(ttl: float) -> float:
    """How often a lease of `ttl` seconds is renewed: a few renewals may be missed
    before it lapses."""
    return min(1.0, ttl / 4)


class OwnLease:
    """This instance's lease. `held()` says whether it may act; `term` grows each
    time the lease is held again after it lapsed (or for the first time), and
    whatever was claimed in an earlier term must be claimed anew."""

    def __init__(self, kv: KeyValue, role: str, instance: str, *, ttl: float) -> None:
        self._kv = kv
        self.instance = instance
        self.key = instance_key(role, instance)
        self.ttl = ttl
        self.interval = renewal_interval(ttl)
        self._held_until = -math.inf  # monotonic
        self.term = 0
        # The bucket revision of the renewal that began this term: a watcher that has
        # seen it has seen every twin's renewal stored before this term began.
        self.term_revision = 0

    def held(self) -> bool:
        return time.monotonic() < self._held_until

    async def renew(self) -> None:
        """One renewal; raises when it fails (or does not finish while the lease
        still holds: a put that hangs must not outlast the lease)."""
        sent = time.monotonic()
        lease = InstanceLease(
            instance=self.instance,
            pid=os.getpid(),
            renewed_at=time.time(),
            interval_s=self.interval,
            ttl_s=self.ttl,
        )
        left = self._held_until - sent
        revision = await asyncio.wait_for(
            self._kv.put(self.key, _encode(lease)),
            timeout=max(0.05, left) if left > 0 else self.ttl,
        )
        if sent >= self._held_until:
            # Lapsed before this renewal was sent (a pause, an outage): a new term.
            self.term += 1
            self.term_revision = revision
            log.info("%s holds its lease (term %d)", self.instance, self.term)
        self._held_until = max(self._held_until, sent + self.ttl)

    async def run(self) -> None:
        """Renew every `interval` seconds, for the service's lifetime."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.renew()
            except Exception as err:  # the lease lapsing is what says so
                log.warning("%s: lease renewal failed: %r", self.instance, err)


class InstanceWatcher:
    """Every instance of one role as this process sees their leases: live while a
    renewal arrived here within `ttl + margin` seconds — or the twin's own `ttl_s`
    plus the margin, when it holds a longer lease than ours (each instance may be
    given its own `--lease-ttl`; a twin is live for as long as it holds). An
    instance never seen is given `ttl + margin` from when the watch began (its
    lease may just not have arrived)."""

    def __init__(self, kv: KeyValue, role: str, *, ttl: float, margin: float = 0.0) -> None:
        self._role = role
        self._ttl = ttl
        self._margin = margin
        self._renewals = RenewalWatcher(
            kv,
            ttl=ttl + margin,
            decode=_decode,
            key_of=lambda lease: instance_key(role, lease.instance),
            keys=f"{role}.>",
        )
        self._started = math.inf

    async def start(self) -> None:
        await self._renewals.start()
        self._started = time.monotonic()

    async def stop(self) -> None:
        await self._renewals.stop()

    def is_live(self, instance: str) -> bool:
        seen = self._renewals.seen(instance_key(self._role, instance))
        if seen is None:
            return time.monotonic() - self._started < self._ttl + self._margin
        arrived, lease = seen
        return time.monotonic() - arrived < max(self._ttl, lease.ttl_s) + self._margin

    def has_seen(self, revision: int) -> bool:
        """Whether every renewal stored up to `revision` has arrived here."""
        return self._renewals.revision >= revision
