"""The recovery service: host liveness, and what a lost host means for its sandboxes.

It watches the lease bucket. A host that has not renewed for `lease_ttl` is
lost (`host.lost`); each sandbox placed there becomes `lost`, its running
commands end `infrastructure_lost`, dispatched-but-unconfirmed ones `unknown`,
unfinished saves fail. Only once `lease_ttl + fence_margin` have passed since
the last renewal it saw does it declare the host `fenced` (and each sandbox):
by then a host-agent that cannot renew has killed its processes and stopped
writing. Nothing is restarted here: the next start or command does that.

Two recovery services at once (docs/deploy.md): both watch the leases and
decide on the same log; each declaration is appended once (the fence; a
sandbox's with the same id from both). The first to see a host's lease run
out declares it, so before declaring, one reads the lease itself: a watcher
that fell behind (its own connection slow, its node lagging) must not declare
a host lost that its twin sees renewing.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.js.errors import KeyNotFoundError
from sandhold.bus import leases
from sandhold.bus.names import Names
from sandhold.bus.service import Shell
from sandhold.domain import host as host_domain
from sandhold.domain import recovery as policy
from sandhold.domain import sandbox as sb
from sandhold.domain.errors import SandholdError

log = logging.getLogger("sandhold.recovery")


class Recovery:
    name = "recovery"

    def __init__(
        self,
        nats_url: str,
        names: Names,
        *,
        lease_ttl: float = 5.0,
        fence_margin: float = 2.0,
        tick_s: float = 0.2,
    ) -> None:
        self._names = names
        self._shell = Shell(self.name, nats_url, names)
        self._ttl = lease_ttl
        self._margin = fence_margin
        self._tick_s = tick_s
        self._started_at = time.time()

    async def run(self) -> None:
        async with self._shell as shell:
            kv = self._kv = await leases.lease_bucket(shell.js, self._names)
            settings = leases.RecoverySettings(lease_ttl_s=self._ttl, fence_margin_s=self._margin)
            await kv.put(leases.SETTINGS_KEY, msgspec.json.encode(settings))
            self.hosts = shell.store("host", host_domain.evolve)
            # Looked at on every tick: what came since the last one, folded at once
            # (decision 087), not each event as the exec path appends it.
            self.sandboxes = shell.store(
                "sandbox", sb.evolve, compact=sb.compact, forget=sb.forgettable,
                pace_s=self._tick_s,
            )  # fmt: skip
            # What a tick looks at, kept in step with the log (decision 056): the
            # places held on each host, and the sandboxes whose loss still has
            # something to say; not every sandbox ever made.
            self._placements = self.sandboxes.group(sb.placed_on)
            self._losing = self.sandboxes.select(policy.loss_pending)
            self.leases = leases.LeaseWatcher(kv, ttl=self._ttl)
            await shell.start_stores()
            await self.leases.start()
            shell.on_close(self.leases.stop)
            shell.spawn(self._watch(), "watch")
            log.info(
                "recovery ready (lease_ttl %.1fs, fence_margin %.1fs)", self._ttl, self._margin
            )
            await shell.serve()

    async def shutdown(self) -> None:
        self._shell.stop()

    async def _watch(self) -> None:
        while True:
            try:
                await self._check_hosts()
                await self._check_sandboxes()
            except SandholdError as err:
                log.warning("recovery check failed, retrying: %s", err)
            except Exception:
                log.exception("recovery check failed, retrying")
            await asyncio.sleep(self._tick_s)

    async def _check_hosts(self) -> None:
        now = time.time()
        for host_id in self.hosts.ids():
            host, _ = self.hosts.get(host_id)
            if host is None:
                continue
            if host.status == "registered":
                # Never renewed since this recovery service started: count from then.
                last = self.leases.last_renewal(host_id, epoch=host.epoch)
                last = last if last is not None else max(host.registered_at, self._started_at)
                if now - last > self._ttl and not await self._renewed_unseen(host_id):
                    fence_at = last + self._ttl + self._margin
                    log.warning(
                        "host %s lost (epoch %d): no renewal for %.1fs",
                        host_id,
                        host.epoch,
                        now - last,
                    )
                    await self._host_follow_up(
                        host_id,
                        lambda h, e=host.epoch, seen=last, f=fence_at: host_domain.decide_lost(
                            h, epoch=e, last_renewal_at=seen, fence_at=f
                        ),
                        "lost",
                    )
            elif host.status == "lost" and host.fence_at is not None and now >= host.fence_at:
                log.warning("host %s fenced (epoch %d)", host_id, host.epoch)
                await self._host_follow_up(
                    host_id, lambda h, e=host.epoch: host_domain.decide_fenced(h, epoch=e), "fenced"
                )

    async def _renewed_unseen(self, host_id: str) -> bool:
        """Whether the lease bucket holds a renewal of `host_id` newer than the last
        one the watcher delivered here (then the watcher is behind, not the host)."""
        try:
            entry = await self._kv.get(host_id)
            stored = msgspec.json.decode(entry.value or b"", type=leases.Lease)
        except (KeyNotFoundError, msgspec.DecodeError):  # no lease: nothing newer to go by
            return False
        except Exception as err:  # noqa: BLE001 - the bucket did not answer: not now
            log.warning("host %s: its lease could not be read (%r); judged later", host_id, err)
            return True
        if stored.host != host_id:
            return False  # a value speaks for its own key only
        seen = self.leases.lease(host_id)
        if seen is not None and (stored.epoch, stored.renewed_at) <= (seen.epoch, seen.renewed_at):
            return False
        log.warning(
            "host %s renewed its lease after the last renewal seen here: not declared lost",
            host_id,
        )
        return True

    def _to_check(self) -> set[str]:
        """The sandboxes placed on a host judged lost, and those being lost."""
        ids = set(self._losing.ids())
        for host_id in self.hosts.ids():
            host, _ = self.hosts.get(host_id)
            if host is not None and host.status in ("lost", "fenced"):
                ids |= self._placements.members(host_id)
        return ids

    async def _check_sandboxes(self) -> None:
        now = time.time()
        for sandbox_id in sorted(self._to_check()):
            try:
                await self._check_sandbox(sandbox_id, now)
            except Exception as err:  # one sandbox's trouble must not hold up the others
                log.warning("recovery of %s: %r; will retry", sandbox_id, err)

    async def _check_sandbox(self, sandbox_id: str, now: float) -> None:
        state, _ = self.sandboxes.get(sandbox_id)
        if state is None or state.host is None:
            return
        host, _ = self.hosts.get(state.host)
        if (
            host is not None
            and host.status in ("lost", "fenced")
            and state.phase in sb.ACTIVE_PHASES
            and host.last_renewal_at is not None
            and host.fence_at is not None
        ):
            await self._follow_up(
                sandbox_id,
                lambda s, h=host: policy.declare_lost(
                    s, host=h.host, last_renewal_at=h.last_renewal_at, fence_at=h.fence_at
                ),
                "lost",
            )
            state, _ = self.sandboxes.get(sandbox_id)
        if state is None or state.lost is None:
            return
        if policy.after_loss(state):
            await self._follow_up(sandbox_id, policy.after_loss, "after-loss")
        if not state.lost.fenced and now >= state.lost.fence_at:
            await self._follow_up(
                sandbox_id,
                lambda s, h=state.lost.host: policy.declare_fenced(s, host=h),
                "fenced",
            )

    async def _follow_up(self, sandbox_id: str, decide, why: str) -> None:
        await self.sandboxes.follow_up(sandbox_id, decide, why=why)

    async def _host_follow_up(self, host_id: str, decide, why: str) -> None:
        await self.hosts.follow_up(host_id, decide, why=why)
