"""The scheduler: decides client requests, places sandboxes, dispatches work.

One loop takes requests off the REQUESTS work queue: decode strictly → decide
on the sandbox's folded state → append behind the fence → reply → ack. A
second loop reconciles: after any change to a sandbox it runs the domain's
level-triggered `plan` (place, dispatch, not_launched, stop, destroy) until
nothing is left to do, and sends the host work that state calls for.

Two schedulers at once (docs/deploy.md): they share the request queue (one
durable consumer: each request goes to one of them, and a redelivered one is
answered again from its key), and both reconcile every sandbox; the fence lets
one append each decision and their host work carries the same message ids,
which JetStream de-duplicates. Placement alone counts across sandboxes (a
host's free slots), so only the scheduler holding the claim
`scheduler.claim.placement` places (claims.py), from a fold caught up with
the log when it took the claim: two never fill one host's last slot twice.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from sandhold.bus import leases, secret_store
from sandhold.bus.answering import RequestKinds, answer
from sandhold.bus.claims import Claim
from sandhold.bus.instances import instance_bucket
from sandhold.bus.names import Names
from sandhold.bus.reconciler import DirtyLoop, SentWork, send_work
from sandhold.bus.service import Shell, instance_name
from sandhold.domain import events as ev
from sandhold.domain import host as host_domain
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import work as wk
from sandhold.domain.envelope import Envelope
from sandhold.domain.errors import Rejected
from sandhold.domain.placement import HostInfo, Waiting, choose_host, network_modes, why_waiting
from sandhold.domain.reconcile import plan, secrets_gone
from sandhold.domain.saves import SaveRecord
from sandhold.domain.views import ErrorBody, Reply, reply_for
from sandhold.saves.errors import CorruptManifest, MissingManifest
from sandhold.saves.store import SaveStore

log = logging.getLogger("sandhold.scheduler")

# How long a seed not found waits before it is looked for again (a replica behind
# the leader), the last time refusing the request.
LAGGING_REPLICA_RETRIES_S = (0.1, 0.3, 0.6)
# A command's secrets are kept before its `command.queued` is appended (perhaps
# by another scheduler): secrets younger than this may belong to one on its way.
LEFT_SECRETS_GRACE_S = 60.0
# How long after host work was stored a pass does not send it again: well
# within the host work stream's duplicate window (decision 097).
RESEND_QUIET_S = 30.0

_reply_encoder = msgspec.json.Encoder()


class Scheduler:
    name = "scheduler"

    def __init__(
        self,
        nats_url: str,
        names: Names,
        *,
        lease_ttl: float = 5.0,
        defaults: sb.Defaults = sb.Defaults(),  # noqa: B008 - frozen
        durable: str = "scheduler",
        instance: str | None = None,
        claim_ttl: float = 5.0,
        left_secrets_grace_s: float = LEFT_SECRETS_GRACE_S,
    ) -> None:
        self._names = names
        self._left_secrets_grace_s = left_secrets_grace_s
        self.left_secrets_removed: int | None = None  # once looked for: how many
        self._shell = Shell(self.name, nats_url, names)
        self.instance = instance or instance_name(self.name)
        self._claim_ttl = claim_ttl
        self._placing_term: int | None = None  # the claim's term this one places in
        self._lease_ttl = lease_ttl
        self._defaults = defaults
        self._durable = durable
        # sandbox id -> ids of its commands whose secrets may still be stored (for
        # a sandbox first looked at since this process started: all it keeps;
        # those of commands ended before are `_forget_left_secrets`'s).
        self._secrets_held: dict[str, set[str]] = {}
        self._connections_forgotten: set[str] = set()  # deleted sandboxes' ids, likewise
        # A sandbox the store forgot (decision 061): the secrets and whether the
        # Connections it may have left, for the pass its forgetting sets off.
        self._leftovers: dict[str, tuple[frozenset[str], bool]] = {}
        self._snapshot_owner: dict[str, str] = {}  # Snapshot's save id -> its sandbox
        self._dirty_loop = DirtyLoop(
            self._reconcile, what="reconciling", trace_of=lambda sid: self.sandboxes.trace_of(sid)
        )

    async def run(self) -> None:
        async with self._shell as shell:
            self._nc, self._js = shell.nc, shell.js
            # (What the stream stored is believed on the connection it said so on.)
            self._sent = SentWork(RESEND_QUIET_S, connection=lambda: shell.nc.stats["reconnects"])
            self.hosts = shell.store("host", host_domain.evolve)
            self.sandboxes = shell.store(
                "sandbox", sb.evolve, compact=sb.compact, forget=sb.forgettable
            )
            self.sandboxes.on_forget(self._forgotten)
            self.leases = leases.LeaseWatcher(
                await leases.lease_bucket(shell.js, self._names), ttl=self._lease_ttl
            )
            self.leases.on_renewal(self._host_renewed)
            self.sandboxes.watch(self._note_secrets)
            self.sandboxes.listen(self._mark_dirty)
            # Those waiting on something outside their own log (`_sweep`), and the
            # places held on each host, kept as each sandbox changes: placing one
            # must not count every sandbox again (200 waiting sandboxes, each
            # planned every sweep, made that the scheduler's busiest loop).
            self._waiting = self.sandboxes.select(sb.waits_outside_its_log)
            self._placements = self.sandboxes.group(sb.placed_on)
            self.sandboxes.listen(self._note_snapshots)
            self.sandboxes.watch(self._note_deleted_snapshots)
            await shell.start_stores()
            await self.leases.start()
            shell.on_close(self.leases.stop)
            self.placement = Claim(
                await instance_bucket(shell.js, self._names),
                self.name,
                "placement",
                self.instance,
                ttl=self._claim_ttl,
                on_change=self._placement_changed,
            )
            await self.placement.look()  # free (the first scheduler, or one given up): place now
            shell.spawn(self.placement.run(), "placement claim")
            shell.on_close(self.placement.release)
            for sandbox_id in self.sandboxes.ids():
                self._mark_dirty(sandbox_id)
            shell.spawn(self._forget_left_secrets(), "left secrets")
            # Sandbox and command requests; task requests are the orchestrator's.
            # Creating the consumer also moves one made with the old `req.>` filter.
            consumer = ConsumerConfig(
                durable_name=self._durable,
                ack_policy=AckPolicy.EXPLICIT,
                # Deciding takes milliseconds; a request delivered to a scheduler
                # that died reaches the next one well within a client's 30 s wait.
                ack_wait=10,
                max_deliver=10,
                filter_subjects=[
                    self._names.requests("sandbox"),
                    self._names.requests("command"),
                    self._names.requests("connection"),
                ],
            )
            await shell.work_queue(
                self._names.requests_stream, consumer, self._handle, what="requests"
            )
            shell.spawn(self._dirty_loop.run(), "reconcile")
            shell.spawn(self._sweep(), "sweep")
            log.info("scheduler ready")
            await shell.serve()

    async def shutdown(self) -> None:
        self._shell.stop()

    # --- requests -------------------------------------------------------------

    async def _handle(self, msg: Msg) -> None:
        request = await answer(self._nc, self._names, msg, _REQUESTS, self._decide)
        if request is not None:
            self._mark_dirty(sb.aggregate_of(request))

    async def _decide(self, request: rq.AnyRequest) -> bytes:
        sandbox_id = sb.aggregate_of(request)
        if isinstance(request, rq.CreateSandbox) and request.seed is not None:
            await self._check_seed(request.seed, sandbox_id, request.seed_manifest_digest or "")
        if isinstance(request, rq.CreateSandbox) and request.from_snapshot is not None:
            # Its owner as the leader has it: a Snapshot can be deleted (decision
            # 069), and a twin may have just appended that.
            owner = self._snapshot_owner.get(request.from_snapshot)
            if owner is not None:
                await self.sandboxes.sync(owner, from_leader=True)
        kept = await self._keep_secrets(request, sandbox_id)
        before, _ = self.sandboxes.get(sandbox_id)
        value = await self._keep_connection(request, sandbox_id)
        try:
            executed = await self.sandboxes.execute(
                sandbox_id,
                lambda state: sb.decide(
                    state, request, defaults=self._defaults, find_snapshot=self._find_snapshot
                ),
                id_base=f"req:{request.key}",
                causation_id=request.key,
                correlation_id=request.key,
                whole=lambda state: sb.whole_needed(state, request),
            )
        except Rejected:
            if kept is not None:
                await secret_store.forget(self._js, self._names, self._names.secret(kept))
            if value is not None:
                await self._forget_connection_value(sandbox_id, value)
            raise
        assert executed.state is not None
        if not executed.appended:
            await self._forget_kept_for_nothing(executed.state, kept, value)
        if before is not None:
            for replaced in _value_ids(before) - _value_ids(executed.state):
                await self._forget_connection_value(sandbox_id, replaced)
        record = sb.result_of(executed.state, request)
        return _reply_encoder.encode(reply_for(record, sandbox_id, now=time.time()))

    async def _forget_kept_for_nothing(
        self, state: sb.Sandbox, kept: str | None, value: str | None
    ) -> None:
        """A retry answered with nothing appended, whose secrets or Connection
        value were kept again because the cache no longer knew its key (a deleted
        sandbox's, compacted, decision 057): they go again if what they were for
        is over (its command ended, its sandbox deleted). Not otherwise: the
        first request's command may still need the very same secrets."""
        command = state.commands.get(kept) if kept is not None else None
        if kept is not None and command is not None and command.ended:
            await secret_store.forget(self._js, self._names, self._names.secret(kept))
        if value is not None and state.phase == "deleted":
            await self._forget_connection_value(state.id, value)

    async def _keep_secrets(self, request: rq.AnyRequest, sandbox_id: str) -> str | None:
        """Keep a new command's secrets before the event that names them is
        appended (so a dispatch always finds them); the command's id if kept."""
        if not isinstance(request, rq.RunCommand) or not request.secrets:
            return None
        command_id = rq.command_id_for(sandbox_id, request.key)
        state, _ = self.sandboxes.get(sandbox_id)
        if state is not None and sb.queued_by(state, request.key):
            return None  # a retry of a command already queued: its secrets are kept (or used)
        # (`queued_by` None: its key kept as a fingerprint, decision 085. Kept again,
        # and forgotten again if the retry appends nothing, as for a deleted sandbox.)
        await secret_store.keep(
            self._js, self._names, self._names.secret(command_id), request.secrets
        )
        return command_id

    # --- connections (decision 031) ---------------------------------------------

    async def _keep_connection(self, request: rq.AnyRequest, sandbox_id: str) -> str | None:
        """Keep a set request's value before the event that refers to it is
        appended; the value's id if kept (None: not a new set)."""
        if not isinstance(request, rq.SetConnection):
            return None
        state, _ = self.sandboxes.get(sandbox_id)
        known = state is not None and sb.remembers(state, request.key)
        if known is None:  # kept as a fingerprint (decision 085): the log is exact
            state, _ = await self.sandboxes.read_whole(sandbox_id)
            known = state is not None and sb.remembers(state, request.key)
        if known:
            return None  # a retry: the first one's value is the one referred to
        value_id = rq.connection_value_id(sandbox_id, request.key)
        await secret_store.keep(
            self._js,
            self._names,
            self._names.connection(sandbox_id, value_id),
            {"value": request.value},
            stream=self._names.connections_stream,
        )
        return value_id

    async def _forget_connection_value(self, sandbox_id: str, value_id: str) -> None:
        await secret_store.forget(
            self._js,
            self._names,
            self._names.connection(sandbox_id, value_id),
            stream=self._names.connections_stream,
        )

    async def _connection_values(
        self, sandbox_id: str, value_ids: dict[str, str]
    ) -> dict[str, str]:
        values = {}
        for name, value_id in value_ids.items():
            kept = await secret_store.fetch(
                self._js,
                self._names,
                self._names.connection(sandbox_id, value_id),
                stream=self._names.connections_stream,
            )
            if kept is None or "value" not in kept:
                # Only an operator's purge (or a lost store) does this: the file is
                # left out, and setting the Connection again brings it back.
                log.error("the value of Connection %s of %s is gone", name, sandbox_id)
                continue
            values[name] = kept["value"]
        return values

    def _forgotten(self, sandbox_id: str, state: sb.Sandbox) -> None:
        """What is kept here beside a sandbox the store forgets goes with it: the
        values it may have left are removed by the pass that follows."""
        held = self._secrets_held.pop(sandbox_id, None)
        for save_id in state.snapshot_ids:
            self._snapshot_owner.pop(save_id, None)
        connections = (
            state.connections_revision > 0 and sandbox_id not in self._connections_forgotten
        )
        self._connections_forgotten.discard(sandbox_id)
        if held or connections:
            self._leftovers[sandbox_id] = (frozenset(held or ()), connections)

    async def _forget_leftovers(self, sandbox_id: str) -> None:
        left = self._leftovers.get(sandbox_id)
        if left is None:
            return
        secrets, connections = left
        for command_id in sorted(secrets):
            await secret_store.forget(self._js, self._names, self._names.secret(command_id))
        if connections:
            await self._forget_connections(sandbox_id)
        del self._leftovers[sandbox_id]

    async def _forget_connections(self, sandbox_id: str) -> None:
        """Remove every Connection value kept for the sandbox."""
        await secret_store.forget(
            self._js,
            self._names,
            self._names.connections_of(sandbox_id),
            stream=self._names.connections_stream,
        )

    async def _forget_deleted(self, state: sb.Sandbox) -> None:
        """A deleted sandbox's Connections' values go with it."""
        if state.phase != "deleted" or state.connections_revision == 0:
            return
        if state.id in self._connections_forgotten:
            return
        await self._forget_connections(state.id)
        if self.sandboxes.get(state.id)[0] is not None:  # (not forgotten meanwhile)
            self._connections_forgotten.add(state.id)

    async def _with_values(self, state: sb.Sandbox, work: wk.AnyWork) -> wk.AnyWork | None:
        """The instruction with the values it carries: a start's or a delivery's
        Connections, a run's secrets; None (and the command ended `not_launched`)
        when a command's secrets are gone."""
        if isinstance(work, wk.StartSandboxWork | wk.DeliverConnectionsWork):
            if not work.connection_value_ids:
                return work
            connections = await self._connection_values(state.id, work.connection_value_ids)
            return msgspec.structs.replace(work, connections=connections)
        if not isinstance(work, wk.RunCommandWork):
            return work
        command = state.commands.get(work.command_id)
        if command is None or not command.secret_names:
            return work  # (ended since, and compacted away: the host will not run it)
        values = await secret_store.fetch(
            self._js, self._names, self._names.secret(work.command_id)
        )
        if values is not None:
            return msgspec.structs.replace(work, secrets=values)
        await self.sandboxes.execute(
            state.id,
            lambda s: (
                [secrets_gone(s, work.command_id)]
                if s is not None
                and (c := s.commands.get(work.command_id)) is not None
                and c.state == "dispatched"
                else []
            ),
            id_base=f"secrets-gone:{work.command_id}",
            causation_id=work.command_id,
            correlation_id=work.command_id,
        )
        return None

    async def _forget_left_secrets(self) -> None:
        """Once, after start: secrets kept for a command that is not waiting to
        start (it started or ended, or was never queued) are left over from a
        process that stopped before it removed them. A pass looks only at the
        commands a store keeps, and it keeps no ended one (decision 057)."""
        try:
            held = await secret_store.held(self._js, self._names, self._names.secret("*"))
            waiting = {
                command_id
                for sandbox_id in self.sandboxes.ids()
                if (state := self.sandboxes.get(sandbox_id)[0]) is not None
                for command_id in state.unended_ids
            }
            removed = 0
            for subject in held:
                command_id = subject.rsplit(".", 1)[1]
                if command_id in waiting:
                    continue  # (its age is asked only of a candidate: one read each)
                kept_at = await secret_store.kept_at(self._js, self._names, subject)
                if kept_at is None or time.time() - kept_at < self._left_secrets_grace_s:
                    continue
                log.info("removing the secrets left for %s", command_id)
                await secret_store.forget(self._js, self._names, subject)
                removed += 1
            self.left_secrets_removed = removed
        except Exception as err:  # noqa: BLE001 - they expire on their own (streams.py)
            log.warning("secrets left over not looked for: %r", err)
        try:
            await self._forget_left_connections()
        except Exception as err:  # noqa: BLE001 - the next start looks again
            log.warning("Connections left over not looked for: %r", err)

    async def _forget_left_connections(self) -> None:
        """Once, after start: the Connections' values of a deleted sandbox the
        store forgot before the pass that removes them ran (decision 061). They
        do not expire, so they are looked for (names only; a sandbox not held
        is read back to be sure it is deleted)."""
        held = await secret_store.held(
            self._js,
            self._names,
            self._names.connections_of("*"),
            stream=self._names.connections_stream,
        )
        for sandbox_id in sorted({subject.split(".")[-2] for subject in held}):
            if self.sandboxes.get(sandbox_id)[0] is not None:
                continue
            whole, _ = await self.sandboxes.read_whole(sandbox_id)
            if whole is not None and whole.phase == "deleted":
                log.info("removing the Connections left by deleted sandbox %s", sandbox_id)
                await self._forget_connections(sandbox_id)

    def _note_secrets(self, sandbox_id: str, envelopes: list[Envelope]) -> None:
        """Remember the commands queued with secrets, as their events are folded:
        a pass then looks at those alone, not at every command the sandbox ran."""
        held = self._secrets_held.get(sandbox_id)
        if held is None:
            return  # not looked at yet: the first pass goes through them all
        for envelope in envelopes:
            event = envelope.event
            if isinstance(event, ev.CommandQueued) and event.secret_names:
                held.add(event.command_id)

    async def _forget_used_secrets(self, state: sb.Sandbox) -> None:
        """A command that started (or ended) needs its secrets no more."""
        held = self._secrets_held.get(state.id)
        if held is None:  # the first look since start: anything may be left over
            held = {c.id for c in state.commands.values() if c.secret_names}
            self._secrets_held[state.id] = held
        for command_id in sorted(held):
            command = state.commands.get(command_id)
            if command is not None and command.state in ("queued", "dispatched"):
                continue
            await secret_store.forget(self._js, self._names, self._names.secret(command_id))
            held.discard(command_id)

    async def _check_seed(self, save_id: str, sandbox_id: str, digest: str) -> None:
        """A seed must be stored, and staged for exactly this sandbox: the id is
        derived from tenant and key, so no one can start from another's files.
        With its digest (the orchestrator's), it must be the manifest staged."""
        if await self.sandboxes.known(sandbox_id):
            return  # already created (perhaps deleted and forgotten): the aggregate answers
        # Manifests by direct get only (its permissions pin the subjects), so no
        # leader's get: a replica behind is waited for below instead.
        store = SaveStore(self._nc, self._names, leader_reads=False)
        manifest = None
        # Staged a moment ago: a replica behind the leader may answer the direct
        # get without it (a replicated stream), so "missing" is asked again, briefly.
        for delay in (*LAGGING_REPLICA_RETRIES_S, None):
            try:
                manifest = await store.get_manifest(save_id, digest=digest)
            except CorruptManifest:
                break
            except MissingManifest:
                if delay is not None:
                    await asyncio.sleep(delay)
                    continue
            break
        if manifest is None or manifest.sandbox_id != sandbox_id:
            raise Rejected("seed_not_found", f"no save {save_id} staged for sandbox {sandbox_id}")

    def _find_snapshot(self, save_id: str) -> tuple[sb.Sandbox, SaveRecord] | None:
        owner = self._snapshot_owner.get(save_id)
        state = self.sandboxes.get(owner)[0] if owner is not None else None
        if state is None or save_id not in state.saves:
            return None
        return state, state.saves[save_id]

    def _note_snapshots(self, sandbox_id: str) -> None:
        """Whose each Snapshot is, as they are taken (a create from one must not
        go through every sandbox): a new one is always the last of its sandbox's
        (a deleted one leaves the list, `_note_deleted_snapshots`)."""
        state, _ = self.sandboxes.get(sandbox_id)
        if state is None:
            return
        if state.snapshot_ids and state.snapshot_ids[-1] not in self._snapshot_owner:
            for save_id in state.snapshot_ids:  # a new one: whose it is, once
                self._snapshot_owner[save_id] = sandbox_id

    def _note_deleted_snapshots(self, _sandbox_id: str, envelopes: list[Envelope]) -> None:
        for envelope in envelopes:
            if isinstance(envelope.event, ev.SnapshotDeleted):
                self._snapshot_owner.pop(envelope.event.save_id, None)

    # --- reconciling ----------------------------------------------------------

    def _mark_dirty(self, sandbox_id: str) -> None:
        self._dirty_loop.mark(sandbox_id)

    # --- placement: one scheduler at a time ------------------------------------

    def _placement_changed(self, held: bool) -> None:
        self._placing_term = None
        if held:
            term = self.placement.term
            self._shell.spawn(self._ready_to_place(term), f"placement term {term}")

    async def _ready_to_place(self, term: int) -> None:
        """Place only from a fold that has every placement made so far, a former
        holder's of a moment ago included: count each host's sandboxes right."""
        while self.placement.held() and self.placement.term == term:
            try:
                await self.hosts.catch_up()
                await self.sandboxes.catch_up()
            except Exception as err:  # NATS away: placing waits, the rest goes on
                log.warning("catching up before placing: %r; trying again", err)
                await asyncio.sleep(1.0)
                continue
            if self.placement.held() and self.placement.term == term:
                self._placing_term = term
                log.info("%s places sandboxes (term %d)", self.instance, term)
                for sandbox_id in self.sandboxes.ids():
                    self._mark_dirty(sandbox_id)
            return

    def _places(self) -> bool:
        return self._placing_term is not None and (
            self.placement.held() and self.placement.term == self._placing_term
        )

    def _host_renewed(self, host: str, was_live: bool) -> None:
        if was_live:
            return
        # A host came (back) to life: sandboxes waiting for one may fit now.
        for sandbox_id in self._waiting.ids():
            state, _ = self.sandboxes.get(sandbox_id)
            if state is not None and state.phase in ("pending", "recovering"):
                self._mark_dirty(sandbox_id)

    async def _sweep(self, every_s: float = 2.0) -> None:
        """Sandboxes waiting on something outside their own log are planned again
        every few seconds: a slot frees up when another sandbox stops; a deleted
        sandbox's host may have died before it could destroy the copy."""
        while True:
            await asyncio.sleep(every_s)
            for sandbox_id in self._waiting.ids():
                self._dirty_loop.mark(sandbox_id, later=True)

    async def _reconcile(self, sandbox_id: str) -> None:
        state, seq = self.sandboxes.get(sandbox_id)
        if state is None:
            await self._forget_leftovers(sandbox_id)
            return
        executed = await self.sandboxes.execute(
            sandbox_id,
            lambda s: plan(s, self._choose_host, self._host_alive).events if s is not None else [],
            id_base="plan",
            causation_id=f"{sandbox_id}@{seq}",
            correlation_id=f"{sandbox_id}@{seq}",
        )
        if executed.state is None or self.sandboxes.get(sandbox_id)[0] is None:
            return  # (forgotten as it was decided: the pass that set off cleans up)
        # From the state the decision was made on (it may have been re-read). When
        # events were just appended, their follow-up work (the run instruction after
        # `command.dispatched`) goes out now rather than on the next pass. (A
        # command run on a running sandbox was dispatched by its `command.queued`,
        # decision 098: the pass that event sets off appends nothing and sends it.)
        after = plan(executed.state, self._choose_host, self._host_alive)
        if after.events:
            return  # more to decide: our own events marked it dirty again
        await self._forget_used_secrets(executed.state)
        await self._forget_deleted(executed.state)
        for host, work in after.work:
            if self._sent.recent(work.msg_id):
                continue  # (sent a moment ago: a copy would be dropped, decision 097)
            ready = await self._with_values(executed.state, work)
            if ready is not None and await send_work(self._js, self._names, host, ready):
                self._sent.stored(work.msg_id)

    def _host_alive(self, host_id: str) -> bool:
        registered, _ = self.hosts.get(host_id)
        return (
            registered is not None
            and registered.status == "registered"
            and self.leases.is_live(host_id)
        )

    def _choose_host(self, state: sb.Sandbox) -> str | Waiting | None:
        if not self._places():
            return None  # the scheduler holding the placement claim places it
        load = self._placements.sizes()
        hosts = []
        for host_id in self.hosts.ids():
            registered, _ = self.hosts.get(host_id)
            if registered is not None:
                hosts.append(
                    HostInfo(
                        host=registered.host,
                        capacity_sandboxes=registered.capacity_sandboxes,
                        memory_bytes=registered.memory_bytes,
                        live=self.leases.is_live(registered.host)
                        and registered.status == "registered",
                        network_modes=network_modes(registered.capabilities),
                        disk_quota=registered.capabilities.get("disk_quota") == "True",
                    )
                )
        chosen = choose_host(
            hosts,
            load,
            memory_limit_bytes=state.memory_limit_bytes,
            prefer=state.host,
            network=state.network,
            disk_limit_bytes=state.disk_limit_bytes,
        )
        if chosen is not None:
            return chosen
        return why_waiting(
            hosts,
            load,
            memory_limit_bytes=state.memory_limit_bytes,
            network=state.network,
            disk_limit_bytes=state.disk_limit_bytes,
        )


def _value_ids(state: sb.Sandbox) -> set[str]:
    return {c.value_id for c in state.connections.values()}


def _error(code: str, message: str) -> bytes:
    return _reply_encoder.encode(Reply(ok=False, error=ErrorBody(code=code, message=message)))


_REQUESTS = RequestKinds(
    decode=rq.decode_request,
    tag_of=rq.request_tag,
    tenant_of=lambda request: request.tenant,
    error=_error,
    what="requests",
)
