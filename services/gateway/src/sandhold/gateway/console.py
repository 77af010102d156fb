"""The web console: the gateway's pages for people (decision 049).

Served by the gateway itself, from the same read model and with the same
tokens and tenant rules as the API: a page shows what `GET /api/v1/...` would
show the token it was signed in with, and another tenant's sandbox is the same
404 as one that does not exist. Pages are rendered here as plain HTML (no
template engine, no JavaScript build, nothing loaded from elsewhere).

Sessions. Signing in with a token sets `sandhold_session`: HttpOnly,
SameSite=Strict, signed with the gateway's console key (`console.key` beside
the tokens file, made on first start), carrying the token's SHA-256 digest
(never the token), an expiry and a nonce. It holds across gateway restarts;
each request looks the digest up in the tokens file again, so a revoked token's
session ends at its next request. Every form carries a CSRF token derived from
the session's nonce; the sign-in form, before any session, a double-submit
cookie of its own.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import html
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.datastructures import Cookie
from litestar.params import FromPath
from litestar.response import Stream
from sandhold.domain.task_views import task_view
from sandhold.domain.views import sandbox_view
from sandhold.gateway.problems import ProblemError
from sandhold.gateway.routes_sandboxes import event_response, host_views, last_event_id, owned
from sandhold.gateway.routes_tasks import TASK_STATES, task_decoder
from sandhold.gateway.tokens import Tokens, digest
from sandhold.gateway.web import PHASES, SANDBOX_ID, Context, call, fresh

SESSION_COOKIE = "sandhold_session"
SIGN_IN_COOKIE = "sandhold_sign_in"  # the sign-in form's CSRF value, before any session
SESSION_S = 12 * 3600.0
MAX_TOKEN = 200  # longer than any token `sandhold token create` makes
KEY_FILE = "console.key"
LIST_LIMIT = 500


class _Payload(msgspec.Struct, forbid_unknown_fields=True):
    d: str  # the token's SHA-256
    e: float  # expiry, unix seconds
    n: str  # nonce: the session's CSRF tokens derive from it


_payload = msgspec.json.Decoder(_Payload)
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class Session:
    tenant: str
    csrf: str


class Sessions:
    """Signed session cookies for the console's users."""

    def __init__(self, tokens: Tokens, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("a console key has at least 32 bytes")
        self._tokens = tokens
        self._key = key

    @classmethod
    def beside(cls, tokens: Tokens) -> Sessions:
        """With the key kept next to the tokens file (made on first use, 0600)."""
        path = tokens.path.with_name(KEY_FILE)
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(tmp, path)  # the first of two starting gateways wins
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
            key = path.read_bytes()
        return cls(tokens, key)

    def _sign(self, body: bytes) -> str:
        return hmac.new(self._key, body, hashlib.sha256).hexdigest()

    def issue(self, token: str, *, now: float | None = None) -> str | None:
        """A session cookie's value for `token`, or None if the token is unknown."""
        wanted = digest(token)
        if self._tokens.tenant_of_digest(wanted) is None:
            return None
        expires = (time.time() if now is None else now) + SESSION_S
        body = _encode(_Payload(d=wanted, e=expires, n=secrets.token_hex(16)))
        # No padding: a cookie value with "=" in it would be sent quoted.
        return f"{base64.urlsafe_b64encode(body).decode().rstrip('=')}.{self._sign(body)}"

    def open(self, value: str | None, *, now: float | None = None) -> Session | None:
        """The session a cookie value stands for, if it is intact, current and
        its token is not revoked."""
        if not value or len(value) > 1000:
            return None
        encoded, _, signature = value.partition(".")
        try:
            body = base64.urlsafe_b64decode(encoded.encode() + b"=" * (-len(encoded) % 4))
        except ValueError:
            return None
        if not hmac.compare_digest(self._sign(body), signature):
            return None
        try:
            payload = _payload.decode(body)
        except msgspec.DecodeError:
            return None
        if payload.e < (time.time() if now is None else now):
            return None
        tenant = self._tokens.tenant_of_digest(payload.d)
        if tenant is None:
            return None
        return Session(tenant=tenant, csrf=self._sign(b"csrf:" + payload.n.encode()))


# --- pages ----------------------------------------------------------------------

_STYLE = """\
:root { color-scheme: light dark; --line: #8884; --muted: #777; }
body { font: 15px/1.45 system-ui, sans-serif; margin: 0; }
header { display: flex; gap: 1.5rem; align-items: center; padding: .6rem 1.2rem;
         border-bottom: 1px solid var(--line); flex-wrap: wrap; }
header strong { margin-right: auto; }
main { padding: 1rem 1.2rem; max-width: 80rem; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .35rem .6rem; border-bottom: 1px solid var(--line); }
th { font-weight: 600; }
.muted { color: var(--muted); }
.error { border: 2px solid #c33; padding: .6rem .9rem; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: .3rem 1rem; }
dt { font-weight: 600; }
td, dd, li { overflow-wrap: anywhere; }
a:focus, button:focus, input:focus, select:focus { outline: 3px solid #48f; }
@media (max-width: 40rem) { .wide { display: none; } }
"""

# The pages' one script: times in the viewer's zone, and a sandbox's events as
# they come (EventSource resumes after its Last-Event-ID by itself, so a dropped
# connection shows what it missed, each event once).
_SCRIPT = """\
"use strict";
function local(t) {
  const when = new Date(t.dateTime);
  t.title = when.toISOString().replace("T", " ").slice(0, 19) + " UTC";
  t.textContent = when.toLocaleString();
}
document.querySelectorAll("time[datetime]").forEach(local);
function summary(fields) {
  return Object.entries(fields || {})
    .filter(([k, v]) => k !== "type" && v !== null && typeof v !== "object")
    .map(([k, v]) => k + "=" + String(v).slice(0, 80)).join(" ");
}
const list = document.querySelector("[data-events]");
if (list) {
  const live = document.getElementById("live");
  const status = document.querySelector("[data-refresh]");
  let pending = null;
  const source = new EventSource(list.dataset.events);
  source.onopen = () => { live.textContent = "Live: new events appear as they happen."; };
  source.onerror = () => {
    live.textContent = "Connection lost: reconnecting; what happens meanwhile is shown once back.";
  };
  source.onmessage = (message) => {
    const e = JSON.parse(message.data);
    if (document.getElementById("ev-" + e.seq)) return;
    const item = document.createElement("li");
    item.id = "ev-" + e.seq;
    const t = document.createElement("time");
    t.dateTime = new Date(e.time * 1000).toISOString();
    local(t);
    const kind = document.createElement("strong");
    kind.textContent = e.type;
    item.append(t, " ", kind, " ", summary(e.event), " (" + e.actor + ")");
    list.append(item);
    if (status && pending === null) {
      pending = setTimeout(async () => {
        pending = null;
        const answer = await fetch(status.dataset.refresh, {credentials: "same-origin"});
        if (answer.ok) {
          status.innerHTML = await answer.text();
          status.querySelectorAll("time[datetime]").forEach(local);
        }
      }, 150);
    }
  };
}
"""

_SECURITY_HEADERS = {
    # Everything a page loads comes from the gateway; no page may be framed.
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _when(ts: float | None) -> str:
    if not ts:
        return '<span class="muted">—</span>'
    utc = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
    return f'<time datetime="{iso}" title="{utc}">{utc}</time>'


def _page(
    title: str,
    body: str,
    session: Session | None = None,
    *,
    status: int = 200,
    cookies: list[Cookie] | None = None,
) -> Response:
    nav = ""
    if session is not None:
        nav = (
            '<nav aria-label="sections"><a href="/sandboxes">Sandboxes</a> · '
            '<a href="/tasks">Tasks</a> · <a href="/hosts">Hosts</a></nav>'
            f'<span class="muted">tenant {_e(session.tenant)}</span>'
            '<form method="post" action="/sign-out">'
            f'<input type="hidden" name="csrf" value="{_e(session.csrf)}">'
            '<button type="submit">Sign out</button></form>'
        )
    document = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)} · sandhold</title>"
        '<link rel="stylesheet" href="/console.css"></head><body>'
        f"<header><strong>sandhold</strong>{nav}</header>"
        f"<main><h1>{_e(title)}</h1>{body}</main></body></html>"
    )
    return Response(
        content=document,
        status_code=status,
        media_type="text/html; charset=utf-8",
        headers=_SECURITY_HEADERS,
        cookies=cookies or [],
    )


def _asset(content: str, media_type: str) -> Response:
    """The stylesheet or the script: served by the gateway itself, like everything a page loads."""
    return Response(
        content=content,
        media_type=f"{media_type}; charset=utf-8",
        headers={"Cache-Control": "max-age=300", "X-Content-Type-Options": "nosniff"},
    )


def _to(location: str, cookies: list[Cookie] | None = None) -> Response:
    return Response(
        content=b"",
        status_code=303,
        headers={"Location": location, **_SECURITY_HEADERS},
        cookies=cookies or [],
    )


def _cookie(name: str, value: str, max_age: int) -> Cookie:
    # Secure is left to a TLS proxy in front: the gateway itself speaks plain HTTP
    # on loopback, where a Secure cookie would never be sent back.
    return Cookie(
        key=name,
        value=value,
        max_age=max_age,
        path="/",
        httponly=True,
        samesite="strict",
    )


def _sign_in_form(csrf: str, error: str = "") -> str:
    problem = f'<p class="error" role="alert">{_e(error)}</p>' if error else ""
    return (
        f"{problem}"
        '<form method="post" action="/sign-in">'
        f'<input type="hidden" name="csrf" value="{_e(csrf)}">'
        '<p><label for="token">HTTP token</label><br>'
        f'<input id="token" name="token" type="password" autocomplete="off" required '
        f'maxlength="{MAX_TOKEN}" size="50" autofocus></p>'
        '<p><button type="submit">Sign in</button></p></form>'
        '<p class="muted">A token comes from <code>sandhold token create &lt;tenant&gt;</code>;'
        " the console shows that tenant's sandboxes and nothing else.</p>"
    )


def handlers(ctx: Context) -> list:
    made: list[Sessions] = []  # on first use: building the app reads no file

    def sessions() -> Sessions:
        if not made:
            made.append(Sessions.beside(ctx.tokens))
        return made[0]

    def session_of(request: Request) -> Session | None:
        return sessions().open(request.cookies.get(SESSION_COOKIE))

    async def form_of(request: Request) -> dict[str, str]:
        form = await request.form()
        return {k: v for k, v in form.items() if isinstance(v, str)}

    def forbidden(session: Session | None) -> Response:
        body = (
            '<p class="error" role="alert">This form was not sent from a page of this'
            " console (its CSRF token is missing or wrong). Nothing was done.</p>"
            '<p><a href="/">Back</a></p>'
        )
        return _page("Refused", body, session, status=403)

    @get("/console.css", include_in_schema=False)
    async def stylesheet() -> Response:
        return _asset(_STYLE, "text/css")

    @get("/", include_in_schema=False)
    async def home(request: Request) -> Response:
        return _to("/sandboxes" if session_of(request) else "/sign-in")

    @get("/sign-in", include_in_schema=False)
    async def sign_in_page(request: Request) -> Response:
        csrf = secrets.token_hex(16)
        return _page(
            "Sign in",
            _sign_in_form(csrf),
            cookies=[_cookie(SIGN_IN_COOKIE, csrf, 3600)],
        )

    @post("/sign-in", include_in_schema=False)
    async def sign_in(request: Request) -> Response:
        form = await form_of(request)
        expected = request.cookies.get(SIGN_IN_COOKIE, "")
        if not expected or not hmac.compare_digest(form.get("csrf", ""), expected):
            return forbidden(None)
        token = form.get("token", "").strip()
        value = None
        if not token:
            error = "Enter a token."
        elif len(token) > MAX_TOKEN or not token.isprintable():
            error = f"That is not a token: at most {MAX_TOKEN} printable characters."
        else:
            value = sessions().issue(token)
            error = "No such token (or it was revoked)."
        if value is None:
            return _page("Sign in", _sign_in_form(expected, error), status=401)
        return _to(
            "/sandboxes",
            cookies=[
                _cookie(SESSION_COOKIE, value, int(SESSION_S)),
                _cookie(SIGN_IN_COOKIE, "", 0),
            ],
        )

    @post("/sign-out", include_in_schema=False)
    async def sign_out(request: Request) -> Response:
        session = session_of(request)
        form = await form_of(request)
        if session is None:
            return _to("/sign-in", cookies=[_cookie(SESSION_COOKIE, "", 0)])
        if not hmac.compare_digest(form.get("csrf", ""), session.csrf):
            return forbidden(session)
        return _to("/sign-in", cookies=[_cookie(SESSION_COOKIE, "", 0)])

    @get("/sandboxes", include_in_schema=False)
    async def sandboxes_page(request: Request) -> Response:
        session = session_of(request)
        if session is None:
            return _to("/sign-in")
        phase = request.query_params.get("phase") or None
        if phase is not None and phase not in PHASES:
            body = f'<p class="error" role="alert">No phase “{_e(phase)}”.</p>'
            return _page("Sandboxes", body + _filter(None), session, status=400)
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
        return _page("Sandboxes", _filter(phase) + _sandbox_table(views), session)

    async def signed_in_sandbox(
        request: Request, sandbox_id: str
    ) -> tuple[Session, Any] | Response:
        """The session and the sandbox's view; else where to go instead: the
        sign-in, or a 404 page if the sandbox is not this tenant's (or none's)."""
        session = session_of(request)
        if session is None:
            return _to("/sign-in")
        try:
            if not SANDBOX_ID.match(sandbox_id):
                raise ProblemError("sandbox_not_found", f"no sandbox {sandbox_id}")
            return session, await call(ctx.client(session.tenant).show_sandbox(sandbox_id))
        except ProblemError as err:
            if err.code != "sandbox_not_found":
                raise
            body = f'<p class="error" role="alert">No sandbox {_e(sandbox_id)}.</p>'
            return _page("Not found", body, session, status=404)

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
            '<script src="/console.js" defer></script>'
        )
        return _page(f"Sandbox {view.id}", body, session)

    @get("/sandboxes/{sandbox_id:str}/status", include_in_schema=False)
    async def sandbox_status(request: Request, sandbox_id: FromPath[str]) -> Response:
        """The status block alone: what the page swaps in as events come."""
        found = await signed_in_sandbox(request, sandbox_id)
        if isinstance(found, Response):
            return found
        return Response(
            content=_sandbox_status(found[1]),
            media_type="text/html; charset=utf-8",
            headers=_SECURITY_HEADERS,
        )

    @get("/sandboxes/{sandbox_id:str}/events", include_in_schema=False)
    async def sandbox_events(request: Request, sandbox_id: FromPath[str]) -> Stream | Response:
        """The sandbox's events as the page's EventSource takes them: from the
        start, then live; a reconnect resumes after its Last-Event-ID."""
        # (Annotated as a Stream: with `Any`, Litestar would send it as application/json.)
        session = session_of(request)
        if session is None:
            return _to("/sign-in")
        if not SANDBOX_ID.match(sandbox_id):
            raise ProblemError("sandbox_not_found", f"no sandbox {sandbox_id}")
        await owned(ctx, session.tenant, "sandbox", sandbox_id)
        subject = ctx.names.events("sandbox", sandbox_id)
        return await event_response(ctx, request, subject, last_event_id(request), 0, named=False)

    @get("/console.js", include_in_schema=False)
    async def script() -> Response:
        return _asset(_SCRIPT, "text/javascript")

    @get("/tasks", include_in_schema=False)
    async def tasks_page(request: Request) -> Response:
        session = session_of(request)
        if session is None:
            return _to("/sign-in")
        state = request.query_params.get("state") or None
        choices = _choices("/tasks", "state", "all", sorted(TASK_STATES), state)
        if state is not None and state not in TASK_STATES:
            body = f'<p class="error" role="alert">No task state “{_e(state)}”.</p>'
            return _page("Tasks", body + choices, session, status=400)
        await fresh(ctx)
        sql = "SELECT body FROM tasks WHERE tenant = ?"
        params: list = [session.tenant]
        if state is not None:
            sql += " AND state = ?"
            params.append(state)
        sql += " ORDER BY submitted_at DESC, id LIMIT ?"
        params.append(LIST_LIMIT)
        rows = await ctx.read_model.query(sql, tuple(params))
        decoder = task_decoder()
        views = [task_view(decoder.decode(r[0])) for r in rows]
        return _page("Tasks", choices + _task_table(views), session)

    @get("/hosts", include_in_schema=False)
    async def hosts_page(request: Request) -> Response:
        session = session_of(request)
        if session is None:
            return _to("/sign-in")
        hosts = await host_views(ctx)
        # This tenant's sandboxes on each host (other tenants' are not its business).
        counts = dict(
            await ctx.read_model.query(
                "SELECT host, count(*) FROM sandboxes WHERE tenant = ? AND host IS NOT NULL "
                "AND phase NOT IN ('stopped', 'deleted', 'failed') GROUP BY host",
                (session.tenant,),
            )
        )
        return _page("Hosts", _host_table(hosts, counts), session)

    return [
        sandbox_status,
        sandbox_events,
        script,
        tasks_page,
        hosts_page,
        stylesheet,
        home,
        sign_in_page,
        sign_in,
        sign_out,
        sandboxes_page,
        sandbox_page,
    ]


def _health(health) -> str:
    if health is None:
        return "—"
    return _e(health.state) + (f" — {_e(health.reason)}" if health.reason else "")


def _decode_sandbox(state: bytes):
    from sandhold.gateway.readmodel import KINDS

    return KINDS["sandbox"].decoder.decode(state)


def _filter(phase: str | None) -> str:
    return _choices("/sandboxes", "phase", "all but deleted", sorted(PHASES), phase)


def _choices(action: str, name: str, blank: str, values: list[str], chosen: str | None) -> str:
    options = "".join(
        f'<option value="{_e(v)}"{" selected" if v == chosen else ""}>{_e(v)}</option>'
        for v in values
    )
    return (
        f'<form method="get" action="{_e(action)}"><label for="{_e(name)}">'
        f"{_e(name.capitalize())}</label> "
        f'<select id="{_e(name)}" name="{_e(name)}"><option value="">{_e(blank)}</option>'
        f'{options}</select> <button type="submit">Show</button></form>'
    )


def _table(
    head: list[str], rows: list[list[str]], empty: str, wide: frozenset[int] = frozenset()
) -> str:
    """Cells are HTML already; columns in `wide` are hidden on a narrow screen."""
    if not rows:
        return f'<p class="muted">{_e(empty)}</p>'

    def cls(i: int) -> str:
        return ' class="wide"' if i in wide else ""

    th = "".join(f"<th scope=col{cls(i)}>{_e(h)}</th>" for i, h in enumerate(head))
    body = "".join(
        "<tr>" + "".join(f"<td{cls(i)}>{cell}</td>" for i, cell in enumerate(row)) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _task_table(views: list) -> str:
    rows = [
        [
            _e(v.id),
            _e(v.name),
            _e(v.state) + (f" — {_e(v.reason)}" if v.reason else ""),
            _e(v.sandbox_id or "—"),
            _when(v.submitted_at),
            _e(v.hang_warnings),
        ]
        for v in views
    ]
    head = ["Task", "Name", "State", "Sandbox", "Submitted", "Hang warnings"]
    return _table(head, rows, "No tasks.", wide=frozenset({3, 5}))


def _host_table(hosts: list, counts: dict[str, int]) -> str:
    rows = [
        [
            _e(h.host),
            _e(h.status),
            _e(h.epoch),
            f"{h.last_renewal_age_s:.1f} s ago" if h.last_renewal_age_s is not None else "—",
            _when(h.fence_at),
            f"{counts.get(h.host, 0)} of {h.capacity_sandboxes}",
        ]
        for h in hosts
    ]
    head = ["Host", "Status", "Epoch", "Lease renewed", "Fenced at", "Your sandboxes"]
    return _table(head, rows, "No hosts.", wide=frozenset({2, 4}))


def _sandbox_table(views: list) -> str:
    rows = []
    for v in views:
        last = v.last_completed_save
        commands = ", ".join(f"{_e(state)} {n}" for state, n in sorted(v.commands.items()))
        rows.append(
            [
                f'<a href="/sandboxes/{_e(v.id)}">{_e(v.id)}</a>',
                _e(v.phase) + (f" — {_e(v.reason)}" if v.reason else ""),
                _e(v.host or "—"),
                _e(v.generation),
                _health(v.save_health),
                _when(last.completed_at if last else None),
                commands or "—",
            ]
        )
    head = ["Sandbox", "Phase", "Host", "Generation", "Save health", "Last save", "Commands"]
    return _table(head, rows, "No sandboxes.", wide=frozenset({3, 5, 6}))


def _sandbox_status(v) -> str:
    last = v.last_completed_save
    facts = [
        ("Phase", _e(v.phase) + (f" — {_e(v.reason)}" if v.reason else "")),
        ("Host", _e(v.host or "—")),
        ("Generation", _e(v.generation)),
        ("Created", _when(v.created_at)),
        ("Save health", _health(v.save_health)),
        ("Last completed save", _e(last.id) + " " + _when(last.completed_at) if last else "—"),
        ("RPO", f"{v.rpo_s:.0f} s" if v.rpo_s is not None else "—"),
        ("Recoverable from", _e(v.recoverable_from or "—")),
        (
            "Commands",
            ", ".join(f"{_e(s)} {n}" for s, n in sorted(v.commands.items())) or "none",
        ),
    ]
    items = "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in facts)
    return f"<dl>{items}</dl>"
