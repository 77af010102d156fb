"""The typed client: requests with idempotency keys, state read by folding the log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypedDict, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from sandhold.bus import credentials as creds
from sandhold.bus import leases
from sandhold.bus.codec import OFFSET_HEADER, STREAM_HEADER
from sandhold.bus.connection import close_quickly
from sandhold.bus.connection import connect as bus_connect
from sandhold.bus.credentials import Credentials
from sandhold.bus.names import Names
from sandhold.bus.output import OutputLog
from sandhold.bus.ownership import tenant_of
from sandhold.bus.read import read_subject, read_subjects
from sandhold.bus.requesting import publish_request
from sandhold.client.feeds import Feeds
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import task as tk
from sandhold.domain.commands import END_STATES as _END_STATES
from sandhold.domain.commands import is_end_state
from sandhold.domain.envelope import Envelope, Recorded
from sandhold.domain.errors import InfraError, Rejected
from sandhold.domain.fold import fold
from sandhold.domain.host import Host, liveness
from sandhold.domain.host import evolve as evolve_host
from sandhold.domain.saves import IN_FLIGHT
from sandhold.domain.task_manifest import TaskManifest
from sandhold.domain.task_views import TaskReply, TaskView, task_view
from sandhold.domain.views import (
    CommandView,
    Reply,
    SandboxView,
    SaveView,
    command_view,
    ended_view,
    sandbox_view,
    save_view,
)
from sandhold.telemetry import context

log = logging.getLogger(__name__)

_reply_decoder = msgspec.json.Decoder(Reply)
_task_reply_decoder = msgspec.json.Decoder(TaskReply)

OutputCallback = Callable[[str, bytes], None]
S = TypeVar("S")  # an aggregate's folded state
# How long an exec waits to hear its command's end live before it looks in
# the log (live delivery is best effort; the log is the truth), and again.
LOG_CHECK_S = 2.0
R = TypeVar("R")  # what a wait returns once its check finds it


class CommandResult(msgspec.Struct, kw_only=True):
    """A command's record with the output that was kept."""

    command: CommandView
    stdout: bytes = b""
    stderr: bytes = b""


class HostListing(TypedDict):
    """`list_hosts`: each host as a JSON-ready dict, and the lease settings."""

    hosts: list[dict[str, object]]
    lease_ttl_s: float
    fence_margin_s: float


class Client:
    def __init__(
        self, nc: NATS, names: Names, *, tenant: str = "default", request_timeout: float = 30.0
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.names = names
        self.tenant = tenant
        self.request_timeout = request_timeout
        self._feeds = Feeds(self.js, names)

    async def close(self) -> None:
        try:
            await self._feeds.close()
        finally:
            await close_quickly(self.nc)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- requests ---------------------------------------------------------------

    async def send(self, request: rq.AnyRequest) -> Reply:
        """Publish a request to the REQUESTS stream and wait for the scheduler's reply.

        The request is acknowledged by JetStream before we wait, so it survives a
        scheduler that is down; the reply comes when the scheduler has decided.
        Raises `Rejected` with the scheduler's code when it refuses.
        """
        data = await self._request(
            self.names.request(rq.request_tag(request), request.tenant),
            rq.encode_request(request),
            f"{request.tenant}:{request.key}:{rq.request_digest(request)}",
            "scheduler",
        )
        reply = _reply_decoder.decode(data)
        if not reply.ok:
            assert reply.error is not None
            raise Rejected(reply.error.code, reply.error.message)
        return reply

    async def send_task(self, request: tk.AnyTaskRequest) -> TaskView:
        """Like `send`, for the orchestrator's task requests."""
        data = await self._request(
            self.names.request(tk.task_request_tag(request), request.tenant),
            tk.encode_task_request(request),
            f"{request.tenant}:{request.key}:{tk.task_request_digest(request)}",
            "orchestrator",
        )
        reply = _task_reply_decoder.decode(data)
        if not reply.ok:
            assert reply.error is not None
            raise Rejected(reply.error.code, reply.error.message)
        assert reply.task is not None
        return reply.task

    async def _request(self, subject: str, payload: bytes, msg_id: str, service: str) -> bytes:
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, max_msgs=1)
        try:
            # One id per call: a publish retried inside this call is dropped as a
            # duplicate by the stream, while a later call with the same key reaches
            # the service and gets the original result back (decision 001).
            # A trace starts here (or continues the caller's) and lasts until the
            # reply: the service and every one after it add their spans to it.
            tag = ".".join(subject.rsplit(".req.", 1)[-1].split(".")[:2])  # not the tenant
            with context.span(f"request {tag}", kind="client"):
                await publish_request(
                    self.js, self.names, subject, payload,
                    msg_id=f"{msg_id}:{inbox[-22:]}", reply_to=inbox,
                )  # fmt: skip
                try:
                    msg = await sub.next_msg(timeout=self.request_timeout)
                except TimeoutError as err:
                    raise InfraError(
                        f"no answer from the {service} in {self.request_timeout}s; the request "
                        f"is queued and will be handled when a {service} runs",
                        retryable=True,
                    ) from err
        finally:
            await sub.unsubscribe()
        return msg.data

    def _key(self, key: str | None) -> str:
        return key or uuid.uuid4().hex

    async def create_sandbox(
        self,
        *,
        memory_limit_bytes: int | None = None,
        key: str | None = None,
        from_snapshot: str | None = None,
        save_interval_s: float | None = None,
        stop_deadline_s: float | None = None,
        recovery: rq.Recovery | None = None,
        network: rq.Network = "none",
        image: str | None = None,
        pids_limit: int | None = None,
        cpu_limit: float | None = None,
        disk_limit_bytes: int | None = None,
        idle_timeout_s: float | None = None,
        keep_stopped_s: float | None = None,
    ) -> SandboxView:
        reply = await self.send(
            rq.CreateSandbox(
                key=self._key(key),
                tenant=self.tenant,
                memory_limit_bytes=memory_limit_bytes,
                from_snapshot=from_snapshot,
                save_interval_s=save_interval_s,
                stop_deadline_s=stop_deadline_s,
                recovery=recovery,
                network=network,
                image=image,
                pids_limit=pids_limit,
                cpu_limit=cpu_limit,
                disk_limit_bytes=disk_limit_bytes,
                idle_timeout_s=idle_timeout_s,
                keep_stopped_s=keep_stopped_s,
            )
        )
        assert reply.sandbox is not None
        return reply.sandbox

    async def start_sandbox(self, sandbox_id: str, *, key: str | None = None) -> SandboxView:
        return await self._lifecycle(rq.StartSandbox, sandbox_id, key)

    async def stop_sandbox(self, sandbox_id: str, *, key: str | None = None) -> SandboxView:
        return await self._lifecycle(rq.StopSandbox, sandbox_id, key)

    async def touch_sandbox(self, sandbox_id: str, *, key: str | None = None) -> SandboxView:
        """A keep-alive: the sandbox's idle time starts again."""
        return await self._lifecycle(rq.TouchSandbox, sandbox_id, key)

    async def delete_sandbox(self, sandbox_id: str, *, key: str | None = None) -> SandboxView:
        return await self._lifecycle(rq.DeleteSandbox, sandbox_id, key)

    async def _lifecycle(
        self,
        kind: type[rq.StartSandbox | rq.StopSandbox | rq.TouchSandbox | rq.DeleteSandbox],
        sandbox_id: str,
        key: str | None,
    ) -> SandboxView:
        reply = await self.send(kind(key=self._key(key), tenant=self.tenant, sandbox_id=sandbox_id))
        assert reply.sandbox is not None
        return reply.sandbox

    async def snapshot(self, sandbox_id: str, name: str, *, key: str | None = None) -> SaveView:
        """Ask for a Snapshot; returns its record as accepted (state `requested`)."""
        reply = await self.send(
            rq.SnapshotSandbox(
                key=self._key(key), tenant=self.tenant, sandbox_id=sandbox_id, name=name
            )
        )
        assert reply.save is not None
        return reply.save

    async def delete_snapshot(
        self, sandbox_id: str, save_id: str, *, key: str | None = None
    ) -> SaveView:
        """Delete a Snapshot (decision 069): it becomes a save like the others,
        and retention drops it unless it is among the newest the sandbox keeps.
        Returns its record as it is then (kind `scheduled`, no name)."""
        reply = await self.send(
            rq.DeleteSnapshot(
                key=self._key(key), tenant=self.tenant, sandbox_id=sandbox_id, save_id=save_id
            )
        )
        assert reply.save is not None
        return reply.save

    async def set_connection(
        self, sandbox_id: str, name: str, value: str, *, key: str | None = None
    ) -> SandboxView:
        """Attach (or replace) the Connection `name`: the file /run/connections/<name>
        wherever the sandbox runs, from now on; its value is never recorded."""
        reply = await self.send(
            rq.SetConnection(
                key=self._key(key), tenant=self.tenant, sandbox_id=sandbox_id, name=name,
                value=value,
            )
        )  # fmt: skip
        assert reply.sandbox is not None
        return reply.sandbox

    async def remove_connection(
        self, sandbox_id: str, name: str, *, key: str | None = None
    ) -> SandboxView:
        reply = await self.send(
            rq.RemoveConnection(
                key=self._key(key), tenant=self.tenant, sandbox_id=sandbox_id, name=name
            )
        )
        assert reply.sandbox is not None
        return reply.sandbox

    async def wait_for_save(
        self, sandbox_id: str, save_id: str, *, timeout: float = 600.0
    ) -> SaveView:
        """The save's record once it ended: completed, unchanged (decision 067),
        failed (or completed and expired since)."""

        def settled(state: sb.Sandbox) -> SaveView | None:
            record = state.saves.get(save_id)
            if record is not None and record.state not in IN_FLIGHT:
                return save_view(sandbox_id, record)
            return None

        return await self.wait_for(
            sandbox_id, settled, timeout=timeout, what=f"save {save_id} to settle"
        )

    async def list_hosts(self) -> HostListing:
        """Hosts with their status (live / suspect / lost / fenced / down), lease
        ages, and the lease settings the services use."""
        states: dict[str, Host | None] = await self.fold_all("host", evolve_host)
        kv = await self.js.key_value(self.names.lease_bucket)
        settings = await leases.published_settings(kv)
        ttl = settings["lease_ttl_s"]
        placed: dict[str, int] = {}
        for view in await self.list_sandboxes():
            if view.host and view.phase in sb.ACTIVE_PHASES:
                placed[view.host] = placed.get(view.host, 0) + 1
        hosts: list[dict[str, object]] = []
        for host_id, state in sorted(states.items()):
            if state is None:
                continue
            # the host's clock; on one machine (or with NTP) good enough for a listing
            age, interval = await leases.lease_age(kv, host_id, now=time.time())
            status = liveness(state, lease_age_s=age, ttl_s=ttl, interval_s=interval)
            lease = await leases.read_lease(kv, host_id)
            cache = lease.chunk_cache if lease is not None else None
            hosts.append(
                {
                    "host": host_id,
                    "status": status,
                    "epoch": state.epoch,
                    "last_renewal_age_s": age,
                    "lease_interval_s": interval,
                    "capacity_sandboxes": state.capacity_sandboxes,
                    "sandboxes": placed.get(host_id, 0),
                    "capabilities": state.capabilities,
                    "fence_at": state.fence_at,
                    # as of its last renewal: what it holds, its limit, hits since it started
                    "chunk_cache": msgspec.structs.asdict(cache) if cache else None,
                }
            )
        return {
            "hosts": hosts,
            "lease_ttl_s": ttl,
            "fence_margin_s": settings["fence_margin_s"],
        }

    async def storage(self) -> dict[str, object]:
        """Where saves live: the save store's kind and replica count."""
        info = await self.js.stream_info(self.names.saves_stream)
        return {
            "kind": "jetstream",
            "stream": self.names.saves_stream,
            "replicas": info.config.num_replicas or 1,
        }

    async def cancel_command(
        self, sandbox_id: str, command_id: str, *, key: str | None = None
    ) -> CommandView:
        reply = await self.send(
            rq.CancelCommand(
                key=self._key(key), tenant=self.tenant, sandbox_id=sandbox_id, command_id=command_id
            )
        )
        assert reply.command is not None
        return reply.command

    # --- tasks --------------------------------------------------------------------

    async def submit_task(
        self,
        manifest: TaskManifest,
        *,
        key: str | None = None,
        secrets: dict[str, str] | None = None,
    ) -> TaskView:
        """Raises ValueError (before sending) when `secrets` are not one value for
        each secret the manifest names."""
        request = tk.SubmitTask(
            key=self._key(key), tenant=self.tenant, manifest=manifest, secrets=secrets or {}
        )
        return await self.send_task(request)

    async def cancel_task(self, task_id: str, *, key: str | None = None) -> TaskView:
        return await self.send_task(
            tk.CancelTask(key=self._key(key), tenant=self.tenant, task_id=task_id)
        )

    async def task_records(self, task_id: str) -> list[Recorded]:
        return await read_subject(
            self.js, self.names.events_stream, self.names.events("task", task_id)
        )

    async def task_state(self, task_id: str) -> tk.Task | None:
        state = fold(tk.evolve, (r.envelope for r in await self.task_records(task_id)), None)
        return state if state is not None and state.tenant == self.tenant else None

    async def show_task(self, task_id: str) -> TaskView:
        state = await self.task_state(task_id)
        if state is None:
            raise Rejected("task_not_found", f"no task {task_id}")
        return task_view(state)

    async def list_tasks(self, *, state: str | None = None) -> list[TaskView]:
        states = await self.fold_all("task", tk.evolve)
        return sorted(
            (
                task_view(t)
                for t in states.values()
                if t is not None and t.tenant == self.tenant and (state is None or t.state == state)
            ),
            key=lambda v: v.submitted_at,
        )

    async def wait_for_task(
        self, task_id: str, check: Callable[[tk.Task], R | None], *, timeout: float, what: str
    ) -> R:
        """Re-fold the task whenever one of its events arrives until `check(state)`
        returns something."""
        return await self._wait_for("task", task_id, self.task_state, check, timeout, what)

    # --- reading state (the same fold the services use) -------------------------

    async def sandbox_records(self, sandbox_id: str) -> list[Recorded]:
        """The sandbox's events with their stream sequences, oldest first."""
        return await read_subject(
            self.js, self.names.events_stream, self.names.events("sandbox", sandbox_id)
        )

    async def sandbox_state(self, sandbox_id: str) -> sb.Sandbox | None:
        records = await self.sandbox_records(sandbox_id)
        state = fold(sb.evolve, (r.envelope for r in records), None)
        return state if state is not None and state.tenant == self.tenant else None

    async def show_sandbox(self, sandbox_id: str) -> SandboxView:
        state = await self.sandbox_state(sandbox_id)
        if state is None:
            raise Rejected("sandbox_not_found", f"no sandbox {sandbox_id}")
        return sandbox_view(state, now=time.time())

    async def _owns(self, sandbox_id: str) -> bool:
        """Whether the sandbox is this tenant's (`ownership`)."""
        return await tenant_of(self.js, self.names, "sandbox", sandbox_id) == self.tenant

    async def fold_all(
        self, kind: str, evolve: Callable[[S | None, Envelope], S | None]
    ) -> dict[str, S | None]:
        """Every aggregate of a kind, folded from the log: id -> state."""
        states: dict[str, S | None] = {}
        for record in await read_subjects(
            self.js, self.names.events_stream, self.names.events(kind, "*"), bulk=True
        ):
            aggregate = record.envelope.aggregate_id
            states[aggregate] = evolve(states.get(aggregate), record.envelope)
        return states

    async def list_sandboxes(self, *, include_deleted: bool = False) -> list[SandboxView]:
        states = await self.fold_all("sandbox", sb.evolve)
        return [
            sandbox_view(s, now=time.time())
            for s in states.values()
            if s is not None
            and s.tenant == self.tenant
            and (include_deleted or s.phase != "deleted")
        ]

    async def show_command(self, sandbox_id: str, command_id: str) -> CommandView:
        state = await self.sandbox_state(sandbox_id)
        if state is None:  # missing, or another tenant's: the same answer
            raise Rejected("sandbox_not_found", f"no sandbox {sandbox_id}")
        if command_id not in state.commands:
            raise Rejected("command_not_found", f"no command {command_id} in {sandbox_id}")
        return command_view(sandbox_id, state.commands[command_id], state)

    async def read_output(self, sandbox_id: str, command_id: str) -> dict[str, bytes]:
        """The command's kept output, per stream, from the OUTPUT stream.

        Another tenant's sandbox is reported exactly like a missing one."""
        if not await self._owns(sandbox_id):
            raise Rejected("sandbox_not_found", f"no sandbox {sandbox_id}")
        out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        subject = self.names.output(sandbox_id, command_id) + ".*"
        for msg in await read_subjects(self.js, self.names.output_stream, subject, raw=True):
            headers = msg.headers or {}  # every chunk has both (the host-agent sets them)
            stream = headers[STREAM_HEADER]
            offset = int(headers[OFFSET_HEADER])
            buf = out.setdefault(stream, bytearray())
            if offset == len(buf):
                buf += msg.data
            elif offset < len(buf) < offset + len(msg.data):
                buf += msg.data[len(buf) - offset :]
        return {k: bytes(v) for k, v in out.items()}

    async def read_output_tail(
        self, sandbox_id: str, command_id: str, *, limit: int, stream: str = "stdout"
    ) -> bytes:
        """`OutputLog.tail`, for this tenant's sandboxes only."""
        if not await self._owns(sandbox_id):
            raise Rejected("sandbox_not_found", f"no sandbox {sandbox_id}")
        return await OutputLog(self.js, self.names).tail(
            sandbox_id, command_id, limit=limit, stream=stream
        )

    # --- exec -----------------------------------------------------------------

    async def exec(
        self,
        sandbox_id: str,
        argv: list[str],
        *,
        key: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        secrets: dict[str, str] | None = None,
        timeout_s: float | None = None,
        kill_grace_s: float = 5.0,
        user: rq.CommandUser = "user",
        on_output: OutputCallback | None = None,
        wait_timeout: float | None = None,
    ) -> CommandResult:
        """Run a command and wait for its end state, streaming output to `on_output`.

        Output is printed in order per stream; output that arrived before we
        listened (a retried key) or that live delivery dropped is read back
        from the OUTPUT stream, so every kept byte is delivered exactly once.
        """
        key = self._key(key)
        command_id = rq.command_id_for(sandbox_id, key)
        printer = _OutputPrinter(on_output)

        async def on_chunk(msg: Msg) -> None:
            headers = msg.headers or {}  # every chunk has both (the host-agent sets them)
            printer.live(headers[STREAM_HEADER], int(headers[OFFSET_HEADER]), msg.data)

        # The end state comes from JetStream's own delivery, so it is one the
        # stream has stored: a core subscription would also hear an append the
        # stream then refused (a fenced host's stale `command.ended`) and sees
        # every append a moment before it is stored. Output is shown live: what
        # was kept is settled by `output_kept` in the stored end (and read back).
        async with contextlib.AsyncExitStack() as listening:
            # The sandbox's events from before this request on, through a follower
            # shared with the execs before and after this one (decision 089): it
            # starts after a sequence the stream already holds (one this client
            # learned a moment ago, decision 099, or else the stream's last,
            # read before its first exec's request), and its consumer is made
            # while that request is stored and decided (off the path). Every
            # later exec registers here before it sends its request, so it
            # hears every event it causes.
            feed = listening.enter_context(self._feeds.holding(sandbox_id))
            ended = feed.wait_for(command_id)
            listening.callback(feed.forget, command_id, ended)
            chunks = await self.nc.subscribe(
                self.names.output(sandbox_id, command_id) + ".*", cb=on_chunk
            )
            listening.push_async_callback(_quietly, chunks.unsubscribe)
            if not feed.positioned.done():  # (the first exec on this feed)
                # Waited for, never awaited: this exec's cancel is not the others'.
                await asyncio.wait([feed.positioned])
            if self._feeds.closed:  # (closed meanwhile; a feed positioned at once, 099)
                raise InfraError("the client is closed", retryable=False)
            feed.positioned.result()  # why not, raised: the request is not sent
            reply = await self.send(
                rq.RunCommand(
                    key=key,
                    tenant=self.tenant,
                    sandbox_id=sandbox_id,
                    argv=argv,
                    cwd=cwd,
                    env=env or {},
                    secrets=secrets or {},
                    timeout_s=timeout_s,
                    kill_grace_s=kill_grace_s,
                    user=user,
                )
            )
            assert reply.command is not None
            record = reply.command
            if record.state not in _END_STATES:
                if not feed.following.done():
                    await asyncio.wait([feed.following])
                if feed.broken:
                    # Live delivery is best effort: `_wait_for_end` reads the log
                    # when it hears nothing. Raising here would leave a caller
                    # retrying with a new key to run the command twice.
                    why = "stopped" if feed.following.cancelled() else feed.following.exception()
                    log.warning("no live events of %s (%r): reading the log", sandbox_id, why)
                at, end = await self._wait_for_end(sandbox_id, command_id, ended, wait_timeout)
                record = ended_view(record, end, at=at)
        if record.cold and record.cold_start is None:  # what waking its sandbox cost
            view = await self.show_command(sandbox_id, command_id)
            record = msgspec.structs.replace(record, cold_start=view.cold_start)
        kept = await self._complete_output(sandbox_id, command_id, record, printer)
        return CommandResult(
            command=record, stdout=kept.get("stdout", b""), stderr=kept.get("stderr", b"")
        )

    async def _wait_for_end(
        self,
        sandbox_id: str,
        command_id: str,
        ended: asyncio.Future[tuple[float, ev.CommandEnded]],
        wait_timeout: float | None,
    ) -> tuple[float, ev.CommandEnded]:
        """The live `command.ended` event; if none arrives for a while (live
        delivery is best effort), look in the log, which is the truth."""
        loop = asyncio.get_running_loop()
        deadline = None if wait_timeout is None else loop.time() + wait_timeout
        while True:
            step = LOG_CHECK_S
            if deadline is not None:
                step = max(0.0, min(step, deadline - loop.time()))
            try:
                return await asyncio.wait_for(asyncio.shield(ended), step)
            except TimeoutError:
                pass
            state = await self.sandbox_state(sandbox_id)
            command = state.commands.get(command_id) if state is not None else None
            # `command.ended`, as a check that also narrows the state's type
            if command is not None and is_end_state(command.state):
                return command.ended_at or 0.0, ev.CommandEnded(
                    command_id=command.id,
                    state=command.state,
                    exit_code=command.exit_code,
                    signal=command.signal,
                    reason=command.reason,
                    host=command.host,
                    generation=command.generation,
                    output_kept=command.output_kept,
                    output_complete=command.output_complete,
                    pid=command.pid,
                )
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"{command_id} has not ended after {wait_timeout}s")

    async def _complete_output(
        self, sandbox_id: str, command_id: str, record: CommandView, printer: _OutputPrinter
    ) -> dict[str, bytes]:
        if all(printer.received(s) >= n for s, n in record.output_kept.items()):
            return printer.collected()
        stored = await self.read_output(sandbox_id, command_id)
        for stream, data in stored.items():
            printer.live(stream, 0, data)
        return printer.collected()

    async def wait_for_phase(
        self, sandbox_id: str, phases: set[str], *, timeout: float = 30.0
    ) -> SandboxView:
        """Wait until the sandbox reaches one of `phases`."""
        return await self.wait_for(
            sandbox_id,
            lambda s: sandbox_view(s, now=time.time()) if s.phase in phases else None,
            timeout=timeout,
            what=f"phase {sorted(phases)}",
        )

    async def wait_for(
        self,
        sandbox_id: str,
        check: Callable[[sb.Sandbox], R | None],
        *,
        timeout: float,
        what: str,
    ) -> R:
        """Re-fold the sandbox whenever one of its events arrives (and every
        second regardless) until `check(state)` returns something."""
        return await self._wait_for("sandbox", sandbox_id, self.sandbox_state, check, timeout, what)

    async def _wait_for(
        self,
        kind: str,
        aggregate_id: str,
        read: Callable[[str], Awaitable[S | None]],
        check: Callable[[S], R | None],
        timeout: float,
        what: str,
    ) -> R:
        changed = asyncio.Event()

        async def on_event(msg: Msg) -> None:
            changed.set()

        sub = await self.nc.subscribe(self.names.events(kind, aggregate_id), cb=on_event)
        try:
            deadline = time.monotonic() + timeout
            while True:
                changed.clear()
                state = await read(aggregate_id)
                if state is None:
                    raise Rejected(f"{kind}_not_found", f"no {kind} {aggregate_id}")
                found = check(state)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{aggregate_id}: waited {timeout}s for {what}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(1.0, left))
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


class _OutputPrinter:
    """Delivers each stream's bytes once and in order, whatever order they arrive in."""

    def __init__(self, on_output: OutputCallback | None) -> None:
        self._on_output = on_output
        self._buffers: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._early: dict[str, dict[int, bytes]] = {}

    def received(self, stream: str) -> int:
        return len(self._buffers.get(stream, b""))

    def collected(self) -> dict[str, bytes]:
        return {k: bytes(v) for k, v in self._buffers.items()}

    def live(self, stream: str, offset: int, data: bytes) -> None:
        buf = self._buffers.setdefault(stream, bytearray())
        if offset > len(buf):
            # A gap: hold this piece until what comes before it arrives.
            self._early.setdefault(stream, {})[offset] = data
            return
        fresh = data[len(buf) - offset :]
        if fresh:
            buf += fresh
            if self._on_output is not None:
                self._on_output(stream, fresh)
        early = self._early.get(stream, {})
        while early:
            next_offset = min(early)
            if next_offset > len(buf):
                break
            self.live(stream, next_offset, early.pop(next_offset))


async def _quietly(stop: Callable[[], Awaitable[object]]) -> None:
    with contextlib.suppress(Exception):  # a closed connection has no subscriptions
        await stop()


async def connect(
    url: str | list[str],
    *,
    prefix: str = "sh",
    tenant: str = "default",
    credentials: Credentials | None = None,
) -> Client:
    """A client connected as `credentials` (else the user in the URL, else
    `SANDHOLD_NATS_CREDENTIALS`)."""
    credentials = credentials or creds.from_environment()
    if credentials is not None and credentials.role == "tenant":
        raise ValueError(
            f"{credentials.user} is a tenant's credential: it reaches sandhold through "
            f"the gateway's NATS API ({Names(prefix).api(str(credentials.tenant))}, docs/api.md), "
            "not the operator's bus this client speaks"
        )
    nc = await bus_connect(url, name="sandhold-client", credentials=credentials)
    return Client(nc, Names(prefix), tenant=tenant)
