"""The sandboxes pages: a table by phase; a sandbox's status and events, live."""

from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, get
from litestar.params import FromPath
from litestar.response import Stream
from sandhold.domain.views import sandbox_view
from sandhold.gateway.console.html import (
    choices,
    error,
    esc,
    facts,
    fragment,
    page,
    state_and_reason,
    table,
    when,
)
from sandhold.gateway.console.kit import Console
from sandhold.gateway.console.sessions import Session
from sandhold.gateway.problems import ProblemError
from sandhold.gateway.routes_sandboxes import event_response, last_event_id, owned
from sandhold.gateway.web import PHASES, SANDBOX_ID, call, fresh

LIST_LIMIT = 500


def handlers(console: Console) -> list:
    ctx = console.ctx

    @get("/sandboxes", include_in_schema=False)
    async def sandboxes_page(request: Request) -> Response:
        session = console.signed_in(request)
        if isinstance(session, Response):
            return session
        phase = request.query_params.get("phase") or None
        if phase is not None and phase not in PHASES:
            body = error(f"No phase “{phase}”.") + _filter(None)
            return page("Sandboxes", body, session, status=400)
        await fresh(ctx)
        sql = "SELECT state FROM sandboxes WHERE tenant = ?"
        params: list = [session.tenant]
        if phase is not None:
            sql += " AND phase = ?"
            params.append(phase)
        else:
            sql += " AND phase != 'deleted'"
        sql += " ORDER BY created_at DESC, id LIMIT ?"
        params.append(LIST_LIMIT)
        rows = await ctx.read_model.query(sql, tuple(params))
        now = time.time()
        views = [sandbox_view(_decode_sandbox(r[0]), now=now) for r in rows]
        return page("Sandboxes", _filter(phase) + _sandbox_table(views), session)

    async def signed_in_sandbox(
        request: Request, sandbox_id: str
    ) -> tuple[Session, Any] | Response:
        """The session and the sandbox's view; else where to go instead: the
        sign-in, or a 404 page if the sandbox is not this tenant's (or none's)."""
        session = console.signed_in(request)
        if isinstance(session, Response):
            return session
        try:
            if not SANDBOX_ID.match(sandbox_id):
                raise ProblemError("sandbox_not_found", f"no sandbox {sandbox_id}")
            return session, await call(ctx.client(session.tenant).show_sandbox(sandbox_id))
        except ProblemError as err:
            if err.code != "sandbox_not_found":
                raise
            return page("Not found", error(f"No sandbox {sandbox_id}."), session, status=404)

    @get("/sandboxes/{sandbox_id:str}", include_in_schema=False)
    async def sandbox_page(request: Request, sandbox_id: FromPath[str]) -> Response:
        found = await signed_in_sandbox(request, sandbox_id)
        if isinstance(found, Response):
            return found
        session, view = found
        here = f"/sandboxes/{view.id}"
        body = (
            '<section aria-labelledby="status-h"><h2 id="status-h">Status</h2>'
            f'<div id="status" data-refresh="{here}/status">{_sandbox_status(view)}</div>'
            "</section>"
            '<section aria-labelledby="events-h"><h2 id="events-h">Events</h2>'
            '<p id="live" class="muted" role="status">Loading the history…</p>'
            f'<ol id="events" data-events="{here}/events"></ol></section>'
        )
        return page(f"Sandbox {view.id}", body, session)

    @get("/sandboxes/{sandbox_id:str}/status", include_in_schema=False)
    async def sandbox_status(request: Request, sandbox_id: FromPath[str]) -> Response:
        """The status block alone: what the page swaps in as events come."""
        found = await signed_in_sandbox(request, sandbox_id)
        if isinstance(found, Response):
            return found
        return fragment(_sandbox_status(found[1]))

    @get("/sandboxes/{sandbox_id:str}/events", include_in_schema=False)
    async def sandbox_events(request: Request, sandbox_id: FromPath[str]) -> Stream | Response:
        """The sandbox's events as the page's EventSource takes them: from the
        start, then live; a reconnect resumes after its Last-Event-ID."""
        # (Annotated as a Stream: with `Any`, Litestar would send it as application/json.)
        session = console.signed_in(request)
        if isinstance(session, Response):
            return session
        if not SANDBOX_ID.match(sandbox_id):
            raise ProblemError("sandbox_not_found", f"no sandbox {sandbox_id}")
        await owned(ctx, session.tenant, "sandbox", sandbox_id)
        subject = ctx.names.events("sandbox", sandbox_id)
        return await event_response(ctx, request, subject, last_event_id(request), 0, named=False)

    return [sandboxes_page, sandbox_page, sandbox_status, sandbox_events]


def _decode_sandbox(state: bytes):
    from sandhold.gateway.readmodel import KINDS

    return KINDS["sandbox"].decoder.decode(state)


def _filter(phase: str | None) -> str:
    return choices("/sandboxes", "phase", "all but deleted", sorted(PHASES), phase)


def _health(health) -> str:
    return "—" if health is None else state_and_reason(health.state, health.reason)


def _commands(counts: dict[str, int]) -> str:
    return ", ".join(f"{esc(state)} {n}" for state, n in sorted(counts.items()))


def _sandbox_table(views: list) -> str:
    rows = []
    for v in views:
        last = v.last_completed_save
        rows.append(
            [
                f'<a href="/sandboxes/{esc(v.id)}">{esc(v.id)}</a>',
                state_and_reason(v.phase, v.reason),
                esc(v.host or "—"),
                esc(v.generation),
                _health(v.save_health),
                when(last.completed_at if last else None),
                _commands(v.commands) or "—",
            ]
        )
    head = ["Sandbox", "Phase", "Host", "Generation", "Save health", "Last save", "Commands"]
    return table(head, rows, "No sandboxes.", wide=frozenset({3, 5, 6}))


def _sandbox_status(v) -> str:
    last = v.last_completed_save
    return facts(
        [
            ("Phase", state_and_reason(v.phase, v.reason)),
            ("Host", esc(v.host or "—")),
            ("Generation", esc(v.generation)),
            ("Created", when(v.created_at)),
            ("Save health", _health(v.save_health)),
            ("Last completed save", esc(last.id) + " " + when(last.completed_at) if last else "—"),
            ("RPO", f"{v.rpo_s:.0f} s" if v.rpo_s is not None else "—"),
            ("Recoverable from", esc(v.recoverable_from or "—")),
            ("Commands", _commands(v.commands) or "none"),
        ]
    )
