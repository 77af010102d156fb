"""The tasks pages: a table by state; a task's status, timeline and step ledger,
live or as of any point in its log (what `sandhold replay task <id> --at`
shows); cancelling it; downloading its artifacts."""

from __future__ import annotations

import re
import time
import urllib.parse
from dataclasses import dataclass

from litestar import Request, Response, get, post
from litestar.params import FromPath
from litestar.response import Stream
from sandhold.domain import asof
from sandhold.domain import events as ev
from sandhold.domain import task as tk
from sandhold.domain.envelope import Envelope, Recorded
from sandhold.domain.errors import InfraError, Rejected
from sandhold.domain.task_views import TaskView, task_view
from sandhold.gateway.console.actions import FORM_KEY, new_key
from sandhold.gateway.console.html import (
    SECURITY_HEADERS,
    choices,
    csrf_field,
    error,
    esc,
    facts,
    fragment,
    page,
    redirect,
    state_and_reason,
    table,
    when,
)
from sandhold.gateway.console.kit import Console
from sandhold.gateway.console.live import aggregate_events, live_list
from sandhold.gateway.console.sessions import Session
from sandhold.gateway.console.task_chart import task_chart
from sandhold.gateway.problems import ProblemError
from sandhold.gateway.routes_sandboxes import owned
from sandhold.gateway.routes_tasks import TASK_STATES, task_decoder
from sandhold.gateway.web import TASK_ID, call, fresh
from sandhold.saves import SaveStore
from sandhold.saves.artifacts import artifact_entry, entry_chunks

LIST_LIMIT = 500


@dataclass(frozen=True)
class Shown:
    """A task as a page shows it: now, or as of a record of its log."""

    session: Session
    view: TaskView
    records: list[Recorded]  # up to the point shown
    as_of: Recorded | None  # None: now (live)


def handlers(console: Console) -> list:
    ctx = console.ctx

    @get("/tasks", include_in_schema=False)
    async def tasks_page(request: Request) -> Response:
        session = console.signed_in(request)
        if isinstance(session, Response):
            return session
        state = request.query_params.get("state") or None
        filter_ = choices("/tasks", "state", "all", sorted(TASK_STATES), state)
        if state is not None and state not in TASK_STATES:
            return page("Tasks", error(f"No task state “{state}”.") + filter_, session, status=400)
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
        if request.query_params.get("part") == "table":
            return fragment(_task_table(views))
        here = "/tasks?part=table" + (f"&state={state}" if state else "")
        body = f"{filter_}{live_list('task', here, _task_table(views))}"
        return page("Tasks", body, session)

    async def signed_in_task(request: Request, task_id: str) -> Shown | Response:
        """The task folded from its log, up to `?at=` when given (as `replay
        --at` folds it); else where to go instead: the sign-in, a 400 page for
        a point that is not one, or a 404 page if the task is not this
        tenant's (or none's) at that point."""
        session = console.signed_in(request)
        if isinstance(session, Response):
            return session
        at = request.query_params.get("at") or None
        try:
            seq, moment = asof.parse_point(at)
        except ValueError as err:
            body = error(f"“at” takes {err}.") + f'<p><a href="/tasks/{esc(task_id)}">Back</a></p>'
            return page("Not a point in the log", body, session, status=400)
        if TASK_ID.match(task_id):
            records = await call(ctx.client(session.tenant).task_records(task_id))
            found = asof.state_at(tk.evolve, records, seq, moment)
            if found is not None and found[0].tenant == session.tenant:
                state, last = found
                kept = [r for r in records if r.seq <= last.seq]
                return Shown(session, task_view(state), kept, None if at is None else last)
        return not_found(session, task_id, " at that point" if at else "")

    async def tenants(tenant: str, task_id: str) -> bool:
        """Whether the task is `tenant`'s (`ownership`); a malformed id is no
        one's, and never put in a subject."""
        if not TASK_ID.match(task_id):
            return False
        try:
            await owned(ctx, tenant, "task", task_id)
        except ProblemError:
            return False
        return True

    @get("/tasks/{task_id:str}", include_in_schema=False)
    async def task_page(request: Request, task_id: FromPath[str]) -> Response:
        shown = await signed_in_task(request, task_id)
        if isinstance(shown, Response):
            return shown
        v, here, live = shown.view, f"/tasks/{shown.view.id}", shown.as_of is None

        def block(name: str, content: str) -> str:
            # Live, the script fetches the block again after each event; history stays put.
            refresh = f' data-refresh="{here}/{name}"' if live else ""
            return f'<div id="{name}"{refresh}>{content}</div>'

        body = "" if shown.as_of is None else _as_of_notice(here, shown.as_of)
        status = _status(v, shown.session if live else None)
        body += (
            '<section aria-labelledby="status-h"><h2 id="status-h">Status</h2>'
            f"{block('status', status)}</section>"
            '<section aria-labelledby="timeline-h"><h2 id="timeline-h">Timeline</h2>'
            f"{block('timeline', _timeline(here, shown.records, v, _now(shown)))}</section>"
            + _history_form(here, request.query_params.get("at") or "")
        )
        if live:
            body += (
                '<section aria-labelledby="events-h"><h2 id="events-h">Events</h2>'
                '<p id="live" class="muted" role="status">Loading the history…</p>'
                f'<ol id="events" data-events="{here}/events"></ol></section>'
            )
        return page(f"Task {v.id}", body, shown.session)

    @get("/tasks/{task_id:str}/status", include_in_schema=False)
    async def task_status(request: Request, task_id: FromPath[str]) -> Response:
        """The status block alone: what the page swaps in as events come."""
        shown = await signed_in_task(request, task_id)
        if isinstance(shown, Response):
            return shown
        return fragment(_status(shown.view, shown.session if shown.as_of is None else None))

    @get("/tasks/{task_id:str}/timeline", include_in_schema=False)
    async def task_timeline(request: Request, task_id: FromPath[str]) -> Response:
        """The timeline and step ledger alone, likewise."""
        shown = await signed_in_task(request, task_id)
        if isinstance(shown, Response):
            return shown
        return fragment(_timeline(f"/tasks/{task_id}", shown.records, shown.view, _now(shown)))

    @get("/tasks/{task_id:str}/events", include_in_schema=False)
    async def task_events(request: Request, task_id: FromPath[str]) -> Stream | Response:
        """The task's events as the page's EventSource takes them: from the
        start, then live; a reconnect resumes after its Last-Event-ID."""
        return await aggregate_events(console, request, "task", task_id)

    @post("/tasks/{task_id:str}/cancel", include_in_schema=False)
    async def cancel_task(request: Request, task_id: FromPath[str]) -> Response:
        posted = await console.posted(request)
        if isinstance(posted, Response):
            return posted
        session, form = posted
        if not await tenants(session.tenant, task_id):
            return not_found(session, task_id)
        back = f'<p><a href="/tasks/{task_id}">Back to the task</a></p>'
        key = form.get("key", "")
        if not FORM_KEY.match(key):
            message = "This form has no valid key: reload the task and try again. Nothing was done."
            return page("Not cancelled", error(message) + back, session, status=400)
        if form.get("confirmed") != "yes":
            return _confirm(session, task_id, key)
        cancel = tk.CancelTask(key=key, tenant=session.tenant, task_id=task_id)
        try:
            await call(ctx.client(session.tenant).send_task(cancel))
        except ProblemError as err:  # ended already (409), or not answered in time (503)
            return page("Not cancelled", error(err.detail) + back, session, status=err.status)
        return redirect(f"/tasks/{task_id}")

    @get("/tasks/{task_id:str}/artifacts", include_in_schema=False)
    async def task_artifact(request: Request, task_id: FromPath[str]) -> Stream | Response:
        """An artifact's bytes, as a download (never shown as a page: its
        content is the task's, not the console's)."""
        shown = await signed_in_task(request, task_id)
        if isinstance(shown, Response):
            return shown
        path = request.query_params.get("path", "")
        store = SaveStore(ctx.nc, ctx.names)
        try:
            entry = await artifact_entry(store, task_id, shown.view.artifacts, path)
        except Rejected:
            message = f"Task {task_id} has no artifact “{path}”."
            return page("Not found", error(message), shown.session, status=404)
        except InfraError as err:  # the save store did not answer, or lost the snapshot
            message = f"The artifact cannot be read now: {err}"
            return page("Not available", error(message), shown.session, status=503)
        headers = {**SECURITY_HEADERS, "Content-Disposition": _attachment(path)}
        return Stream(
            entry_chunks(store, entry), media_type="application/octet-stream", headers=headers
        )

    return [
        tasks_page,
        task_page,
        task_status,
        task_timeline,
        task_events,
        cancel_task,
        task_artifact,
    ]


def not_found(session: Session, task_id: str, where: str = "") -> Response:
    """Missing, malformed, or another tenant's: one and the same page."""
    return page("Not found", error(f"No task {task_id}{where}."), session, status=404)


def _attachment(path: str) -> str:
    name = path.rsplit("/", 1)[-1] or "artifact"
    plain = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return f"attachment; filename=\"{plain}\"; filename*=UTF-8''{urllib.parse.quote(name)}"


def _task_table(views: list) -> str:
    rows = [
        [
            f'<a href="/tasks/{esc(v.id)}">{esc(v.id)}</a>',
            esc(v.name),
            state_and_reason(v.state, v.reason),
            esc(v.sandbox_id or "—"),
            when(v.submitted_at),
            esc(v.hang_warnings),
        ]
        for v in views
    ]
    head = ["Task", "Name", "State", "Sandbox", "Submitted", "Hang warnings"]
    return table(head, rows, "No tasks.", wide=frozenset({3, 5}))


# --- the task page's parts ------------------------------------------------------------


def _status(v: TaskView, session: Session | None) -> str:
    """The task's facts; with a session (live, not history), its cancel button
    while it has not ended: in the block refreshed after each event, so the
    button goes when the task ends."""
    sandbox = f'<a href="/sandboxes/{esc(v.sandbox_id)}">{esc(v.sandbox_id)}</a>'
    state = state_and_reason(v.state, v.reason) + (f" ({esc(v.detail)})" if v.detail else "")
    if v.cancel_requested and v.state not in tk.TERMINAL:
        state += " — cancel requested"
    cancel = ""
    if session is not None and v.state not in tk.TERMINAL:
        cancel = _cancel_form(session, v.id)
    return (
        facts(
            [
                ("State", state),
                ("Name", esc(v.name)),
                ("Sandbox", sandbox if v.sandbox_id else "—"),
                ("Submitted", when(v.submitted_at)),
                ("Finished", when(v.finished_at)),
                ("Commit", esc(v.commit or "—")),
                ("Failed stage", esc(v.failed_stage or "—")),
                ("Failed attempts", esc(len(v.attempts))),
                (
                    "Hang warnings",
                    f"{v.hang_warnings} hang warning(s)" if v.hang_warnings else "none",
                ),
                ("Artifacts", _artifacts(v)),
            ]
        )
        + cancel
    )


def _artifacts(v: TaskView) -> str:
    if not v.artifacts:
        return "none"
    items = "".join(
        f'<li><a href="/tasks/{esc(v.id)}/artifacts?path={esc(urllib.parse.quote(a.path))}"'
        f" download>{esc(a.path)}</a> ({a.size:,} bytes)</li>"
        for a in v.artifacts
    )
    return f"<ul>{items}</ul>"


def _now(shown: Shown) -> float:
    """Where the chart of a task not ended stops: now, or the point shown."""
    return time.time() if shown.as_of is None else shown.as_of.envelope.time


def _timeline(here: str, records: list[Recorded], v: TaskView, now: float) -> str:
    """The task's lifecycle on a time axis; every event in words, oldest first, each a
    link to the task as of it; then the step ledger as the orchestrator keeps it."""
    rows = [
        [
            f'<a href="{here}?at={r.seq}" title="the task as of this event">{r.seq}</a>',
            when(r.envelope.time),
            _happened(r.envelope),
            esc(r.envelope.actor),
        ]
        for r in records
    ]
    timeline = table(["Seq", "Time", "What happened", "Who"], rows, "No events.", frozenset({0}))
    chart = task_chart(records, now)
    return chart + timeline + '<h3 id="steps-h">Step ledger</h3>' + _ledger(v)


def _happened(e: Envelope) -> str:
    """One event in words (HTML)."""
    match e.event:
        case ev.TaskSubmitted(manifest=manifest):
            return f"Submitted “{esc(manifest.name)}”"
        case ev.TaskDriverClaimed(driver=driver, epoch=epoch):
            return f"Driven by {esc(driver)} (epoch {epoch})"
        case ev.TaskStageEntered(stage=stage):
            return f"Entered {esc(stage)}"
        case ev.TaskOperationFailed() as failed:
            said = f"{esc(failed.operation)} attempt {failed.attempt} failed: {esc(failed.reason)}"
            said += f" ({esc(failed.error_class)})"
            if failed.detail:
                said += f" — {esc(failed.detail[:300])}"
            if failed.retry_at is None:
                return said + "; not retried"
            wait = max(failed.retry_at - e.time, 0.0)
            return said + f"; retry at {when(failed.retry_at)} (after {wait:.1f} s)"
        case ev.TaskStaged() as staged:
            size = f"{staged.files} files, {staged.bytes:,} bytes"
            return f"Staged commit {esc(staged.commit[:12])} ({size})"
        case ev.TaskProvisioned(sandbox_id=sandbox_id):
            link = f'<a href="/sandboxes/{esc(sandbox_id)}">{esc(sandbox_id)}</a>'
            return f"Provisioned sandbox {link}"
        case ev.TaskStepClaimed() as claimed:
            return f"Step {esc(claimed.step_id)} ({claimed.kind}) attempt {claimed.attempt} claimed"
        case ev.TaskStepDispatched() as sent:
            again = " (sent anew after a crash)" if sent.fresh_after_crash else ""
            return f"Step {esc(sent.step_id)} attempt {sent.attempt} dispatched{again}"
        case ev.TaskStepFinished() as done:
            return f"Step {esc(done.step_id)} attempt {done.attempt} finished{_code(done)}"
        case ev.TaskStepFailed() as failed_step:
            said = f"Step {esc(failed_step.step_id)} attempt {failed_step.attempt} failed: "
            said += esc(failed_step.reason) + _code(failed_step)
            return said + (f" — {esc(failed_step.detail[:300])}" if failed_step.detail else "")
        case ev.TaskHangWarned(step_id=step_id, silent_s=silent_s):
            return f"<strong>Hang warning</strong>: step {esc(step_id)} silent for {silent_s:.0f} s"
        case ev.TaskCancelRequested():
            return "Cancel requested"
        case ev.TaskArtifactsCollected(artifacts=artifacts):
            return f"{len(artifacts)} artifact(s) collected"
        case ev.TaskCompleted():
            return "Completed"
        case ev.TaskFailed(reason=reason, detail=detail, stage=stage):
            return f"Failed in {esc(stage or '—')}: {esc(reason)}" + (
                f" — {esc(detail[:300])}" if detail else ""
            )
        case ev.TaskCancelled(stage=stage):
            return f"Cancelled in {esc(stage or '—')}"
        case ev.TaskTimedOut(stage=stage, detail=detail):
            return f"Timed out in {esc(stage or '—')}" + (f" — {esc(detail)}" if detail else "")
        case ev.TaskReleased():
            return "Released: nothing more is done for it (its sandbox, if any, stopped)"
        case _:
            return esc(e.type)


def _code(ended: ev.TaskStepFinished | ev.TaskStepFailed) -> str:
    """How a step ended, as far as it says: end state, exit code, HTTP status."""
    parts = []
    if isinstance(ended, ev.TaskStepFailed) and ended.end_state:
        parts.append(esc(ended.end_state))
    if ended.exit_code is not None:
        parts.append(f"exit code {ended.exit_code}")
    if isinstance(ended, ev.TaskStepFinished) and ended.status is not None:
        parts.append(f"HTTP {ended.status}")
    return "".join(f", {part}" for part in parts)


def _ledger(v: TaskView) -> str:
    rows = []
    for s in v.steps:
        result = [s.end_state or "", s.reason]
        if s.exit_code is not None:
            result.append(f"exit code {s.exit_code}")
        if s.http_status is not None:
            result.append(f"HTTP {s.http_status}")
        if s.hang_warned:
            result.append("hang warning")
        rows.append(
            [
                esc(s.id),
                esc(s.kind),
                esc(s.attempt),
                esc(s.status),
                esc(", ".join(r for r in result if r) or "—"),
                when(s.claimed_at),
                when(s.finished_at),
            ]
        )
    head = ["Step", "Kind", "Attempt", "Status", "Result", "Claimed", "Finished"]
    return table(head, rows, "No step has been claimed yet.", wide=frozenset({5}))


def _as_of_notice(here: str, as_of: Recorded) -> str:
    replay = f"sandhold replay task {as_of.envelope.aggregate_id} --at {as_of.seq}"
    return (
        f'<p class="notice" role="status">As of seq {as_of.seq} ({when(as_of.envelope.time)}):'
        f" the task as its log had it then, as <code>{esc(replay)}</code> shows it."
        f' <a href="{here}">Back to now</a></p>'
    )


def _history_form(here: str, at: str) -> str:
    return (
        f'<form method="get" action="{here}"><label for="at">Show as of</label> '
        f'<input id="at" name="at" value="{esc(at)}" size="24" '
        'placeholder="event number or 2026-12-03T12:00:00Z" required> '
        '<button type="submit">Show</button></form>'
    )


def _cancel_form(session: Session, task_id: str) -> str:
    return (
        f'<form method="post" action="/tasks/{task_id}/cancel">{csrf_field(session)}'
        f'<input type="hidden" name="key" value="{new_key()}">'
        '<button type="submit">Cancel the task…</button> '
        '<span class="muted">You are asked to confirm first.</span></form>'
    )


def _confirm(session: Session, task_id: str, key: str) -> Response:
    """The confirmation, a page of its own (no script needed), with the same key."""
    body = (
        f"<p>Cancel task {esc(task_id)}? A running step is interrupted and the task"
        " ends cancelled.</p>"
        f'<form method="post" action="/tasks/{task_id}/cancel">{csrf_field(session)}'
        f'<input type="hidden" name="key" value="{esc(key)}">'
        '<input type="hidden" name="confirmed" value="yes">'
        '<button type="submit" autofocus>Yes, cancel it</button> '
        f'<a href="/tasks/{task_id}">No, back</a></form>'
    )
    return page("Confirm", body, session)
