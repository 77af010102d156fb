"""Which tasks this orchestrator instance drives (decision 036).

An instance renews its own lease in the instance bucket and watches its twins'.
It drives a task only under a claim it appended to the task's log
(`task.driver_claimed`, a new epoch); it claims a task that is new and was
submitted through it, one left unclaimed for a lease's length, one whose
driver's lease it has not seen renewed for `ttl + margin`, and one its own name
drove in an earlier process or an earlier lease term. The log's fence settles
two instances racing for one task.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from nats.js.kv import KeyValue
from sandhold.bus.instances import InstanceWatcher, OwnLease
from sandhold.bus.ports import Aggregates
from sandhold.domain import events as ev
from sandhold.domain import task as tk
from sandhold.domain.errors import Rejected
from sandhold.domain.task_driver import claim_driver
from sandhold.orchestrator.runner import DriverClaim

log = logging.getLogger("sandhold.orchestrator")


class Driving:
    """This instance's lease, its twins' as seen here, and its claims of tasks."""

    def __init__(
        self,
        tasks: Aggregates[tk.Task],
        kv: KeyValue,
        role: str,
        instance: str,
        *,
        lease_ttl_s: float,
        fence_margin_s: float,
    ) -> None:
        self._tasks = tasks
        self.instance = instance
        self.lease = OwnLease(kv, role, instance, ttl=lease_ttl_s)
        self.twins = InstanceWatcher(kv, role, ttl=lease_ttl_s, margin=fence_margin_s)
        # task -> (lease term, epoch) of this process's latest claim of it
        self._claims: dict[str, tuple[int, int]] = {}
        # In a claim's message id: two processes that run under one name (which they
        # should not) never pass one append for both, so they never share an epoch.
        self._process = uuid.uuid4().hex[:8]

    async def start(self) -> None:
        """Watch the twins, then renew once: nothing is claimed before that. A
        cluster still electing its leaders may not answer yet: asked again."""
        await self.twins.start()
        while True:
            try:
                await self.lease.renew()
                return
            except Exception as err:  # noqa: BLE001 - the lease is what matters, not why
                log.warning("%s: first lease renewal failed (%r); again", self.instance, err)
                await asyncio.sleep(self.lease.interval)

    def may_claim(self) -> bool:
        """The lease held, and every twin's renewal stored before this lease term
        began seen here: a process that was paused must not judge its twins by
        what it saw before the pause."""
        return self.lease.held() and self.twins.has_seen(self.lease.term_revision)

    def wants(self, state: tk.Task, *, asked: bool) -> bool:
        """Whether to drive `state` (or release its sandbox) from here; `asked`:
        a request about it was taken here."""
        if state.driver is None:
            # New: its submitter's, which claims it at once. Left unclaimed for a
            # lease's length (its submitter died first, or it predates claims):
            # whoever gets there first.
            return asked or time.time() - state.submitted_at >= self.lease.ttl
        if state.driver == self.instance:
            return True  # this process's claim, or an earlier one's, taken over
        return not self.twins.is_live(state.driver)

    async def claim(self, task_id: str, term: int) -> int | None:
        """The epoch this instance drives the task in, claimed now or held since;
        None where another live instance drives it or the task ended meanwhile."""
        held = self._claims.get(task_id)
        holding = held[1] if held is not None and held[0] == term else None

        def decide(state: tk.Task | None) -> list[ev.AnyEvent]:
            if not self.lease.held() or self.lease.term != term:
                raise Rejected("lease_lapsed", f"{self.instance}'s lease lapsed")
            return claim_driver(state, self.instance, holding=holding, live=self.twins.is_live)

        try:
            executed = await self._tasks.follow_up(task_id, decide, why=f"driver:{self._process}")
        except Rejected as err:
            log.debug("%s: not claimed by %s: %s", task_id, self.instance, err.message)
            return None
        assert executed.state is not None
        epoch = executed.state.driver_epoch
        if executed.appended:
            log.info("%s: driven by %s from epoch %d", task_id, self.instance, epoch)
        self._claims[task_id] = (term, epoch)
        return epoch

    def runner_claim(self, epoch: int, term: int) -> DriverClaim:
        """What a runner drives under: good while the lease holds in `term`."""
        return DriverClaim(
            self.instance, epoch, held=lambda: self.lease.held() and self.lease.term == term
        )

    def forget(self, task_id: str) -> None:
        self._claims.pop(task_id, None)
