"""What a console user can do to a sandbox: create one, run a command, take a
snapshot, stop, start.

Each form carries its CSRF field and an idempotency key made when the form was
drawn, so one click is one request however often the browser sends it (a
double click, a resend after a dropped answer): the scheduler answers a key it
has seen with what it did the first time. Every action but create asks for
confirmation on a page of its own, which works without JavaScript and by
keyboard, and carries the same key.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, post
from litestar.params import FromPath
from sandhold.domain import requests as rq
from sandhold.gateway import bodies as b
from sandhold.gateway.console.html import csrf_field, error, esc, page, redirect
from sandhold.gateway.console.kit import Console
from sandhold.gateway.console.sessions import Session
from sandhold.gateway.problems import ProblemError
from sandhold.gateway.web import PHASES, SANDBOX_ID, call

FORM_KEY = re.compile(r"^console-[0-9a-f]{32}\Z")  # what `new_key` makes
MAX_LINE = 8192  # a command line typed into the page


@dataclass(frozen=True)
class Action:
    label: str  # the button
    question: str  # the confirmation, with {id}
    shows_in: frozenset[str]  # phases where the button is offered


ACTIONS: dict[str, Action] = {
    # Offered whenever the sandbox exists: the scheduler decides (a sandbox stopped
    # for being idle starts again for it) and its refusal is shown as it is.
    "exec": Action("Run", "Run this command in {id}?", PHASES - {"deleted"}),
    "snapshot": Action("Take a snapshot", "Take a snapshot of {id} now?", frozenset({"running"})),
    "stop": Action(
        "Stop",
        "Stop {id}? Its files are kept in a final save; running commands end.",
        frozenset({"pending", "placed", "starting", "running"}),
    ),
    "start": Action("Start", "Start {id} again from its last save?", frozenset({"stopped"})),
    # One form per completed Snapshot (decision 069), a deleted sandbox's too.
    "delete_snapshot": Action(
        "Delete snapshot",
        "Delete this snapshot of {id}? It becomes a save like the others, which "
        "retention then drops unless it is among the newest kept.",
        PHASES,
    ),
}
_SAVE_ID = re.compile(r"^sv-[0-9a-f]{16}$")


def new_key() -> str:
    return f"console-{secrets.token_hex(16)}"


def action_form(session: Session, sandbox_id: str, action: str, fields: str = "") -> str:
    """The form for one action, with its own key (one per drawing of the page)."""
    return (
        f'<form method="post" action="/sandboxes/{esc(sandbox_id)}/{action}" class="action">'
        f'{csrf_field(session)}<input type="hidden" name="key" value="{new_key()}">'
        f'{fields}<button type="submit">{esc(ACTIONS[action].label)}</button></form>'
    )


def exec_fields() -> str:
    return (
        '<label for="line">Command (run with <code>sh -c</code>)</label> '
        f'<input id="line" name="line" required maxlength="{MAX_LINE}" size="40" '
        'autocomplete="off" spellcheck="false"> '
    )


def snapshot_fields() -> str:
    return (
        '<label for="name">Snapshot name</label> '
        '<input id="name" name="name" required maxlength="100" size="20" '
        'pattern="[A-Za-z0-9][A-Za-z0-9_.:\\-]*" value="console"> '
    )


def delete_snapshot_fields(save_id: str, name: str | None) -> str:
    return (
        f'<input type="hidden" name="save_id" value="{esc(save_id)}">'
        f"<code>{esc(name or save_id)}</code> "
    )


def handlers(console: Console) -> list:
    ctx = console.ctx

    @post("/sandboxes", include_in_schema=False)
    async def create(request: Request) -> Response:
        posted = await console.posted(request)
        if isinstance(posted, Response):
            return posted
        session, form = posted
        key = form.get("key", "")
        if not FORM_KEY.match(key):
            return _refused(session, "This form has no valid key: reload the page and try again.")
        try:
            reply = await call(
                ctx.client(session.tenant).send(rq.CreateSandbox(key=key, tenant=session.tenant))
            )
        except ProblemError as err:
            return _refused(session, err.detail, err.status)
        return redirect(f"/sandboxes/{reply.sandbox.id}")

    @post("/sandboxes/{sandbox_id:str}/{action:str}", include_in_schema=False)
    async def act(request: Request, sandbox_id: FromPath[str], action: FromPath[str]) -> Response:
        posted = await console.posted(request)
        if isinstance(posted, Response):
            return posted
        session, form = posted
        if action not in ACTIONS or not SANDBOX_ID.match(sandbox_id):
            return page("Not found", error("No such page."), session, status=404)
        key = form.get("key", "")
        if not FORM_KEY.match(key):
            return _refused(session, "This form has no valid key: reload the page and try again.")
        try:
            made = _request(action, form, key, session.tenant, sandbox_id)
        except ProblemError as err:
            return _refused(session, err.detail, err.status, back=f"/sandboxes/{sandbox_id}")
        if form.get("confirmed") != "yes":
            return _confirm(session, sandbox_id, action, form)
        try:
            reply = await call(ctx.client(session.tenant).send(made))
        except ProblemError as err:
            return _refused(session, err.detail, err.status, back=f"/sandboxes/{sandbox_id}")
        if action == "exec":
            return redirect(f"/sandboxes/{sandbox_id}/commands/{reply.command.id}")
        return redirect(f"/sandboxes/{sandbox_id}")

    return [create, act]


def _request(action: str, form: dict[str, str], key: str, tenant: str, sandbox_id: str):
    """The request a form asks for, checked as the API checks a body."""
    common: dict[str, Any] = {"key": key, "tenant": tenant, "sandbox_id": sandbox_id}
    match action:
        case "exec":
            line = form.get("line", "").strip()
            if not line:
                raise ProblemError("invalid_request", "Type the command to run.", status=400)
            if len(line) > MAX_LINE or "\x00" in line:
                raise ProblemError(
                    "invalid_request",
                    f"A command line is at most {MAX_LINE} characters, without NUL.",
                    status=400,
                )
            body = b.convert({"argv": ["sh", "-c", line]}, b.RunCommandBody)
            return rq.RunCommand(**common, **b.request_fields(body))
        case "snapshot":
            body = b.convert({"name": form.get("name", "")}, b.SnapshotBody)
            return rq.SnapshotSandbox(**common, **b.request_fields(body))
        case "delete_snapshot":
            save_id = form.get("save_id", "")
            if not _SAVE_ID.match(save_id):
                raise ProblemError("invalid_request", "No such snapshot.", status=400)
            return rq.DeleteSnapshot(**common, save_id=save_id)
        case "stop":
            return rq.StopSandbox(**common)
        case _:
            return rq.StartSandbox(**common)


def _confirm(session: Session, sandbox_id: str, action: str, form: dict[str, str]) -> Response:
    kept = "".join(
        f'<input type="hidden" name="{name}" value="{esc(form[name])}">'
        for name in ("key", "line", "name", "save_id")
        if name in form
    )
    shown = ""
    if action == "exec":
        shown = f"<pre>{esc(form.get('line', ''))}</pre>"
    elif action == "snapshot":
        shown = f"<p>Named <code>{esc(form.get('name', ''))}</code>.</p>"
    elif action == "delete_snapshot":
        shown = f"<p>Snapshot <code>{esc(form.get('save_id', ''))}</code>.</p>"
    body = (
        f"<p>{esc(ACTIONS[action].question.format(id=sandbox_id))}</p>{shown}"
        f'<form method="post" action="/sandboxes/{esc(sandbox_id)}/{action}">'
        f'{csrf_field(session)}{kept}<input type="hidden" name="confirmed" value="yes">'
        f'<button type="submit" autofocus>Yes, {esc(ACTIONS[action].label.lower())}</button> '
        f'<a href="/sandboxes/{esc(sandbox_id)}">No, back</a></form>'
    )
    return page("Confirm", body, session)


def _refused(
    session: Session, message: str, status: int = 400, back: str = "/sandboxes"
) -> Response:
    body = error(message) + f'<p><a href="{esc(back)}">Back</a></p>'
    return page("Not done", body, session, status=status)
