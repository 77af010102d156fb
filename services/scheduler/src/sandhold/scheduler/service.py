"""The scheduler: decides client requests, places sandboxes, dispatches work.

One loop takes requests off the REQUESTS work queue: decode strictly → decide
on the sandbox's folded state → append behind the fence → reply → ack. A
second loop reconciles: after any change to a sandbox it runs the domain's
level-triggered `plan` (place, dispatch, not_launched, stop, destroy) until
nothing is left to do, and sends the host work that state calls for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from sandhold.bus import deadletters, leases
from sandhold.bus.codec import REPLY_HEADER
from sandhold.bus.names import Names
from sandhold.bus.reconciler import DirtyLoop, consume, dead_letter, send_work
from sandhold.bus.service import announce_ready, close_quickly, connect
from sandhold.bus.store import AggregateStore
from sandhold.bus.streams import ensure_streams
from sandhold.domain import host as host_domain
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain.errors import InfraError, Rejected
from sandhold.domain.placement import HostInfo, choose_host, network_modes
from sandhold.domain.reconcile import plan
from sandhold.domain.saves import SaveRecord
from sandhold.domain.views import ErrorBody, Reply, reply_for
from sandhold.saves.errors import MissingManifest
from sandhold.saves.store import SaveStore
from sandhold.telemetry import metrics

log = logging.getLogger("sandhold.scheduler")

_reply_encoder = msgspec.json.Encoder()


class Scheduler:
    name = "scheduler"

    def __init__(
        self,
        nats_url: str,
        names: Names,
        *,
        replicas: int = 1,
        lease_ttl: float = 5.0,
        defaults: sb.Defaults = sb.Defaults(),  # noqa: B008 - frozen
        durable: str = "scheduler",
    ) -> None:
        self._url = nats_url
        self._names = names
        self._replicas = replicas
        self._lease_ttl = lease_ttl
        self._defaults = defaults
        self._durable = durable
        self._stopping = asyncio.Event()
        self._dirty_loop = DirtyLoop(
            self._reconcile, what="reconciling", trace_of=lambda sid: self.sandboxes.trace_of(sid)
        )

    async def run(self) -> None:
        nc = await connect(self._url, name="sandhold-scheduler")
        try:
            js = nc.jetstream()
            await ensure_streams(js, self._names, replicas=self._replicas)
            self._js = js
            self.sandboxes = AggregateStore(
                js, self._names, "sandbox", sb.evolve, actor="scheduler"
            )
            self.hosts = AggregateStore(
                js, self._names, "host", host_domain.evolve, actor="scheduler"
            )
            self.leases = leases.LeaseWatcher(
                await leases.lease_bucket(js, self._names), ttl=self._lease_ttl
            )
            self.leases.on_renewal(self._host_renewed)
            self.sandboxes.listen(self._mark_dirty)
            await self.hosts.start()
            await self.sandboxes.start()
            await self.leases.start()
            for sandbox_id in self.sandboxes.ids():
                self._mark_dirty(sandbox_id)
            # Sandbox and command requests; task requests are the orchestrator's.
            # Creating the consumer also moves one made with the old `req.>` filter.
            await js.add_consumer(
                self._names.requests_stream,
                ConsumerConfig(
                    durable_name=self._durable,
                    ack_policy=AckPolicy.EXPLICIT,
                    # Deciding takes milliseconds; a request delivered to a scheduler
                    # that died reaches the next one well within a client's 30 s wait.
                    ack_wait=10,
                    max_deliver=10,
                    filter_subjects=[
                        self._names.request("sandbox.>"),
                        self._names.request("command.>"),
                    ],
                ),
            )
            sub = await js.pull_subscribe_bind(self._durable, self._names.requests_stream)
            await deadletters.watch(nc, self._names.requests_stream, self._durable, what="requests")
            await announce_ready(nc, self._names, self.name)
            log.info("scheduler ready")
            tasks = [
                asyncio.create_task(self._requests(sub)),
                asyncio.create_task(self._dirty_loop.run()),
                asyncio.create_task(self._sweep()),
            ]
            await self._stopping.wait()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.leases.stop()
        finally:
            await close_quickly(nc, getattr(self, "sandboxes", None), getattr(self, "hosts", None))

    async def shutdown(self) -> None:
        self._stopping.set()

    # --- requests -------------------------------------------------------------

    async def _requests(self, sub) -> None:
        await consume(sub, self._handle, batch=32, what="requests")

    async def _handle(self, msg: Msg) -> None:
        reply_to = (msg.headers or {}).get(REPLY_HEADER)
        try:
            request = rq.decode_request(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            # A poison message: answer it, drop it, never redeliver it.
            log.warning("malformed request on %s: %s", msg.subject, err)
            await self._reply(reply_to, _error("malformed_request", f"malformed request: {err}"))
            await dead_letter(msg, "requests")
            return
        expected_subject = self._names.request(rq.request_tag(request))
        if msg.subject != expected_subject:
            message = (
                f"malformed request: a {rq.request_tag(request)!r} request was sent to "
                f"{msg.subject}; send it to {expected_subject}"
            )
            await self._reply(reply_to, _error("malformed_request", message))
            await dead_letter(msg, "requests")
            return
        sandbox_id = sb.aggregate_of(request)
        try:
            if isinstance(request, rq.CreateSandbox) and request.seed is not None:
                await self._check_seed(request.seed, sandbox_id)
            executed = await self.sandboxes.execute(
                sandbox_id,
                lambda state: sb.decide(
                    state, request, defaults=self._defaults, find_snapshot=self._find_snapshot
                ),
                id_base=f"req:{request.key}",
                causation_id=request.key,
                correlation_id=request.key,
            )
        except Rejected as err:
            await self._reply(reply_to, _error(err.code, err.message))
            await msg.ack()
            return
        except InfraError as err:
            log.warning("request %s not decided yet: %s", request.key, err)
            await msg.nak(delay=1)
            return
        assert executed.state is not None
        record = sb.result_of(executed.state, request)
        await self._reply(reply_to, reply_for(record, sandbox_id))
        await msg.ack()
        self._mark_dirty(sandbox_id)

    async def _reply(self, reply_to: str | None, reply: Reply) -> None:
        metrics.replied(reply.error.code if reply.error else "ok")
        if reply_to:
            await self._js._nc.publish(reply_to, _reply_encoder.encode(reply))

    async def _check_seed(self, save_id: str, sandbox_id: str) -> None:
        """A seed must be stored, and staged for exactly this sandbox: the id is
        derived from tenant and key, so no one can start from another's files."""
        state, _ = self.sandboxes.get(sandbox_id)
        if state is not None:
            return  # already created: the aggregate answers the retry
        try:
            manifest = await SaveStore(self._js, self._names).get_manifest(save_id)
        except MissingManifest:
            manifest = None
        if manifest is None or manifest.sandbox_id != sandbox_id:
            raise Rejected("seed_not_found", f"no save {save_id} staged for sandbox {sandbox_id}")

    def _find_snapshot(self, save_id: str) -> tuple[sb.Sandbox, SaveRecord] | None:
        for sandbox_id in self.sandboxes.ids():
            state, _ = self.sandboxes.get(sandbox_id)
            if state is not None and save_id in state.saves:
                return state, state.saves[save_id]
        return None

    # --- reconciling ----------------------------------------------------------

    def _mark_dirty(self, sandbox_id: str) -> None:
        self._dirty_loop.mark(sandbox_id)

    def _host_renewed(self, host: str, was_live: bool) -> None:
        if was_live:
            return
        # A host came (back) to life: sandboxes waiting for one may fit now.
        for sandbox_id in self.sandboxes.ids():
            state, _ = self.sandboxes.get(sandbox_id)
            if state is not None and state.phase in ("pending", "recovering"):
                self._mark_dirty(sandbox_id)

    async def _sweep(self, every_s: float = 2.0) -> None:
        """Sandboxes waiting on something outside their own log are planned again
        every few seconds: a slot frees up when another sandbox stops; a deleted
        sandbox's host may have died before it could destroy the copy."""
        while True:
            await asyncio.sleep(every_s)
            for sandbox_id in self.sandboxes.ids():
                state, _ = self.sandboxes.get(sandbox_id)
                waiting = state is not None and (
                    state.phase in ("pending", "recovering")
                    or (state.delete_requested and state.phase in ("stopped", "failed"))
                )
                if waiting:
                    self._mark_dirty(sandbox_id)

    async def _reconcile(self, sandbox_id: str) -> None:
        state, seq = self.sandboxes.get(sandbox_id)
        if state is None:
            return
        executed = await self.sandboxes.execute(
            sandbox_id,
            lambda s: plan(s, self._choose_host, self._host_alive).events if s is not None else [],
            id_base="plan",
            causation_id=f"{sandbox_id}@{seq}",
            correlation_id=f"{sandbox_id}@{seq}",
        )
        if executed.state is None:
            return
        # From the state the decision was made on (it may have been re-read). When
        # events were just appended, their follow-up work (the run instruction after
        # `command.dispatched`) goes out now rather than on the next pass.
        after = plan(executed.state, self._choose_host, self._host_alive)
        if after.events:
            return  # more to decide: our own events marked it dirty again
        for host, work in after.work:
            await send_work(self._js, self._names, host, work)

    def _host_alive(self, host_id: str) -> bool:
        registered, _ = self.hosts.get(host_id)
        return (
            registered is not None
            and registered.status == "registered"
            and self.leases.is_live(host_id)
        )

    def _choose_host(self, state: sb.Sandbox) -> str | None:
        load: dict[str, int] = {}
        for sandbox_id in self.sandboxes.ids():
            other, _ = self.sandboxes.get(sandbox_id)
            if other is not None and other.host and other.phase in sb.ACTIVE_PHASES:
                load[other.host] = load.get(other.host, 0) + 1
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
        return choose_host(
            hosts,
            load,
            memory_limit_bytes=state.memory_limit_bytes,
            prefer=state.host,
            network=state.network,
            disk_limit_bytes=state.disk_limit_bytes,
        )


def _error(code: str, message: str) -> Reply:
    return Reply(ok=False, error=ErrorBody(code=code, message=message))
