"""The sandboxes pages: a table by phase, live; a sandbox's status, commands, saves
and events, live, or as of any point in its log."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from litestar import Request, Response, get
from litestar.params import FromPath
from litestar.response import Stream
from sandhold.domain import asof
from sandhold.domain import sandbox as sb
from sandhold.domain.envelope import Recorded
from sandhold.domain.views import SaveView, command_view, sandbox_view
from sandhold.gateway.console.actions import (
    ACTIONS,
    action_form,
    delete_snapshot_fields,
    exec_fields,
    new_key,
    snapshot_fields,
)
from sandhold.gateway.console.commands import command_rows, commands_table
from sandhold.gateway.console.html import (
    choices,
    csrf_field,
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
from sandhold.gateway.console.live import aggregate_events, live_list
from sandhold.gateway.console.saves import saves_timeline
from sandhold.gateway.console.sessions import Session
from sandhold.gateway.problems import ProblemError
from sandhold.gateway.routes_sandboxes import count_commands, decode_sandbox
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
        table_ = await _sandbox_list(session.tenant, phase)
        if request.query_params.get("part") == "table":
            return fragment(table_)
        create = (
            '<form method="post" action="/sandboxes" class="action">'
            f'{csrf_field(session)}<input type="hidden" name="key" value="{new_key()}">'
            '<button type="submit">Create a sandbox</button></form>'
        )
        here = "/sandboxes?part=table" + (f"&phase={phase}" if phase else "")
        body = f"{create}{_filter(phase)}{live_list('sandbox', here, table_)}"
        return page("Sandboxes", body, session)

    async def _sandbox_list(tenant: str, phase: str | None) -> str:
        await fresh(ctx)
        sql = "SELECT state FROM sandboxes WHERE tenant = ?"
        params: list = [tenant]
        if phase is not None:
            sql += " AND phase = ?"
            params.append(phase)
        else:
            sql += " AND phase != 'deleted'"
        sql += " ORDER BY created_at DESC, id LIMIT ?"
        params.append(LIST_LIMIT)
        rows = await ctx.read_model.query(sql, tuple(params))
        now = time.time()
        views = [sandbox_view(decode_sandbox(r[0]), now=now) for r in rows]
        return _sandbox_table(await count_commands(ctx, views))

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
        at = request.query_params.get("at")
        if at is not None:
            return await _as_of(session, view.id, at)
        here = f"/sandboxes/{view.id}"
        body = (
            f'<div id="actions" data-refresh="{here}/actions" data-swap="when-forms-change">'
            f"{_actions(session, view)}</div>"
            '<section aria-labelledby="status-h"><h2 id="status-h">Status</h2>'
            f'<div id="status" data-refresh="{here}/status">{_sandbox_status(view)}</div>'
            "</section>"
            '<section aria-labelledby="commands-h"><h2 id="commands-h">Commands</h2>'
            f'<div id="commands" data-refresh="{here}/commands">'
            f"{await commands_table(ctx, view.id)}</div></section>"
            '<section aria-labelledby="saves-h"><h2 id="saves-h">Saves</h2>'
            f'<div id="saves" data-refresh="{here}/saves">{await _saves_timeline(view)}</div>'
            "</section>"
            '<section aria-labelledby="events-h"><h2 id="events-h">Events</h2>'
            f"{_history_form(here)}"
            '<p id="live" class="muted" role="status">Loading the history…</p>'
            f'<ol id="events" data-events="{here}/events"></ol></section>'
        )
        return page(f"Sandbox {view.id}", body, session)

    async def _as_of(session: Session, sandbox_id: str, at: str) -> Response:
        """The sandbox as `sandhold replay --at` shows it: folded from its events up
        to a point, with those events."""
        here = f"/sandboxes/{sandbox_id}"
        try:
            seq, moment = asof.parse_point(at)
        except ValueError as err:
            body = error(f"“at” takes {err}.") + _history_form(here)
            return page(f"Sandbox {sandbox_id}", body, session, status=400)
        everything = await ctx.client(session.tenant).sandbox_records(sandbox_id)
        found = asof.state_at(sb.evolve, everything, seq, moment)
        if found is None:
            body = error(f"{sandbox_id} did not exist yet at {at}.") + _history_form(here, at)
            return page(f"Sandbox {sandbox_id}", body, session, status=404)
        state, last = found
        records = [r for r in everything if r.seq <= last.seq]
        view = sandbox_view(state, now=moment if moment is not None else last.envelope.time)
        commands = [command_view(sandbox_id, c, state) for c in state.commands.values()]
        body = (
            f'<p role="status" class="notice">As of event {last.seq} ({when(last.envelope.time)}):'
            f' what sandhold knew then. <a href="{here}">Back to now</a></p>'
            f"{_history_form(here, at)}"
            f'<section aria-labelledby="status-h"><h2 id="status-h">Status then</h2>'
            f"{_sandbox_status(view)}</section>"
            '<section aria-labelledby="commands-h"><h2 id="commands-h">Commands then</h2>'
            f"{command_rows(sorted(commands, key=lambda c: -c.queued_at))}</section>"
            '<section aria-labelledby="events-h"><h2 id="events-h">Events up to then</h2>'
            f'<ol id="events">{"".join(event_item(r) for r in records)}</ol></section>'
        )
        return page(f"Sandbox {sandbox_id}", body, session)

    @get("/sandboxes/{sandbox_id:str}/status", include_in_schema=False)
    async def sandbox_status(request: Request, sandbox_id: FromPath[str]) -> Response:
        """The status block alone: what the page swaps in as events come (from
        the read model: not a fold of the whole log after every event)."""
        found = await owned_row(request, sandbox_id)
        if isinstance(found, Response):
            return found
        return fragment(_sandbox_status(found[1]))

    @get("/sandboxes/{sandbox_id:str}/events", include_in_schema=False)
    async def sandbox_events(request: Request, sandbox_id: FromPath[str]) -> Stream | Response:
        # (Annotated as a Stream: with `Any`, Litestar would send it as application/json.)
        return await aggregate_events(console, request, "sandbox", sandbox_id)

    async def owned_row(request: Request, sandbox_id: str) -> tuple[Session, Any] | Response:
        """For fragments: the session and the read model's sandbox (this tenant's only)."""
        session = console.signed_in(request)
        if isinstance(session, Response):
            return session
        # What the log had when asked: the page's events come from the log itself
        # and may be ahead of the read model, and a block drawn after the last of
        # them is not drawn again.
        await fresh(ctx)
        rows = await ctx.read_model.query(
            "SELECT state FROM sandboxes WHERE id = ? AND tenant = ?", (sandbox_id, session.tenant)
        )
        if not rows:
            return page("Not found", error(f"No sandbox {sandbox_id}."), session, status=404)
        view = sandbox_view(decode_sandbox(rows[0][0]), now=time.time())
        return session, (await count_commands(ctx, [view]))[0]

    @get("/sandboxes/{sandbox_id:str}/actions", include_in_schema=False)
    async def actions_fragment(request: Request, sandbox_id: FromPath[str]) -> Response:
        """The buttons for what the sandbox's phase allows now (stopped: start)."""
        found = await owned_row(request, sandbox_id)
        if isinstance(found, Response):
            return found
        return fragment(_actions(*found))

    @get("/sandboxes/{sandbox_id:str}/commands", include_in_schema=False)
    async def commands_fragment(request: Request, sandbox_id: FromPath[str]) -> Response:
        found = await owned_row(request, sandbox_id)
        if isinstance(found, Response):
            return found
        return fragment(await commands_table(ctx, found[1].id))

    @get("/sandboxes/{sandbox_id:str}/saves", include_in_schema=False)
    async def saves_fragment(request: Request, sandbox_id: FromPath[str]) -> Response:
        found = await owned_row(request, sandbox_id)
        if isinstance(found, Response):
            return found
        return fragment(await _saves_timeline(found[1]))

    async def _saves_timeline(view: Any) -> str:
        rows = await ctx.read_model.query(
            "SELECT view FROM saves WHERE sandbox_id = ? ORDER BY requested_at, id", (view.id,)
        )
        return saves_timeline(view, [_save_decoder.decode(r[0]) for r in rows], time.time())

    return [
        sandboxes_page,
        sandbox_page,
        sandbox_status,
        sandbox_events,
        actions_fragment,
        commands_fragment,
        saves_fragment,
    ]


_save_decoder = msgspec.json.Decoder(SaveView)


def _actions(session: Session, view: Any) -> str:
    forms = [
        action_form(session, view.id, action, fields)
        for action, fields in (
            ("exec", exec_fields()),
            ("snapshot", snapshot_fields()),
            ("stop", ""),
            ("start", ""),
        )
        if view.phase in ACTIONS[action].shows_in
    ]
    forms += [
        action_form(session, view.id, "delete_snapshot", delete_snapshot_fields(s.id, s.name))
        for s in view.snapshots
        if s.state == "completed"
    ]
    if not forms:
        return ""
    return (
        '<section aria-labelledby="act-h"><h2 id="act-h">Do</h2>'
        f'{"".join(forms)}<p class="muted">Each asks you to confirm first.</p></section>'
    )


def _history_form(here: str, at: str = "") -> str:
    return (
        f'<form method="get" action="{esc(here)}"><label for="at">Show as of</label> '
        f'<input id="at" name="at" value="{esc(at)}" size="24" '
        'placeholder="event number or 2026-12-03T12:00:00Z" required> '
        '<button type="submit">Show</button></form>'
    )


def event_item(record: Recorded) -> str:
    """One event as the history shows it: when, what, with its fields, and who."""
    e = record.envelope
    fields = msgspec.to_builtins(e.event)
    summary = " ".join(
        f"{k}={str(v)[:80]}"
        for k, v in fields.items()
        if k != "type" and v is not None and not isinstance(v, dict | list)
    )
    return (
        f'<li id="ev-{record.seq}">{when(e.time)} <strong>{esc(fields.get("type", ""))}</strong> '
        f"{esc(summary)} ({esc(e.actor)})</li>"
    )


def _filter(phase: str | None) -> str:
    return choices("/sandboxes", "phase", "all but deleted", sorted(PHASES), phase)


def _health(health) -> str:
    return "—" if health is None else state_and_reason(health.state, health.reason)


def _commands(counts: dict[str, int]) -> str:
    return ", ".join(f"{esc(state)} {n}" for state, n in sorted(counts.items()))


def _isolation(v) -> str:
    iso = v.isolation
    if not iso.get("driver"):
        return esc(f"network {iso.get('network', '—')}")
    walls = "unisolated (development driver)" if iso.get("unisolated") else str(iso["driver"])
    return esc(f"{walls}, network {iso.get('network', '—')}")


def _rpo(v) -> str:
    if v.unchanged_since_save is not None:
        return "0 s (unchanged since its last save)"
    return "—" if v.rpo_s is None else f"{v.rpo_s:.0f} s"


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
                _isolation(v),
                _health(v.save_health),
                _rpo(v),
                when(last.completed_at if last else None),
                _commands(v.commands) or "—",
            ]
        )
    head = [
        "Sandbox", "Phase", "Host", "Generation", "Isolation", "Save health", "RPO",
        "Last save", "Commands",
    ]  # fmt: skip
    return table(head, rows, "No sandboxes.", wide=frozenset({3, 4, 6, 7, 8}))


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
            ("Isolation", _isolation(v)),
            ("RPO", _rpo(v)),
            ("Recoverable from", esc(v.recoverable_from or "—")),
            ("Commands", _commands(v.commands) or "none"),
        ]
    )
