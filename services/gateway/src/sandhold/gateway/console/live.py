"""What keeps the console's lists live: a stream of which of the tenant's
sandboxes (or tasks) just changed, for a page to fetch its table again.

Only ids go out, and only the tenant's own: the events of every tenant pass
through here, and whose each aggregate is comes from its first event (cached
for the connection). No Last-Event-ID: a list that reconnects fetches its
table again, which shows whatever it missed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar import Request, Response, get
from litestar.params import FromPath
from litestar.response import Stream
from sandhold.bus import ownership
from sandhold.bus.append import last_sequence
from sandhold.bus.follow import pull_batches
from sandhold.gateway.console.html import error, esc, page
from sandhold.gateway.console.kit import Console
from sandhold.gateway.problems import ProblemError
from sandhold.gateway.routes_sandboxes import event_response, last_event_id, owned, sse_stream
from sandhold.gateway.web import SANDBOX_ID, TASK_ID, Context

KINDS = frozenset({"sandbox", "task"})
_CACHED = 10_000  # aggregates whose tenant a connection remembers


async def changes(ctx: Context, tenant: str, kind: str) -> AsyncIterator[bytes]:
    subject = ctx.names.events(kind)
    after = await last_sequence(ctx.js, ctx.names.events_stream, subject)
    yield b"retry: 1000\n\n"
    mine: dict[str, bool] = {}
    batches = pull_batches(
        ctx.js, ctx.names.events_stream, subject, after=after, batch=64,
        idle_s=ctx.keepalive_s, what="a console list",
    )  # fmt: skip
    try:
        async for batch in batches:
            if not batch:
                yield b": keep-alive\n\n"
            changed: list[str] = []
            for _, msg in batch:
                aggregate = msg.subject.rsplit(".", 1)[1]
                if aggregate not in mine:
                    if len(mine) >= _CACHED:
                        mine.clear()
                    owner = await ownership.tenant_of(ctx.js, ctx.names, kind, aggregate)
                    mine[aggregate] = owner == tenant
                if mine[aggregate] and aggregate not in changed:
                    changed.append(aggregate)
            for aggregate in changed:
                yield f"data: {aggregate}\n\n".encode()
    finally:
        await batches.aclose()


def live_list(kind: str, here: str, table: str) -> str:
    """A list page's table, fetched again from `here` whenever one of the
    tenant's sandboxes or tasks (`kind`) changes."""
    return (
        '<p id="live" class="muted" role="status">Connecting…</p>'
        f'<div id="list" data-refresh="{esc(here)}" data-changes="/changes/{kind}">{table}</div>'
    )


_IDS = {"sandbox": SANDBOX_ID, "task": TASK_ID}


async def aggregate_events(
    console: Console, request: Request, kind: str, aggregate_id: str
) -> Stream | Response:
    """A sandbox's or task's events as a page's EventSource takes them: from the
    start, then live, for as long as the session holds; a reconnect resumes
    after its Last-Event-ID. Missing, malformed or another tenant's: one and the
    same not-found page (a malformed id is never put in a subject)."""
    session = console.signed_in(request)
    if isinstance(session, Response):
        return session
    ctx = console.ctx
    try:
        if not _IDS[kind].match(aggregate_id):
            raise ProblemError(f"{kind}_not_found", f"no {kind} {aggregate_id}")
        await owned(ctx, session.tenant, kind, aggregate_id)
    except ProblemError:
        return page("Not found", error(f"No {kind} {aggregate_id}."), session, status=404)
    subject = ctx.names.events(kind, aggregate_id)
    after = last_event_id(request)
    hold = console.hold(request)
    return await event_response(ctx, request, subject, after, 0, named=False, hold=hold)


def handlers(console: Console) -> list:
    @get("/changes/{kind:str}", include_in_schema=False)
    async def changes_stream(request: Request, kind: FromPath[str]) -> Stream | Response:
        session = console.signed_in(request)
        if isinstance(session, Response):
            return session
        if kind not in KINDS:
            return page("Not found", error("No such page."), session, status=404)
        frames = changes(console.ctx, session.tenant, kind)
        return sse_stream(console.while_signed_in(request, frames))

    return [changes_stream]
