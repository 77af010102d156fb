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
from sandhold.gateway.console.html import error, page
from sandhold.gateway.console.kit import Console
from sandhold.gateway.routes_sandboxes import sse_stream
from sandhold.gateway.web import Context

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
