"""Sandboxes, their commands, saves and events; hosts."""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import msgspec
from litestar import Request, Response, delete, get, post, put
from litestar.params import FromPath
from litestar.response import Stream
from sandhold.bus import leases, ownership
from sandhold.domain import requests as rq
from sandhold.domain.commands import END_STATES
from sandhold.domain.host import Host, liveness
from sandhold.domain.views import Reply, sandbox_view, save_view
from sandhold.gateway import bodies as b
from sandhold.gateway.problems import FieldError, ProblemError
from sandhold.gateway.sse import event_frames, event_page, output_frames
from sandhold.gateway.web import (
    COMMAND_ID,
    COMMAND_STATES,
    MAX_LIMIT,
    PHASES,
    SANDBOX_ID,
    SAVE_ID,
    SAVE_KINDS,
    SAVE_STATES,
    Context,
    call,
    check_id,
    decode_cursor,
    encode_cursor,
    fresh,
    idempotency_key,
    is_digits,
    json_body,
    json_response,
    query_bool,
    query_choice,
    query_int,
    tenant_of,
)


def handlers(ctx: Context) -> list:
    def sid(value: str) -> str:
        return check_id(value, SANDBOX_ID, "sandbox_not_found", "sandbox")

    def cid(value: str) -> str:
        return check_id(value, COMMAND_ID, "command_not_found", "command")

    # --- sandboxes -------------------------------------------------------------

    @post("/api/v1/sandboxes")
    async def create_sandbox(request: Request) -> Response:
        tenant = tenant_of(ctx, request)
        key = idempotency_key(request)
        body = b.decode_json(await json_body(request), b.CreateSandboxBody, empty_ok=True)
        reply = await call(
            ctx.client(tenant).send(
                rq.CreateSandbox(key=key, tenant=tenant, **b.request_fields(body))
            )
        )
        view = reply.sandbox
        return json_response(view, 201, headers={"Location": f"/api/v1/sandboxes/{view.id}"})

    @get("/api/v1/sandboxes")
    async def list_sandboxes(request: Request) -> Response:
        tenant = tenant_of(ctx, request)
        phase = query_choice(request, "phase", PHASES)
        limit = query_int(request, "limit", 100, 1, MAX_LIMIT)
        include_deleted = query_bool(request, "include_deleted")
        after = decode_cursor(request)
        await fresh(ctx)
        sql = "SELECT state, created_at, id FROM sandboxes WHERE tenant = ?"
        params: list = [tenant]
        if phase is not None:
            sql += " AND phase = ?"
            params.append(phase)
        elif not include_deleted:
            sql += " AND phase != 'deleted'"
        rows, next_cursor = await page(ctx, sql, params, after, limit, "created_at")
        now = time.time()
        items = await count_commands(
            ctx, [sandbox_view(decode_sandbox(r[0]), now=now) for r in rows]
        )
        return json_response(b.SandboxPage(items=items, next_cursor=next_cursor))

    @get("/api/v1/sandboxes/{sandbox_id:str}")
    async def show_sandbox(request: Request, sandbox_id: FromPath[str]) -> Response:
        client = ctx.client(tenant_of(ctx, request))
        view = await call(client.show_sandbox(sid(sandbox_id)))
        with contextlib.suppress(Exception):
            view.storage = await client.storage()
        return json_response(view)

    async def _sent(request: Request, sandbox_id: str, make) -> Reply:
        """A request to one sandbox, made of the call's idempotency key, the
        token's tenant and the sandbox id (`make(key, tenant, sandbox_id)`):
        its reply."""
        tenant = tenant_of(ctx, request)
        key = idempotency_key(request)
        return await call(ctx.client(tenant).send(make(key, tenant, sid(sandbox_id))))

    async def _lifecycle(request: Request, sandbox_id: FromPath[str], make) -> b.SandboxView:
        view = (await _sent(request, sandbox_id, make)).sandbox
        assert view is not None  # a lifecycle request's reply carries the sandbox
        return view

    @post("/api/v1/sandboxes/{sandbox_id:str}/start", status_code=200)
    async def start_sandbox(request: Request, sandbox_id: FromPath[str]) -> Response:
        view = await _lifecycle(
            request,
            sandbox_id,
            lambda k, t, s: rq.StartSandbox(key=k, tenant=t, sandbox_id=s),
        )
        return json_response(view)

    @post("/api/v1/sandboxes/{sandbox_id:str}/touch", status_code=200)
    async def touch_sandbox(request: Request, sandbox_id: FromPath[str]) -> Response:
        view = await _lifecycle(
            request,
            sandbox_id,
            lambda k, t, s: rq.TouchSandbox(key=k, tenant=t, sandbox_id=s),
        )
        return json_response(view)

    @post("/api/v1/sandboxes/{sandbox_id:str}/stop", status_code=200)
    async def stop_sandbox(request: Request, sandbox_id: FromPath[str]) -> Response:
        wait = query_int(request, "wait", 0, 0, 3600)
        view = await _lifecycle(
            request,
            sandbox_id,
            lambda k, t, s: rq.StopSandbox(key=k, tenant=t, sandbox_id=s),
        )
        client = ctx.client(view.tenant)
        final = view.final_save
        settled = view.phase in ("stopped", "failed", "deleted") and (
            final is None or final.state in ("completed", "failed", "expired")
        )
        if wait and not settled:
            deadline = time.monotonic() + wait
            with contextlib.suppress(TimeoutError):
                view = await call(
                    client.wait_for_phase(view.id, {"stopped", "failed", "deleted"}, timeout=wait)
                )
                if view.final_save is not None:
                    left = max(0.1, deadline - time.monotonic())
                    await call(client.wait_for_save(view.id, view.final_save.id, timeout=left))
            view = await call(client.show_sandbox(view.id))
            final = view.final_save
            settled = view.phase in ("stopped", "failed", "deleted") and (
                final is None or final.state in ("completed", "failed", "expired")
            )
        return json_response(
            b.StopResult(
                stopped=view.phase == "stopped",
                phase=view.phase,
                final_save=view.final_save,
                settled=settled,
                sandbox=view,
            )
        )

    @delete("/api/v1/sandboxes/{sandbox_id:str}", status_code=202)
    async def delete_sandbox(request: Request, sandbox_id: FromPath[str]) -> Response:
        view = await _lifecycle(
            request,
            sandbox_id,
            lambda k, t, s: rq.DeleteSandbox(key=k, tenant=t, sandbox_id=s),
        )
        return json_response(view, 202)

    # --- snapshots and saves ---------------------------------------------------------

    @post("/api/v1/sandboxes/{sandbox_id:str}/snapshots")
    async def take_snapshot(request: Request, sandbox_id: FromPath[str]) -> Response:
        tenant = tenant_of(ctx, request)
        key = idempotency_key(request)
        body = b.decode_json(await json_body(request), b.SnapshotBody)
        reply = await call(
            ctx.client(tenant).send(
                rq.SnapshotSandbox(
                    key=key, tenant=tenant, sandbox_id=sid(sandbox_id), **b.request_fields(body)
                )
            )
        )
        save = reply.save
        location = f"/api/v1/sandboxes/{save.sandbox_id}/saves/{save.id}"
        return json_response(save, 202, headers={"Location": location})

    @delete("/api/v1/sandboxes/{sandbox_id:str}/snapshots/{save_id:str}", status_code=200)
    async def delete_snapshot(
        request: Request, sandbox_id: FromPath[str], save_id: FromPath[str]
    ) -> Response:
        reply = await _sent(
            request,
            sandbox_id,
            lambda k, t, s: rq.DeleteSnapshot(
                key=k,
                tenant=t,
                sandbox_id=s,
                save_id=check_id(save_id, SAVE_ID, "snapshot_not_found", "snapshot"),
            ),
        )
        return json_response(reply.save, 200)

    async def _saves(request: Request, sandbox_id: str, kind: str | None) -> Response:
        tenant = tenant_of(ctx, request)
        state = query_choice(request, "state", SAVE_STATES)
        limit = query_int(request, "limit", 100, 1, MAX_LIMIT)
        after = decode_cursor(request)
        await _owned(ctx, tenant, sid(sandbox_id))
        await fresh(ctx)
        sql = "SELECT view, requested_at, id FROM saves WHERE sandbox_id = ? AND tenant = ?"
        params: list = [sandbox_id, tenant]
        for column, value in (("kind", kind), ("state", state)):
            if value is not None:
                sql += f" AND {column} = ?"
                params.append(value)
        rows, next_cursor = await page(ctx, sql, params, after, limit, "requested_at")
        return json_response(
            b.SavePage(
                items=[msgspec.json.decode(r[0], type=b.SaveView) for r in rows],
                next_cursor=next_cursor,
            )
        )

    @get("/api/v1/sandboxes/{sandbox_id:str}/saves")
    async def list_saves(request: Request, sandbox_id: FromPath[str]) -> Response:
        return await _saves(request, sandbox_id, query_choice(request, "kind", SAVE_KINDS))

    @get("/api/v1/sandboxes/{sandbox_id:str}/snapshots")
    async def list_snapshots(request: Request, sandbox_id: FromPath[str]) -> Response:
        return await _saves(request, sandbox_id, "snapshot")

    @get("/api/v1/sandboxes/{sandbox_id:str}/saves/{save_id:str}")
    async def show_save(
        request: Request, sandbox_id: FromPath[str], save_id: FromPath[str]
    ) -> Response:
        client = ctx.client(tenant_of(ctx, request))
        state = await call(client.sandbox_state(sid(sandbox_id)))
        if state is None:
            raise ProblemError("sandbox_not_found", f"no sandbox {sandbox_id}")
        record = state.saves.get(save_id) if SAVE_ID.match(save_id) else None
        if record is None:
            raise ProblemError("save_not_found", f"no save {save_id} in {sandbox_id}")
        return json_response(save_view(state.id, record))

    # --- connections (decision 031) ------------------------------------------------

    def connection_name(value: str) -> str:
        return b.convert(value, rq.ConnectionName)

    @put("/api/v1/sandboxes/{sandbox_id:str}/connections/{name:str}", status_code=200)
    async def set_connection(
        request: Request, sandbox_id: FromPath[str], name: FromPath[str]
    ) -> Response:
        tenant = tenant_of(ctx, request)
        key = idempotency_key(request)
        body = b.decode_json(await json_body(request), b.ConnectionBody)
        reply = await call(
            ctx.client(tenant).send(
                rq.SetConnection(
                    key=key,
                    tenant=tenant,
                    sandbox_id=sid(sandbox_id),
                    name=connection_name(name),
                    value=body.value,
                )
            )
        )
        return json_response(reply.sandbox)

    @delete("/api/v1/sandboxes/{sandbox_id:str}/connections/{name:str}", status_code=200)
    async def remove_connection(
        request: Request, sandbox_id: FromPath[str], name: FromPath[str]
    ) -> Response:
        view = await _lifecycle(
            request,
            sandbox_id,
            lambda k, t, s: rq.RemoveConnection(
                key=k, tenant=t, sandbox_id=s, name=connection_name(name)
            ),
        )
        return json_response(view)

    # --- commands ----------------------------------------------------------------

    @post("/api/v1/sandboxes/{sandbox_id:str}/commands")
    async def run_command(request: Request, sandbox_id: FromPath[str]) -> Response:
        tenant = tenant_of(ctx, request)
        key = idempotency_key(request)
        body = b.decode_json(await json_body(request), b.RunCommandBody)
        try:
            run = rq.RunCommand(
                key=key, tenant=tenant, sandbox_id=sid(sandbox_id), **b.request_fields(body)
            )
        except ValueError as err:  # a rule across fields (env and secrets share a name)
            raise ProblemError(
                "invalid_request", str(err), errors=[FieldError(field="$", message=str(err))]
            ) from err
        reply = await call(ctx.client(tenant).send(run))
        command = reply.command
        location = f"/api/v1/sandboxes/{command.sandbox_id}/commands/{command.id}"
        return json_response(command, 202, headers={"Location": location})

    @get("/api/v1/sandboxes/{sandbox_id:str}/commands")
    async def list_commands(request: Request, sandbox_id: FromPath[str]) -> Response:
        tenant = tenant_of(ctx, request)
        state = query_choice(request, "state", COMMAND_STATES)
        limit = query_int(request, "limit", 100, 1, MAX_LIMIT)
        after = decode_cursor(request)
        await _owned(ctx, tenant, sid(sandbox_id))
        await fresh(ctx)
        sql = "SELECT view, queued_at, id FROM commands WHERE sandbox_id = ? AND tenant = ?"
        params: list = [sandbox_id, tenant]
        if state is not None:
            sql += " AND state = ?"
            params.append(state)
        rows, next_cursor = await page(ctx, sql, params, after, limit, "queued_at")
        return json_response(
            b.CommandPage(
                items=[msgspec.json.decode(r[0], type=b.CommandView) for r in rows],
                next_cursor=next_cursor,
            )
        )

    @get("/api/v1/sandboxes/{sandbox_id:str}/commands/{command_id:str}")
    async def show_command(
        request: Request, sandbox_id: FromPath[str], command_id: FromPath[str]
    ) -> Response:
        client = ctx.client(tenant_of(ctx, request))
        return json_response(await call(client.show_command(sid(sandbox_id), cid(command_id))))

    @post("/api/v1/sandboxes/{sandbox_id:str}/commands/{command_id:str}/cancel", status_code=200)
    async def cancel_command(
        request: Request, sandbox_id: FromPath[str], command_id: FromPath[str]
    ) -> Response:
        reply = await _sent(
            request,
            sandbox_id,
            lambda k, t, s: rq.CancelCommand(
                key=k, tenant=t, sandbox_id=s, command_id=cid(command_id)
            ),
        )
        return json_response(reply.command)

    @get("/api/v1/sandboxes/{sandbox_id:str}/commands/{command_id:str}/output")
    async def command_output(
        request: Request, sandbox_id: FromPath[str], command_id: FromPath[str]
    ) -> Stream | Response:
        client = ctx.client(tenant_of(ctx, request))
        last_event_id(request)  # refused when malformed, whichever answer is asked for
        command = await call(client.show_command(sid(sandbox_id), cid(command_id)))
        if wants_stream(request):
            return output_response(ctx, request, sandbox_id, command_id)
        output = await call(client.read_output(sandbox_id, command_id))
        return json_response(_output(command, output))

    # --- events --------------------------------------------------------------------

    @get("/api/v1/sandboxes/{sandbox_id:str}/events")
    async def sandbox_events(request: Request, sandbox_id: FromPath[str]) -> Stream | Response:
        tenant = tenant_of(ctx, request)
        after, wait_s = last_event_id(request), page_wait(request)
        await _owned(ctx, tenant, sid(sandbox_id))
        subject = ctx.names.events("sandbox", sandbox_id)
        return await event_response(ctx, request, subject, after, wait_s)

    # --- hosts -----------------------------------------------------------------------

    @get("/api/v1/hosts")
    async def list_hosts(request: Request) -> Response:
        tenant_of(ctx, request)
        return json_response(b.HostList(items=await host_views(ctx)))

    return [
        create_sandbox,
        list_sandboxes,
        show_sandbox,
        start_sandbox,
        stop_sandbox,
        touch_sandbox,
        delete_sandbox,
        take_snapshot,
        delete_snapshot,
        set_connection,
        remove_connection,
        list_saves,
        list_snapshots,
        show_save,
        run_command,
        list_commands,
        show_command,
        cancel_command,
        command_output,
        sandbox_events,
        list_hosts,
    ]


# --- shared with the task routes --------------------------------------------------


def last_event_id(request: Request) -> int:
    """`Last-Event-ID` (a reconnecting EventSource), else `?after=`; 0 = from the start.
    Each one given must be a sequence number, whichever is used."""
    given = {
        "Last-Event-ID": request.headers.get("last-event-id"),
        "after": request.query_params.get("after"),
    }
    for name, raw in given.items():
        if raw is not None and not (is_digits(raw.strip()) and len(raw.strip()) <= 19):
            raise ProblemError(
                "invalid_header",
                "Last-Event-ID (or ?after=) is the id of an event this stream sent: "
                "a sequence number",
                errors=[FieldError(field=name, message="a non-negative integer")],
            )
    raw = given["Last-Event-ID"] or given["after"] or "0"
    return int(raw.strip())


MAX_WAIT_S = 30


def page_wait(request: Request) -> int:
    """`?wait=`: how long a page of events waits for a first one (0-30 s)."""
    return query_int(request, "wait", 0, 0, MAX_WAIT_S)


Frames = AsyncIterator[bytes]


def sse_stream(frames: Frames) -> Stream:
    return Stream(
        frames,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _as_is(frames: Frames) -> Frames:
    return frames


async def event_response(
    ctx: Context,
    request: Request,
    subject: str,
    after: int,
    wait_s: int,
    *,
    named: bool = True,
    hold: Callable[[Frames], Frames] = _as_is,
) -> Stream | Response:
    """The events after `after`: a Server-Sent Events stream, or, for a client
    that asks for JSON (a poller, a tenant's NATS API call), one page of them,
    waiting up to `wait_s` seconds for the first when there are none. `hold`
    wraps the stream's frames (the console's: for as long as the session holds)."""
    if _wants_json(request):
        page = await event_page(
            ctx.js, ctx.names.events_stream, subject, after=after, wait_s=wait_s
        )
        return json_response(page)
    frames = event_frames(
        ctx.js, ctx.names.events_stream, subject, after=after, keepalive_s=ctx.keepalive_s,
        named=named,
    )  # fmt: skip
    return sse_stream(hold(frames))


def output_response(
    ctx: Context,
    request: Request,
    sandbox_id: str,
    command_id: str,
    *,
    hold: Callable[[Frames], Frames] = _as_is,
) -> Stream:
    """A command's output as Server-Sent Events (`output_frames`): what it kept
    so far, then live, then its end; a reconnect resumes after Last-Event-ID.
    The caller has checked that the command is the tenant's."""

    async def ended() -> b.CommandView | None:
        await fresh(ctx)  # (the read model takes the log in batches: decision 087)
        rows = await ctx.read_model.query(
            "SELECT view FROM commands WHERE sandbox_id = ? AND id = ?", (sandbox_id, command_id)
        )
        view = msgspec.json.decode(rows[0][0], type=b.CommandView) if rows else None
        return view if view is not None and view.state in END_STATES else None

    frames = output_frames(
        ctx.js,
        ctx.names.output_stream,
        ctx.names.output(sandbox_id, command_id) + ".*",
        after=last_event_id(request),
        ended=ended,
        keepalive_s=ctx.keepalive_s,
    )
    return sse_stream(hold(frames))


def wants_stream(request: Request) -> bool:
    """`Accept: text/event-stream` (what a browser's EventSource sends)."""
    return "text/event-stream" in request.headers.get("accept", "").lower()


def _wants_json(request: Request) -> bool:
    """`Accept: application/json` without `text/event-stream` (a browser's
    EventSource sends the latter; no Accept at all keeps the stream)."""
    accept = request.headers.get("accept", "").lower()
    return "application/json" in accept and "text/event-stream" not in accept


async def owned(ctx: Context, tenant: str, kind: str, aggregate_id: str) -> None:
    """Refuse, as not found, a sandbox or task that is not `tenant`'s (`ownership`)."""
    if await ownership.tenant_of(ctx.js, ctx.names, kind, aggregate_id) != tenant:
        raise ProblemError(f"{kind}_not_found", f"no {kind} {aggregate_id}")


async def _owned(ctx: Context, tenant: str, sandbox_id: FromPath[str]) -> None:
    await owned(ctx, tenant, "sandbox", sandbox_id)


async def count_commands(ctx: Context, views: list[b.SandboxView]) -> list[b.SandboxView]:
    """Views from the read model with their commands counted by state: commands
    are rows of their own there, so they are counted there."""
    if views:
        by_id = {view.id: view for view in views}
        counts = await ctx.read_model.query(
            "SELECT sandbox_id, state, count(*) FROM commands "
            f"WHERE sandbox_id IN ({', '.join('?' * len(views))}) GROUP BY sandbox_id, state",
            tuple(by_id),
        )
        for sandbox, state, n in counts:
            by_id[sandbox].commands[state] = n
    return views


async def host_views(ctx: Context) -> list[b.HostView]:
    """Every host as `GET /api/v1/hosts` and the console show it: its record
    with its lease's liveness and renewal age, and its chunk cache."""
    await fresh(ctx)
    rows = await ctx.read_model.query("SELECT state FROM hosts ORDER BY id")
    kv = await leases.lease_bucket(ctx.js, ctx.names)
    ttl = (await leases.published_settings(kv))["lease_ttl_s"]
    items = []
    for (row,) in rows:
        host = msgspec.json.decode(row, type=Host)
        age, interval = await leases.lease_age(kv, host.host, now=time.time())
        status = liveness(host, lease_age_s=age, ttl_s=ttl, interval_s=interval)
        view = msgspec.json.decode(row, type=b.HostView)
        lease = await leases.read_lease(kv, host.host)
        items.append(
            msgspec.structs.replace(
                view,
                status=status,
                last_renewal_age_s=age,
                lease_interval_s=interval,
                chunk_cache=lease.chunk_cache if lease is not None else None,
            )
        )
    return items


async def page(ctx: Context, sql: str, params: list, after, limit: int, order: str):
    if after is not None:
        sql += f" AND ({order}, id) > (?, ?)"
        params += after
    sql += f" ORDER BY {order}, id LIMIT ?"
    params.append(limit + 1)
    rows = await ctx.read_model.query(sql, tuple(params))
    more = len(rows) > limit
    last = rows[limit - 1] if more else None
    return rows[:limit], (encode_cursor(last[1], last[2]) if last else None)


def decode_sandbox(state: bytes):
    """A sandbox's state as the read model keeps it (without its commands, with
    only the saves its view reads)."""
    from sandhold.gateway.readmodel import KINDS

    return KINDS["sandbox"].decode(state)


def _output(command: b.CommandView, output: dict[str, bytes]) -> b.CommandOutput:
    streams = {name: output.get(name, b"") for name in ("stdout", "stderr")}
    try:
        text = {name: data.decode() for name, data in streams.items()}
        encoding = "utf-8"
    except UnicodeDecodeError:
        text = {name: base64.b64encode(data).decode() for name, data in streams.items()}
        encoding = "base64"
    kept = dict(command.output_kept)
    missing = {name: max(0, kept.get(name, 0) - len(streams[name])) for name in streams}
    ended = command.state in END_STATES
    return b.CommandOutput(
        command_id=command.id,
        state=command.state,
        ended=ended,
        encoding=encoding,
        stdout=text["stdout"],
        stderr=text["stderr"],
        kept_bytes=kept,
        missing_bytes=missing,
        output_complete=command.output_complete,
        complete=ended and command.output_complete and not any(missing.values()),
    )
